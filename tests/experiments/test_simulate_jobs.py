"""`autosp simulate --search --jobs 2`: the planner's whole-depth probe one granule above its last rung's answer runs
in a second (spawned) process while the search's own process probes the answer; the search finds what the
sequential one finds, probe for probe, the second process's record equal to the sequential search's."""
from __future__ import annotations

from autosp.cli import main
from autosp.experiments import simulate as sim
from autosp.experiments.simulate.devices import MIB, get_device_model
from autosp.harness.config import RunConfig
from tests.experiments.test_simulate import _deep

#: what differs between two runs of the same simulation: identity, time and the clock of the probe
VOLATILE = ("run_id", "search_id", "timestamp", "wall_s")


def _stable(record: dict) -> dict:
    return {k: _stable(v) if isinstance(v, dict) else v for k, v in record.items() if k not in VOLATILE}


def test_two_jobs_find_what_one_finds_probe_for_probe(monkeypatch):
    """5-layer tiny at 14 MiB, P=2 (as the planner's search test in test_simulate.py): the same longest length, first
    oom, plan and probes, and each record the second process made equal to the sequential search's at its length."""
    from autosp.experiments.simulate import elsewhere, lengths

    cfg = RunConfig(method="autosp", model=_deep(monkeypatch, "tiny", num_layers=5), seq_len=1, world_size=2,
                    compile_backend="aot_eager", sac="auto", offload="auto")
    device = get_device_model("cpu", 14 * MIB)
    made: list[dict] = []
    real = lengths.simulate
    monkeypatch.setattr(lengths, "simulate", lambda c, d: made.append(real(c, d)) or made[-1])
    sequential = sim.simulated_search(cfg, device, granularity=512, max_len=65536)
    by_length = {(r["seq_len"], r["config"]["sac"]): r for r in made}
    sim.extrapolate._PREDICTIONS.clear()

    elsewhere_made: list[dict] = []

    class Recorded(elsewhere.ProbeElsewhere):
        def result(self) -> dict:
            elsewhere_made.append(super().result())
            return elsewhere_made[-1]

    monkeypatch.setattr(lengths, "ProbeElsewhere", Recorded)
    parallel = sim.simulated_search(cfg, device, granularity=512, max_len=65536, jobs=2)
    assert sequential["extra"]["searched_on"]["planner_confirmed"] and len(elsewhere_made) == 1
    assert _stable(parallel) == _stable(sequential)
    (other,) = elsewhere_made
    assert _stable(other) == _stable(by_length[other["seq_len"], "auto"])


def test_cli_jobs_must_be_positive(capsys):
    assert main(["simulate", "--method", "ring", "--model", "tiny", "--world-size", "2", "--seq-len", "256",
                 "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err
