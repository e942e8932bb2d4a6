"""Mamba2's SSD scan as AutoSP's ops (`autosp_sp::ssd_scan`, `ssd_scan_with_state`) against HF's kernel called
directly: outputs, final state and every input's gradient (the ops' backward re-runs the kernel under autograd), and
the identity the sharded rewrite rests on: a sequence's output is its first half's, then its second half's from a zero
state corrected by C_t . (decay since the half's start) h_mid, with h_mid the first half's final state."""
from __future__ import annotations

import importlib

import pytest
import torch

import autosp.comm  # noqa: F401
import autosp.compiler.sp  # noqa: F401  (registers the ops)
from autosp.comm.library import op

MODULE = "transformers.models.mamba2.modeling_mamba2"


def _inputs(seq_len: int = 12, heads: int = 4, groups: int = 2, head_dim: int = 3, state: int = 5):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, seq_len, heads, head_dim, generator=g)
    dt = torch.randn(2, seq_len, heads, generator=g)
    A = -torch.rand(heads, generator=g) - 0.5
    B, C = (torch.randn(2, seq_len, groups, state, generator=g) for _ in range(2))
    D, dt_bias = torch.randn(heads, generator=g), torch.randn(heads, generator=g)
    return [t.requires_grad_() for t in (x, dt, A, B, C, D, dt_bias)]


def _hf(x, dt, A, B, C, D, dt_bias, chunk_size=4):
    kernel = importlib.import_module(MODULE).mamba2_chunk_scan
    return kernel(x, dt, A, B, C, chunk_size, D=D, dt_bias=dt_bias, dt_softplus=True, dt_limit=(0.0, float("inf")),
                  return_final_states=True)


def test_the_ops_outputs_and_gradients_are_hf_kernels():
    inputs = _inputs()
    out, state = op("ssd_scan_with_state")(*inputs, 4, True, 0.0, float("inf"), MODULE, 0)
    ref_out, ref_state = _hf(*inputs)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(state, ref_state)
    grads = torch.autograd.grad((out.sum() + (state * 0.5).sum()), inputs)
    ref = torch.autograd.grad((ref_out.sum() + (ref_state * 0.5).sum()), inputs, retain_graph=True)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got, want)
    only_out = op("ssd_scan")(*inputs, 4, True, 0.0, float("inf"), MODULE, 0)
    only_out = torch.autograd.grad(only_out.square().sum(), inputs)
    ref_only = torch.autograd.grad(ref_out.square().sum(), inputs)
    for got, want in zip(only_out, ref_only, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("tile", [4, 8])  # three tiles of one chunk; two tiles, the last one chunk
def test_the_ops_over_tiles_with_their_state_carried_equal_the_whole_kernel(tile):
    """`tile_tokens` runs HF's kernel tile by tile from the state the tile before left: the output, final state and
    every gradient (A's, D's and dt_bias's summed over the tiles) equal the untiled op's to fp32 rounding."""
    inputs = _inputs()
    results = []
    for tile_tokens in (0, tile):
        out, state = op("ssd_scan_with_state")(*inputs, 4, True, 0.0, float("inf"), MODULE, tile_tokens)
        grads = torch.autograd.grad((out * out).sum() + (state * 0.5).sum(), inputs)
        only_out = op("ssd_scan")(*inputs, 4, True, 0.0, float("inf"), MODULE, tile_tokens)
        results.append([out, state, *grads, only_out, *torch.autograd.grad(only_out.square().sum(), inputs)])
    for whole, tiled in zip(*results, strict=True):
        torch.testing.assert_close(tiled, whole, rtol=1e-5, atol=1e-5)


def test_two_halves_from_a_zero_state_corrected_by_the_first_halfs_state_are_the_whole_scan():
    x, dt, A, B, C, D, dt_bias = (t.detach() for t in _inputs())
    whole, _ = _hf(x, dt, A, B, C, D, dt_bias)
    halves = [[t[:, s] for t in (x, dt, B, C)] for s in (slice(0, 6), slice(6, 12))]
    first, h_mid = _hf(halves[0][0], halves[0][1], A, halves[0][2], halves[0][3], D, dt_bias)
    second, _ = _hf(halves[1][0], halves[1][1], A, halves[1][2], halves[1][3], D, dt_bias)
    decay = torch.exp(torch.cumsum(torch.nn.functional.softplus(halves[1][1] + dt_bias) * A, 1))
    readout = halves[1][3].repeat_interleave(2, dim=2)
    corrected = second + torch.einsum("blh,blhn,bhpn->blhp", decay, readout, h_mid)
    torch.testing.assert_close(torch.cat([first, corrected], 1), whole)
    assert (second - whole[:, 6:]).abs().max() > 1e-2  # the correction is not nothing


def test_the_planner_sees_the_scans_scratch_and_the_clock_its_flops():
    """The liveness replay charges the kernel's intermediates while the op runs (`autosp.comm.transients`): the
    forward's, and twice that in backward (the re-run forward's kept for autograd, and their gradients)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp.comm.costs import declared_cost
    from autosp.comm.transients import transient_bytes

    inputs = _inputs()

    def step(*inputs):
        out = op("ssd_scan")(*inputs, 4, True, 0.0, float("inf"), MODULE, 0)
        return torch.autograd.grad(out.sum(), inputs)

    gm = make_fx(step)(*inputs)
    (forward,) = [n for n in gm.graph.nodes if n.target == op("ssd_scan").default]
    (backward,) = [n for n in gm.graph.nodes if n.target == op("ssd_scan_backward").default]
    # [2, 12, 4, 3] x, chunks of 4, state 5: per head 12 (4 * 3 + 3 * 5 + 3 * 4) + 3 * 3 * 5 fp32 values
    assert transient_bytes(forward) == 4 * 2 * 4 * (12 * (12 + 15 + 12) + 3 * 15)
    assert transient_bytes(backward) == 2 * transient_bytes(forward)
    flops = 2 * 2 * 12 * 4 * (4 * (5 + 3) + 2 * 3 * 5)  # 2 B L H (Q (N + P) + 2 P N)
    assert declared_cost(forward.target, tuple(n.meta["val"] if hasattr(n, "meta") else n for n in forward.args),
                         {}) == ("matmul", flops)


def test_the_scan_in_tiles_holds_one_tiles_intermediates():
    """HF's kernel on real tensors (2,048 tokens, 8 heads of 16, state 16, chunks of 64), the harness's CPU meter: its
    scratch in four tiles, forward and backward, under 40% of the whole's (measured 27-28%; the declared scratch, an
    estimate of the SSD kernel's, follows the same tile: `python -m tests.experiments.recurrence_scratch_check
    2048`)."""
    from tests.experiments.recurrence_scratch_check import peak_inside

    torch.manual_seed(0)
    x, grad = torch.randn(1, 2048, 8, 16), torch.randn(1, 2048, 8, 16)
    dt, A, D, dt_bias = torch.randn(1, 2048, 8), -torch.rand(8), torch.randn(8), torch.randn(8)
    B, C = torch.randn(1, 2048, 2, 16), torch.randn(1, 2048, 2, 16)
    for call, prefix in ((op("ssd_scan"), ()), (op("ssd_scan_backward"), (grad, None))):
        scratch = []
        for tile in (0, 512):
            peak, outputs = peak_inside(call, (*prefix, x, dt, A, B, C, D, dt_bias, 64, True, 0.0, float("inf"),
                                               MODULE, tile))
            scratch.append(peak - outputs)
        assert scratch[1] < 0.4 * scratch[0], (call, scratch)
