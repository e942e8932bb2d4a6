"""Importing DeepSpeed for the DeepSpeed baselines (zero3, ds-autosp): absent → a clear ConfigError; on gloo,
no shared-memory comm op build.

DeepSpeed's `init_distributed` (called by `deepspeed.initialize`) builds a `TorchBackend`, whose constructor
JIT-compiles the CPU shared-memory collective `deepspeed_shm_comm` (~35 s, into ~/.cache/torch_extensions)
whenever DeepSpeed's op-compatibility table says the op can be built. That op only serves
`inference_all_reduce`; training collectives go through torch.distributed (gloo here). The clean switch is
that table itself: `deepspeed.ops.__compatible_ops__` is computed once per process and cached in the module
(DeepSpeed keeps it as one dict so edits persist), and `build_shm_op` returns None for an op marked
incompatible. Marking `deepspeed_shm_comm` incompatible on gloo (and on the simulator's fake process group) skips
the build and changes nothing else; on nccl (GPUs) the table is left alone.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from autosp.harness.config import ConfigError
from autosp.harness.precision import precision_of
from autosp.harness.strategy import TrainStep

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

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


#: DeepSpeed's mixed precision: the module in bf16, fp32 master partitions and moments in its ZeRO optimizer,
#: gradients accumulated and communicated in fp32 (its defaults would accumulate and reduce them in bf16)
MIXED_BF16 = {"bf16": {"enabled": True}, "communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}}


def precision_config(dtype: str, method: str, *, pure_bf16: bool = False) -> dict[str, object]:
    """The DeepSpeed config sections for `--dtype` (fp32: none). `pure_bf16`: the engine can train all-bf16
    (ZeRO stage 0); elsewhere DeepSpeed's bf16 always keeps fp32 masters, and its fp16 always scales the loss,
    so pure 16-bit names are refused rather than run as something else."""
    precision = precision_of(dtype)
    if precision.mixed:
        return dict(MIXED_BF16)
    if precision.compute == torch.float32:
        return {}
    if pure_bf16 and precision.compute == torch.bfloat16:
        return {"bf16": {"enabled": True}}
    raise ConfigError(f"--method {method} has no {precision.label} training: DeepSpeed's bf16 keeps fp32 master "
                      "weights and its fp16 scales the loss; use --dtype bfloat16 (mixed) or float32")


def engine_gradients(engine: DeepSpeedEngine) -> Iterator[tuple[str, torch.Tensor | None]]:
    """`TrainStep.local_gradients` of a DeepSpeed engine, from its safe getters: a ZeRO-3 parameter's local fp32
    gradient partition; otherwise the full gradient (`.grad`, or at ZeRO 1/2 and under bf16 the fp32 one
    assembled from the partitions: then collective, in the same parameter order on every rank)."""
    from deepspeed.utils import safe_get_full_grad, safe_get_local_grad

    for name, p in engine.module.named_parameters():
        yield name, safe_get_local_grad(p) if hasattr(p, "ds_id") else safe_get_full_grad(p)


class DeepSpeedZeroStep(TrainStep):
    """A step around a DeepSpeed ZeRO engine (`self.engine`): its step also zeroes the gradients; full gradients and
    fp32 master parameters come from DeepSpeed's safe getters (collective under ZeRO-3)."""

    engine: DeepSpeedEngine

    def optimizer_step(self) -> None:
        self.engine.step()

    def local_gradients(self) -> Iterator[tuple[str, torch.Tensor | None]]:
        return engine_gradients(self.engine)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_grad

        return {n: safe_get_full_grad(p).detach().cpu().clone() for n, p in self.engine.module.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor]:
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().cpu().clone()
                for n, p in self.engine.module.named_parameters()}
