"""`autosp.comm.host_optimizer` on one process: the host AdamW steps masters exactly as AdamW steps the parameters,
the device parameters are their compute-dtype casts, the state survives a state_dict round trip, the host budget
is checked before anything is allocated. (Every ZeRO stage over gloo ranks: tests/baselines/test_autosp_method.py.)"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

from autosp.comm.host_optimizer import HostMasters, HostMemoryError, HostOptimizer, check_host_budget


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int = 3) -> None:
    for step in range(steps):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step)).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_host_adamw_steps_the_masters_bit_for_bit_as_adamw_steps_the_parameters():
    reference, offloaded = _model(), _model()
    _steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    masters = HostMasters.capture(offloaded.parameters(), None)
    optimizer = HostOptimizer(offloaded.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    _steps(offloaded, optimizer)
    for p, q in zip(reference.parameters(), offloaded.parameters(), strict=True):
        assert torch.equal(p, q) and torch.equal(p, masters.master(q))
    assert optimizer.implementation == "torch.optim.adamw.AdamW torch (host tensors)"
    n = sum(p.numel() for p in reference.parameters())
    assert optimizer.host_bytes() == 16 * n + 4 * 4 and optimizer.device_bytes_saved() == 8 * n


def test_mixed_precision_keeps_bf16_casts_on_the_device_and_fp32_masters_on_the_host():
    model = _model()
    masters = HostMasters.capture(model.parameters(), torch.bfloat16)
    optimizer = HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    _steps(model, optimizer, steps=2)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and masters.master(p).dtype == torch.float32
        assert torch.equal(p, masters.master(p).to(torch.bfloat16))
    assert optimizer.device_bytes_saved() == sum(8 * p.numel() + 2 * 2 * p.numel() for p in model.parameters())


def test_state_dict_round_trip_restores_masters_moments_and_device_parameters():
    model = _model()
    masters = HostMasters.capture(model.parameters(), torch.bfloat16)
    optimizer = HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    _steps(model, optimizer, steps=2)
    saved, after = copy.deepcopy(optimizer.state_dict()), [masters.master(p).clone() for p in model.parameters()]
    _steps(model, optimizer, steps=1)  # move away, then restore
    optimizer.load_state_dict(saved)
    for p, master in zip(model.parameters(), after, strict=True):
        assert torch.equal(masters.master(p), master) and torch.equal(p, master.to(torch.bfloat16))
    assert all(set(s) == {"step", "exp_avg", "exp_avg_sq", "master"} for s in optimizer.state.values())


def test_a_host_budget_below_the_state_is_out_of_memory_naming_the_host():
    assert check_host_budget(1000, torch.float32, 16_000) == 16_000
    with pytest.raises(HostMemoryError, match="^host memory: offload=optimizer keeps 16000 B"):
        check_host_budget(1000, torch.float32, 15_999)
    assert issubclass(HostMemoryError, torch.OutOfMemoryError)  # a run records it as `oom`


@pytest.mark.long  # DeepSpeed's CPU Adam is built on first use (a JIT C++ build, minutes on a fresh machine)
def test_deepspeeds_cpu_adam_steps_the_masters_within_fp32_tolerance_of_torchs():
    pytest.importorskip("deepspeed")
    reference, offloaded = _model(), _model()
    _steps(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    masters = HostMasters.capture(offloaded.parameters(), None)
    optimizer = HostOptimizer(offloaded.parameters(), optimizer_class=torch.optim.AdamW, masters=masters,
                              use_deepspeed=True, lr=1e-2)
    if optimizer.implementation != "deepspeed-cpu-adam":
        pytest.skip("DeepSpeed's CPU Adam op does not build here")
    _steps(offloaded, optimizer)
    for p, q in zip(reference.parameters(), offloaded.parameters(), strict=True):
        assert (p - q).norm() <= 1e-5 * p.norm()


def test_deepspeed_asked_for_another_optimizer_class_is_refused_in_one_line():
    from autosp.errors import SequenceParallelError

    model = _model()
    masters = HostMasters.capture(model.parameters(), None)
    with pytest.raises(SequenceParallelError, match="not of SGD; use optimizer:torch"):
        HostOptimizer(model.parameters(), optimizer_class=torch.optim.SGD, masters=masters, use_deepspeed=True, lr=0.1)


def _paired(clip: float | None, micro_batches: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:
    """AdamW on the device vs the host optimizer, `micro_batches` backward passes per step, optionally clipped after
    backward: the parameters of both after three steps, and how many streamed gradients each host step used."""
    reference, offloaded = _model(), _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    masters = HostMasters.capture(offloaded.parameters(), None)
    optimizer = HostOptimizer(offloaded.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    used = []
    for step in range(3):
        for model, opt in ((reference, ref_opt), (offloaded, optimizer)):
            for micro in range(micro_batches):
                x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                model(x).square().mean().backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
        used.append(optimizer.streamed_gradients)
    return list(reference.parameters()), list(offloaded.parameters()), used


@pytest.mark.parametrize(("clip", "micro_batches", "streamed"), [(None, 1, 4), (None, 2, 4), (1e-3, 1, 0)])
def test_gradients_streamed_in_backward_are_used_only_while_unchanged(clip, micro_batches, streamed):
    """Each gradient is copied to host memory when autograd has accumulated it; the step uses that copy unless the
    gradient changed since (clipped in place after backward): either way the parameters are AdamW's, bit for bit."""
    expected, got, used = _paired(clip, micro_batches)
    for p, q in zip(expected, got, strict=True):
        assert torch.equal(p, q)
    assert used == [streamed] * 3


