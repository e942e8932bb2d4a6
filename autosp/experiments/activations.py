"""Activation memory saved for backward, broken down by operator category (attention, mlp, norm, other).

The paper reports that sequence-aware checkpointing cuts the activation memory of attention operators 13.03x
and of MLP operators 2.22x; this module measures the same breakdown for any method:

* compiled methods (AutoSP, or any ``sac_backend``): from the partitioned graphs, each value the forward graph
  hands to backward is classified by the op that produced it (attention kernels and the collectives around
  them are attention) or else by the module it came from (Dynamo's ``nn_module_stack``);
* eager methods: ``SavedActivationRecorder`` sees every tensor autograd saves (``saved_tensors_hooks``) and the
  innermost module running at that moment (forward pre/post hooks on the model's modules).

Bytes count each storage once (parameters excluded); a view saves its whole base.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pandas as pd
import torch
import torch.nn as nn
from torch.utils.hooks import RemovableHandle

from autosp.harness.config import ConfigError
from autosp.compiler.memory.saved_report import CATEGORIES, UNATTRIBUTED, category_of_module

def working_set_table(working: dict[str, Any]) -> pd.DataFrame:
    """Rows: categories, parameter gradients, scratch inside the running op, total; columns: saved and
    working-set bytes at the peak."""
    rows = {c: [working["saved"].get(c, 0), working["working"].get(c, 0)] for c in CATEGORIES}
    rows["parameter gradients"] = [0, working["gradients"]]
    rows["op scratch"] = [0, working.get("scratch", 0)]  # records from before the scratch was declared lack it
    df = pd.DataFrame.from_dict(rows, orient="index", columns=["saved at peak", "working set at peak"])
    df.loc["total"] = df.sum()
    df.index.name = "category"
    return df


class SavedActivationRecorder:
    """Context manager: bytes autograd saves for backward while it is active (``model``'s parameters
    excluded), by the category of the innermost running module of ``model``. ``by_module=False`` (or no
    model) books everything as ``unattributed``: for compiled code, whose modules run inside one graph (use
    ``compiled_breakdown`` there). Inside a torch.utils.checkpoint region the checkpoint's own hooks take over."""

    def __init__(self, model: nn.Module | None = None, *, by_module: bool = True) -> None:
        self.model = model
        self.by_module = by_module and model is not None
        self.bytes_by_category: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self._stack: list[str] = []
        self._seen: set[int] = set()
        self._params: set[int] = set()
        self._handles: list[RemovableHandle] = []
        self._hooks: Any = None

    def __enter__(self) -> "SavedActivationRecorder":
        if self.model is not None:
            self._params = {_storage_ptr(p) for p in self.model.parameters()}
        if self.by_module:
            for path, module in self.model.named_modules():
                category = category_of_module(path, type(module))
                self._handles.append(module.register_forward_pre_hook(self._enter_module(category)))
                self._handles.append(module.register_forward_hook(self._leave_module, always_call=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, category: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: Any) -> None:
            self._stack.append(category)

        return hook

    def _leave_module(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._stack.pop()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        local = _local(tensor)
        if _is_parameter(local):  # FSDP2's unsharded parameters (and views of them) saved by the layers using them
            return tensor
        if local.device.type != "meta" and not isinstance(local, torch._subclasses.FakeTensor):
            storage = local.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._params and ptr not in self._seen:
                self._seen.add(ptr)
                category = self._category()
                self.bytes_by_category[category] = self.bytes_by_category.get(category, 0) + storage.nbytes()
        return tensor

    def _category(self) -> str:
        # Each module's category already reflects its whole path (a Linear inside self_attn is attention).
        return self._stack[-1] if self.by_module and self._stack else UNATTRIBUTED

    @property
    def total(self) -> int:
        return sum(self.bytes_by_category.values())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's parameters: the wrapper has no storage of its own), else the tensor."""
    return getattr(tensor, "_local_tensor", tensor)


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


def _storage_ptr(tensor: torch.Tensor) -> int:
    return _local(tensor).untyped_storage().data_ptr()


def breakdown_table(breakdowns: dict[str, dict[str, int]], baseline: str) -> pd.DataFrame:
    """Rows: categories and total; columns: bytes per method, then ``<method> reduction`` = baseline bytes /
    method bytes (the paper's "13.03x" style; inf where only the method saves nothing of a category)."""
    if baseline not in breakdowns:
        raise ConfigError(f"baseline {baseline!r} is not one of the methods compared: {', '.join(breakdowns)}")
    categories = [c for c in (*CATEGORIES, UNATTRIBUTED) if any(b.get(c, 0) for b in breakdowns.values())]
    df = pd.DataFrame({m: [b.get(c, 0) for c in categories] for m, b in breakdowns.items()}, index=categories)
    df.loc["total"] = df.sum()
    for method in breakdowns:
        if method != baseline:
            df[f"{method} reduction"] = df[baseline] / df[method].astype(float)
    df.index.name = "category"
    return df


def _rank_saved_activations(cfg_dict: dict[str, Any], extra_imports: tuple[str, ...] = ()) -> dict[str, Any]:
    """One rank: build the method as `autosp run` does, train one step, report what it saved for backward.

    Compiled methods report the partitioner's view (their ``metrics()``); eager ones are watched with
    ``SavedActivationRecorder`` on their model. Either way the bytes are this rank's."""
    from autosp.harness.config import RunConfig
    from autosp.harness.runner import build_train_step, global_batch, train_step, validate

    cfg = RunConfig.from_dict(cfg_dict)
    strategy, sp_size = validate(cfg, extra_imports)
    step, device = build_train_step(cfg, strategy, sp_size)
    batch = global_batch(cfg, sp_size).to(device)
    model = getattr(step, "model", None)
    with SavedActivationRecorder(model if isinstance(model, nn.Module) else None) as recorder:
        train_step(step, batch)
    metrics = step.metrics() if callable(getattr(step, "metrics", None)) else {}
    if metrics.get("saved_by_category"):
        by_category, source = metrics["saved_by_category"], "compiled graphs (partitioner)"
    else:
        by_category, source = recorder.bytes_by_category, "saved_tensors_hooks (eager)"
    return {"saved_by_category": dict(by_category), "source": source,
            "implementation": step.implementation or cfg.method,
            **{key: metrics[key] for key in ("peak_working_set", "tiles") if key in metrics}}


def measure_saved_activations(cfg: Any, *, out: str, extra_imports: Iterable[str] = ()) -> dict[str, Any]:
    """Saved-for-backward bytes by category of `cfg`'s method on its ranks (rank 0's; SP ranks are symmetric),
    appended to `out` as a record with kind "activations" (a failed run is recorded with its status)."""
    from autosp.harness.launch import launch
    from autosp.harness.records import append_record, new_record
    from autosp.harness.runner import validate

    extra_imports = tuple(extra_imports)
    _, sp_size = validate(cfg, extra_imports)
    record = new_record(cfg, sp_size=sp_size)
    outcome = launch(_rank_saved_activations, (cfg.to_dict(), extra_imports), world_size=cfg.world_size,
                     device=cfg.device, timeout_s=cfg.timeout_s)
    record.update(kind="activations", status=outcome.status, error=outcome.error)
    if outcome.status == "ok":
        first = outcome.results[0]
        record["implementation"] = first["implementation"]
        record["extra"].update(saved_by_category=first["saved_by_category"], saved_activation_source=first["source"],
                               saved_activation_bytes=sum(first["saved_by_category"].values()),
                               **{key: first[key] for key in ("peak_working_set", "tiles") if key in first})
    append_record(out, record)
    return record


def method_label(method: str, sac: str | None) -> str:
    """How a run is named in the memory figure: compiled AutoSP runs carry their SAC policy (autosp:sac)."""
    return f"{method}:{sac}" if method == "autosp" and sac else method


def _cmd_activations(args: Any) -> int:
    from autosp.harness.flags import run_config_from_args
    from autosp.harness.measure import format_size

    cfg = run_config_from_args(args)
    record = measure_saved_activations(cfg, out=args.out, extra_imports=args.extra_imports)
    if record["status"] != "ok":
        print(f"{record['status']}: {cfg.method} {cfg.model}: {record['error']}")
        return 1
    parts = ", ".join(f"{c} {format_size(b)}" for c, b in record["extra"]["saved_by_category"].items() if b)
    print(f"{method_label(cfg.method, cfg.sac)} {cfg.model} S={cfg.seq_len} P={cfg.world_size}: saved for backward "
          f"per rank {format_size(record['extra']['saved_activation_bytes'])} ({parts}) -> {args.out}")
    working = record["extra"].get("peak_working_set")
    if working is None:
        print("(the working set at the peak is known only for compiled methods: their partitioned graphs)")
        return 0
    print(f"\nalive at the estimated peak of the step (graph replay, per rank; at: {', '.join(working['at'])}):")
    print(working_set_table(working).map(format_size).to_string())
    print(f"estimated peak beyond the model state: {format_size(working['peak_bytes'])}")
    for tile in record["extra"].get("tiles", []):
        logits = (f", one tile's fp32 logits {format_size(tile['tile_logits_bytes'])} (inside the tiled op)"
                  if "tile_logits_bytes" in tile else "")
        print(f"tiled: {tile['tile']}: {tile['tokens']} tokens in tiles of {tile['tile_tokens']}{logits}")
    return 0


def add_activations_parser(subparsers: Any) -> None:
    """`autosp activations --method M --model X --seq-len S --world-size P [--sac POLICY] --out FILE`."""
    from autosp.harness.flags import add_run_config_arguments

    p = subparsers.add_parser("activations", help="saved-for-backward bytes by operator category of one method")
    add_run_config_arguments(p)
    p.add_argument("--out", default="results/activations.jsonl", help="JSONL file the record is appended to")
    p.set_defaults(func=_cmd_activations)
