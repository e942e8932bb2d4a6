"""Activation offload: the tensors kept at decoder-layer boundaries live in host memory between forward and backward.

Under SAC what backward keeps of a layer is its output (the residual stream) plus attention's results; over many
layers the residual stream is the bulk of what stays on the device from forward to backward. It is needed again
only when backward reaches its layer, so it can wait in host memory: on GH200 (Grace memory coherent with the
GPU, ~450 GB/s) or any PCIe GPU with pinned buffers, the copy overlaps the next layer's compute.

The pass runs on the *partitioned* forward and backward graphs (after the SAC partitioner decided what is saved):
- forward: each saved value produced inside a decoder layer and read by another layer (a layer boundary) gets
  `autosp_sp::offload` right where it is made; the host copy replaces it among the saved values, so the
  device tensor dies at its last forward use;
- backward: the saved host copy is brought back by `autosp_sp::reload` (issued one layer ahead: where the
  previous boundary is first used, so the copy overlaps that layer's backward) and `autosp_sp::wait` just
  before its own first use.

The ops, per device:
- CUDA / ROCm: pinned host buffers; offload and reload copy on one side stream (`non_blocking`), the side stream
  first waits for the compute stream; the source of an offload is kept alive for the copy by `record_stream`;
  `wait` makes the compute stream wait for the reload's event. Not run here (no GPU on the machines this was
  built on); written against torch's stream API as torch's own `ao::` offload ops are.
- CPU: the device is host memory, so a device run is emulated: offload copies into a fresh buffer that the memory
  meter books as *host* (allocations made inside `autosp_sp::offload`), reload copies back into device
  memory. The graph, the schedule and the bytes are those a GPU would run; only the copies are synchronous.
- any other device: a one-line error.

Why not torch's own partitioner offload (`torch._functorch.config.enable_activation_offloading`, 2.13): it is a
process-wide flag; it offloads each value after its *last* forward use and then waits for the copy there (or
sinks every wait to the end of forward, which keeps all sources on the device until forward ends, i.e. saves
nothing for a whole-model graph); its reload prefetch schedules by benchmarking nodes on the GPU; and on CPU its
`device_put` to the CPU is a no-op and its `ao::` ops need an accelerator stream, so nothing of it can run, be
tested or be measured here. Its rules of what may be offloaded (no views, getitems, model outputs or
non-contiguous values) are kept.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.host_copy import side_stream, to_host
from autosp.comm.library import custom_op, fragment, op, qualified
from autosp.compiler.fx.nodes import node_nbytes
from autosp.compiler.fx.layers import assign_layers
from autosp.compiler.fx.node_kinds import _is_view
from autosp.errors import ConfigError, SequenceParallelError

OFFLOAD_CHOICES = ("off", "activations", "auto")
OPTIMIZER_ITEM = "optimizer"
"""The `offload` item that keeps the optimizer state in host memory (`autosp.comm.host_optimizer`); `optimizer:torch`
and `optimizer:deepspeed` choose the host AdamW (default: DeepSpeed's CPU Adam on GPUs, torch's on CPU)."""
PARAMS_ITEM = "params"
"""The `offload` item that keeps the parameters (ZeRO-3 shards; at one rank the whole parameters) in host memory,
fetched to the device where used and their gradients streamed back in backward (`autosp.comm.host_params`); it needs
the `optimizer` item (the host optimizer steps them)."""
HOST_ADAM_CHOICES = ("auto", "torch", "deepspeed")
DEVICE_WINDOW = 2
"""Boundary values on the device at once in backward: the one its layer is using and the one being prefetched
(the floor and `autosp levers` count the rest, all but these of one per layer, in host memory)."""
OFFLOAD_OP_NAME = qualified("offload")
"""The profiler event name of the offload op: the CPU memory meter books allocations made inside it as host memory."""


def _items(value: str | None) -> tuple[str, str | None, bool]:
    """`offload` as (the activations' mode, the optimizer item's host AdamW or None, whether the params item is
    named): a comma-separated list of at most one of off | activations | auto, at most one optimizer[:torch|deepspeed]
    and at most one params (which needs the optimizer item); the activations' mode is off when it is not named."""
    text = "off" if value is None else str(value).strip().lower()
    modes, optimizer, params = [], None, False
    for item in (part.strip() for part in text.split(",")):
        name, _, adam = item.partition(":")
        if name == OPTIMIZER_ITEM and optimizer is None and (adam or "auto") in HOST_ADAM_CHOICES:
            optimizer = adam or "auto"
        elif item == PARAMS_ITEM and not params:
            params = True
        elif item in OFFLOAD_CHOICES and not modes:
            modes.append(item)
        else:
            raise ConfigError(f"unknown --offload {value!r}; choose {', '.join(OFFLOAD_CHOICES)}, "
                              f"{OPTIMIZER_ITEM}[:{'|'.join(HOST_ADAM_CHOICES[1:])}] (the AdamW state in host memory), "
                              f"{PARAMS_ITEM} (the parameters in host memory, with {OPTIMIZER_ITEM}), or one of each "
                              f"joined by commas, e.g. activations,{OPTIMIZER_ITEM} or "
                              f"auto,{OPTIMIZER_ITEM},{PARAMS_ITEM}")
    if params and optimizer is None:
        raise ConfigError(f"--offload {value!r}: {PARAMS_ITEM} keeps the parameters in host memory, where only the "
                          f"host optimizer steps them: add {OPTIMIZER_ITEM} (e.g. auto,{OPTIMIZER_ITEM},{PARAMS_ITEM})")
    return (modes[0] if modes else "off"), optimizer, params


