"""The parallel layout one rank runs in: a (dp, sp) device mesh over the initialised process group."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autosp.harness.config import ConfigError


@dataclass
class ParallelContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    sp_size: int
    mesh: DeviceMesh | None  # None when world_size == 1 and no process group is initialised
    # every rank in one dim (ZeRO-3 of the SP baselines shards over it); built with the (dp, sp) mesh because a
    # mesh is host bookkeeping that must not be built under FakeTensorMode (`autosp simulate`: its rank table
    # would be a fake tensor, and DeviceMesh reads it)
    world_mesh: DeviceMesh | None = None

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("sp") if self.mesh is not None else None

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        return self.mesh.get_group("dp") if self.mesh is not None else None

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp") if self.mesh is not None else 0

    @property
    def dp_rank(self) -> int:
        return self.mesh.get_local_rank("dp") if self.mesh is not None else 0


def build_context(sp_size: int, device: torch.device) -> ParallelContext:
    """Lay a (dp, sp) mesh over the current process group: SP groups are runs of consecutive ranks."""
    if not dist.is_initialized():
        if sp_size != 1:
            raise ConfigError(f"sp_size={sp_size} needs an initialised process group")
        return ParallelContext(0, 1, 0, device, 1, None)
    world = dist.get_world_size()
    if world % sp_size:
        raise ConfigError(f"SP degree {sp_size} must divide the world size {world}")
    mesh = init_device_mesh(device.type, (world // sp_size, sp_size), mesh_dim_names=("dp", "sp"))
    world_mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("world",))  # the default group, no new one
    local_rank = device.index if device.index is not None else 0
    return ParallelContext(dist.get_rank(), world, local_rank, device, sp_size, mesh, world_mesh)
