"""Importing DeepSpeed for the DeepSpeed baselines (zero3, ds-autosp): absent → a clear ConfigError; on gloo,
no shared-memory comm op build.

DeepSpeed's `init_distributed` (called by `deepspeed.initialize`) builds a `TorchBackend`, whose constructor
JIT-compiles the CPU shared-memory collective `deepspeed_shm_comm` (~35 s, into ~/.cache/torch_extensions)
whenever DeepSpeed's op-compatibility table says the op can be built. That op only serves
`inference_all_reduce`; training collectives go through torch.distributed (gloo here). The clean switch is
that table itself: `deepspeed.ops.__compatible_ops__` is computed once per process and cached in the module
(DeepSpeed keeps it as one dict so edits persist), and `build_shm_op` returns None for an op marked
incompatible. Marking `deepspeed_shm_comm` incompatible on gloo (and on the simulator's fake process group) skips the build and changes nothing else;
on nccl (GPUs) the table is left alone.
"""
from __future__ import annotations

import importlib.util
from types import ModuleType

import torch.distributed as dist

from autosp.harness.config import ConfigError

SHM_COMM_OP = "deepspeed_shm_comm"


def require_deepspeed(method: str) -> None:
    """ConfigError (before any rank starts) when DeepSpeed is not installed."""
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            f"--method {method} needs DeepSpeed, which is not installed; "
            "`pip install 'autosp[deepspeed]'` (on CPU: DS_BUILD_OPS=0 pip install deepspeed)"
        )


def import_deepspeed(method: str) -> ModuleType:
    """`deepspeed` with its comm layer wrapped around the harness's already initialised process group."""
    require_deepspeed(method)
    import deepspeed

    if dist.is_initialized():
        if dist.get_backend() in ("gloo", "fake"):  # fake: the simulator's process group (autosp simulate)
            deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False
        deepspeed.init_distributed(dist_backend=dist.get_backend())
    return deepspeed


def precision_config(dtype: str) -> dict[str, dict[str, bool]]:
    """The DeepSpeed config section for a training dtype (fp32: none)."""
    return {"bfloat16": {"bf16": {"enabled": True}}, "float16": {"fp16": {"enabled": True}}}.get(dtype, {})
