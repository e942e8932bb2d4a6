"""The one interface every training method implements, the compiler method included, and the registry of methods.

The harness owns it and runs a method by name (`get_strategy`); the methods (`baselines/`, or a module given with
`--import`) implement it and register themselves (`@register`), so the harness imports no method: a built-in
method's module is imported by its name (`BUILTIN_MODULES`) the first time the method is asked for, and a rank loads
only its own method (FSDP's DTensor and DeepSpeed cost seconds of import each).

A method turns (a model built identically on every rank, the parallel context) into a `TrainStep`.
The harness owns everything else: launching ranks, data, timing, memory, records, correctness checks.

Batch contract: every rank receives the same *global* batch of `dp_size * batch_size` rows with the full
sequence. A method picks its own part (rows for data parallelism, a sequence shard for SP) and must
produce, on every rank, the loss of the whole global batch as single-process training computes it
(token mean over all valid labels) and gradients equal to that loss's gradients.
"""
from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from autosp.harness.config import METHOD_OPTIONS, UNREAD_OPTIONS, ConfigError, RunConfig

if TYPE_CHECKING:
    from autosp.harness.parallel import ParallelContext
    from autosp.models.data import Batch


class TrainStep(ABC):
    """A built, ready-to-run training step of one method on one rank."""

    #: which implementation actually ran (e.g. "ring-flash-attn" or "torch-ring"); goes into the record
    implementation: str = ""
    #: FLOPs of the forward ops the last step re-ran in backward, on this rank, where the method counts them
    #: (`baselines.recompute_flops`; autosp's planner records its own per graph); None where it does not
    recompute_flops: int | None = None

    @abstractmethod
    def forward_backward(self, batch: Batch) -> torch.Tensor:
        """Run forward and backward on this rank's part of the global batch; return the global loss (detached)."""

    @abstractmethod
    def optimizer_step(self) -> None:
        """Apply AdamW and zero the gradients."""

    @abstractmethod
    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        """After backward, before `optimizer_step`: (parameter name, this rank's gradient or its shard of it, None
        where it has none) for every parameter in the model's order, the same names on every rank, without copies.
        What the harness checks for non-finite values in the step that made them (`first_nonfinite`)."""

    def first_nonfinite(self) -> tuple[int, list[str]]:
        """(index of the first parameter whose local gradient holds an inf or nan, or the parameter count when none
        does; every parameter's name in order). One max-abs reduction per tensor (inf or nan exactly when an element
        is; no temporary the size of a gradient, which a measured peak would count), one host sync for them all."""
        names, checked, flags = [], [], []
        for index, (name, grad) in enumerate(self.local_gradients()):
            names.append(name)
            if grad is not None and grad.numel():
                checked.append(index)
                flags.append(torch.linalg.vector_norm(grad, float("inf")).isfinite())
        finite = torch.stack(flags).tolist() if flags else []
        return next((i for i, ok in zip(checked, finite, strict=True) if not ok), len(names)), names

    @abstractmethod
    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full (unsharded) gradient on CPU, keyed like `model.named_parameters()`."""

    @abstractmethod
    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective: every parameter's full (unsharded) value on CPU, keyed like `model.named_parameters()`."""

    def metrics(self) -> dict[str, Any]:
        """Method-specific numbers for the record's `extra` (e.g. bytes saved for backward); read after the steps."""
        return {}


