"""Loss curves of long runs and the drift bound they are held to (`test_long_runs`).

Every curve trains `tiny` on one seeded batch (the runner's: the same batch each step, so the loss keeps
falling and any drift has hundreds of steps to grow). The bound is measured, not guessed: fp32 reassociation
is the single-process run against itself with the MLP's hidden units permuted (the same function; every sum
over them, forward and backward, adds in another order), the worst at each step over PERMUTATIONS seeds: one
permutation's drift is one sample of a chaotic process (over 200 steps four seeds gave 5.0e-7 to 3.0e-6). A
correct method may drift SPREAD_FACTOR times that, at every step t, against the worst reassociation drift up
to t (never below one fp32 ulp of the loss: its resolution).

    python -m tests.harness.loss_drift 200   # the curves and bounds of docs/measurements/2026-12-02-long-runs.md
    python -m tests.harness.loss_drift 200 curves.json curves.png   # also keep the curves and plot them
"""
from __future__ import annotations

import sys

import torch

from autosp.harness.check import SPREAD_FACTOR
from autosp.harness.config import RunConfig
from autosp.harness.runner import build_train_step, global_batch, run, train_step, validate

FP32_ULP = 2.0 ** -23  # relative resolution of an fp32 loss value
PERMUTATIONS = (1, 2, 3, 4)  # seeds of the MLP permutations whose worst drift is fp32 reassociation's
SEQ_LEN = 64


def single_losses(steps: int, *, dtype: str = "float32", permuted: int | None = None) -> list[float]:
    """Single-process training in this process; `permuted`: the seed of a permutation of the MLP hidden units."""
    cfg = RunConfig(method="single", model="tiny", seq_len=SEQ_LEN, dtype=dtype)
    strategy, sp_size = validate(cfg)
    step, _ = build_train_step(cfg, strategy, sp_size)
    if permuted is not None:
        with torch.no_grad():
            for layer in step.model.model.layers:
                mlp = layer.mlp
                seeded = torch.Generator().manual_seed(permuted)
                order = torch.randperm(mlp.up_proj.weight.shape[0], generator=seeded)
                for proj in (mlp.gate_proj, mlp.up_proj):
                    proj.weight.copy_(proj.weight[order])
                mlp.down_proj.weight.copy_(mlp.down_proj.weight[:, order])
    batch = global_batch(cfg, sp_size)
    return [train_step(step, batch, i) for i in range(steps)]


def autosp_losses(steps: int, *, zero: int, dtype: str = "float32") -> list[float]:
    """AutoSP on 2 gloo ranks, tiling on (loss and MLP, tiles of 8 tokens), the same batch each step."""
    cfg = RunConfig(method="autosp", model="tiny", seq_len=SEQ_LEN, world_size=2, dtype=dtype, zero=zero,
                    tiling="auto:8", compile_backend="aot_eager", warmup=0, steps=steps - 1, timeout_s=1800)
    record = run(cfg)
    assert record["status"] == "ok", record["error"]
    return record["extra"]["losses"]


def reassociation_drift(steps: int, fp32: list[float]) -> list[float]:
    """fp32 reassociation's drift at each step: the worst over the PERMUTATIONS runs against `fp32`."""
    drifts = [drift(single_losses(steps, permuted=seed), fp32) for seed in PERMUTATIONS]
    return [max(d) for d in zip(*drifts, strict=True)]


def drift(curve: list[float], reference: list[float]) -> list[float]:
    """Relative loss difference per step."""
    return [abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True)]


def bound(spread: list[float]) -> list[float]:
    """SPREAD_FACTOR x the worst spread up to each step, never below one fp32 ulp."""
    out, worst = [], FP32_ULP
    for s in spread:
        worst = max(worst, s)
        out.append(SPREAD_FACTOR * worst)
    return out


def excess(curve_drift: list[float], limit: list[float]) -> list[tuple[int, float, float]]:
    """The steps where the drift exceeds its bound: (step, drift, bound)."""
    return [(t, d, b) for t, (d, b) in enumerate(zip(curve_drift, limit, strict=True)) if d > b]


