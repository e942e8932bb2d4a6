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
    program in this process (another depth, another cell, a test) would otherwise run through, or wrap again.
    Called before a method's setup, when transformers is loaded (an HF model was built)."""
    import sys

    if not _RESTORE or "transformers.masking_utils" not in sys.modules:
        return
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for registry in (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS):
        saved = dict(type(registry)._global_mapping), dict(registry._local_mapping)

        def restore(registry=registry, saved=saved) -> None:
            for mapping, before in zip((type(registry)._global_mapping, registry._local_mapping), saved):
                mapping.clear()
                mapping.update(before)

        _RESTORE[-1].append(restore)


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
    _keep_deepspeed_splice()


def _keep_deepspeed_splice() -> None:
    """DeepSpeed's AutoSP splices its long-context checkpointing into torch's min-cut partitioner from the
    partitioner's source (process-wide, once: a second splice finds no source, `OSError: could not get source
    code`); the splice made by the first engine stays, and a later engine (another depth of the same cell, or
    the next simulation) registers nothing."""
    import sys

    if (init_sp := sys.modules.get("deepspeed.compile.init_sp")) is not None:
        init_sp.register_long_context_checkpointing = lambda: None