class Strategy(ABC):
    """A training method, registered by name (`--method NAME`)."""

    name: ClassVar[str]
    description: ClassVar[str]
    #: True for methods that split the sequence (their default sp_size is the world size)
    sequence_parallel: ClassVar[bool] = False
    #: True for methods that need a process group, i.e. at least 2 ranks
    distributed: ClassVar[bool] = True
    #: ZeRO stages `--zero` may ask of this method; the first is its default (what runs without `--zero`): the
    #: stage of its longest trainable length, the highest it runs, for every method alike
    zero_stages: ClassVar[tuple[int, ...]] = (0,)
    #: True for methods that train any sequence length by padding the shards internally
    pads_sequence: ClassVar[bool] = False
    #: the method-specific RunConfig fields (`METHOD_OPTIONS`) it reads, besides `zero`, which a method honours
    #: when it runs more than one stage; the others never reach it nor its record (`own_config`)
    options: ClassVar[frozenset[str]] = frozenset()
    #: named settings of those options, written as a bare word in a method spec (`autosp[paper]`, `method_spec`)
    presets: ClassVar[dict[str, dict[str, object]]] = {}

    def honoured_options(self) -> frozenset[str]:
        return self.options | (frozenset({"zero"}) if len(self.zero_stages) > 1 else frozenset())

    def own_config(self, cfg: RunConfig) -> RunConfig:
        """`cfg` with every method-specific option this method does not honour back at its default, so that
        options meant for another method (`autosp bench --methods autosp,ulysses --tiling auto`) neither reach
        it nor appear in its record."""
        honoured = self.honoured_options()
        defaults = RunConfig(method=cfg.method, model=cfg.model, seq_len=cfg.seq_len)
        return cfg.replace(**{name: UNREAD_OPTIONS.get(name, getattr(defaults, name)) for name in METHOD_OPTIONS
                              if name not in honoured})

    def zero_stage(self, cfg: RunConfig) -> int:
        """The ZeRO stage of the model state this method runs under `cfg` (recorded with every run)."""
        return self.zero_stages[0] if cfg.zero is None else cfg.zero

    def default_sp_size(self, world_size: int) -> int:
        return world_size if self.sequence_parallel else 1

    def validate(self, cfg: RunConfig, num_heads: int, num_kv_heads: int) -> None:
        """Raise ConfigError for a configuration this method cannot run (before any rank starts)."""
        if self.distributed and cfg.world_size < 2:
            raise ConfigError(f"--method {cfg.method} needs a process group; use --world-size >= 2 "
                              "(or --method single)")
        if cfg.zero is not None and cfg.zero not in self.zero_stages:
            raise ConfigError(f"--method {cfg.method} runs ZeRO stage(s) {sorted(self.zero_stages)}, not --zero "
                              f"{cfg.zero}; drop --zero or pick one of those")
        sp = cfg.sp_size or self.default_sp_size(cfg.world_size)
        if cfg.world_size % sp:
            raise ConfigError(f"--sp-size {sp} must divide --world-size {cfg.world_size}")
        if sp > 1 and cfg.seq_len % sp and not self.pads_sequence:
            raise ConfigError(
                f"--seq-len {cfg.seq_len} is not divisible by the SP degree {sp}; "
                f"use a multiple of {sp}, e.g. {(cfg.seq_len // sp + 1) * sp}"
            )

    @abstractmethod
    def setup(self, model: torch.nn.Module, ctx: ParallelContext, cfg: RunConfig) -> TrainStep:
        """Wrap/transform `model` (already on ctx.device, same seed on every rank) and build its optimizer."""


#: the module each built-in method registers itself in
BUILTIN_MODULES = {
    "alst": "baselines.alst",
    "autosp": "baselines.autosp_method",
    "ds-autosp": "baselines.ds_autosp",
    "fsdp": "baselines.fsdp",
    "ring": "baselines.ring",
    "single": "baselines.single",
    "ulysses": "baselines.ulysses",
    "ulysses-compile": "baselines.ulysses",
    "zero3": "baselines.zero3",
}

#: one spelling per method: a retired name -> what to write instead (a one-line error, not "unknown method")
RETIRED = {"ulysses-ac": "ulysses[ac=layer] with --zero 0 (per-layer activation checkpointing; --ac layer on the "
                         "command line)"}

_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make a method available as `--method cls.name`."""
    _REGISTRY[cls.name] = cls
    return cls


def get_strategy(name: str) -> Strategy:
    if name not in _REGISTRY and name in BUILTIN_MODULES:
        importlib.import_module(BUILTIN_MODULES[name])  # registers it
    if name in RETIRED:
        raise ConfigError(f"method {name!r} is now spelled {RETIRED[name]}")
    if name not in _REGISTRY:
        raise ConfigError(f"unknown method {name!r}; valid methods: {', '.join(method_names())}")
    return _REGISTRY[name]()


def method_names() -> list[str]:
    """Every registered method: the built-in ones (imported here) and any out-of-tree one already imported."""
    for module in sorted(set(BUILTIN_MODULES.values())):
        importlib.import_module(module)
    return sorted(_REGISTRY)
