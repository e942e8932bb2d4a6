"""Lightning attention (MiniMax) as custom ops, so the SP walk finds the recurrence as one node, and Dynamo's graph
holds one node for it at any length instead of HF's block loop unrolled ceil(S / block) times.

HF writes the recurrence inline in the layer's `forward` (`MiniMaxLightningAttention`, HF 5.25: no module-level
kernel to trace as the other recurrences are, `kernels.traced_kernels`), so while Dynamo traces, the forward of every
lightning-attention layer class of the loaded `transformers.models.*` modules (`trace_lightning_attention`) is one
that calls the op in place of the loop. The rule it recognises them by is structural: a class defining HF's
`get_slope_rate` and `decay_factors` (the per-head decay rates and the block decays they make), called on an instance
holding the `slope_rate`, `query_decay`, `key_decay` and `diagonal_decay` buffers, a `block_size` and HF's projections
(`qkv_proj`, `output_gate`, `out_proj`, `norm`, `act_fn`). The traced forward restates HF 5.25's forward around the
loop (the projections, the padding mask, the output gate and norm: `tests/compiler/test_lightning_op.py` holds it
equal to HF's forward, values and gradients); a call with a cache runs HF's forward itself (its loop unrolled, which
the walk refuses where it mixes shards).

The loop per head with decay rate l (`slope_rate`): within a block of n tokens from a carried state S (k^T v
products, [Dk, Dv]), the output at block position j is (q_j e^{-l (j+1)}) S + sum_{i<=j} e^{-l (j-i)} (q_j . k_i)
v_i, and S becomes e^{-l n} S + sum_i e^{-l (n-1-i)} k_i^T v_i. So o_t = q_t sum_{s<=t} e^{-l (t-s)} k_s^T v_s
whatever the block size (up to rounding), a linear recurrence with a per-head scalar decay (`lightning`).

`lightning_attention_with_state(q, k, v, slope_rate, block_size)` ([B, H, S, D] each, `slope_rate` [H, 1, 1]) is
HF's loop from a zero state: the output [B, H, S, Dv] and the final state [B, H, Dk, Dv], what HF's forward returns and
so what the traced forward calls (and what each rank runs on its shard); `lightning_attention` is the output alone,
what the SP pass makes of it where nothing reads the state (`lightning.drop_unread_states`). Their backward
(`lightning_attention_backward`) re-runs the loop under autograd on the saved inputs, so only the inputs are kept.
Each runs the loop over tiles of `tile_tokens` (0: whole), the state carried (`kernels.run_in_tiles`; the tiling's
`recurrence` part sets it), so the blocks' values backward keeps are one tile's.
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from autosp.comm.costs import declare_cost
from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes
from autosp.compiler.sp.recurrence.kernels import (
    contiguous,
    gradients_in_tiles,
    register_rerun_autograd,
    rerun_backward_factor,
    run_in_tiles,
    tile_bounds,
    tile_copies,
)

#: what a lightning-attention layer class defines (HF's), and what its instances hold
_CLASS_METHODS = ("get_slope_rate", "decay_factors")
_BUFFERS = ("slope_rate", "query_decay", "key_decay", "diagonal_decay")
_SUBMODULES = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn")


def _decay_factors(slope_rate: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's `decay_factors`: the queries' decays e^{-l (j+1)} and the keys' e^{-l (n-1-j)} [H, n, 1] of a block of
    n = `block_size` positions j, and the block's causal decays e^{-l (i-j)} (0 above the diagonal) [1, H, n, n]."""
    positions = torch.arange(block_size, device=slope_rate.device) + 1
    query_decay = torch.exp(-slope_rate * positions[:, None])
    key_decay = torch.exp(-slope_rate * (block_size - positions[:, None]))
    diagonal_decay = slope_rate * (positions[:, None] - positions[None, :])[None, None, :, :]
    diagonal_decay = torch.exp(torch.where(diagonal_decay >= 0, -diagonal_decay, float("-inf")))
    return query_decay, key_decay, diagonal_decay


def _loop(block_size: int):
    """HF's block loop (the training path of `MiniMaxLightningAttention.forward`, the same ops in the same order) as
    `run(q, k, v, state, slope_rate)` from `state` (None: zeros): (output [B, H, S, Dv], final state [B, H, Dk, Dv] in
    v's dtype, as HF carries it)."""
    return lambda q, k, v, state, slope_rate: _run(q, k, v, slope_rate, block_size, state)


