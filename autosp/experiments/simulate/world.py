"""A fake world: this process as rank r of a P-rank job (PyTorch's fake process group), and what a job's program
changed process-wide undone when it ends."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as rank `rank` of a `world_size` job whose collectives only hallucinate outputs.

    What a job's program changes process-wide ends with the world: DeepSpeed's ZeRO-3 replaces
    `torch.nn.functional.linear` by its own autograd function ("this will persist unless manually reset") — part of
    the zero3 program, but the next program in this process (a later cell of a `simulate-table` worker, another
    test) would trace it too (autosp's compile then fails on it)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("simulate needs a process without a process group")
    set_local_rank = "LOCAL_RANK" not in os.environ  # DeepSpeed reads it; left behind, it would make later
    os.environ.setdefault("LOCAL_RANK", "0")           # code in this process (accelerate) think it is a job's rank
    linear = torch.nn.functional.linear
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    _RESTORE.append([])
    try:
        yield
    finally:
        for restore in reversed(_RESTORE.pop()):
            restore()
        dist.destroy_process_group()
        _forget_deepspeed_groups()
        torch.nn.functional.linear = linear
        if set_local_rank:
            os.environ.pop("LOCAL_RANK", None)


_RESTORE: list[list] = []  # per active fake world: what to put back when it ends (`keep_hf_registries`)


def keep_hf_registries() -> None:
    """transformers' attention and mask registries as they are now, put back when the fake world ends: alst's setup
    replaces their `sdpa` entries process-wide (DeepSpeed's Ulysses wrapper, no mask under SP), which a later
    program in this process (another cell, a test) would otherwise run through, or wrap again.
    Called before a method's setup, when transformers is loaded (an HF model was built)."""
    if _RESTORE and _hf_registries():
        saved = process_registrations()
        _RESTORE[-1].append(lambda: install_registrations(saved))


def _hf_registries() -> list:
    import sys

    if "transformers.masking_utils" not in sys.modules:
        return []
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return [ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS]


#: ALST's SP groups (`UlyssesSPAttentionHF.register_with_transformers` sets them once per process; DeepSpeed's
#: engine reads them back through its mpu at every step)
_SP_STATE = "deepspeed.runtime.sequence_parallel.parallel_state_sp"
_SP_GROUPS = ("_SEQUENCE_PARALLEL_GROUP", "_SEQUENCE_DATA_PARALLEL_GROUP")


def process_registrations() -> list[tuple]:
    """What a program's setup registers process-wide and its steps read back: transformers' attention and mask
    registries (alst's Ulysses wrapper, its no-mask entry) and ALST's SP groups. Several rank programs of one
    fake world (two depths, two devices' allocator blocks) each keep their own (`RankProgram`): a second alst
    setup on the first's would find the SP groups set (DeepSpeed asserts) and wrap the wrapper (two all-to-alls)."""
    import sys

    state: list[tuple] = [(registry, dict(type(registry)._global_mapping), dict(registry._local_mapping))
                          for registry in _hf_registries()]
    sp = sys.modules.get(_SP_STATE)  # not loaded yet: no groups (its import-time values)
    state.append((_SP_STATE, *(getattr(sp, name, None) for name in _SP_GROUPS)))
    return state


def install_registrations(state: list[tuple]) -> None:
    """Put back what `process_registrations` read (an entry of a module not loaded then stays as it is)."""
    import sys

    for owner, *values in state:
        if owner == _SP_STATE:  # ALST's SP groups
            if (sp := sys.modules.get(_SP_STATE)) is not None:
                for name, value in zip(_SP_GROUPS, values, strict=True):
                    setattr(sp, name, value)
        else:  # a transformers registry: its class-wide and its own mapping
            for mapping, before in zip((type(owner)._global_mapping, owner._local_mapping), values, strict=True):
                mapping.clear()
                mapping.update(before)


@contextlib.contextmanager
def registrations_installed(state: list[tuple]) -> Iterator[None]:
    """`state` installed inside (one program's step), what was there before put back after."""
    before = process_registrations()
    install_registrations(state)
    try:
        yield
    finally:
        install_registrations(before)


def _forget_deepspeed_groups() -> None:
    """DeepSpeed keeps the process groups it derives in module globals; they die with this fake world, so the
    next simulation in this process (e.g. the 3-layer one after the 2-layer one) must not find them."""
    import importlib
    import sys

    if (groups := sys.modules.get("deepspeed.utils.groups")) is not None:
        importlib.reload(groups)  # its globals back to their import-time values (None, {})
    if (sequence_parallel := sys.modules.get("deepspeed.runtime.sequence_parallel.parallel_state_sp")) is not None:
        importlib.reload(sequence_parallel)  # ALST's SP groups (`UlyssesSPAttentionHF.register_with_transformers`)
    if (registry := sys.modules.get("deepspeed.compile.custom_ops.sp_dp_registry")) is not None:
        registry.GROUP_REGISTRY.clear()
    keep_deepspeed_splice()


def keep_deepspeed_splice() -> None:
    """DeepSpeed's AutoSP splices its long-context checkpointing into torch's min-cut partitioner from the
    partitioner's source (process-wide, once: a second splice finds no source, `OSError: could not get source
    code`); the splice made by the first engine stays, and a later engine (another depth of the same cell, or
    the next simulation) registers nothing."""
    import sys

    if (init_sp := sys.modules.get("deepspeed.compile.init_sp")) is not None:
        init_sp.register_long_context_checkpointing = lambda: None
