"""Optimizer state in host memory (ZeRO-Offload): fp32 master weights and the optimizer's moments live on the host,
the step runs on the CPU, the device keeps only the parameters it computes with (and their gradients).

At `autosp.compile(..., offload="optimizer")` every parameter this rank steps (its flat shard at ZeRO 2/3, the whole
parameter at 0/1) gets a host master copy in the parameter's own (master) dtype, captured before anything else
changes it (`HostMasters.capture`); under mixed precision the device parameter then becomes its compute-dtype cast,
so the device holds bf16 weights and bf16 gradients where it held fp32 masters, fp32 gradients and two fp32 moments.
`HostOptimizer.step`: each gradient (after its reduction: the compiled backward's buckets or reduce-scatters) is
copied into a host buffer in the master dtype, the inner optimizer steps the masters on the CPU (DeepSpeed's
`DeepSpeedCPUAdam` for AdamW on a GPU where its op loads, else the optimizer class given, e.g. torch's AdamW on
host tensors: `implementation` says which), and each master is copied back into its device parameter, cast.

Devices: on CUDA the host tensors are pinned; each gradient is streamed to its host buffer as soon as autograd has
accumulated it (a post-accumulate hook: a `non_blocking` copy on the side stream of `autosp.comm.host_copy`, so it
overlaps whatever backward still runs), and the step uses that copy only if the gradient was not changed since (its
version counter: clipping or any in-place change after backward makes the step copy it again; ZeRO's flat shards,
whose gradients are assigned rather than accumulated, are copied in the step). One synchronisation precedes the CPU
step; the updated parameters go back `non_blocking` (the masters are not written again before the next step's
synchronisation). Inside `overlapping()` each streamed gradient's parameter is also stepped at once on a worker
thread, and `step()` keeps or redoes each such step (`autosp.comm.early_step`). Written against torch's CUDA API,
not run on a GPU here. On CPU the
device *is* host memory, so a device run is emulated: the host tensors are allocated inside `HOST_REGION`, which the
CPU memory meter books as host memory (as it books `autosp_sp::offload`), and `host_region` is what the simulator
replaces to book the same allocations as host on a simulated device.
"""
from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from autosp.comm.early_step import EarlySteps
from autosp.comm.host_copy import side_stream, synchronize_side_streams
from autosp.errors import SequenceParallelError

HOST_REGION = "autosp::host_optimizer_state"
"""The profiler region of every host allocation of the optimizer offload: the CPU memory meter books what is
allocated inside it as host memory."""
TORCH_IMPLEMENTATION = "torch (host tensors)"
DEEPSPEED_IMPLEMENTATION = "deepspeed-cpu-adam"


def host_region() -> contextlib.AbstractContextManager:
    """Around every host allocation of the offload: a profiler region the CPU meter reads (the simulator swaps this
    function for its tracker's host booking)."""
    return torch.profiler.record_function(HOST_REGION)


def _host_empty(like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    pinned = like.device.type == "cuda"
    return torch.empty(like.shape, dtype=dtype, device="cpu", pin_memory=pinned)


class HostMasters:
    """The host master copy of every parameter this rank steps, keyed by the device parameter."""

    def __init__(self) -> None:
        self._masters: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        self.master_dtype = torch.float32  # the parameters' own dtype when captured (a model has one)
        self.params_on_host = False  # offload=params: the compute-dtype parameters live in host memory too

    @classmethod
    def capture(cls, params: Iterable[nn.Parameter], compute_dtype: torch.dtype | None) -> HostMasters:
        """Copy each floating-point parameter (in its own dtype, the master dtype) to host memory; with
        `compute_dtype`, the device parameter then becomes its compute-dtype cast (the master leaves the device)."""
        store = cls()
        seen: set[int] = set()
        for p in params:
            if id(p) in seen or not p.is_floating_point():
                continue
            seen.add(id(p))
            store.master_dtype = p.dtype
            with host_region():
                master = _host_empty(p, p.dtype).copy_(p.detach())
            store._masters[id(p)] = (p, master)
            if compute_dtype is not None and p.dtype != compute_dtype:
                p.data = p.detach().to(compute_dtype)
        return store

    def master(self, p: nn.Parameter) -> torch.Tensor:
        entry = self._masters.get(id(p))
        if entry is None or entry[0] is not p:
            raise SequenceParallelError("offload=optimizer: a parameter without a host master (build the optimizer "
                                        "with the compiled module's make_optimizer, over its own parameters)")
        return entry[1]

    def get(self, p: nn.Parameter) -> torch.Tensor | None:
        entry = self._masters.get(id(p))
        return entry[1] if entry is not None and entry[0] is p else None

    def keep_only(self, params: Iterable[nn.Parameter]) -> None:
        """Free the masters of every parameter another rank steps (ZeRO 1: each rank steps its own share)."""
        keep = {id(p) for p in params}
        self._masters = {k: v for k, v in self._masters.items() if k in keep}

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for _, m in self._masters.values())

    def __len__(self) -> int:
        return len(self._masters)


