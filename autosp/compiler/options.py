"""What the compiler can be asked to do: one frozen, validated options object for `autosp.compile`, `autosp.backend`
and `autosp.compiler.backend.make_backend`.

Every field is checked once, when the object is made (`__post_init__`), with the same one-line messages the
parsers give (`ConfigError` for a bad policy, tiling or offload value, `SequenceParallelError` for the rest); the
parsed forms (`policy`, `tiling_options`, `offloads`) are kept beside the text a user wrote.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from autosp.comm.sharding import check_stage
from autosp.compiler.memory import OffloadPlan, Policy, parse_policy
from autosp.compiler.tiling import Tiling, check_outputs, parse_tiling
from autosp.errors import SequenceParallelError

#: the torch.compile backends that lower the graphs after the SP pass (`compile_with_partitioner`); the one list
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def check_backend(backend: str) -> str:
    if backend not in COMPILE_BACKENDS:
        raise SequenceParallelError(f"unknown inner backend {backend!r}; choose one of {', '.join(COMPILE_BACKENDS)}")
    return backend


@dataclass(frozen=True)
class CompileOptions:
    """The compiler's options (the SP group itself is chosen by `sp_size`/`process_group`, not here)."""

    #: what backward's values cost: off | sac | full | auto | budget=<fraction in [0, 1]> | budget=<bytes, e.g.
    #: 32MiB> (`autosp.compiler.memory`). Default auto, the memory planner: one decision per layer over the three
    #: levers (keep on the device, move to host memory, recompute) against the device budget (budget=<bytes>, or
    #: the device's free memory at compile time; no limit on CPU) and `host_budget`, least added step time first.
    #: It stays the `sac` option (with `offload`) rather than a new `memory` switch so that every explicit policy
    #: (the SAC figure's comparisons) keeps its name and `budget=<bytes>` keeps meaning "plan within these bytes"
    sac: str | Policy = "auto"
    #: what lowers the graphs after the SP pass: inductor | aot_eager | eager (`COMPILE_BACKENDS`); default inductor
    backend: str = "inductor"
    #: ZeRO stage 0-3 of the model state over all ranks sharing it; None: the default stage
    #: (`autosp.comm.sharding.resolve_stage`: 3, 0 where one rank holds the model, 1 on a backend without 2/3)
    zero: int | None = None
    #: mixed precision: the dtype the model computes in over the parameters' own (fp32 master) dtype, e.g.
    #: torch.bfloat16: parameters cast before they are gathered (stages 2/3) or where they are used (stages 0/1,
    #: `autosp.comm.precision`), activations and all-to-alls in that dtype, gradients (and their reduction) and
    #: optimizer state in the master dtype; None: the parameters' own dtype
    compute_dtype: torch.dtype | None = None
    #: plan | off | auto | some of loss,mlp,norm,recurrence, optionally :<tokens per tile>: the LM head + cross-entropy
    #: (and token-wise blocks such as the MLP) run over tiles of the local tokens, recomputed in backward; RMSNorms as
    #: one kernel holding their fp32 values for a chunk of tokens at a time (`norm`); the gated delta rule's, the SSD
    #: scan's and lightning attention's kernels over tiles, their state carried (`recurrence`); auto: all four; exact
    #: (`autosp.compiler.tiling.loss`). Default plan: under the planner (sac auto) a graph is tiled as `auto` (tile
    #: size chosen per graph) only where it does not fit the budget untiled with everything kept; under any other
    #: policy plan is off
    tiling: str | Tiling = "plan"
    #: all | loss: `loss` returns None for every output but the loss (a model returning logits has its loss tiled
    #: only then); default all
    outputs: str = "all"
    #: Ulysses all-to-alls inside groups of this many consecutive ranks, ring attention across them; None: the
    #: largest size the heads and the node allow (`autosp.compiler.sp.attention.hybrid`)
    ulysses_size: int | None = None
    #: what may live in host memory (`autosp.compiler.memory.OffloadPlan`, or its text): the layer-boundary
    #: activations (waiting between forward and backward; needs backend aot_eager or inductor), the optimizer state
    #: (fp32 masters and AdamW moments, the step on the CPU: `autosp.comm.host_optimizer`; build the optimizer with
    #: `make_optimizer`; `optimizer:torch|deepspeed` picks the host AdamW) and the parameters (ZeRO-3 shards, or the
    #: whole parameters at one rank, fetched at each use, gradients streamed back: `autosp.comm.host_params`; ZeRO 3
    #: or one rank), each off, on or auto. Default `auto`: under the planner (sac auto) the activations move where
    #: the device budget needs it, and the optimizer state (then the parameters) where the device cannot hold the
    #: model state (`OffloadPlan.resolve_state`: nothing moves on CPU without a budget); under any other policy auto
    #: is off. Text: `off | activations | auto[,optimizer[:torch|deepspeed]][,params]` (`OffloadPlan.parse`)
    offload: str | OffloadPlan = "auto"
    #: bytes of host memory this rank may hold for the offloads (None: no limit): the optimizer state's first, the
    #: planner's activations in the rest
    host_budget: int | None = None
    #: each attention's Ulysses region (all-to-alls of q, k, v, attention, all-to-all back) in this many chunks of
    #: its heads, so one layer's full-length attention tensors exist for one chunk at a time, forward and backward
    #: (`autosp.compiler.sp.attention.communicate.HeadChunks`); must divide the query heads per rank. Default 1 (no
    #: chunks)
    attention_chunks: int = 1

    policy: Policy = field(init=False, repr=False, compare=False)
    tiling_options: Tiling = field(init=False, repr=False, compare=False)
    offload_plan: OffloadPlan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_backend(self.backend)
        if self.zero is not None:
            check_stage(self.zero)
        if self.compute_dtype is not None and not (isinstance(self.compute_dtype, torch.dtype)
                                                   and self.compute_dtype.is_floating_point):
            raise SequenceParallelError(f"compute_dtype={self.compute_dtype!r}: give a floating-point torch.dtype, "
                                        "e.g. torch.bfloat16, or None")
        if self.ulysses_size is not None and (not isinstance(self.ulysses_size, int) or self.ulysses_size < 1):
            raise SequenceParallelError(f"ulysses_size={self.ulysses_size!r}: give a positive rank count or None")
        object.__setattr__(self, "policy", parse_policy(self.sac))
        object.__setattr__(self, "tiling_options", parse_tiling(self.tiling))
        check_outputs(self.outputs)
        object.__setattr__(self, "offload_plan", OffloadPlan.parse(self.offload))
        if self.host_budget is not None and (not isinstance(self.host_budget, int) or self.host_budget < 0):
            raise SequenceParallelError(f"host_budget={self.host_budget!r}: give bytes of host memory (an int >= 0) "
                                        "or None")
        if isinstance(self.attention_chunks, bool) or not isinstance(self.attention_chunks, int) \
                or self.attention_chunks < 1:
            raise SequenceParallelError(f"attention_chunks={self.attention_chunks!r}: give a positive number of "
                                        "chunks of heads (1: none)")
        if self.offloads and self.backend == "eager":
            raise SequenceParallelError("offload=activations rewrites the partitioned forward/backward graphs; "
                                        "use backend aot_eager or inductor, not eager")

    @property
    def offloads(self) -> bool:
        """Whether the offload pass runs on every graph (the activations always in host memory)."""
        return self.offload_plan.activations == "on"

    @property
    def offload_mode(self) -> str:
        """The activations' mode, `off | activations | auto` (`OffloadPlan.activation_mode`)."""
        return self.offload_plan.activation_mode

    @property
    def host_adam(self) -> str | None:
        """The host AdamW (auto | torch | deepspeed) where the optimizer state is in host memory, else None (also
        while it is still `auto`: `autosp.compile` decides it, `OffloadPlan.resolve_state`)."""
        return self.offload_plan.host_adam if self.offload_plan.optimizer == "on" else None

    @property
    def host_params(self) -> bool:
        """Whether the parameters are in host memory (decided: `on`)."""
        return self.offload_plan.params == "on"

    @classmethod
    def of(cls, options: CompileOptions | None = None, **changes: Any) -> CompileOptions:
        """`options` (default: the defaults) with `changes` applied, validated; an unknown name is a TypeError."""
        names = [f.name for f in dataclasses.fields(cls) if f.init]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"unknown AutoSP option {unknown[0]!r}; the options are {', '.join(names)}")
        base = options if options is not None else cls()
        return dataclasses.replace(base, **changes) if changes else base

