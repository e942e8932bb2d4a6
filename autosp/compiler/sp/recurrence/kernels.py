"""HF's module-level recurrence kernels as AutoSP's custom ops while Dynamo traces, so the SP walk finds a
recurrence as one node (recognised by the kernel HF's layers call, not by a pattern of its inlined chunk loop).

`traced_kernels(name, make)` puts `make(module_name, original)` in place of the function `name` of every loaded
`transformers.models.*` module for the duration of the trace; `original(module_name, name)` is HF's function there
(what the ops run). `autograd_inside_op` lets an op's backward re-run HF's kernel under autograd on its saved inputs
(so only the inputs are kept, as a checkpoint would). `run_in_tiles` and `gradients_in_tiles` run a kernel that
takes and returns its state over tiles of the sequence, the state carried from tile to tile, so its intermediates are
one tile's, not the whole sequence's (the state is exact to carry: it is what the SP rewrite exchanges between ranks).
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Callable, Iterator

import torch

from autosp.comm.costs import RERUN_BACKWARD_FACTOR

_ORIGINAL = "_autosp_original_{}"


def contiguous(outputs: tuple) -> tuple:
    """A kernel's outputs laid out as the ops' fake kernels say (contiguous: Inductor asserts their strides)."""
    return tuple(o.contiguous() for o in outputs)


def original(module: str, name: str) -> Callable:
    """HF's kernel `name` of the modeling module `module` (the function the trace replaced, if it did)."""
    loaded = importlib.import_module(module)
    return getattr(loaded, _ORIGINAL.format(name), None) or getattr(loaded, name)


@contextlib.contextmanager
def traced_kernels(name: str, make: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """While Dynamo traces, every loaded transformers modeling module's function `name` is `make(module, original)`
    (which must return the same function for the same arguments, so Dynamo's guards see one global)."""
    patched = []
    for module_name, module in list(sys.modules.items()):
        kernel = getattr(module, name, None) if module_name.startswith("transformers.models.") else None
        if kernel is None or getattr(kernel, "_autosp_traced", False):
            continue
        setattr(module, _ORIGINAL.format(name), kernel)
        setattr(module, name, make(module_name, kernel))
        patched.append((module, kernel))
    try:
        yield
    finally:
        for module, kernel in patched:
            setattr(module, name, kernel)


@contextlib.contextmanager
def autograd_inside_op() -> Iterator[None]:
    """Autograd recording inside a custom op's kernel, which the dispatcher runs with the autograd keys excluded."""
    keys = [torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther]
    excluded = [torch._C._dispatch_tls_is_dispatch_key_excluded(key) for key in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, was in zip(keys, excluded, strict=True):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, was)


def gradients(run: Callable, inputs: list[torch.Tensor | None], grad_outputs: list[torch.Tensor | None]
              ) -> list[torch.Tensor | None]:
    """d(run(*inputs))/d(inputs) against `grad_outputs` (None: that output unused), re-running `run` under autograd;
    None inputs get None, unused ones zeros; contiguous, as the ops' fake kernels say (Inductor asserts strides)."""
    leaves = [None if x is None else x.detach().requires_grad_() for x in inputs]
    with autograd_inside_op(), torch.enable_grad():
        outputs = run(*leaves)
        used = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if g is not None]
        wrt = [x for x in leaves if x is not None]
        result = iter(torch.autograd.grad([o for o, _ in used], wrt, [g for _, g in used], allow_unused=True))
    grads = []
    for x in leaves:
        g = None if x is None else next(result)
        grads.append(None if x is None else x.new_zeros(x.shape) if g is None else g.contiguous())
    return grads


def register_rerun_autograd(output_op, stateful_op, backward_op, tensors: int) -> None:
    """Autograd for a kernel's pair of ops, `output_op(*tensors, *constants) -> out` and `stateful_op(...) -> (out,
    final state)`: the first `tensors` arguments (None allowed) are saved, and `backward_op(grad_out, grad_state,
    *tensors, *constants)` returns the gradients of those given, in order."""

    def setup(ctx, inputs, output):
        ctx.given = [t is not None for t in inputs[:tensors]]
        ctx.save_for_backward(*[t for t in inputs[:tensors] if t is not None])
        ctx.constants = inputs[tensors:]

    def grads(ctx, grad_out, grad_state):
        saved = iter(ctx.saved_tensors)
        given = [next(saved) if g else None for g in ctx.given]
        result = iter(backward_op(grad_out, grad_state, *given, *ctx.constants))
        return (*[next(result) if g else None for g in ctx.given], *[None] * len(ctx.constants))

    output_op.register_autograd(lambda ctx, grad_out: grads(ctx, grad_out, None), setup_context=setup)
    stateful_op.register_autograd(grads, setup_context=setup)


