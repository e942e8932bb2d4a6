"""FlexAttention's block mask without the dense [B, H, S, S] mask HF builds it through: O(128 x S) at a time.

HF (`create_block_mask`, traced into the graph) evaluates `mask_mod` over every (q, kv) position (a vmap into a
dense bool [B, H, S, S]), pads it to multiples of the block sizes and sums each block (`mask_block_sum`,
[B, H, S/128, S/128]); the block counts/indices the HOP reads are computed from those sums alone. That dense
transient is the same on every rank as in one process (16 GiB at S = 128K, and as much again padded).

This pass replaces the dense region by `autosp_sp::flex_block_sums`, which evaluates the same `mask_mod` (the
HOP's own, with the HOP's own mask buffers) over one block of query rows at a time and sums each block at once:
the same counts, so every block tensor downstream is the one HF builds (the reduction after the sums is kept).
Exact when the dense mask is `mask_mod` over those buffers, which holds for torch's `create_block_mask`: the
BlockMask it returns carries the very mask_mod it evaluated. The pass checks what it can read off the graph: the
dense mask is a vmap output reduced exactly as `_convert_mask_to_block_mask` does, and it depends on nothing but
constants and the HOP's mask buffers. A mask it cannot rebuild stays dense, with a warning naming its cost.
"""
from __future__ import annotations

import copy
import hashlib
import warnings

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor
from torch._functorch import predispatch
from torch._functorch.vmap import lazy_load_decompositions

from autosp.comm.library import custom_op, op
from autosp.compiler.fx.nodes import VMAP_LEVELS
from autosp.compiler.sp.attention.masks import RANDOM
from autosp.compiler.sp.spec import node_label