def offload_mode(value: str | None) -> str:
    """`off | activations | auto` (None: off), checked: `auto` leaves the choice to the memory planner
    (`autosp.compiler.memory.planner`; under any other checkpointing policy it is `off`). An `optimizer` item beside it
    (`offload_optimizer`) does not change it."""
    return _items(value)[0]


def parse_offload(value: str | None) -> bool:
    """`off | activations | auto` -> whether the layer-boundary activations are always offloaded (`activations`)."""
    return offload_mode(value) == "activations"


def offload_optimizer(value: str | None) -> str | None:
    """The host AdamW (auto | torch | deepspeed) when `value` names the `optimizer` item (the optimizer state in
    host memory, `autosp.comm.host_optimizer`), else None."""
    return _items(value)[1]


def offload_params(value: str | None) -> bool:
    """Whether `value` names the `params` item (the parameters in host memory, `autosp.comm.host_params`)."""
    return _items(value)[2]


def check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise SequenceParallelError(f"--offload activations runs on CUDA/ROCm (pinned host buffers) or CPU (emulated); "
                                    f"not on {device.type}: use --offload off")


# ------------------------------------------------------------------------------------------------ the ops

_pending_reloads: dict[int, "torch.cuda.Event"] = {}  # device data_ptr -> its reload's completion event