def state_bytes_per_parameter(master_dtype: torch.dtype = torch.float32) -> int:
    """Host bytes per stepped parameter element with AdamW: master + gradient buffer + two moments (master dtype)."""
    return 4 * torch.empty(0, dtype=master_dtype).element_size()


def check_host_budget(numel: int, master_dtype: torch.dtype, host_budget: int | None,
                      params_dtype: torch.dtype | None = None) -> int:
    """The host bytes this rank's AdamW state will take (`state_bytes_per_parameter` x the elements it steps), plus
    with `params_dtype` (offload=params, `autosp.comm.host_params`) the parameters and their gradients in that
    dtype; over `host_budget` a one-line out-of-memory error naming the host (a run records it as `oom`)."""
    per_parameter = state_bytes_per_parameter(master_dtype)
    if params_dtype is not None:
        per_parameter += 2 * torch.empty(0, dtype=params_dtype).element_size()
    need = numel * per_parameter
    if host_budget is not None and need > host_budget:
        what = "AdamW state (master, gradient, two moments)" + (" and the parameters with their gradients"
                                                                 if params_dtype is not None else "")
        raise HostMemoryError(f"host memory: offload=optimizer keeps {need} B of {what} in this rank's host memory, "
                              f"over its host budget of {host_budget} B; raise the host budget, shard the state over "
                              "more ranks (zero=3) or drop offload=optimizer")
    return need


class HostMemoryError(torch.OutOfMemoryError):
    """The host memory a rank may use is too small for what it must keep there."""


def _deepspeed_cpu_adam(groups: list[dict[str, Any]], defaults: dict[str, Any],
                        required: bool = False) -> torch.optim.Optimizer | None:
    """DeepSpeed's CPU Adam (AdamW mode) over the host masters, or None where its op does not load or the options
    are ones it lacks (`required`: a one-line error saying why instead)."""
    if defaults.get("amsgrad") or set(defaults) - {"lr", "betas", "eps", "weight_decay"}:
        if required:
            raise SequenceParallelError(f"offload=optimizer:deepspeed: DeepSpeed's CPU Adam takes lr, betas, eps and "
                                        f"weight_decay, not {sorted(set(defaults) - {'lr', 'betas', 'eps'})}; use "
                                        "optimizer:torch")
        return None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # torch's AdamW defaults, which DeepSpeed's differ from (its weight decay is 0)
        return DeepSpeedCPUAdam(groups, adamw_mode=True, **{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8,
                                                            "weight_decay": 1e-2, **defaults})
    except Exception as exc:  # noqa: BLE001 - any failure to build or load the op: torch's optimizer steps instead
        if required:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise SequenceParallelError(f"offload=optimizer:deepspeed: DeepSpeed's CPU Adam did not load ({reason}); "
                                        "use optimizer:torch, or optimizer (DeepSpeed's where it loads)") from None
        return None


