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
  previous boundary is first used, so the copy overlaps that layer's backward; or late, where the previous one
  is last used, so the two are never on the device together: `RELOAD_TIMES`) and `autosp_sp::wait` just
  before its own first use.

The ops copy on a side stream into pinned buffers on CUDA/ROCm (a pool the pass reserves by the plan's bytes, allocated
once and reused every step: `autosp.comm.host_pool`), synchronously into memory booked as host on CPU (an
emulation with the GPU's graph, schedule and bytes), and refuse any other device. Why not torch's own partitioner
offload, and how the ops run per device: docs/measurements/2026-12-01-offload.md ("The ops per device").
"""
from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from autosp.comm.host_copy import side_stream, to_host
from autosp.comm.host_pool import aligned_bytes, host_pool
from autosp.comm.library import custom_op, fragment, op, qualified
from autosp.compiler.fx import assign_layers, is_view, node_nbytes
from autosp.errors import ConfigError, SequenceParallelError

OFFLOAD_CHOICES = ("off", "activations", "auto")
"""The activations' modes as written in the text: never, always (the layer boundaries), or the planner decides."""
MODES = ("off", "on", "auto")
"""What an `OffloadPlan` says of each kind of state: never in host memory, always, or where the device cannot hold it
(the planner's, `sac="auto"`)."""
OPTIMIZER_ITEM = "optimizer"
"""The `offload` item that keeps the optimizer state in host memory (`autosp.comm.host_optimizer`); `optimizer:torch`
and `optimizer:deepspeed` choose the host AdamW (default: DeepSpeed's CPU Adam on GPUs, torch's on CPU)."""
PARAMS_ITEM = "params"
"""The `offload` item that keeps the parameters (ZeRO-3 shards; at one rank the whole parameters) in host memory,
fetched to the device where used and their gradients streamed back in backward (`autosp.comm.host_params`); it needs
the `optimizer` item (the host optimizer steps them)."""
HOST_ADAM_CHOICES = ("auto", "torch", "deepspeed")
DEVICE_WINDOW = 1
"""Boundary values on the device at once in backward, at the least: the one its layer is using, the next reloaded late
(`RELOAD_TIMES`: after this one's last use; a layer ahead it would be a second). The floor and `autosp levers` count
the rest, all but these of one per layer, in host memory: a lower bound of every offloading plan."""
OFFLOAD_OP_NAME = qualified("offload")
"""The profiler event name of the offload op: the CPU memory meter books allocations made inside it as host memory."""
_ACTIVATION_TEXT = {"off": "off", "activations": "on", "auto": "auto"}


@dataclass(frozen=True)
class OffloadPlan:
    """The `offload` option parsed once: what may live in host memory. Each of the layer-boundary activations, the
    optimizer state (fp32 masters and AdamW moments, stepped on the CPU) and the parameters is `off`, `on` or `auto`
    (`MODES`); `host_adam` picks the host AdamW. The text (`parse`): `auto` alone, the default, leaves all three to
    the planner; otherwise `off | activations | auto` for the activations, `optimizer[:torch|deepspeed]` and
    `params` for the others (named: on, not named: off), joined by commas; `<kind>=<mode>` sets any one explicitly
    (e.g. `activations=auto,optimizer=off`)."""

    activations: str = "auto"
    optimizer: str = "auto"
    params: str = "auto"
    host_adam: str = "auto"

    def __post_init__(self) -> None:
        for kind in ("activations", OPTIMIZER_ITEM, PARAMS_ITEM):
            if getattr(self, kind) not in MODES:
                raise ConfigError(f"offload {kind}={getattr(self, kind)!r}: choose one of {', '.join(MODES)}")
        if self.host_adam not in HOST_ADAM_CHOICES:
            raise ConfigError(f"offload host AdamW {self.host_adam!r}: choose one of {', '.join(HOST_ADAM_CHOICES)}")
        if self.params == "on" and self.optimizer != "on":
            raise ConfigError(f"--offload {self}: {PARAMS_ITEM} keeps the parameters in host memory, where only the "
                              f"host optimizer steps them: add {OPTIMIZER_ITEM} (e.g. auto,{OPTIMIZER_ITEM},"
                              f"{PARAMS_ITEM})")

    @classmethod
    def parse(cls, value: str | OffloadPlan | None) -> OffloadPlan:
        """The text (class doc) as a plan; None is `off`. A bad item is a one-line `ConfigError` naming the choices."""
        if isinstance(value, OffloadPlan):
            return value
        text = "off" if value is None else str(value).strip().lower()
        if text == "auto":
            return cls()
        modes: dict[str, str] = {}
        adam = "auto"
        for item in (part.strip() for part in text.split(",")):
            name, eq, rest = item.partition("=")
            mode, _, impl = (rest if eq else "").partition(":")
            if not eq:
                name, _, impl = item.partition(":")
                mode = "on" if name in (OPTIMIZER_ITEM, PARAMS_ITEM) else _ACTIVATION_TEXT.get(name, "")
                name = name if name in (OPTIMIZER_ITEM, PARAMS_ITEM) else "activations"
            ok = (name in ("activations", OPTIMIZER_ITEM, PARAMS_ITEM) and mode in MODES and name not in modes
                  and (not impl or (name == OPTIMIZER_ITEM and impl in HOST_ADAM_CHOICES)))
            if not ok:
                raise ConfigError(f"unknown --offload {value!r}; choose {', '.join(OFFLOAD_CHOICES)}, "
                                  f"{OPTIMIZER_ITEM}[:{'|'.join(HOST_ADAM_CHOICES[1:])}] (the AdamW state in host "
                                  f"memory), {PARAMS_ITEM} (the parameters in host memory, with {OPTIMIZER_ITEM}), or "
                                  f"one of each joined by commas, e.g. activations,{OPTIMIZER_ITEM} or "
                                  f"auto,{OPTIMIZER_ITEM},{PARAMS_ITEM} (auto alone: the planner decides all three)")
            modes[name] = mode
            adam = impl or adam
        return cls(activations=modes.get("activations", "off"), optimizer=modes.get(OPTIMIZER_ITEM, "off"),
                   params=modes.get(PARAMS_ITEM, "off"), host_adam=adam)

    def __str__(self) -> str:
        """The text that parses back to this plan (short forms where they exist)."""
        if self == OffloadPlan():
            return "auto"
        adam = f":{self.host_adam}" if self.host_adam != "auto" else ""
        items = {"on": ["activations"], "auto": ["auto"], "off": []}[self.activations]
        if self.activations == "auto" and self.optimizer == self.params == "off":
            items = ["activations=auto"]  # `auto` alone would leave the other two to the planner
        items += {"on": [f"{OPTIMIZER_ITEM}{adam}"], "auto": [f"{OPTIMIZER_ITEM}=auto{adam}"],
                  "off": []}[self.optimizer]
        items += {"on": [PARAMS_ITEM], "auto": [f"{PARAMS_ITEM}=auto"], "off": []}[self.params]
        return ",".join(items) or "off"

    @property
    def activation_mode(self) -> str:
        """`off | activations | auto`: the activations' mode as the planner and the offload pass read it."""
        return {"off": "off", "on": "activations", "auto": "auto"}[self.activations]

    @property
    def items(self) -> list[str]:
        """What is always in host memory (`activations`, `optimizer`, `params`), for a run's implementation name."""
        return [kind for kind in ("activations", OPTIMIZER_ITEM, PARAMS_ITEM) if getattr(self, kind) == "on"]

    def resolve_state(self, *, device_bytes: int | None, state_bytes: int, optimizer_bytes: int,
                      compute_state_bytes: int, params_allowed: bool) -> OffloadPlan:
        """This plan with the optimizer's and the parameters' `auto` decided (on or off) where the device cannot hold
        them: the optimizer state goes to host memory when the model state on the device (`state_bytes`: parameters
        and gradients, plus `optimizer_bytes`: masters and moments) exceeds `device_bytes`; the parameters too (where
        `params_allowed`: ZeRO 3 or one rank) when their compute-dtype copies and gradients (`compute_state_bytes`)
        still exceed it. `device_bytes` None (no limit): nothing moves. Each byte count is this rank's."""
        def over(nbytes: int) -> bool:
            return device_bytes is not None and nbytes > device_bytes

        optimizer = self.optimizer if self.optimizer != "auto" else (
            "on" if over(state_bytes + optimizer_bytes) else "off")
        params = self.params if self.params != "auto" else (
            "on" if optimizer == "on" and params_allowed and over(compute_state_bytes) else "off")
        return dataclasses.replace(self, optimizer=optimizer, params=params)


def check_params_offload(plan: OffloadPlan, zero: int, group_size: int) -> None:
    """Parameters in host memory are ZeRO-3 shards (or, at one rank, the whole parameters): refused at any other
    stage, in one line naming the fix."""
    if plan.params == "on" and zero != 3 and group_size > 1:
        raise SequenceParallelError(f"offload=params keeps ZeRO-3 shards in host memory, but this run is at ZeRO "
                                    f"stage {zero} over {group_size} ranks: use zero=3 (or drop params from offload)")


def check_device(device: torch.device) -> None:
    if device.type not in ("cpu", "cuda"):
        raise SequenceParallelError(f"--offload activations runs on CUDA/ROCm (pinned host buffers) or CPU (emulated); "
                                    f"not on {device.type}: use --offload off")


# ------------------------------------------------------------------------------------------------ the ops

_pending_reloads: dict[int, torch.cuda.Event] = {}  # device data_ptr -> its reload's completion event


@custom_op("offload", mutates_args=())
def offload(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor` (pinned, copied on the side stream on CUDA)."""
    check_device(tensor.device)
    return to_host(tensor)


@offload.register_fake
def _(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")


OFFLOAD_OP = op("offload").default
"""The op itself: what alst's host-booked checkpoint calls and the simulator's storage tracker books as host
memory."""


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


WAIT_OP = op("wait").default
fx.node.has_side_effect(WAIT_OP)

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
    return (node.op == "call_function" and node.target is not operator.getitem and not is_view(node)
            and node not in model_outputs and isinstance(val, torch.Tensor) and val.is_floating_point()
            and val.is_contiguous())


OFFLOAD_SCOPES = ("boundaries", "layers")
"""What moves to host memory: the layer-boundary values only, or every saved value made inside a decoder layer as
well (attention's inputs and outputs after the all-to-alls, whatever the partition keeps): the memory planner's
second host-memory step, where the boundaries alone are not enough."""

RELOAD_TIMES = ("ahead", "late")
"""When backward issues an offloaded value's reload: a layer ahead (where the previous offloaded value is first used:
the copy hides behind that layer's backward, and both values are on the device meanwhile), or late (right after the
previous value's last use, or at the latest just before its own first use: the previous one's bytes are free before
these arrive, and the copy overlaps only what runs between): the memory planner's step where the value held a layer
early is what does not fit."""


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
                       scope: str = "boundaries", reload: str = "ahead") -> OffloadReport:
    """Rewrite both graphs in place (module docstring) for the saved values of `scope` (`OFFLOAD_SCOPES`), reloaded
    at `reload` (`RELOAD_TIMES`); returns what is offloaded."""
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
    _reload_before_use(bw_graph, [(placeholders[n.name], n.meta["val"].device) for n in chosen], late=reload == "late")
    for module in (fw_module, bw_module):
        module.graph.lint()
        module.recompile()
    return report


def reserve_host_buffers(fw_module: fx.GraphModule) -> None:
    """The pinned pool of each GPU grows by what this forward graph's offloads take per step
    (`autosp.comm.host_pool`); the graph compiled again (another length) replaces its reservation, as its offloaded
    values carry the same names."""
    offloads = [n for n in fw_module.graph.nodes if n.target is OFFLOAD_OP]
    by_device: dict[torch.device, list[int]] = {}
    for node in offloads:
        (value,) = node.args
        if value.meta["val"].device.type != "cpu":
            by_device.setdefault(value.meta["val"].device, []).append(node_nbytes(value))
    owner = "offload:" + ",".join(node.args[0].name for node in offloads)
    for device, sizes in by_device.items():
        host_pool(device).reserve(owner, aligned_bytes(sizes))


def _last_use(node: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The last node reading `node`'s storage: the latest of its users and of its views' users."""
    return max((_last_use(u, order) if is_view(u) and u.users else u for u in node.users), key=order.__getitem__)


def _reload_before_use(graph: fx.Graph, offloaded: Sequence[tuple[fx.Node, Any]], late: bool = False) -> None:
    """Each offloaded input: reload issued where the previous one (in backward order) is first used, or with `late`
    right after the previous one's last use (`RELOAD_TIMES`), and never after its own first use; wait just before
    its own first use."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    used = [(min(p.users, key=order.__getitem__), _last_use(p, order), p, device) for p, device in offloaded if p.users]
    used.sort(key=lambda item: order[item[0]])
    previous: tuple[fx.Node, fx.Node] | None = None  # the previous value's first and last use
    for first_use, last_use, placeholder, device in used:
        if previous is None:
            issue = graph.inserting_before(first_use)
        elif not late:
            issue = graph.inserting_before(previous[0])
        elif order[previous[1]] < order[first_use]:
            issue = graph.inserting_after(previous[1])
        else:
            issue = graph.inserting_before(first_use)
        with issue:
            loaded = graph.call_function(op("reload").default, (placeholder, device))
        with graph.inserting_before(first_use):
            ready = graph.call_function(WAIT_OP, (loaded,))
        # no recomputed forward op (partitioner_tag), and not the saved op's eager inputs: a custom op's (an
        # all-to-all's) `eager_input_vals` made Inductor normalise reload's arguments against them and fail
        meta = {k: v for k, v in placeholder.meta.items() if k not in ("partitioner_tag", "eager_input_vals")}
        loaded.meta.update(meta)
        ready.meta.update(meta)
        placeholder.meta["val"] = placeholder.meta["val"].to(torch.device("cpu"))  # what it now receives
        for user in list(placeholder.users):
            if user is not loaded:
                user.replace_input_with(placeholder, ready)
        previous = (first_use, last_use)
