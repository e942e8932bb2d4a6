"""`autosp simulate --search --jobs 2`: the planner's whole-depth probe one granule above its last rung's answer runs
in a second (spawned) process while the search's own process probes the answer, and each extrapolated pair's deeper
program in a second process beside the shallower one; the search finds what the sequential one finds, probe for
probe, each second process's record or peak equal to the sequential search's."""
from __future__ import annotations

import pytest

from autosp.cli import main
from autosp.experiments import simulate as sim
from autosp.experiments.simulate.devices import MIB, get_device_model
from autosp.harness.config import RunConfig
from tests.experiments.test_simulate import _deep, _planner_search

#: what differs between two runs of the same simulation: identity, time and the clock of the probe
VOLATILE = ("run_id", "search_id", "timestamp", "wall_s", "cpu_s")


@pytest.fixture(autouse=True)
def fresh_predictions():
    sim.extrapolate._PREDICTIONS.clear()
    yield
    sim.extrapolate._PREDICTIONS.clear()


def _stable(value):
    """`value` without what is `VOLATILE`, in every record nested in it (a search row's probes included)."""
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    return [_stable(v) for v in value] if isinstance(value, list) else value


def _planner(monkeypatch) -> RunConfig:
    """The planner on a 5-layer tiny, P=2 (deeper than `EXACT_LAYERS`: its search runs on the last rung)."""
    return RunConfig(method="autosp", model=_deep(monkeypatch, "tiny", num_layers=5), seq_len=1, world_size=2,
                     compile_backend="aot_eager", sac="auto", offload="auto")


def test_the_second_process_makes_the_record_the_sequential_search_makes(monkeypatch):
    """The sequential search probes the answer, then one granule above on the program it set up at the answer; the
    spawned process, given the answer's length to set its program up at, makes that second record to the byte."""
    from autosp.experiments.simulate.elsewhere import ProbeElsewhere

    cfg, device = _planner(monkeypatch), get_device_model("cpu", 14 * MIB)
    answer, above = 6144, 6656
    other = ProbeElsewhere(cfg.replace(seq_len=above), device, answer)
    with sim.shared_rank_programs():
        sim.simulate(cfg.replace(seq_len=answer), device)
        sequential = sim.simulate(cfg.replace(seq_len=above), device)
    elsewhere = other.result()
    assert elsewhere["extra"]["sac_auto"] and _stable(elsewhere) == _stable(sequential)


class _Synchronous:
    """`ProbeElsewhere` with the stand-in simulation of `_planner_search`, run here (a spawned process would not
    have it); what the search asked of it."""

    made: list[tuple[str, int]] = []

    def __init__(self, cfg: RunConfig, device, built_at: int) -> None:
        from autosp.experiments.simulate import lengths

        self.cfg, self.device, self.simulate = cfg, device, lengths.simulate
        self.made.append(("started", cfg.seq_len))

    def result(self) -> dict:
        self.made.append(("used", self.cfg.seq_len))
        return self.simulate(self.cfg, self.device)

    def cancel(self) -> None:
        self.made.append(("cancelled", self.cfg.seq_len))


@pytest.mark.parametrize("planner, used", [(2560, "used"), (4096, "used"), (1536, "cancelled")])
def test_two_jobs_make_the_probes_one_job_makes(monkeypatch, planner, used):
    """The planner fits at the rung's answer and not above / above too / not at the answer (the stand-in simulation
    of test_simulate.py): with two jobs the same probes in the same order, the probe above the answer started
    beside it and used, or ended where the sequential search does not make it."""
    from autosp.experiments.simulate import lengths

    longest = {sim.LAST_RUNG_SAC: 2560, "auto": planner}
    one = _planner_search(monkeypatch, longest)
    _Synchronous.made = []
    monkeypatch.setattr(lengths, "ProbeElsewhere", _Synchronous)
    real = sim.simulated_search
    monkeypatch.setattr(sim, "simulated_search", lambda *args, **kwargs: real(*args, **kwargs, jobs=2))
    two = _planner_search(monkeypatch, longest)
    assert _stable(two) == _stable(one)
    assert _Synchronous.made == [("started", 3072), (used, 3072)]


@pytest.mark.long
def test_two_jobs_find_what_one_finds_probe_for_probe(monkeypatch):
    """Measured on fake tensors, the planner's search on the 5-layer tiny at 14 MiB, P=2: the same longest length,
    first oom, plan and probes with two jobs, and the record the second process made equal to the sequential
    search's at its length. ~12 CPU-minutes."""
    from autosp.experiments.simulate import elsewhere, lengths

    cfg, device = _planner(monkeypatch), get_device_model("cpu", 14 * MIB)
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


def test_the_deeper_program_elsewhere_makes_the_records_made_here(monkeypatch):
    """AutoSP (the paper's setting, compiled) on the 5-layer tiny, extrapolated from 2 and 3 layers at two lengths on
    shared programs: with the 3-layer program in a second process (`deeper_programs_elsewhere`, kept there across
    the lengths: one symbolic Dynamo trace) every record equals the one-process record, and its CPU seconds count
    the second process's."""
    from autosp.experiments.simulate.programs import cpu_elsewhere, deeper_programs_elsewhere

    cfg = _planner(monkeypatch).replace(sac="sac", offload="off", tiling="off")
    device = get_device_model("cpu", 14 * MIB)
    lengths = (512, 1024)
    with sim.shared_rank_programs():
        here = [sim.simulate(cfg.replace(seq_len=n), device) for n in lengths]
    sim.extrapolate._PREDICTIONS.clear()
    with sim.shared_rank_programs(), deeper_programs_elsewhere(2):
        there = [sim.simulate(cfg.replace(seq_len=n), device) for n in lengths]
        elsewhere_cpu_s = cpu_elsewhere()
    assert [r["extra"]["layers_simulated"] for r in there] == [[2, 3]] * 2
    assert _stable(there) == _stable(here)
    assert elsewhere_cpu_s > 0 and sum(r["extra"]["cpu_s"] for r in there) > elsewhere_cpu_s


def test_what_the_depth_process_raises_is_raised_here(monkeypatch):
    """A request the second process cannot run (a model it was not given) comes back as its own error, and the
    process then serves the next request."""
    from autosp.experiments.simulate.elsewhere import DepthElsewhere

    cfg, device = _planner(monkeypatch).replace(sac=sim.LAST_RUNG_SAC, seq_len=2048), get_device_model("cpu", 14 * MIB)
    process = DepthElsewhere()
    try:
        process.start(cfg.replace(model="no-such-model"), device, 3)
        with pytest.raises(Exception, match="no-such-model"):
            process.result()
        process.start(cfg, device, 2)
        peak, cpu_s = process.result()
        assert peak.num_layers == 2 and cpu_s > 0
    finally:
        process.close()
