"""`baselines.recompute_flops`: the forward FLOPs a checkpointed function re-runs in backward, and nothing else."""
from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from baselines.recompute_flops import RecomputeCounter


@pytest.mark.parametrize("reentrant", [True, False])
def test_a_checkpointed_function_is_counted_once_when_backward_re_runs_it(reentrant):
    counter = RecomputeCounter()
    counter.start((3, 5))
    inner = torch.nn.Linear(8, 16, bias=False)
    outer = torch.nn.Linear(16, 4, bias=False)

    def block(x: torch.Tensor) -> torch.Tensor:  # a nested counted call (TiledMLP inside a layer) counts once
        return outer(counter.wrap(inner)(x).relu())

    x = torch.randn(3, 5, 8, requires_grad=True)
    y = checkpoint(counter.wrap(block), x, use_reentrant=reentrant)
    assert counter.flops == 0  # forward is not recompute
    y.sum().backward()
    # the matmuls' forward, once: reentrant re-runs the whole function, non-reentrant stops at the last value
    # backward needs (relu's output, the outer matmul's input), and what did not run is not counted
    assert counter.flops == 2 * 15 * 8 * 16 + (2 * 15 * 16 * 4 if reentrant else 0)


def test_attention_counts_4_b_h_sq_sk_d_on_the_cpu_flash_kernel_too():
    counter = RecomputeCounter()
    counter.start((2, 32))
    q, k, v = (torch.randn(2, 3, 32, 16, requires_grad=True) for _ in range(3))

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    checkpoint(counter.wrap(attend), q, k, v, use_reentrant=False).sum().backward()
    assert counter.flops == 4 * 2 * 3 * 32 * 32 * 16  # not halved for the causal mask, as the planner counts


def test_a_shape_is_counted_once_and_its_later_steps_run_without_the_counting_mode(monkeypatch):
    """A timed step is the method's own program: at a shape already counted, no dispatch mode runs, and the step
    reports the first step's count; a new shape is counted afresh."""
    import baselines.recompute_flops as recompute_flops

    modes = []

    class Recorded(recompute_flops._FlopCount):
        def __init__(self) -> None:
            super().__init__()
            modes.append(self)

    monkeypatch.setattr(recompute_flops, "_FlopCount", Recorded)
    counter = RecomputeCounter()
    layer = torch.nn.Linear(8, 16, bias=False)

    def step(tokens: int) -> int:
        counter.start((1, tokens))
        x = torch.randn(tokens, 8, requires_grad=True)
        checkpoint(counter.wrap(lambda x: layer(x).relu()), x, use_reentrant=False).sum().backward()
        return counter.flops

    assert step(5) == 2 * 5 * 8 * 16 and len(modes) == 1
    assert step(5) == 2 * 5 * 8 * 16 and len(modes) == 1  # counted before: no mode, the same count
    assert step(7) == 2 * 7 * 8 * 16 and len(modes) == 2
    assert step(5) == 2 * 5 * 8 * 16 and len(modes) == 2