def curves(steps: int) -> dict[str, list[float]]:
    """Every loss curve the bounds need, by name: single fp32, its MLP permutations, single bf16 mixed, and
    AutoSP P=2 at ZeRO 0 and 3 in fp32 and at ZeRO 0 in bf16 mixed."""
    out = {"single fp32": single_losses(steps)}
    out.update({f"single fp32, MLP permutation {seed}": single_losses(steps, permuted=seed) for seed in PERMUTATIONS})
    out["single bf16 mixed"] = single_losses(steps, dtype="bfloat16")
    out.update({f"autosp P=2 zero {z} fp32": autosp_losses(steps, zero=z) for z in (0, 3)})
    out["autosp P=2 zero 0 bf16 mixed"] = autosp_losses(steps, zero=0, dtype="bfloat16")
    return out


def table(loss: dict[str, list[float]]) -> list[tuple[str, list[float], list[float] | None]]:
    """(name, drift from single fp32 per step, its bound or None) for each curve of `curves`."""
    fp32 = loss["single fp32"]
    reassociation = [max(d) for d in zip(*(drift(loss[f"single fp32, MLP permutation {seed}"], fp32)
                                           for seed in PERMUTATIONS), strict=True)]
    bf16_spread = drift(loss["single bf16 mixed"], fp32)
    return [(f"single fp32, MLP permuted (reassociation, worst of {len(PERMUTATIONS)})", reassociation, None),
            *[(f"autosp P=2 zero {z} fp32", drift(loss[f"autosp P=2 zero {z} fp32"], fp32), bound(reassociation))
              for z in (0, 3)],
            ("single bf16 mixed", bf16_spread, None),
            ("autosp P=2 zero 0 bf16 mixed", drift(loss["autosp P=2 zero 0 bf16 mixed"], fp32), bound(bf16_spread))]


def plot(loss: dict[str, list[float]], path: str) -> None:
    """Loss per step (top) and drift from single-process fp32 with the bounds (bottom, log scale) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 8), sharex=True)
    for name in ("single fp32", "autosp P=2 zero 0 fp32", "autosp P=2 zero 3 fp32", "single bf16 mixed",
                 "autosp P=2 zero 0 bf16 mixed"):
        top.plot(loss[name], label=name, linestyle="--" if "zero 3" in name else "-")
    top.set_yscale("log")
    top.set_ylabel("loss (tiny, seq_len 64, one batch)")
    top.legend()
    for name, d, limit in table(loss):
        steps = range(len(d))
        bottom.plot(steps, [max(x, 1e-9) for x in d], label=name, linestyle="--" if "zero 3" in name else "-")
        if limit is not None and "zero 3" not in name:
            bottom.plot(steps, limit, color="black", linestyle=":" if "bf16" in name else "-.",
                        label=f"bound for {'bf16 mixed' if 'bf16' in name else 'fp32'} ({SPREAD_FACTOR}x)")
    bottom.set_yscale("log")
    bottom.set_xlabel("optimizer step")
    bottom.set_ylabel("|loss - single fp32| / single fp32 (floor 1e-9)")
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(steps: int, data: str | None = None, png: str | None = None) -> None:
    """Print the table; with `data`, read the curves from that JSON file if it exists, else measure and write it;
    with `png`, plot them."""
    import json
    import os

    if data is not None and os.path.exists(data):
        with open(data) as f:
            loss = json.load(f)
    else:
        loss = curves(steps)
        if data is not None:
            with open(data, "w") as f:
                json.dump(loss, f)
    fp32 = loss["single fp32"]
    print(f"fp32 single-process loss: step 0 {fp32[0]:.6f}, step {len(fp32) - 1} {fp32[-1]:.6f}")
    print("| curve vs single fp32 | max drift | drift at last step | bound at last step | steps over bound |")
    print("|---|---|---|---|---|")
    for name, d, limit in table(loss):
        over = "-" if limit is None else str(len(excess(d, limit)))
        last = "-" if limit is None else f"{limit[-1]:.2e}"
        print(f"| {name} | {max(d):.2e} | {d[-1]:.2e} | {last} | {over} |")
    if png is not None:
        plot(loss, png)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, *sys.argv[2:4])
