"""Test doubles for the non-finite gradient check: `single`, `autosp` and `zero3` with one element of one
parameter's gradient made inf on the last rank in the run's last step (a tensor hook on the parameter, so the inf
enters the gradient where the method's own backward puts it: `.grad`, an AutoSP ZeRO shard, DeepSpeed's partitions).

Imported into ranks with `extra_imports` / `--import tests.nonfinite_method` (registers on import)."""
import torch
import torch.distributed as dist

from autosp.comm.sharding import full_name
from autosp.harness.config import RunConfig
from autosp.harness.strategy import Strategy, TrainStep, register
from baselines.autosp_method import AutoSP
from baselines.single import Single
from baselines.zero3 import Zero3Strategy

PLANTED = "model.layers.1.mlp.up_proj.weight"


def plant_inf(step: TrainStep, model: torch.nn.Module, cfg: RunConfig) -> TrainStep:
    """Count `step`'s backward passes; in the run's last one (warm-up, measured, timed steps) make one element of
    PLANTED's gradient inf on the last rank."""
    last = cfg.warmup + cfg.steps + 1
    calls = [0]
    forward_backward = step.forward_backward

    def counted(batch):
        calls[0] += 1
        return forward_backward(batch)

    def hook(grad):
        if calls[0] != last:
            return grad
        grad = grad.clone()
        grad.view(-1)[0] = float("inf")
        return grad

    step.forward_backward = counted
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        (param,) = [p for name, p in model.named_parameters() if full_name(name) == PLANTED]
        param.register_hook(hook)
    return step


def planted(method: type[Strategy]) -> type[Strategy]:
    class Planted(method):
        name = f"{method.name}-inf-grad"
        description = f"test double: {method.name} with an inf gradient of {PLANTED} in the last step"

        def setup(self, model, ctx, cfg: RunConfig) -> TrainStep:
            return plant_inf(super().setup(model, ctx, cfg), model, cfg)

    return register(Planted)


for _method in (Single, AutoSP, Zero3Strategy):
    planted(_method)
