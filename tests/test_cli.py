import json
import subprocess
import sys
from pathlib import Path

import pytest

from autosp.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model", "tiny", "--seq-len", "64"]


@pytest.mark.parametrize("argv,message", [
    (["run", "--method", "nope", *TINY], "unknown method 'nope'; valid methods:"),
    (["run", "--method", "single", "--model", "gpt-9", "--seq-len", "64"], "unknown model 'gpt-9'; choose one of"),
    (["run", "--method", "single", "--model", "tiny", "--seq-len", "0"], "--seq-len must be positive"),
    (["run", "--method", "single", "--model", "tiny", "--seq-len", "-8"], "--seq-len must be positive"),
    (["run", "--method", "single", *TINY, "--batch-size", "0"], "--batch-size must be positive"),
    (["run", "--method", "single", *TINY, "--world-size", "0"], "--world-size must be positive"),
    (["run", "--method", "single", *TINY, "--world-size", "2"], "runs on one rank"),
    (["run", "--method", "single", *TINY, "--device", "cuda"], "--device cuda needs a GPU"),
    (["run", "--method", "single", *TINY, "--memory-budget", "lots"], "cannot read the size 'lots'"),
    (["run", "--method", "sp-double", "--model", "tiny", "--seq-len", "63", "--world-size", "2",
      "--import", "tests.sequence_parallel_method"], "--seq-len 63 is not divisible by the SP degree 2"),
    (["run", "--method", "sp-double", *TINY, "--world-size", "3", "--sp-size", "2",
      "--import", "tests.sequence_parallel_method"], "--sp-size 2 must divide --world-size 3"),
    (["check", "--method", "single", *TINY, "--check-steps", "0"], "--check-steps must be positive"),
    (["check", "--method", "single", *TINY, "--tolerance", "-1"], "--tolerance must be positive"),
    (["run", "--method", "single", *TINY, "--import", "no_such_module"],
     "--import no_such_module: No module named 'no_such_module'"),
    (["run", "--method", "single", *TINY, "--lr", "nan"], "--lr must be positive (a finite number), got nan"),
    (["run", "--method", "single", *TINY, "--timeout", "inf"], "--timeout must be positive (a finite number), got inf"),
    (["run", "--method", "single", *TINY, "--timeout-s", "0"], "--timeout must be positive"),
    (["run", "--method", "single", *TINY, "--pad-fraction", "1.5"], "--pad-fraction must be in [0, 1)"),
    (["run", "--method", "fsdp", *TINY, "--world-size", "4096"], "--world-size 4096 needs about 1400.0 GiB of host"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_bad_flag_value_is_one_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "--method", "single", "--model", "tiny", "--seq-len", "abc"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "invalid int value: 'abc'" in err


def test_entry_point_prints_no_traceback() -> None:
    out = subprocess.run([sys.executable, "-m", "autosp", "run", "--method", "single", "--model", "nope",
                          "--seq-len", "64"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert out.returncode == 2 and out.stderr.startswith("autosp run: error: unknown model 'nope'")
    assert "Traceback" not in out.stderr


def test_run_appends_a_record(tmp_path, capsys) -> None:
    out = tmp_path / "runs.jsonl"
    code = main(["run", "--method", "single", "--model", "tiny", "--seq-len", "128", "--steps", "2",
                 "--warmup", "1", "--memory-budget", "1GiB", "--pad-fraction", "0.25", "--out", str(out)])
    assert code == 0
    assert capsys.readouterr().out.startswith("ok: single tiny seq 128")
    record = json.loads(out.read_text())
    assert record["memory_budget"] == 2**30 and record["config"]["data"]["pad_fraction"] == 0.25


def test_check_passes_for_single_and_writes_its_report(tmp_path, capsys) -> None:
    report = tmp_path / "check.json"
    code = main(["check", "--method", "single", "--model", "tiny", "--seq-len", "64", "--batch-size", "2",
                 "--data-ignore-fraction", "0.2", "--packed-documents", "2", "--check-steps", "1",
                 "--json-out", str(report)])
    assert code == 0 and "PASSED" in capsys.readouterr().out
    assert json.loads(report.read_text())["passed"] is True


def test_check_failure_exits_1(capsys) -> None:
    code = main(["check", "--method", "single-perturbed", "--model", "tiny", "--seq-len", "64",
                 "--check-steps", "1", "--import", "tests.perturbed_method"])
    assert code == 1 and "FAILED" in capsys.readouterr().out


@pytest.mark.parametrize("command", [
    ["run", "--method", "ulysses", "--world-size", "2", "--seq-len", "128"],
    ["search", "--method", "ulysses", "--world-size", "2", "--memory-budget", "64MiB"],
    ["bench", "--methods", "ulysses", "--world-size", "2", "--seq-lens", "128"],
])
@pytest.mark.parametrize("where,reason", [("folder", "it is a folder"), ("file/runs.jsonl", "is a file, not a folder")])
def test_unwritable_out_fails_before_training(tmp_path, monkeypatch, capsys, command, where, reason) -> None:
    from autosp.harness import runner

    def no_training(*args, **kwargs):
        raise AssertionError("ranks were started before --out was checked")

    monkeypatch.setattr(runner, "launch", no_training)
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("not a folder")
    assert main([*command, "--model", "tiny", "--out", str(tmp_path / where)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot write --out {tmp_path / where}: " in err and reason in err


def test_every_subcommand_module_exists_and_a_missing_one_is_loud(monkeypatch) -> None:
    """Each of `SUBCOMMANDS` adds its command; a module or function renamed without updating the list fails every
    command at once (it was once skipped, and its command silently vanished)."""
    from autosp import cli

    commands = set(cli.build_parser()._subparsers._group_actions[0].choices)
    assert {"search", "bench", "table", "history", "simulate", "simulate-table"} <= commands
    monkeypatch.setattr(cli, "SUBCOMMANDS", (*cli.SUBCOMMANDS, ("autosp.experiments.no_such_module", "add_parser")))
    with pytest.raises(ModuleNotFoundError, match="autosp.experiments.no_such_module"):
        cli.build_parser()
    monkeypatch.setattr(cli, "SUBCOMMANDS", (("autosp.experiments.bench", "add_no_such_parser"),))
    with pytest.raises(AttributeError, match="add_no_such_parser"):
        cli.build_parser()