def tile_bounds(length: int, tile_tokens: int, granule: int) -> list[slice]:
    """The sequence [0, length) in tiles of `tile_tokens` rounded up to whole `granule`s (a chunked kernel's chunks,
    so only the last tile is padded); one tile where `tile_tokens` is 0 or covers the length."""
    step = -(-tile_tokens // granule) * granule if tile_tokens > 0 else length
    return [slice(start, min(start + step, length)) for start in range(0, length, max(step, 1))] or [slice(0, length)]


def _along(x: torch.Tensor, dim: int, tile: slice) -> torch.Tensor:
    return x.narrow(dim, tile.start, tile.stop - tile.start)


def run_in_tiles(run: Callable, inputs: list[torch.Tensor], state: torch.Tensor | None, tiles: list[slice],
                 shared: tuple = (), dim: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, final state) of `run(*inputs, state, *shared) -> (output, state)` over `tiles` of dim `dim` (the
    sequence) of every input, the state carried (`shared`: whole in every tile); each tile's output written into one
    output tensor."""
    if len(tiles) == 1:
        return run(*inputs, state, *shared)
    out = None
    for tile in tiles:
        piece, state = run(*[_along(x, dim, tile) for x in inputs], state, *shared)
        if out is None:
            shape = list(piece.shape)
            shape[dim] = inputs[0].shape[dim]
            out = piece.new_empty(shape)
        _along(out, dim, tile).copy_(piece)
    return out, state


def gradients_in_tiles(run: Callable, inputs: list[torch.Tensor], state: torch.Tensor | None, tiles: list[slice],
                       grad_out: torch.Tensor, grad_state: torch.Tensor | None, shared: tuple = (), dim: int = 1
                       ) -> list[torch.Tensor | None]:
    """`gradients` of `run(*inputs, state, *shared) -> (output, state)` w.r.t. (*inputs, state, *shared), tile by
    tile (of dim `dim`) from the last: the states entering the tiles from one sweep without autograd, then each tile
    re-run under autograd from its state, its state's gradient passed to the tile before; `shared` inputs' gradients
    summed."""
    if len(tiles) == 1:
        return gradients(run, [*inputs, state, *shared], [grad_out, grad_state])
    entering = [state]
    with torch.no_grad():
        for tile in tiles[:-1]:
            entering.append(run(*[_along(x, dim, tile) for x in inputs], entering[-1], *shared)[1])
    grads = [x.new_empty(x.shape) for x in inputs]
    summed: list[torch.Tensor | None] = [None if x is None else torch.zeros_like(x) for x in shared]
    carry = grad_state
    for tile, before in zip(reversed(tiles), reversed(entering), strict=True):
        pieces = gradients(run, [*(_along(x, dim, tile) for x in inputs), before, *shared],
                           [_along(grad_out, dim, tile), carry])
        for whole, piece in zip(grads, pieces[:len(inputs)], strict=True):
            _along(whole, dim, tile).copy_(piece)
        carry = pieces[len(inputs)]
        for total, piece in zip(summed, pieces[len(inputs) + 1:], strict=True):
            if total is not None:
                total += piece
    return [*grads, carry, *summed]


def tile_copies(nbytes: int, length: int, tile_tokens: int, granule: int) -> int:
    """Tiled, a tile's share of `nbytes` (of `length` tokens) twice: a tile's output (forward) or its inputs'
    gradients (backward) and their contiguous copies, alive until written into the whole; 0 untiled."""
    tiles = tile_bounds(length, tile_tokens, granule)
    return 0 if len(tiles) == 1 else 2 * nbytes * (tiles[0].stop - tiles[0].start) // length


def rerun_backward_factor(length: int, tile_tokens: int, granule: int) -> float:
    """A re-running backward's FLOPs in forwards: RERUN_BACKWARD_FACTOR, and tiled, the sweep without autograd that
    makes the states entering the tiles (every tile's forward but the last's)."""
    last = tile_bounds(length, tile_tokens, granule)[-1]
    return RERUN_BACKWARD_FACTOR + 1 - (last.stop - last.start) / length
