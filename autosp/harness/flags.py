"""The run flags shared by every command that describes runs (`run`, `check`, `search`, `bench`, ...):
one flag per RunConfig/DataConfig field, defaults taken from the dataclasses, and the RunConfig they describe.
Lives in the harness beside RunConfig so the experiments need not import the CLI."""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from autosp.compiler.options import COMPILE_BACKENDS
from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.measure import parse_size

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(RunConfig) if f.default is not dataclasses.MISSING}
_DATA_DEFAULTS = DataConfig()


def add_run_config_arguments(parser: argparse.ArgumentParser, *, varied: Sequence[str] = ()) -> None:
    """One flag per RunConfig field (and per DataConfig field, prefixed), defaults taken from the dataclasses.

    `varied`: fields a command sets itself (e.g. `search` varies seq_len, `bench` also the method)."""
    d = _DEFAULTS
    g = parser.add_argument_group("run configuration")
    if "method" not in varied:
        g.add_argument("--method", required=True, help="training method (see `autosp methods`), e.g. single, autosp, "
                       "or a method spec with its options, e.g. autosp[paper] (the paper's setting), "
                       "ulysses[ac=layer]")
    g.add_argument("--model", required=True, help="model preset, e.g. tiny, small, llama-3.2-1b, hf:tiny")
    if "seq_len" not in varied:
        g.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    g.add_argument("--batch-size", type=int, default=d["batch_size"], help="sequences per data-parallel replica")
    g.add_argument("--world-size", type=int, default=d["world_size"], help="number of ranks")
    g.add_argument("--sp-size", type=int, default=d["sp_size"], help="SP degree (default: the method's)")
    g.add_argument("--dtype", default=d["dtype"], help="float32 | bfloat16 (mixed: bf16 compute, fp32 master weights, "
                   "gradients, AdamW moments) | bfloat16-pure | float16-pure")
    g.add_argument("--device", default=d["device"], help="cpu | cuda (ROCm builds of torch use cuda too)")
    g.add_argument("--seed", type=int, default=d["seed"])
    g.add_argument("--lr", type=float, default=d["lr"], help="AdamW learning rate")
    g.add_argument("--steps", type=int, default=d["steps"],
                   help="timed steps after the measured one (0: measure the peak only)")
    g.add_argument("--warmup", type=int, default=d["warmup"], help="untimed steps before measuring")
    g.add_argument("--sac", default=d["sac"],
                   help="autosp checkpointing: auto (default, the memory planner: the least added step time that fits "
                   "--memory-budget, or the GPU's free memory, per rank, over keeping, tiling (--tiling plan), host "
                   "memory (--offload auto) and recompute) | off | sac | full | budget=<fraction> | budget=<bytes> "
                   "(per rank, for the compiled graphs beyond the model state), e.g. budget=32MiB; the paper's "
                   "setting is --method autosp[paper] (sac, no tiling, no offload)")
    g.add_argument("--compile-backend", default=d["compile_backend"], help=" | ".join(COMPILE_BACKENDS))
    g.add_argument("--memory-budget", default=None,
                   help="emulated device size per rank, e.g. 512MiB or 2GiB: a higher peak ends the run as oom (and "
                   "what autosp's planner plans within)")
    g.add_argument("--timeout", "--timeout-s", dest="timeout_s", type=float, default=d["timeout_s"],
                   help="seconds before the whole run is ended as timeout")
    g.add_argument("--data-ignore-fraction", type=float, default=_DATA_DEFAULTS.ignore_fraction,
                   help="fraction of labels set to -100 (in uneven runs)")
    g.add_argument("--packed-documents", type=int, default=_DATA_DEFAULTS.packed_documents,
                   help="documents packed per row (position_ids restart per document)")
    g.add_argument("--pad-fraction", type=float, default=_DATA_DEFAULTS.pad_fraction,
                   help="fraction of each row that is right padding (attention_mask 0)")
    g.add_argument("--zero", type=int, default=d["zero"], choices=(0, 1, 2, 3),
                   help="ZeRO stage of the model state (0 replicated .. 3 parameters sharded); default: the method's "
                   "longest-length stage (3 for autosp, ulysses, ring, zero3, fsdp; `autosp methods` lists each)")
    g.add_argument("--tiling", default=d["tiling"],
                   help="autosp: plan (default: as auto where --sac auto finds a graph does not fit untiled) | off | "
                   "auto | some of loss,mlp,norm,recurrence [:<tokens per tile>]: LM head + loss and MLPs over token "
                   "tiles, RMSNorms' fp32 values a chunk of tokens at a time, the linear recurrences (gated delta "
                   "rule, SSD scan, lightning attention) over tiles with their state carried (exact; auto: all four)")
    g.add_argument("--ulysses-size", type=int, default=d["ulysses_size"],
                   help="autosp: Ulysses group size of the hybrid Ulysses x Ring (default: from the heads)")
    g.add_argument("--attention-chunks", type=int, default=d["attention_chunks"],
                   help="autosp: each attention's all-to-alls and kernel in this many chunks of the heads a rank "
                   "attends, so one chunk's full-length tensors exist at a time (default 1: none)")
    g.add_argument("--import", dest="extra_imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE in every rank first (out-of-tree methods register on import); repeatable")
    g.add_argument("--pad-side", choices=("right", "left"), default=_DATA_DEFAULTS.pad_side,
                   help="where the padding of --pad-fraction goes")
    g.add_argument("--offload", default=d["offload"],
                   help="autosp: auto (default: --sac auto's planner decides all three below: activations where the "
                   "--memory-budget needs the room, the optimizer state then the parameters where it cannot hold the "
                   "model state) | off | activations | auto,...: the layer-boundary activations wait in host memory "
                   "for backward (auto in a list: the activations only, by the planner); an `optimizer` item "
                   "(optimizer, activations,optimizer, auto,optimizer; optimizer:torch|deepspeed picks the host AdamW) "
                   "keeps the master weights and AdamW moments in host memory, the step on the CPU; a `params` item "
                   "beside it (auto,optimizer,params) keeps the parameters there too, fetched at each use, gradients "
                   "sent to host as backward makes them (ZeRO 3 or one rank)")
    g.add_argument("--ac", default=d["ac"], help="ulysses, ring, zero3, fsdp: off | layer (per-layer activation "
                   "checkpointing, as practitioners run them at long context)")
    g.add_argument("--host-memory-budget", default=None,
                   help="host memory per node (shared by its ranks; autosp's planner gets an even share per rank), "
                   "e.g. 2TiB: more offloaded to host by the node's ranks ends the run as oom (default: unbounded)")


