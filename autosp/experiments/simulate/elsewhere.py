"""Simulations in a process of their own while the search's process simulates another (`simulate --jobs`).

Torch's fake-mode simulation is single-process Python, so one search uses two cores only as two processes, each
spawned (a fresh interpreter: no fake world, no Dynamo state inherited):
- `ProbeElsewhere`: the planner's whole-depth probe one granule above the answer. It sets up the configuration's
  rank program at the length the search's own process set its program up at before it probes its length, so its
  record is the one the sequential search makes on its shared program (the planner's graph budget is the device's
  less the batch of that first length: `baselines.autosp_method.sac_policy`).
- `DepthElsewhere`: the deeper program of an extrapolated pair (`programs.rank_peaks`), kept there across the
  search's lengths as this process keeps the shallower one. A shared program's peak does not depend on the lengths
  it stepped before (`SHARED_PROGRAM_METHODS`), so which process holds which depth changes no number."""
from __future__ import annotations

import time
from multiprocessing import get_context
from multiprocessing.connection import Connection
from typing import Any

from autosp.experiments.simulate.devices import DeviceModel
from autosp.experiments.simulate.tracker import RankPeak
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


class DepthElsewhere:
    """A spawned process that runs `rank_peak` at the depths it is sent, keeping its rank programs across them
    (`shared_rank_programs`): `start(cfg, device, layers)`, then `result()` waits for that peak (re-raising what
    the process raised) and the CPU seconds it took there. One request at a time."""

    def __init__(self) -> None:
        from autosp.models import presets

        context = get_context("spawn")
        self._connection, theirs = context.Pipe()
        self._process = context.Process(target=_serve_depths, args=(theirs, dict(presets.PRESETS)), daemon=True)
        self._process.start()
        theirs.close()

    def start(self, cfg: RunConfig, device: DeviceModel, layers: int) -> None:
        self._connection.send((cfg, device, layers))

    def result(self) -> tuple[RankPeak, float]:
        try:
            outcome, cpu_s = self._connection.recv()
        except EOFError:
            self._process.join()
            raise RuntimeError(f"the depth process ended (exit code {self._process.exitcode}), no peak") from None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome, cpu_s

    def close(self, *, wait: bool = True) -> None:
        """Ends the process: after its request in hand where `wait`, else at once."""
        if wait:
            try:
                self._connection.send(None)
            except OSError:  # the process has ended already
                pass
            self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join()
        self._connection.close()


def _serve_depths(connection: Connection, preset_table: dict) -> None:
    from autosp.experiments.simulate.programs import rank_peak, shared_rank_programs
    from autosp.models import presets

    presets.PRESETS.update(preset_table)
    with shared_rank_programs():
        while (request := connection.recv()) is not None:
            started = time.process_time()
            try:
                outcome: Any = rank_peak(*request)
            except BaseException as exc:  # noqa: BLE001 - handed to the search's process, which raises it
                outcome = exc
            try:
                connection.send((outcome, time.process_time() - started))
            except Exception as exc:  # noqa: BLE001 - an exception that does not pickle, said in its own words
                connection.send((RuntimeError(f"{type(outcome).__name__}: {outcome} ({exc})"), 0.0))
    connection.close()
