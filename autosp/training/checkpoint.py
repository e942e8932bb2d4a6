"""Checkpoints of a model compiled by AutoSP (any ZeRO stage) with torch.distributed.checkpoint (DCP).

`save` / `load` (collective) write and read model and optimizer state sharded: every rank writes only what it holds
and reads only what it needs, nothing is gathered on one rank. The checkpoint names each parameter by the model's
own name and stores it flat (1-D, `numel` long), whatever the stage: a ZeRO 2/3 shard *is* a contiguous piece of
that flat tensor (`ShardedParameter`: chunks of ceil(numel/P), torch.chunk's layout), so it is described to DCP as
a DTensor sharded on dim 0 and DCP reshards on load. A checkpoint therefore resumes at another world size or stage
(save on 2 ranks at ZeRO 3, resume on 4, or on 1 unsharded). The optimizer state is keyed the same way
(`optim.state.<param>.<key>`); stage 1's `ZeroRedundancyOptimizer` holds each parameter's state on one rank, which
writes it. `export` writes the full, unsharded weights as `model.safetensors` (+ `config.json` for an HF model):
`from_pretrained` loads it.

Loading never unpickles arbitrary objects: the state holds tensors only (hyper-parameters and `extra` values are
stored as 0-d/1-d tensors and read back as numbers), tensors are read with `weights_only=True`, and DCP's metadata
file (a pickle) is read by an unpickler that admits only DCP's own metadata classes and torch sizes and dtypes.

Modelled on torchtitan's checkpoint manager (DCP, one key space for model and optimizer, `extra` for the step).
"""
from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import parametrize

from autosp.api import SequenceParallelModule
from autosp.comm.sharding import ShardedParameter, full_name, full_state
from autosp.errors import SequenceParallelError

MODEL_FILE = "model.safetensors"


@dataclass
class _Param:
    name: str  # the model's own (unsharded) name
    param: nn.Parameter  # what the module holds: the full parameter, or this rank's flat shard
    spec: ShardedParameter | None


def _params(model: nn.Module) -> Iterator[_Param]:
    specs = {f"{prefix}.parametrizations.{name}.original".lstrip("."): plist[0]
             for prefix, module in model.named_modules() if parametrize.is_parametrized(module)
             for name, plist in module.parametrizations.items()}
    for name, p in model.named_parameters():  # a tied weight once, under its first name
        spec = specs.get(name)
        yield _Param(full_name(name), p, spec if isinstance(spec, ShardedParameter) else None)


class _Layout:
    """How one rank's tensors map onto the checkpoint's flat tensors."""

    def __init__(self, model: nn.Module) -> None:
        inner = model.module if isinstance(model, SequenceParallelModule) else model
        self.params = list(_params(inner))
        self.mesh = None
        if any(p.spec is not None for p in self.params):
            device = self.params[0].param.device.type
            self.mesh = DeviceMesh.from_group(model.reduce_group, device)

    def flat(self, value: torch.Tensor, entry: _Param) -> torch.Tensor:
        """`value` (the parameter or a tensor of its shape: an optimizer moment) as the checkpoint's flat tensor."""
        value = value.detach()
        if entry.spec is None:
            return value.reshape(-1)
        spec = entry.spec
        valid = max(0, min(spec.shard_numel, spec.numel - spec.rank * spec.shard_numel))
        return DTensor.from_local(value[:valid], self.mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size([spec.numel]), stride=(1,))