def test_a_replaced_host_optimizer_is_freed_and_no_longer_copies_gradients():
    import gc
    import weakref

    model = _model()
    masters = HostMasters.capture(model.parameters(), None)
    first = HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    gone = weakref.ref(first)
    del first
    gc.collect()
    assert gone() is None  # the gradient hooks do not keep its host buffers alive
    _steps(model, HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2), 1)


class _Gate(torch.autograd.Function):
    """Identity whose backward waits (at most 60 s) until `event` is set: put at the model's input, it holds the end
    of backward until the host optimizer has finished an early step, which must therefore overlap backward."""

    @staticmethod
    def forward(ctx, x, event):
        ctx.event = event
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.waited = ctx.event.wait(timeout=60)
        _Gate.opened.append(ctx.waited)
        return grad, None


def _overlapped(clip: str | None, micro_batches: int = 1, lr_change: bool = False):
    """AdamW on the device vs the host optimizer stepping during the last backward of each step: parameters of both
    after three steps, and per step how many early steps stood and how many were rolled back."""
    import threading

    from autosp.comm import early_step

    reference, offloaded = _model(), _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    masters = HostMasters.capture(offloaded.parameters(), None)
    optimizer = HostOptimizer(offloaded.parameters(), optimizer_class=torch.optim.AdamW, masters=masters,
                              overlap_step=True, lr=1e-2)
    first_step_done = threading.Event()
    step_one = early_step.EarlySteps._step_one

    def signalling(self, *args):
        step_one(self, *args)
        first_step_done.set()

    counts, _Gate.opened = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(early_step.EarlySteps, "_step_one", signalling)
        for step in range(3):
            for model, opt in ((reference, ref_opt), (offloaded, optimizer)):
                for micro in range(micro_batches):
                    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(10 * step + micro))
                    last = micro == micro_batches - 1 and opt is optimizer
                    context = opt.overlapping() if last else contextlib.nullcontext()
                    first_step_done.clear()
                    with context:
                        gated = _Gate.apply(x.requires_grad_(), first_step_done) if last else x
                        model(gated).square().mean().backward()
                if clip == "torch":  # multiplies every gradient in place, by 1 under the threshold too
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                elif clip == "under":  # under the threshold the gradients are left as they are
                    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
                    if bool(1e3 / (norm + 1e-6) < 1):
                        torch.nn.utils.clip_grads_with_norm_(list(model.parameters()), 1e3, norm)
                if lr_change:
                    for g in opt.param_groups:
                        g["lr"] = 1e-2 / (step + 2)
                opt.step()
                opt.zero_grad(set_to_none=True)
            counts.append((optimizer.early_steps, optimizer.early.rolled_back))
    return list(reference.parameters()), list(offloaded.parameters()), counts


@pytest.mark.parametrize(("clip", "micro_batches", "lr_change", "stood"), [
    (None, 1, False, 4), ("under", 1, False, 4), (None, 2, False, 4), ("torch", 1, False, 0), (None, 1, True, 0)])
def test_steps_taken_during_backward_stand_only_where_the_plain_step_would_equal_them(clip, micro_batches,
                                                                                     lr_change, stood):
    """Inside `overlapping()` each parameter is stepped on the host as its gradient arrives, while backward still
    runs (the gate holds backward's end until an early step has finished); at step() a gradient changed since (torch's
    clip multiplies by its factor even when it is 1) or other hyper-parameters roll the early steps back and redo
    them: the parameters are AdamW's bit for bit in every case."""
    expected, got, counts = _overlapped(clip, micro_batches, lr_change)
    for p, q in zip(expected, got, strict=True):
        assert torch.equal(p, q)
    assert all(_Gate.opened), "backward ended before any early step finished: the step did not overlap backward"
    assert counts == [(stood, 4 - stood)] * 3


def test_clip_grad_norm_under_its_threshold_leaves_the_gradients_unchanged():
    """autosp's clip under its threshold does not touch the gradients (so early steps stand); over it, torch's clip."""
    from autosp.training.gradients import clip_grad_norm_

    model = _model()
    model.zero = 0
    model(torch.randn(5, 8)).square().mean().backward()
    versions = [p.grad._version for p in model.parameters()]
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model, 1e6)
    assert [p.grad._version for p in model.parameters()] == versions
    clip_grad_norm_(model, float(norm) / 2)
    for p, g in zip(model.parameters(), before, strict=True):
        assert torch.allclose(p.grad, g * (float(norm) / 2) / (norm + 1e-6))


def test_overlap_step_without_host_masters_is_refused_in_one_line():
    from autosp.api import SequenceParallelModule
    from autosp.errors import SequenceParallelError

    module = SequenceParallelModule(_model(), None, None, None, zero=0)
    with pytest.raises(SequenceParallelError, match="compile with offload='optimizer'"):
        module.make_optimizer(torch.optim.AdamW, overlap_step=True, lr=1e-2)


def test_without_overlap_step_overlapping_steps_nothing_during_backward():
    model = _model()
    masters = HostMasters.capture(model.parameters(), None)
    optimizer = HostOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, masters=masters, lr=1e-2)
    before = [m.clone() for _, m in optimizer._pairs]
    with optimizer.overlapping():
        model(torch.randn(5, 8)).square().mean().backward()
    assert all(torch.equal(b, m) for b, (_, m) in zip(before, optimizer._pairs, strict=True))
    optimizer.step()
    assert optimizer.early_steps == 0 and optimizer.streamed_gradients == 4