@custom_op("offload", mutates_args=())
def offload(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` (pinned, copied on the side stream on CUDA)."""
    check_device(tensor.device)
    return to_host(tensor)


@offload.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


OFFLOAD_OP = op("offload").default
"""What the simulator's storage tracker books as host memory."""


@custom_op("reload", mutates_args=())
def reload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` back on `device`; on CUDA the copy is issued on the side stream and `wait` completes it."""
    check_device(device)
    if device.type == "cpu":
        return host.clone()
    side, compute = side_stream(device), torch.cuda.current_stream(device)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)  # allocated on the compute stream
    side.wait_stream(compute)  # the block may be in use by queued compute until here
    with torch.cuda.stream(side):
        out.copy_(host, non_blocking=True)  # after the offload's copy: same stream
        done = torch.cuda.Event()
        done.record(side)
    _pending_reloads[out.data_ptr()] = done
    return out


@reload.register_fake
def _(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


RELOAD_OP = op("reload").default


_library = fragment()
_library.define("wait(Tensor(a) tensor) -> Tensor(a)")


@torch.library.impl(_library, "wait", "CompositeExplicitAutograd")
def _wait(tensor: torch.Tensor) -> torch.Tensor:
    """The reloaded value is ready: the compute stream waits for its copy (nothing to wait for on CPU)."""
    done = _pending_reloads.pop(tensor.data_ptr(), None)
    if done is not None:
        torch.cuda.current_stream(tensor.device).wait_event(done)
    return tensor


@torch.library.register_fake(qualified("wait"))
def _(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


fx.node.has_side_effect(op("wait").default)

# ------------------------------------------------------------------------------------------------ the pass


@dataclass
class OffloadReport:
    """What one graph offloads: the boundary values' names and bytes (per step, host memory)."""

    values: list[str] = field(default_factory=list)
    nbytes: int = 0


def _layers(graph: fx.Graph) -> dict[fx.Node, str | None]:
    return assign_layers(graph, {n for n in graph.nodes if n.op != "output"})


def _offloadable(node: fx.Node, model_outputs: set[fx.Node]) -> bool:
    """torch's rules (activation_offloading.can_offload): no views, getitems, model outputs, non-contiguous."""
    val = node.meta.get("val")
    return (node.op == "call_function" and node.target is not operator.getitem and not _is_view(node)
            and node not in model_outputs and isinstance(val, torch.Tensor) and val.is_floating_point()
            and val.is_contiguous())


OFFLOAD_SCOPES = ("boundaries", "layers")
"""What moves to host memory: the layer-boundary values only, or every saved value made inside a decoder layer as
well (attention's inputs and outputs after the all-to-alls, whatever the partition keeps): the memory planner's
second host-memory step, where the boundaries alone are not enough."""


def boundary_values(fw_module: fx.GraphModule, num_fwd_outputs: int, scope: str = "boundaries") -> list[fx.Node]:
    """Saved values made in one decoder layer (or before the first) and read in another (or after the last): the
    residual stream between layers, which SAC keeps for backward; with `scope="layers"` also every other saved
    value made inside a decoder layer."""
    (output,) = fw_module.graph.find_nodes(op="output")
    outputs = list(output.args[0])
    model_outputs = {o for o in outputs[:num_fwd_outputs] if isinstance(o, fx.Node)}
    layers = _layers(fw_module.graph)
    chosen: list[fx.Node] = []
    for node in outputs[num_fwd_outputs:]:
        if not isinstance(node, fx.Node) or node in chosen or not _offloadable(node, model_outputs):
            continue
        sides = {layers.get(node)} | {layers.get(u) for u in node.users if u.op != "output"}
        if len(sides) > 1 or (scope == "layers" and layers.get(node) is not None):
            chosen.append(node)  # made on one side of a layer boundary and read on the other, or inside a layer
    return chosen


def offload_boundaries(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int,
                       scope: str = "boundaries") -> OffloadReport:
    """Rewrite both graphs in place (module docstring) for the saved values of `scope` (`OFFLOAD_SCOPES`); returns
    what is offloaded."""
    chosen = boundary_values(fw_module, num_fwd_outputs, scope)
    report = OffloadReport()
    if not chosen:
        return report
    fw_graph, bw_graph = fw_module.graph, bw_module.graph
    (fw_output,) = fw_graph.find_nodes(op="output")
    placeholders = {n.name: n for n in bw_graph.find_nodes(op="placeholder")}
    host_of: dict[fx.Node, fx.Node] = {}
    for node in chosen:
        check_device(node.meta["val"].device)  # at compile time, not from inside the compiled graph
        if node.name not in placeholders:
            raise SequenceParallelError(f"offload: saved value {node.name} has no backward input of that name")
        with fw_graph.inserting_after(node):
            host = fw_graph.call_function(op("offload").default, (node,))
        host.meta["val"] = node.meta["val"].to(torch.device("cpu"))
        host_of[node] = host
        report.values.append(node.name)
        report.nbytes += node_nbytes(node)
    outputs = list(fw_output.args[0])
    fw_output.update_arg(0, tuple(outputs[:num_fwd_outputs])
                         + tuple(host_of.get(o, o) for o in outputs[num_fwd_outputs:]))
    _reload_before_use(bw_graph, [(placeholders[n.name], n.meta["val"].device) for n in chosen])
    for module in (fw_module, bw_module):
        module.graph.lint()
        module.recompile()
    return report


def _reload_before_use(graph: fx.Graph, offloaded: Sequence[tuple[fx.Node, Any]]) -> None:
    """Each offloaded input: reload issued where the previous one (in backward order) is first used, wait just
    before its own first use."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    used = [(min(p.users, key=order.__getitem__), p, device) for p, device in offloaded if p.users]
    used.sort(key=lambda item: order[item[0]])
    previous_first_use: fx.Node | None = None
    for first_use, placeholder, device in used:
        with graph.inserting_before(previous_first_use or first_use):
            loaded = graph.call_function(op("reload").default, (placeholder, device))
        with graph.inserting_before(first_use):
            ready = graph.call_function(op("wait").default, (loaded,))
        meta = {k: v for k, v in placeholder.meta.items() if k != "partitioner_tag"}  # no recomputed forward op
        loaded.meta.update(meta)
        ready.meta.update(meta)
        placeholder.meta["val"] = placeholder.meta["val"].to(torch.device("cpu"))  # what it now receives
        for user in list(placeholder.users):
            if user is not loaded:
                user.replace_input_with(placeholder, ready)
        previous_first_use = first_use