def _run(q, k, v, slope_rate, block_size, state=None):
    batch, heads, length, _ = q.shape
    query_decay, key_decay, diagonal_decay = _decay_factors(slope_rate, block_size)
    if state is None:
        state = torch.zeros(batch, heads, k.shape[-1], v.shape[-1], device=v.device, dtype=v.dtype)
    outputs = []
    for start in range(0, length, block_size):
        end = min(start + block_size, length)
        n = end - start
        block_q, block_k, block_v = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end]
        intra = torch.matmul(torch.matmul(block_q, block_k.transpose(-1, -2)) * diagonal_decay[:, :, :n, :n], block_v)
        inter = torch.matmul(block_q * query_decay[:, :n], state)
        outputs.append(inter + intra)
        update = torch.matmul((block_k * key_decay[:, -n:]).transpose(-1, -2), block_v)
        state = state * torch.exp(-slope_rate * n) + update
    return contiguous((torch.cat(outputs, dim=-2), state))


def _run_tiled(q, k, v, slope_rate, block_size, tile_tokens):
    return run_in_tiles(_loop(block_size), [q, k, v], None, tile_bounds(q.shape[2], tile_tokens, block_size),
                        shared=(slope_rate,), dim=2)


@custom_op("lightning_attention", mutates_args=())
def lightning_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope_rate: torch.Tensor,
                        block_size: int, tile_tokens: int) -> torch.Tensor:
    """Lightning attention's output [B, H, S, Dv] from a zero state (HF's block loop)."""
    return _run_tiled(q, k, v, slope_rate, block_size, tile_tokens)[0]


@custom_op("lightning_attention_with_state", mutates_args=())
def lightning_attention_with_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope_rate: torch.Tensor,
                                   block_size: int, tile_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state [B, H, Dk, Dv]) of lightning attention from a zero state."""
    out, state = _run_tiled(q, k, v, slope_rate, block_size, tile_tokens)
    return out, state


@custom_op("lightning_attention_backward", mutates_args=())
def lightning_attention_backward(grad_out: torch.Tensor, grad_state: torch.Tensor | None, q: torch.Tensor,
                                 k: torch.Tensor, v: torch.Tensor, slope_rate: torch.Tensor,
                                 block_size: int, tile_tokens: int) -> list[torch.Tensor]:
    """Gradients of (q, k, v, slope_rate): the loop re-run under autograd, tile by tile."""
    gq, gk, gv, _, g_rate = gradients_in_tiles(_loop(block_size), [q, k, v], None,
                                               tile_bounds(q.shape[2], tile_tokens, block_size), grad_out, grad_state,
                                               shared=(slope_rate,), dim=2)
    return [gq, gk, gv, g_rate]


def _fake_out(q, v):
    return v.new_empty((*q.shape[:-1], v.shape[-1]))


@lightning_attention.register_fake
def _lightning_attention_fake(q, k, v, slope_rate, *constants):
    return _fake_out(q, v)


@lightning_attention_with_state.register_fake
def _lightning_attention_with_state_fake(q, k, v, slope_rate, *constants):
    return _fake_out(q, v), v.new_empty((q.shape[0], q.shape[1], k.shape[-1], v.shape[-1]))


@lightning_attention_backward.register_fake
def _lightning_attention_backward_fake(grad_out, grad_state, q, k, v, slope_rate, *constants):
    return [t.new_empty(t.shape) for t in (q, k, v, slope_rate)]


register_rerun_autograd(lightning_attention, lightning_attention_with_state, lightning_attention_backward, tensors=4)


def _is_lightning_class(cls: object) -> bool:
    """A module class defining HF's lightning-attention methods, beside HF's padding mask in its modeling module."""
    return (isinstance(cls, type) and issubclass(cls, torch.nn.Module)
            and all(callable(getattr(cls, name, None)) for name in _CLASS_METHODS)
            and callable(getattr(sys.modules.get(cls.__module__), "apply_mask_to_padding_states", None)))


def _holds_lightning_state(module: torch.nn.Module) -> bool:
    """An instance holding what HF's loop reads: the decay buffers, the block size and the projections."""
    return (all(isinstance(getattr(module, name, None), torch.Tensor) for name in _BUFFERS)
            and all(hasattr(module, name) for name in _SUBMODULES)
            and isinstance(getattr(module, "block_size", None), int))


@functools.cache
def _traced_forward(cls: type, hf_forward):
    """HF's lightning-attention forward with its block loop as the `lightning_attention_with_state` op (the output
    and the final state, as HF's forward returns them; the SP pass drops the state where nothing reads it) in
    training (no cache); any other call, or an instance not holding what the loop reads, runs HF's forward. One
    function per class, so Dynamo's guards see the same one at every call."""
    mask_padding = sys.modules[cls.__module__].apply_mask_to_padding_states  # HF's, beside the class

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if cache is not None or kwargs.get("past_key_values") is not None or not _holds_lightning_state(self):
            return hf_forward(self, hidden_states, position_embeddings, attention_mask, cache=cache, **kwargs)
        batch, length, _ = hidden_states.shape
        heads, dim = self.num_attention_heads, self.head_dim
        qkv = self.act_fn(self.qkv_proj(hidden_states))
        qkv = mask_padding(qkv, attention_mask)
        qkv = qkv.reshape(batch, length, heads, 3 * dim)
        q, k, v = (t.transpose(1, 2) for t in torch.split(qkv, dim, dim=3))
        out, state = lightning_attention_with_state(q, k, v, self.slope_rate, self.block_size, 0)
        out = self.norm(out.transpose(1, 2).reshape(batch, length, heads * dim))
        return self.out_proj(F.sigmoid(self.output_gate(hidden_states)) * out), state

    forward._autosp_traced = True
    return forward