_FLEX_ATTENTION = torch.ops.higher_order.flex_attention
_PADS = (F.pad, torch._C._nn.pad)
_VMAP_OUTPUT = predispatch._remove_batch_dim  # the vmap ops as Dynamo puts them in its graph
_VMAP_KEYS = tuple(getattr(torch._C.DispatchKey, k) for k in (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched", "FuncTorchVmapMode"))
_MASK_MODS: dict[str, fx.GraphModule] = {}  # by the hash of their code: the op's string argument names one


@custom_op("flex_block_sums", mutates_args=())
def flex_block_sums(buffers: list[Tensor], mask_mod: str, batch: int, heads: int, q_len: int, kv_len: int,
                    q_block: int, kv_block: int, device: torch.device) -> Tensor:
    """[batch, heads, q_len / q_block, kv_len / kv_block] (rounded up): how many (q, kv) of each block `mask_mod`
    keeps, evaluated one block of query rows at a time (what HF's dense mask summed per block holds)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.nn.attention.flex_attention import _vmap_for_bhqkv

    module = _MASK_MODS[mask_mod]
    evaluate = _vmap_for_bhqkv(lambda b, h, q, kv: module(b, h, q, kv, *buffers), prefix=())  # as create_mask
    q_blocks, kv_blocks = -(-q_len // q_block), -(-kv_len // kv_block)
    sums = torch.empty(batch, heads, q_blocks, kv_blocks, dtype=torch.int64, device=device)
    b, h, kv = (torch.arange(n, device=device) for n in (batch, heads, kv_len))
    for i in range(q_blocks):
        q = torch.arange(i * q_block, min((i + 1) * q_block, q_len), device=device)
        with _vmap_enabled(), TransformGetItemToIndex():
            mask = evaluate(b, h, q, kv)
        mask = F.pad(mask, (0, kv_blocks * kv_block - kv_len))
        sums[:, :, i] = mask.view(batch, heads, len(q), kv_blocks, kv_block).sum(dim=(2, 4))
    return sums


def _vmap_enabled() -> torch._C._ForceDispatchKeyGuard:
    """The dispatch keys vmap runs on, which a custom op's body is called with excluded."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _VMAP_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


@flex_block_sums.register_fake
def _(buffers, mask_mod, batch, heads, q_len, kv_len, q_block, kv_block, device):
    return torch.empty(batch, heads, -(-q_len // q_block), -(-kv_len // kv_block), dtype=torch.int64, device=device)


def build_block_masks_by_rows(gm: fx.GraphModule) -> int:
    """Replace each dense mask region feeding a flex HOP's block mask by `flex_block_sums`. Returns the count."""
    rebuilt = 0
    done: set[fx.Node] = set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _FLEX_ATTENTION:
            continue
        block_mask, buffers = node.args[4], tuple(node.args[-1])
        found = _block_sum(block_mask[2], block_mask[-3], block_mask[-2])
        if found is None or found[0] in done:
            continue
        block_sum, mask = found
        module = gm.get_submodule(block_mask[-1].target)
        if not _rebuildable(mask, buffers, module):
            _warn_dense(node, mask)
            done.add(block_sum)
            continue
        key = hashlib.sha256(module.code.encode()).hexdigest()
        _MASK_MODS.setdefault(key, copy.deepcopy(module))  # as it is now, reading the model's heads
        batch, heads, q_len, kv_len = mask.meta["example_value"].shape
        with gm.graph.inserting_before(block_sum):
            sums = gm.graph.call_function(op("flex_block_sums").default,
                                          (list(buffers), key, batch, heads, q_len, kv_len, block_mask[-3],
                                           block_mask[-2], mask.meta["example_value"].device))
        sums.meta.update(block_sum.meta)
        block_sum.replace_all_uses_with(sums)
        done.add(sums)
        _erase_dead(gm, block_sum)
        rebuilt += 1
    _erase_empty_vmap_levels(gm)
    return rebuilt


def _block_sum(start: object, q_block: int, kv_block: int) -> tuple[fx.Node, fx.Node] | None:
    """(the block-sum node, the dense mask it sums) among the ancestors of a block tensor, or None."""
    pending, seen = [start], set()
    while pending:
        node = pending.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if node.target is op("flex_block_sums").default:
            return node, node
        mask = _summed_mask(node, q_block, kv_block)
        if mask is not None:
            return node, mask
        pending.extend(node.all_input_nodes)
    return None


def _summed_mask(node: fx.Node, q_block: int, kv_block: int) -> fx.Node | None:
    """`mask` where `node` is `_convert_mask_to_block_mask`'s `pad(mask).view(..).permute(..).sum([-2, -1])`."""
    dim = node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)
    if node.target != "sum" or not isinstance(dim, (list, tuple)) or list(dim) != [-2, -1]:
        return None
    permute = node.args[0]
    if not isinstance(permute, fx.Node) or permute.target != "permute" or tuple(permute.args[1:]) != (0, 1, 2, 4, 3, 5):
        return None
    view = permute.args[0]
    if not isinstance(view, fx.Node) or view.target != "view" or tuple(view.args[4::2]) != (q_block, kv_block):
        return None
    pad = view.args[0]
    if not isinstance(pad, fx.Node) or pad.target not in _PADS:
        return None
    mask = pad.args[0]
    value = mask.meta.get("example_value") if isinstance(mask, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() != 4:
        return None
    return mask


def _rebuildable(mask: fx.Node, buffers: tuple, module: torch.nn.Module) -> bool:
    """The dense mask is a vmap output computed from constants and the HOP's mask buffers alone, and the mask_mod
    is a self-contained graph (its code is all of it: no attributes or submodules)."""
    if mask.target is not _VMAP_OUTPUT or not isinstance(module, fx.GraphModule) or \
            any(n.op in ("get_attr", "call_module") for n in module.graph.nodes) or \
            sum(n.op == "placeholder" for n in module.graph.nodes) != 4 + len(buffers):
        return False
    pending, seen = [mask], set()
    while pending:
        node = pending.pop()
        if node in seen or node in buffers:
            continue
        seen.add(node)
        if node.op not in ("call_function", "call_method") or not _is_pure(node):
            return False  # an input, attribute, random or in-place value the HOP's mask_mod does not read
        pending.extend(node.all_input_nodes)
    return True


def _is_pure(node: fx.Node) -> bool:
    name = getattr(node.target, "__name__", str(node.target))
    return not any(word in name for word in RANDOM) and not (name.endswith("_") and not name.endswith("__"))


def _warn_dense(attention: fx.Node, mask: fx.Node) -> None:
    value = mask.meta["example_value"]
    warnings.warn(
        f"AutoSP keeps the dense {tuple(value.shape)} torch.bool flex_attention mask that builds the block mask of "
        f"{node_label(attention)}: {value.numel() / 2**20:.1f} MiB per rank, O(S^2) in the sequence length",
        stacklevel=2)


def _erase_dead(gm: fx.GraphModule, start: fx.Node) -> None:
    """Erase `start` and the pure ancestors nothing else uses (the dense region; vmap levels: `_erase_empty`)."""
    pending = [start]
    while pending:
        node = pending.pop()
        if node.users or node.op not in ("call_function", "call_method") or node.target in VMAP_LEVELS or \
                not _is_pure(node):
            continue
        inputs = node.all_input_nodes
        gm.graph.erase_node(node)
        pending.extend(inputs)


def _erase_empty_vmap_levels(gm: fx.GraphModule) -> None:
    """Drop vmap levels entered and left with nothing in between (what erasing a dense region leaves)."""
    changed = True
    while changed:
        changed = False
        levels = [n for n in gm.graph.nodes if n.target in VMAP_LEVELS]
        for enter, leave in zip(levels, levels[1:]):
            if enter.target is VMAP_LEVELS[0] and leave.target is VMAP_LEVELS[1] and \
                    all(n.target is lazy_load_decompositions
                        for n in _between(enter, leave)) and not enter.users and not leave.users:
                gm.graph.erase_node(leave)
                gm.graph.erase_node(enter)
                changed = True
                break


def _between(first: fx.Node, last: fx.Node) -> list[fx.Node]:
    nodes, node = [], first.next
    while node is not last:
        nodes.append(node)
        node = node.next
    return nodes
