"""The tensors live at the backward peak of autosp's last rung (`budget=1B`) on Llama-3.1-8B, by producing op
(docs/measurements/2026-12-05-lever.md, section 1).

    bin/autosp-env python docs/measurements/2026-12-05-lever-liveset.py SEQ DEVICE WORLD LAYERS [tiling=auto] [out=F]

Each storage the tracker counts is labelled, when first seen, with its op, shape, dtype, phase and the line of the
compiled graph that made it (its FX node's module path); the backward peak's storages are printed largest first and
written to `out` (JSON). The planner's own view (its liveness replay of the chosen partition) follows.
"""
from __future__ import annotations

import json
import linecache
import sys

import torch

from autosp.compiler.memory import planner
from autosp.experiments.simulate import programs, tracker
from autosp.experiments.simulate.config import simulate_config
from autosp.experiments.simulate.devices import get_device_model
from autosp.experiments.simulate.extrapolate import LAST_RUNG_SAC, model_state_at_depth
from autosp.experiments.simulate.world import fake_world
from autosp.harness.config import RunConfig

GiB = 2**30


def where() -> tuple[str | None, str]:
    """The compiled graph's line running now and its node's module path, or (None, '')."""
    frame = sys._getframe(2)
    while frame is not None:
        if "eval_with_key" in frame.f_code.co_filename:
            line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
            gm, name = frame.f_locals.get("self"), line.split("=")[0].strip()
            node = next((n for n in gm.graph.nodes if n.name == name), None) if isinstance(gm, torch.fx.GraphModule) \
                else None
            stack = (node.meta.get("nn_module_stack") or {}) if node is not None else {}
            return line[:160], "/".join(str(path) for path, _ in stack.values())[-70:]
        frame = frame.f_back
    return None, ""


def main() -> None:
    seq, device_name, world, layers = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    options = dict(arg.split("=", 1) for arg in sys.argv[5:])
    out = options.pop("out", "/tmp/liveset.json")
    labels: dict[int, dict] = {}
    running: dict = {}
    record, track = tracker.LiveStorageTracker.record, tracker.LiveStorageTracker.track

    def labelled_record(self, func, out, args=(), kwargs=None):  # noqa: ANN001, ANN202 - the tracker's signature
        running.update(func=func, where=None)
        return record(self, func, out, args, kwargs)

    def labelled_track(self, tensor):  # noqa: ANN001, ANN202
        new = id(tensor.untyped_storage()) not in self.serials
        serial = track(self, tensor)
        if new:
            running["where"] = running.get("where") or where()
            labels[serial] = dict(op=str(running.get("func")), shape=list(tensor.shape), dtype=str(tensor.dtype),
                                  phase="backward" if torch._C._current_graph_task_id() != -1 else self.phase,
                                  line=running["where"][0], module=running["where"][1])
        return serial

    tracker.LiveStorageTracker.record, tracker.LiveStorageTracker.track = labelled_record, labelled_track
    device = get_device_model(device_name, None)
    cfg = RunConfig(method="autosp", model="llama-3.1-8b", seq_len=seq, world_size=world, dtype="bfloat16",
                    sac=LAST_RUNG_SAC, steps=0, **options)
    run = simulate_config(model_state_at_depth(cfg, device))
    with fake_world(run.world_size, 0):
        program = programs.RankProgram(run, device, num_layers=layers)
        peak = program.measure(run)
    plans = [(p.get("mlp_tile_halvings", 0), p["estimated_peak_bytes"], p["fits"]) for p in peak.plans]
    tiles = [[b["tile_tokens"] for b in r.mlp] for r in program.step.compiled.tiling_reports]
    print(f"offload {run.offload}; plans (halvings, estimated peak, fits) {plans}; MLP tiles {tiles}")
    backward = peak.phases["backward"]
    print(f"backward peak {backward.peak_bytes / GiB:.2f} GiB at {backward.peak_op}: model state "
          f"{backward.model_state_bytes / GiB:.2f}, gradients {backward.gradient_bytes / GiB:.2f}, saved "
          f"{backward.saved_activation_bytes / GiB:.2f}, transient {backward.transient_bytes / GiB:.2f} GiB")
    moment = program.tracker.moments["backward"]
    largest_first = sorted(moment.sizes.items(), key=lambda kv: -kv[1])
    rows = [dict(serial=s, bytes=n, **labels.get(s, {})) for s, n in largest_first]
    for row in rows:
        if row["bytes"] >= 64 << 20:
            print(f"{row['bytes'] / GiB:6.2f} {row.get('phase', ''):8} {row.get('op', ''):36} {row.get('shape')} "
                  f"{row.get('line') or ''} [{row.get('module', '')}]")
    print(f"{sum(r['bytes'] for r in rows if r['bytes'] < 64 << 20) / GiB:.2f} GiB in storages under 64 MiB")
    with open(out, "w") as f:
        json.dump(rows, f)
    chosen = program.step.compiled.partition_records[-1]
    fw, bw = chosen.fw_module, chosen.bw_module
    bytes_at, values = planner.live_at_peak(bw, planner.backward_inputs(fw, bw, chosen.num_fwd_outputs))
    order = list(bw.graph.nodes)
    latest = order[max(order.index(n) for n in values)]
    held = sum(map(planner.node_nbytes, values))
    print(f"the planner's replay of backward: {bytes_at / GiB:.2f} GiB, {held / GiB:.2f} GiB of it values, the latest "
          f"made {latest.name} ({latest.target})")


if __name__ == "__main__":
    main()