def _local_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer steps this rank's share in .optim


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None, extra: dict | None) -> dict[str, torch.Tensor]:
    """The flat state dict (views of the live tensors): model, optimizer, hyper-parameters, extra."""
    layout = _Layout(model)
    out = {f"model.{e.name}": layout.flat(e.param, e) for e in layout.params}
    if optimizer is not None:
        local = _local_optimizer(optimizer)
        for entry in layout.params:
            for key, value in local.state.get(entry.param, {}).items():
                if not torch.is_tensor(value):
                    raise SequenceParallelError(f"checkpoint: optimizer state {entry.name}.{key} is a "
                                                f"{type(value).__name__}, not a tensor; use a torch.optim optimizer")
                flat = layout.flat(value, entry) if value.shape == entry.param.shape else value.detach()
                out[f"optim.state.{entry.name}.{key}"] = flat
        for i, group in enumerate(optimizer.param_groups):
            for key, value in group.items():
                if isinstance(value, (bool, int, float)) or (
                        isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
                    out[f"optim.param_groups.{i}.{key}"] = torch.tensor(value, dtype=torch.float64)
    for key, value in (extra or {}).items():
        out[f"extra.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
    return out


def save(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict[str, int | float | torch.Tensor] | None = None) -> None:
    """Collective: write `model`'s parameters, `optimizer`'s state and `extra` (e.g. the step) under `path`,
    each rank its own share (a directory of DCP files)."""
    dcp.save(_state(model, optimizer, extra), checkpoint_id=str(path))


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Collective: read a checkpoint written by `save` (at any world size and ZeRO stage) into `model` and
    `optimizer`; returns its `extra` values (ints and floats as Python numbers, 1-element tensors included)."""
    reader = _SafeReader(str(path))
    metadata = reader.read_metadata()
    if optimizer is not None and not _local_optimizer(optimizer).state:
        _initialise(optimizer)
    live = _state(model, optimizer, None)
    saved_keys = set(metadata.state_dict_metadata)
    missing = sorted(k for k in live if k.startswith(("model.", "optim.state.")) and k not in saved_keys)
    if missing:
        raise SequenceParallelError(f"checkpoint {path} lacks {len(missing)} entries this model needs, e.g. "
                                    f"{missing[0]}; load a checkpoint of this model (and optimizer)")
    live = {k: v for k, v in live.items() if k in saved_keys}
    for key in saved_keys:
        if key.startswith("extra."):
            meta = metadata.state_dict_metadata[key]
            live[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
    fresh = {k: _like(v) for k, v in live.items()}
    dcp.load(fresh, storage_reader=reader)
    with torch.no_grad():
        for key, target in live.items():
            if key.startswith(("model.", "optim.state.")):
                _local(target).copy_(_local(fresh[key]))
    if optimizer is not None:
        for key, value in fresh.items():
            if key.startswith("optim.param_groups."):
                index, name = key.removeprefix("optim.param_groups.").split(".", 1)
                group = optimizer.param_groups[int(index)]
                old = group.get(name)
                group[name] = (type(old)(value.tolist()) if isinstance(old, tuple) else
                               type(old)(value.item()) if isinstance(old, (bool, int, float)) else old)
    return {k.removeprefix("extra."): (v.item() if v.numel() == 1 and v.dim() == 0 else v)
            for k, v in fresh.items() if k.startswith("extra.")}


def export(path: str | Path, model: nn.Module) -> None:
    """Collective (gathers every parameter, as an export must): rank 0 writes the full weights under the model's
    own names as `path/model.safetensors`, and an HF model's `config.json`, so `from_pretrained(path)` loads it
    (the project Llama: `load_state_dict(safetensors.torch.load_file(path / "model.safetensors"))`)."""
    from safetensors.torch import save_file

    inner = model.module if isinstance(model, SequenceParallelModule) else model
    full = full_state(inner, gradients=False)
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in full.items()}, str(path / MODEL_FILE), metadata={"format": "pt"})
    config = getattr(inner, "config", None)
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(str(path))


def _initialise(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's state (the tensors a load fills) by one step with zero gradients at lr 0, as
    torch.distributed.checkpoint.state_dict does; parameters are unchanged (decoupled decay scales by 1 - 0)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    lrs = [g["lr"] for g in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _like(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor):
        return DTensor.from_local(torch.empty_like(t.to_local()), t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return torch.empty_like(t)


#: beyond DCP's classes, sizes and dtypes: what DCP's metadata pickles (a layout by its name, the checkpoint path)
_ALSO_ADMITTED = {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
                  ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, torch.Size and dtypes, a layout by name, paths, and nothing else."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint as package

        if module.startswith(package.__name__ + "."):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type):
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in _ALSO_ADMITTED:
            return super().find_class(module, name)
        raise SequenceParallelError(f"checkpoint metadata refers to {module}.{name}, which a checkpoint written by "
                                    "autosp.training.checkpoint.save never does; not loading it")


class _SafeReader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        if not path.is_file():
            raise SequenceParallelError(f"{self.path} is not a checkpoint (no .metadata); pass the directory "
                                        "autosp.training.checkpoint.save wrote")
        metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes())).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
