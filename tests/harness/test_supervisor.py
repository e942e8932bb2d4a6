import json
import signal
import time
from pathlib import Path

import pytest

from autosp.cli import RUN_EXIT_CODES
from autosp.harness.launch import launch
from autosp.harness.supervisor import INTERRUPTED_EXIT_CODE, WARM_RANK_NAME
from tests.harness.processes import MARK, interrupt_once_ranks_run, marked_processes, new_mark, start_cli
from tests.harness.test_launch import sum_ranks

pytestmark = pytest.mark.usefixtures("cold_ranks")  # these inspect rank processes by their environment and command

RUN = ["run", "--method", "ulysses", "--model", "tiny", "--seq-len", "128", "--world-size", "2", "--steps", "3000",
       "--zero", "0"]


def test_timeout_during_rank_start_up_ends_every_rank(monkeypatch) -> None:
    mark = new_mark()
    monkeypatch.setenv(MARK, mark)
    start = time.monotonic()
    result = launch(sum_ranks, ("x",), world_size=2, timeout_s=1)  # ranks are still importing torch at 1 s
    elapsed = time.monotonic() - start
    assert result.status == "timeout" and "1 s timeout" in result.error
    assert elapsed < 1 + 5, elapsed
    assert marked_processes(mark) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_autosp_run_ends_every_rank_and_records_interrupted(tmp_path, sig: signal.Signals) -> None:
    mark = new_mark()
    out_file = tmp_path / "runs.jsonl"
    proc = start_cli([*RUN, "--out", str(out_file)], mark, tmp_path)
    out, err, seconds = interrupt_once_ranks_run(proc, mark, sig)
    assert proc.returncode == INTERRUPTED_EXIT_CODE == RUN_EXIT_CODES["interrupted"], err
    assert seconds < 15, seconds
    assert marked_processes(mark) == []
    record = json.loads(out_file.read_text())
    assert record["status"] == "interrupted" and f"interrupted by {sig.name}" in record["error"]
    # rank output (profiler lines, library banners) went to the log: the summary is all the command printed
    assert len(out.splitlines()) == 1 and out.startswith("interrupted: ulysses tiny seq 128")
    assert err == ""


def test_sigterm_to_the_cli_process_group_ends_its_warm_ranks_and_records_interrupted(tmp_path) -> None:
    """The CLI forks its CPU ranks from a warm server in its own process group; a scheduler's SIGTERM to that whole
    group kills the server and with it the ranks, and the run is still `interrupted`, with nothing left behind."""
    mark = new_mark()
    out_file = tmp_path / "runs.jsonl"
    proc = start_cli([*RUN, "--out", str(out_file)], mark, tmp_path, own_group=True)
    ranks = _wait_for_ranks(mark)
    assert all(Path(f"/proc/{pid}/comm").read_bytes().strip() == WARM_RANK_NAME for pid in ranks), "fresh ranks"
    out, err, seconds = interrupt_once_ranks_run(proc, mark, signal.SIGTERM, group=True)
    assert proc.returncode == INTERRUPTED_EXIT_CODE, err
    assert marked_processes(mark) == [], "the warm server or a rank outlived the CLI"
    record = json.loads(out_file.read_text())
    assert record["status"] == "interrupted" and "interrupted by SIGTERM" in record["error"], record["error"]


def _wait_for_ranks(mark: str, wait_s: float = 120.0) -> list[int]:
    deadline = time.monotonic() + wait_s
    while not (ranks := marked_processes(mark, ranks_only=True)):
        assert time.monotonic() < deadline, "no rank started"
        time.sleep(0.1)
    return ranks
