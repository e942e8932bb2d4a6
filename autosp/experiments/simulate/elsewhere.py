"""A probe simulated in a process of its own while the search's process simulates another (`simulate --jobs`).

Torch's fake-mode simulation is single-process Python, so two probes of one search use two cores only as two
processes. The process is spawned (a fresh interpreter: no fake world, no Dynamo state inherited) and sets up the
configuration's rank program at the length the search's own process set its program up at before it probes its
length, so its record is the one the sequential search makes on its shared program (the planner's graph budget is
the device's less the batch of that first length: `baselines.autosp_method.sac_policy`)."""
from __future__ import annotations

from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

from autosp.experiments.simulate.devices import DeviceModel
from autosp.harness.config import RunConfig


class ProbeElsewhere:
    """`simulate(cfg, device)` in a spawned process on a rank program set up at `built_at` tokens; `result()` waits
    for its record (re-raising what the process raised), `cancel()` ends the process."""

    def __init__(self, cfg: RunConfig, device: DeviceModel, built_at: int) -> None:
        from autosp.models import presets

        context = get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        # the presets as this process has them (a test registers a deeper variant of a CPU preset)
        self._process = context.Process(target=_probe, args=(send, cfg, device, built_at, dict(presets.PRESETS)),
                                        daemon=True)
        self._process.start()
        send.close()

    def result(self) -> dict[str, Any]:
        try:
            outcome = self._receive.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the probe process ended (exit code {self._process.exitcode}), no record") from None
        self._process.join()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def cancel(self) -> None:
        self._process.terminate()
        self._process.join()


def _probe(send: Connection, cfg: RunConfig, device: DeviceModel, built_at: int, preset_table: dict) -> None:
    from autosp.experiments.simulate.config import simulate_config
    from autosp.experiments.simulate.lengths import simulate
    from autosp.experiments.simulate.programs import set_up_program, shared_rank_programs
    from autosp.models import presets

    presets.PRESETS.update(preset_table)
    try:
        with shared_rank_programs():
            set_up_program(simulate_config(cfg.replace(seq_len=built_at)), device)
            outcome: Any = simulate(cfg, device)
    except BaseException as exc:  # noqa: BLE001 - handed to the search's process, which raises it
        outcome = exc
    send.send(outcome)
    send.close()