def run_config_from_args(args: argparse.Namespace, **varied: object) -> RunConfig:
    """The RunConfig the flags of `add_run_config_arguments` describe (sizes parsed, e.g. 512MiB); `varied`
    supplies the fields the command set itself (a placeholder method or length for search/bench)."""
    budget = parse_size(args.memory_budget) if args.memory_budget is not None else None
    host_budget = parse_size(args.host_memory_budget) if args.host_memory_budget is not None else None
    data = DataConfig(ignore_fraction=args.data_ignore_fraction, packed_documents=args.packed_documents,
                      pad_fraction=args.pad_fraction, pad_side=args.pad_side)
    fields = dict(method=getattr(args, "method", None), model=args.model, seq_len=getattr(args, "seq_len", None),
                  batch_size=args.batch_size, world_size=args.world_size, sp_size=args.sp_size, dtype=args.dtype,
                  device=args.device, seed=args.seed, lr=args.lr, steps=args.steps, warmup=args.warmup, sac=args.sac,
                  compile_backend=args.compile_backend, memory_budget=budget, timeout_s=args.timeout_s, data=data,
                  zero=args.zero, tiling=args.tiling, ulysses_size=args.ulysses_size, offload=args.offload,
                  ac=args.ac, host_memory_budget=host_budget, attention_chunks=args.attention_chunks)
    fields = {**fields, **varied}
    method = str(fields["method"] or "")
    if "[" in method:
        from autosp.harness.method_spec import parse_method_spec

        spec = parse_method_spec(method)  # `autosp[paper]`: the spec's options over the flags
        return spec.config(RunConfig(**{**fields, "method": spec.method}))
    from autosp.harness.strategy import get_strategy

    cfg = RunConfig(**fields)
    try:  # the options the method does not read as its records hold them (searches keyed by them resume)
        return get_strategy(method).own_config(cfg)
    except ConfigError:
        return cfg  # an unknown method: refused where it is run, with the list of methods