class HostOptimizer(torch.optim.Optimizer):
    """`optimizer_class` stepping host masters of the device parameters it is given (see the module docstring).

    Its `param_groups` hold the device parameters (so `zero_grad`, LR schedulers and torch's ZeroRedundancyOptimizer
    see the parameters they expect); the inner optimizer's groups hold the masters and take the hyper-parameters
    from these at every step. `state[p]` is the inner state of p's master plus the master itself (`master`), so
    checkpoints save and restore the fp32 weights, not their bf16 casts."""

    def __init__(self, params: Any, *, optimizer_class: type[torch.optim.Optimizer], masters: HostMasters,
                 use_deepspeed: bool | None = None, overlap_step: bool = False, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.masters = masters
        self._pairs = [(p, masters.master(p)) for g in self.param_groups for p in g["params"]]
        with host_region():
            self._host_grads = {id(p): _host_empty(m, m.dtype) for p, m in self._pairs}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [masters.master(p) for p in g["params"]]}
                  for g in self.param_groups]
        on_gpu = any(p.device.type == "cuda" for p, _ in self._pairs)
        inner = None
        if use_deepspeed and optimizer_class is not torch.optim.AdamW:
            raise SequenceParallelError(f"offload=optimizer:deepspeed runs DeepSpeed's CPU Adam in place of "
                                        f"torch.optim.AdamW, not of {optimizer_class.__name__}; use optimizer:torch")
        if optimizer_class is torch.optim.AdamW and (use_deepspeed if use_deepspeed is not None else on_gpu):
            inner = _deepspeed_cpu_adam(groups, defaults, required=bool(use_deepspeed))
        self.implementation = DEEPSPEED_IMPLEMENTATION if inner is not None else \
            f"{optimizer_class.__module__}.{optimizer_class.__name__} {TORCH_IMPLEMENTATION}"
        if inner is None and "foreach" in inspect.signature(optimizer_class).parameters:
            # what torch picks for CPU tensors anyway, said outright: a simulated GPU run (fake tensors, all on
            # "cpu", torch's choice patched to the GPU's) steps the host masters as the device run does
            defaults = {"foreach": False, **defaults}
        self.inner = inner if inner is not None else optimizer_class(groups, **defaults)
        self._streamed: dict[int, tuple[weakref.ref, int]] = {}  # id(p) -> (the gradient copied, its version then)
        self.streamed_gradients = 0  # of the last step's gradients, those whose streamed copy it used
        self.overlap_step = overlap_step  # `overlapping()` steps during backward (opt-in: it costs host memory)
        self.early = EarlySteps(self.inner, host_region)
        self.early_steps = 0  # of the last step's parameters, those whose step during backward stood
        stream = weakref.WeakMethod(self._stream_gradient)  # the hook must not keep a replaced optimizer's state

        def hook(p: nn.Parameter) -> None:
            method = stream()
            if method is not None:
                method(p)

        for p, _ in self._pairs:
            p.register_post_accumulate_grad_hook(hook)

    def _stream_gradient(self, p: nn.Parameter) -> None:
        """Copy `p`'s just-accumulated gradient into its host buffer now (module docstring)."""
        buffer, grad = self._host_grads[id(p)], p.grad
        if p.device.type == "cuda":
            side = side_stream(p.device)
            side.wait_stream(torch.cuda.current_stream(p.device))
            with torch.cuda.stream(side):
                buffer.copy_(grad.detach().reshape(buffer.shape), non_blocking=True)
            grad.record_stream(side)
        else:
            buffer.copy_(grad.detach().reshape(buffer.shape))
        self._streamed[id(p)] = (weakref.ref(grad), grad._version)
        if self.early.active:
            ready = None
            if p.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(side_stream(p.device))
            self.early.submit(p, self.masters.master(p), buffer, ready)

    def _hyper(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Around the step's last backward: each gradient autograd accumulates in it is stepped on the host while
        backward goes on; `step()` keeps each such step whose gradient was not changed since (module docstring of
        `autosp.comm.early_step`). A backward that raises rolls its early steps back. Only with `overlap_step`
        (each parameter stepped early keeps a copy of its master and its state aside: 3 more master-sized host
        tensors per parameter); otherwise a no-op."""
        if not self.overlap_step:
            yield
            return
        self.early.begin(self._hyper())
        try:
            yield
        except BaseException:
            self.early.finish(self._hyper(), keeps=lambda pid: False)
            raise
        finally:
            self.early.active = False

    def _unchanged(self, p: nn.Parameter) -> bool:
        """`p.grad` is the gradient streamed in backward, not changed since."""
        streamed = self._streamed.get(id(p))
        return streamed is not None and p.grad is not None and streamed[0]() is p.grad \
            and streamed[1] == p.grad._version

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 - see the class docstring
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group, inner_group in zip(self.param_groups, self.inner.param_groups, strict=True):
            inner_group.update({k: v for k, v in group.items() if k != "params"})
        if self.masters.params_on_host and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # gradients streamed to host memory in backward (offload=params) have arrived
        synchronize_side_streams()  # the gradients streamed in backward are in host memory
        by_id = {id(p): p for p, _ in self._pairs}
        stood = self.early.finish(self._hyper(), keeps=lambda pid: self._unchanged(by_id[pid]))
        self.early_steps = len(stood)
        devices = set()
        self.streamed_gradients = 0
        for p, master in self._pairs:
            unchanged = self._unchanged(p)
            self._streamed.pop(id(p), None)
            if p.grad is None or id(p) in stood:
                master.grad = None
                self.streamed_gradients += id(p) in stood
                continue
            buffer = self._host_grads[id(p)]
            if unchanged:
                self.streamed_gradients += 1
            else:  # not accumulated by autograd (a ZeRO shard), or changed since it was streamed
                buffer.copy_(p.grad.detach().reshape(buffer.shape), non_blocking=p.device.type == "cuda")
                devices.add(p.device)
            master.grad = buffer
        for device in devices:
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # the gradients are in host memory
        with host_region():  # the inner optimizer's state (made at its first step) and temporaries: host memory
            self.inner.step()
        for p, master in self._pairs:
            if master.grad is not None or id(p) in stood:
                p.copy_(master, non_blocking=p.device.type == "cuda")
                master.grad = None
        return loss

    @property
    def state(self) -> dict:  # type: ignore[override]
        return {p: {**self.inner.state[m], "master": m} for p, m in self._pairs if m in self.inner.state} \
            if hasattr(self, "inner") else self._base_state

    @state.setter
    def state(self, value: dict) -> None:
        self._base_state = value

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyper-parameters, the inner state and the masters (then the device parameters from them)."""
        groups = state_dict["param_groups"]
        saved = state_dict["state"]
        index = 0
        for group, saved_group in zip(self.param_groups, groups, strict=False):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        with torch.no_grad():
            for index, (p, master) in enumerate(self._pairs):
                entry = saved.get(index)
                if entry is None:
                    continue
                master.copy_(entry["master"])
                self.inner.state[master] = {k: (v.to(master.device).clone() if torch.is_tensor(v) else v)
                                            for k, v in entry.items() if k != "master"}
                p.copy_(master)

    def state_dict(self) -> dict[str, Any]:
        index = {id(p): i for i, (p, _) in enumerate(self._pairs)}
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()},
                "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                  "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]}

    def host_bytes(self) -> int:
        """Bytes this optimizer holds in host memory: masters, gradient buffers, the inner optimizer's state."""
        tensors: dict[int, torch.Tensor] = {}
        for p, master in self._pairs:
            tensors[id(master)] = master
            tensors[id(self._host_grads[id(p)])] = self._host_grads[id(p)]
            for value in self.inner.state.get(master, {}).values():
                if torch.is_tensor(value):
                    tensors[id(value)] = value
        return sum(t.numel() * t.element_size() for t in tensors.values()) + self.early.host_bytes()

    def device_bytes_saved(self) -> int:
        """Device bytes this rank would hold without the offload, less what it holds with it: the inner state's
        tensors (AdamW's moments), and under mixed precision the master-vs-compute-dtype difference of the
        parameter and of its gradient (with the parameters in host memory, offload=params: all of both)."""
        saved = 0
        for p, master in self._pairs:
            saved += sum(v.numel() * v.element_size() for v in self.inner.state.get(master, {}).values()
                         if torch.is_tensor(v) and v.dim() > 0)
            kept = 0 if self.masters.params_on_host else p.element_size()
            saved += 2 * p.numel() * (master.element_size() - kept)
        return saved


def iter_pairs(optimizer: torch.optim.Optimizer) -> Iterator[HostOptimizer]:
    """The host optimizers inside `optimizer` (itself, or the local optimizer of a ZeroRedundancyOptimizer)."""
    for candidate in (optimizer, getattr(optimizer, "optim", None)):
        if isinstance(candidate, HostOptimizer):
            yield candidate