def _lightning_classes() -> Iterator[type]:
    """The lightning-attention layer classes defined in the loaded transformers modeling modules."""
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("transformers.models."):
            continue
        for cls in list(vars(module).values()):
            if (_is_lightning_class(cls) and cls.__module__ == module_name
                    and not getattr(cls.forward, "_autosp_traced", False)):
                yield cls


@contextlib.contextmanager
def trace_lightning_attention() -> Iterator[None]:
    """While Dynamo traces, every loaded lightning-attention layer class's forward calls the op for its loop."""
    patched = [(cls, cls.forward) for cls in _lightning_classes()]
    for cls, hf_forward in patched:
        cls.forward = _traced_forward(cls, hf_forward)
    try:
        yield
    finally:
        for cls, hf_forward in patched:
            cls.forward = hf_forward


def _forward_flops(q, v, block_size) -> float:
    """HF's loop per head and block of n tokens: q k^T and its product with v (2 n^2 (Dk + Dv)), the carried state's
    read-out and update (2 n Dk Dv each)."""
    batch, heads, length, dk = q.shape
    dv, block = v.shape[-1], min(block_size, length)
    return float(2 * batch * heads * length * (block * (dk + dv) + 2 * dk * dv))


@declare_cost(op("lightning_attention"))
@declare_cost(op("lightning_attention_with_state"))
def _lightning_attention_cost(q, k, v, slope_rate, block_size, tile_tokens):
    return "matmul", _forward_flops(q, v, block_size)


@declare_cost(op("lightning_attention_backward"))
def _lightning_attention_backward_cost(grad_out, grad_state, q, k, v, slope_rate, block_size, tile_tokens):
    return "matmul", rerun_backward_factor(q.shape[2], tile_tokens, block_size) * _forward_flops(q, v, block_size)


def _tile_length(q, block_size, tile_tokens) -> int:
    tile = tile_bounds(q.shape[2], tile_tokens, block_size)[0]
    return tile.stop - tile.start


def _scratch(q, v, block_size, length) -> int:
    """The loop's intermediates alive together over `length` tokens (a tile's), per head: the blocks' outputs until
    their concatenation ([L, Dv]), one block's scores, decayed scores and decays ([n, n] each) and its decayed queries
    and keys ([n, Dk] each)."""
    batch, heads, _, dk = q.shape
    block = min(block_size, length)
    return v.element_size() * batch * heads * (length * v.shape[-1] + 3 * block * block + 2 * block * dk)


def _backward_scratch(q, v, block_size, length) -> int:
    """The re-run loop's values autograd keeps over `length` tokens (a tile's), per head and block of n: its scores
    and decayed scores ([n, n] each), decayed queries and keys ([n, Dk] each) and carried state ([Dk, Dv]); the re-run
    output and a slice's full-length gradient ([L, Dv] and [L, Dk]); the block decays made with their autograd (3
    [n, n]). Measured: `python -m tests.experiments.recurrence_scratch_check`."""
    batch, heads, _, dk = q.shape
    dv, block = v.shape[-1], min(block_size, length)
    blocks = -(-length // block)
    per_head = blocks * (2 * block * block + 2 * block * dk + dk * dv) + length * (dk + dv) + 3 * block * block
    return v.element_size() * batch * heads * per_head


@declare_transient_bytes(op("lightning_attention"))
@declare_transient_bytes(op("lightning_attention_with_state"))
def _lightning_attention_scratch(q, k, v, slope_rate, block_size, tile_tokens):
    # tiled, a tile's concatenated output is not the op's: it lives until copied into the whole
    length = _tile_length(q, block_size, tile_tokens)
    piece = v.element_size() * q.shape[0] * q.shape[1] * length * v.shape[-1] if length < q.shape[2] else 0
    return _scratch(q, v, block_size, length) + piece


@declare_transient_bytes(op("lightning_attention_backward"))
def _lightning_attention_backward_scratch(grad_out, grad_state, q, k, v, slope_rate, block_size, tile_tokens):
    # tiled, the states entering the tiles and a tile's input gradients with their contiguous copies
    tiles = len(tile_bounds(q.shape[2], tile_tokens, block_size))
    states = v.element_size() * q.shape[0] * q.shape[1] * k.shape[-1] * v.shape[-1] * (tiles - 1)
    return (_backward_scratch(q, v, block_size, _tile_length(q, block_size, tile_tokens)) + states
            + tile_copies(sum(map(nbytes, (q, k, v))), q.shape[2], tile_tokens, block_size))
