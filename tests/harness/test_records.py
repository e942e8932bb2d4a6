import json
import multiprocessing as mp

import pandas as pd
import pytest

from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.records import (
    FIELDS,
    SCHEMA_VERSION,
    append_record,
    check_writable,
    load_records,
    new_record,
    write_json_atomic,
)

CFG = RunConfig(method="single", model="tiny", seq_len=64, data=DataConfig(pad_fraction=0.25))


def _write_many(path: str, writer: int, count: int) -> None:
    for i in range(count):
        record = new_record(CFG, sp_size=1)
        record.update(status="ok", loss=float(i), extra={"writer": writer, "i": i, "payload": "x" * 200_000})
        append_record(path, record)


def test_concurrent_writers_never_interleave(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    ctx = mp.get_context("fork")  # plain Python writers: no torch state in the children
    writers = [ctx.Process(target=_write_many, args=(str(path), w, 25)) for w in range(4)]
    for p in writers:
        p.start()
    for p in writers:
        p.join(60)
        assert p.exitcode == 0
    lines = path.read_bytes().split(b"\n")
    assert lines[-1] == b"" and len(lines) == 4 * 25 + 1
    records = [json.loads(line) for line in lines[:-1]]  # every line is one whole record
    assert sorted((r["extra"]["writer"], r["extra"]["i"]) for r in records) == [
        (w, i) for w in range(4) for i in range(25)]
    assert len({r["run_id"] for r in records}) == 100


def test_new_record_has_every_field() -> None:
    record = new_record(CFG, sp_size=1)
    assert set(record) == set(FIELDS)
    assert record["schema_version"] == SCHEMA_VERSION and record["mode"] == "measured"
    assert record["config"]["data"]["pad_fraction"] == 0.25
    # the options `single` does not read as every such record holds them (`Strategy.own_config`)
    assert record["config_hash"] == CFG.replace(sac="sac", tiling="off", offload="off").config_hash()
    assert record["precision"] == "float32"
    assert new_record(CFG.replace(dtype="bfloat16"), sp_size=1)["precision"] == "bfloat16-mixed"
    assert {"python", "torch", "deepspeed", "transformers"} <= set(record["versions"])


def test_load_records_flattens_nested_fields(tmp_path) -> None:
    paths = [tmp_path / "a.jsonl", tmp_path / "b.jsonl"]
    for n, path in enumerate(paths):
        record = new_record(CFG.replace(seq_len=64 * (n + 1)), sp_size=1)
        record.update(status="ok", peak_mem_by_rank=[10, 20],
                      iter_time_s={"median": 0.5, "min": 0.4, "max": 0.6, "samples": [0.4, 0.5, 0.6]})
        append_record(path, record)
    df = load_records(paths)
    assert isinstance(df, pd.DataFrame) and len(df) == 2
    assert list(df["seq_len"]) == [64, 128]
    assert list(df["iter_time_s.median"]) == [0.5, 0.5]
    assert df["peak_mem_by_rank"].iloc[0] == [10, 20]
    assert list(df["config.data.pad_fraction"]) == [0.25, 0.25]
    assert df["versions.torch"].notna().all()
    assert list(df["source"]) == [str(p) for p in paths]
    assert len(load_records(paths[0])) == 1  # a single path works too


def test_corrupt_line_names_file_and_line(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    append_record(path, {**new_record(CFG, sp_size=1), "status": "ok"})
    with open(path, "a") as f:
        f.write('{"half": \n')
    with pytest.raises(ValueError, match=r"runs.jsonl:2"):
        load_records(path)


def test_missing_file_is_an_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read records file .*nope.jsonl: No such file"):
        load_records(tmp_path / "nope.jsonl")


def test_write_json_atomic_replaces_whole_file(tmp_path) -> None:
    path = tmp_path / "sub" / "report.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in path.parent.iterdir()] == ["report.json"]


def test_torn_last_line_is_repaired_and_both_records_load(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    append_record(path, {**new_record(CFG, sp_size=1), "status": "ok"})
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # a writer stopped before its newline
    append_record(path, {**new_record(CFG, sp_size=1), "status": "error"})
    assert list(load_records(path)["status"]) == ["ok", "error"]


def test_half_written_line_is_skipped_and_reported_when_asked(tmp_path) -> None:
    path = tmp_path / "runs.jsonl"
    append_record(path, {**new_record(CFG, sp_size=1), "status": "ok"})
    with open(path, "ab") as f:
        f.write(b'{"status": "o')  # half a record, no newline
    append_record(path, {**new_record(CFG, sp_size=1), "status": "error"})
    with pytest.raises(ConfigError, match=r"runs.jsonl:2: not a JSON record .*--skip-bad-lines"):
        load_records(path)
    df = load_records(path, skip_bad_lines=True)
    assert list(df["status"]) == ["ok", "error"]
    assert [line.split(": ")[0] for line in df.attrs["skipped_lines"]] == [f"{path}:2"]


@pytest.mark.parametrize("where,reason", [
    ("folder", "it is a folder"),
    ("file/runs.jsonl", "is a file, not a folder"),
])
def test_unwritable_output_is_a_config_error(tmp_path, where: str, reason: str) -> None:
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=f"cannot write --out .*{reason}"):
        check_writable(tmp_path / where)


def test_check_writable_creates_the_folder_and_leaves_no_trace(tmp_path) -> None:
    check_writable(tmp_path / "new" / "runs.jsonl")
    assert list((tmp_path / "new").iterdir()) == []
