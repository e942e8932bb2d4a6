"""Attempted reproducer (issue 9): the heap corruption of the per-parameter gather prefetch at ZeRO 3 on gloo.

Plain torch, 2 gloo ranks: per-parameter asynchronous functional all-gathers (`_c10d_functional.all_gather_into_tensor`)
of one "layer" issued while the previous layer computes, waited with `wait_tensor`, optionally an all-to-all and an
asynchronous reduce-scatter per layer, optionally under the memory profiler the harness measures with, called
directly or through torch.compile(backend="aot_eager"). Checks every step's result against the first.

    python tests/comm/repro_gloo_async_gather.py {eager,compiled} ITERS [--profile] [--rs] [--a2a]

Result (torch 2.13.0+cpu, loaded 2-core machine): `eager 200`, `eager 200 --profile --rs --a2a` and
`compiled 100 --profile --rs --a2a` all exit 0 with identical results: it does NOT reproduce the crash, so the
cause stays open (DESIGN.md, ZeRO stages). Kept so the next attempt starts from it, on a quiet machine.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

c10d = torch.ops._c10d_functional
SHAPES = [(128,), (128, 128), (64, 128), (64, 128), (128, 128), (128,), (352, 128), (352, 128), (128, 352)]
LAYERS = 4


def step(shards, x, group_size, group_name, use_rs, use_a2a):
    """Forward-like: gather layer k+1 while layer k computes; backward-like: reduce-scatter per layer."""
    issued = [c10d.all_gather_into_tensor(s, group_size, group_name) for s in shards[0]]
    outs = []
    for k in range(LAYERS):
        nxt = [c10d.all_gather_into_tensor(s, group_size, group_name) for s in shards[k + 1]] if k + 1 < LAYERS else []
        full = [c10d.wait_tensor(t) for t in issued]
        w = full[1][: 128 * 128].view(128, 128)
        h = x
        for _ in range(4):
            h = torch.tanh(h @ w)  # compute on the main thread while the next gathers are in flight
        if use_a2a:
            h = c10d.wait_tensor(c10d.all_to_all_single(h.contiguous(), [h.shape[0] // 2] * 2, [h.shape[0] // 2] * 2,
                                                        group_name))
        outs.append(h.sum() + sum(f.sum() for f in full))
        if use_rs:
            flat = torch.cat([f.view(group_size, -1) for f in full], 1).view(-1) * 1.0
            outs.append(c10d.wait_tensor(c10d.reduce_scatter_tensor(flat, "sum", group_size, group_name)).sum())
        issued = nxt
    return torch.stack(outs).sum()


def run(rank, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    group = dist.group.WORLD
    name = group.group_name
    g = torch.Generator().manual_seed(0)
    shards = [[torch.randn(-(-torch.Size(s).numel() // 2), generator=g) for s in SHAPES] for _ in range(LAYERS)]
    x = torch.randn(1024, 128, generator=g)
    fn = step
    if args.mode == "compiled":
        fn = torch.compile(step, backend="aot_eager", fullgraph=True)
    ref = None
    ctx = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) \
        if args.profile else torch.autograd.profiler.record_function("noop")
    with ctx:
        for i in range(args.iters):
            out = fn(shards, x, 2, name, args.rs, args.a2a)
            if ref is None:
                ref = out
            assert torch.equal(out, ref), (i, out, ref)
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["eager", "compiled"])
    p.add_argument("iters", type=int)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--rs", action="store_true")
    p.add_argument("--a2a", action="store_true")
    p.add_argument("--port", type=int, default=29631)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=run, args=(r, a)) for r in range(2)]
    for q in procs:
        q.start()
    for q in procs:
        q.join()
    codes = [q.exitcode for q in procs]
    print("exit codes", codes)
    sys.exit(0 if codes == [0, 0] else 1)
