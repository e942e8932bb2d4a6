"""Tiling: the LM head + cross-entropy computed over tiles of the (local) tokens, with its gradients, in forward.

Past a few thousand tokens the largest tensors of a training step are not the saved activations but the loss's
working set: the logits over the vocabulary for every local token, their fp32 copy, the log-softmax and its
gradient (Llama-3: ~0.5 MB per token in fp32). None of it needs to exist whole: the loss is a sum over tokens.

`tile_loss` finds, in Dynamo's Torch-IR graph (after the SP pass), a projection `linear(hidden, W)` whose only
consumer is a token-wise `F.cross_entropy` (through casts, views/reshapes that keep the vocabulary as the last
dim, and slices of the token dims: the project Llama and HF's ForCausalLMLoss), and replaces the chain with one
opaque op, `autosp_sp::linear_cross_entropy(hidden, W, target)`: tile by tile it makes the logits once, adds their
loss, turns them into their gradient in place and accumulates dhidden/dW for an upstream gradient of 1 (as
Liger's fused linear cross-entropy); backward only scales those by the loss's gradient. So no logits are made
twice (recomputing them in backward cost ~6% of a step's FLOPs on `small` at 1K tokens), and the step keeps dhidden
([tokens, hidden], the size of the hidden states an untiled head would keep) and the fp32 dW (which backward
makes anyway) from the loss to the start of backward. Being an opaque custom op, it survives aot_autograd, the
SAC partitioner (which cannot recompute it: its outputs are saved) and inductor unchanged; at no time are more
than one tile's logits (and their gradient) alive.

A model that returns its logits needs them whole, so there is nothing to tile unless the caller says it does
not want them (`autosp.compile(..., outputs="loss")`, which returns None for every output but the loss).
"""
from __future__ import annotations

import inspect
import logging
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

from autosp.comm.library import custom_op, op
from autosp.comm.transients import declare_transient_bytes, nbytes, numel
from autosp.compiler import fx_nodes
from autosp.compiler.fx_nodes import DYNAMO
from autosp.errors import ConfigError

logger = logging.getLogger("autosp")

#: fewest tokens per tile: below this a [T, d] x [d, V] matmul stops using the hardware well
MIN_TILE_TOKENS = 256
_LINEARS = {torch._C._nn.linear, F.linear}
_CASTS = {"float", "to", "type"}
_VIEWS = {"view", "reshape", "flatten"}


# ------------------------------------------------------------------------------------------------ the ops


def _tiles(num_tokens: int, tile_tokens: int) -> range:
    return range(0, num_tokens, max(1, tile_tokens))


def _tile_logits(hidden: Tensor, weight: Tensor, start: int, tile_tokens: int, dtype: torch.dtype) -> Tensor:
    return (hidden[start:start + tile_tokens] @ weight.t()).to(dtype)


def tiled_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum over tokens of cross_entropy((hidden @ weight.T).to(dtype), target), its gradients d hidden and d weight
    for an upstream gradient of 1): hidden [N, d], target [N]. One pass: each tile's logits are made once, give
    their loss (logsumexp - target logit, in fp32) and are turned into their gradient in place (softmax - one_hot);
    dW accumulates in fp32. Computing the gradients here, not in backward, means no tile's logits are ever made
    twice: tiling costs no extra FLOPs (backward only scales them by the loss's gradient). Without `with_grads`
    (nothing to differentiate) the gradients are empty."""
    total = hidden.new_zeros((), dtype=torch.float32)
    grad_hidden = torch.empty_like(hidden) if with_grads else hidden.new_empty(0)
    grad_weight = torch.zeros_like(weight, dtype=torch.float32) if with_grads else weight.new_empty(0, dtype=torch.float32)
    head = weight.to(hidden.dtype)
    for start in _tiles(hidden.shape[0], tile_tokens):
        tile_target = target[start:start + tile_tokens]
        logits = _tile_logits(hidden, weight, start, tile_tokens, dtype)
        logits = logits.float() if logits.dtype != torch.float32 else logits
        valid = tile_target != ignore_index
        rows = torch.arange(tile_target.shape[0], device=logits.device)
        picked = tile_target.clamp(min=0) * valid
        log_normalizer = torch.logsumexp(logits, dim=-1, keepdim=True)
        total += ((log_normalizer.squeeze(-1) - logits[rows, picked]) * valid).sum()
        if not with_grads:
            continue
        logits.sub_(log_normalizer).exp_()  # softmax, in place
        del log_normalizer
        logits[rows, picked] -= valid.to(logits.dtype)
        logits.mul_(valid.to(logits.dtype).unsqueeze(-1))
        grad_logits = logits.to(hidden.dtype)
        del logits
        torch.mm(grad_logits, head, out=grad_hidden[start:start + tile_tokens])
        grad_weight.addmm_(grad_logits.t().float(), hidden[start:start + tile_tokens].float())
        del grad_logits
    return total.to(dtype), grad_hidden, grad_weight


@custom_op("linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
    with_grads: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    return tiled_cross_entropy(hidden, weight, target, ignore_index, dtype, tile_tokens, with_grads)


@linear_cross_entropy.register_fake
def _(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype, tile_tokens: int,
      with_grads: bool) -> tuple[Tensor, Tensor, Tensor]:
    if not with_grads:
        return hidden.new_empty((), dtype=dtype), hidden.new_empty(0), weight.new_empty(0, dtype=torch.float32)
    return (hidden.new_empty((), dtype=dtype), torch.empty_like(hidden),
            torch.empty_like(weight, dtype=torch.float32))


def _tile_elements(hidden: Tensor, weight: Tensor, tile_tokens: int) -> int:
    return min(numel(hidden) // hidden.shape[-1], tile_tokens) * weight.shape[0]


@declare_transient_bytes(op("linear_cross_entropy"))
def _scratch(hidden: Tensor, weight: Tensor, target: Tensor, ignore_index: int, dtype: torch.dtype,
             tile_tokens: int, with_grads: bool) -> int:
    """One tile's fp32 logits and logsumexp's temporary of their size (8 bytes per logit: every other moment of
    a tile, the matmul result and its casts, holds at most as many), plus the weight in the hidden dtype when that
    is not the weight itself. The gradients are the op's outputs, counted as such."""
    recast = nbytes(weight) // weight.element_size() * hidden.element_size() if weight.dtype != hidden.dtype else 0
    return _tile_elements(hidden, weight, tile_tokens) * 8 + recast


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    _, grad_hidden, grad_weight = output
    ctx.save_for_backward(grad_hidden, grad_weight)
    ctx.weight_dtype = inputs[1].dtype


def _backward(ctx: Any, grad: Tensor, *_unused: Any) -> tuple:
    """The gradients were made in forward for an upstream gradient of 1: scale them by the loss's gradient."""
    grad_hidden, grad_weight = ctx.saved_tensors
    return (grad_hidden * grad.to(grad_hidden.dtype), (grad_weight * grad.float()).to(ctx.weight_dtype),
            None, None, None, None, None)


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class Tiling:
    """A parsed `tiling=` value: what to tile, and the tile size in tokens (None: chosen per graph)."""

    loss: bool = False
    mlp: bool = False
    tile_tokens: int | None = None

    @property
    def enabled(self) -> bool:
        return self.loss or self.mlp


def parse_tiling(value: "str | Tiling | None") -> Tiling:
    """`off | loss | mlp | loss,mlp | auto` (= loss,mlp), optionally `:<tokens per tile>` (e.g. `auto:1024`)."""
    if isinstance(value, Tiling):
        return value
    text = "off" if value is None else str(value).strip().lower()
    kind, _, size = text.partition(":")
    tile_tokens = None
    if size:
        if not size.isdigit() or int(size) < 1:
            raise ConfigError(f"tiling {value!r}: the tile size after ':' must be a positive token count, e.g. loss:1024")
        tile_tokens = int(size)
    if kind == "off" and not size:
        return Tiling()
    kinds = {"loss", "mlp"} if kind == "auto" else set(kind.split(","))
    if not kinds or not kinds <= {"loss", "mlp"}:
        raise ConfigError(
            f"unknown tiling {value!r}; choose off, loss, mlp, loss,mlp or auto (optionally :<tokens per tile>)"
        )
    return Tiling(loss="loss" in kinds, mlp="mlp" in kinds, tile_tokens=tile_tokens)


OUTPUTS = ("all", "loss")


def check_outputs(outputs: str) -> str:
    if outputs not in OUTPUTS:
        raise ConfigError(f"outputs={outputs!r}: choose 'all' (the model's outputs) or 'loss' (only the loss)")
    return outputs


def auto_tile_tokens(num_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per loss tile: the tile's logits no larger than the hidden states feeding the head (which the step
    holds anyway), but at least MIN_TILE_TOKENS so each tile's matmul stays efficient."""
    rows = math.ceil(num_tokens * hidden_size / vocab_size)
    return max(1, min(num_tokens, max(MIN_TILE_TOKENS, rows)))


# --------------------------------------------------------------------------------------------- the pass


@dataclass
class TilingReport:
    """What `tile_loss` did to one graph: tiled heads (tokens, vocab, tokens per tile) and why others were not."""

    tiled: list[dict[str, int]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    mlp: list[dict[str, Any]] = field(default_factory=list)  # token-wise blocks: module, tokens, tile_tokens


def _is_method(node: fx.Node, names: set[str]) -> bool:
    return node.op == "call_method" and node.target in names


def _cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype a cast node casts to (None: not a cast, or not one this pass follows)."""
    if not _is_method(node, _CASTS):
        return None
    if node.target == "float":
        return torch.float32
    for arg in (*node.args[1:], node.kwargs.get("dtype")):
        if isinstance(arg, torch.dtype):
            return arg
    return None


def _value(node: Any) -> Any:
    return fx_nodes.fake_value(node, DYNAMO)


def _keeps_last_dim(index: Any, ndim: int) -> bool:
    """A getitem index that slices/selects only leading (token) dims."""
    index = index if isinstance(index, tuple) else (index,)
    if any(i is None for i in index):
        return False
    if Ellipsis in index:
        return index[-1] is Ellipsis or index[-1] == slice(None)
    return len(index) < ndim or index[-1] == slice(None)


@dataclass
class _Head:
    linear: fx.Node
    steps: list[fx.Node]  # token-wise shape ops between the head and the loss, in program order
    dtype: torch.dtype  # the loss's input dtype (after casts)


def _find_head(ce_input: fx.Node, output: fx.Node) -> "_Head | str":
    """The LM head feeding `ce_input`, or the reason it cannot be tiled."""
    steps: list[fx.Node] = []
    node = ce_input
    dtype = _value(ce_input).dtype
    below = ce_input  # the chain node consuming `node`
    while not (node.op == "call_function" and node.target in _LINEARS):
        if len(node.users) != 1:
            return f"{node.name} (between the head and the loss) has other users"
        if _cast_dtype(node) is not None or _is_method(node, {"contiguous"}):
            pass
        elif _is_method(node, _VIEWS) or node.target in (torch.reshape, torch.flatten):
            steps.append(node)
        elif node.target is operator.getitem and _keeps_last_dim(node.args[1], _value(node.args[0]).dim()):
            steps.append(node)
        else:
            return f"the loss input comes from {node.name} ({node.target}), not a linear LM head"
        if not isinstance(node.args[0], fx.Node):
            return f"{node.name} has no tensor input"
        below, node = node, node.args[0]
    linear = node
    bias = linear.args[2] if len(linear.args) > 2 else linear.kwargs.get("bias")
    if bias is not None:
        return f"the head {linear.name} has a bias"
    others = [u for u in linear.users if u is not below]
    if others:
        if others == [output]:
            return "the model returns its logits; compile with outputs='loss' to let AutoSP tile the loss"
        return f"the logits {linear.name} have other users ({', '.join(u.name for u in others)})"
    if dtype not in (torch.float32, _value(linear).dtype):
        return f"the loss runs in {dtype}, a cast this pass does not follow"
    return _Head(linear, list(reversed(steps)), dtype)


def _hidden_through(graph: fx.Graph, head: _Head, vocab: int, hidden_size: int) -> fx.Node:
    """Replay the token-wise shape ops on the head's input (vocabulary dim -> hidden dim)."""
    node = head.linear.args[0]
    for step in head.steps:
        args = list(step.args)
        args[0] = node
        if step.target is not operator.getitem and args[-1] == vocab:
            args[-1] = hidden_size
        node = fx_nodes.emit(graph, step.target, tuple(args), dict(step.kwargs), key=DYNAMO)
    return node


def tile_loss(gm: fx.GraphModule, tiling: Tiling) -> TilingReport:
    """Rewrite every tileable LM head + cross-entropy of `gm` into `autosp_sp::linear_cross_entropy` (in place)."""
    report = TilingReport()
    if not tiling.loss:
        return report
    graph = gm.graph
    (output,) = [n for n in graph.nodes if n.op == "output"]
    for ce in [n for n in graph.nodes if n.op == "call_function" and n.target is F.cross_entropy]:
        reason, bound = _loss_arguments(ce)
        if reason is None:
            head = _find_head(bound["input"], output)
            reason = head if isinstance(head, str) else None
        if reason is not None:
            report.skipped.append(f"{ce.name}: {reason}")
            continue
        vocab, hidden_size = _value(head.linear).shape[-1], _value(head.linear.args[0]).shape[-1]
        with graph.inserting_before(ce):
            hidden = _hidden_through(graph, head, vocab, hidden_size)
            tokens = _value(hidden).shape[0]
            tile_tokens = tiling.tile_tokens or auto_tile_tokens(tokens, hidden_size, vocab)
            weight = head.linear.args[1]
            with_grads = _value(hidden).requires_grad or _value(weight).requires_grad
            fused = fx_nodes.emit(graph, op("linear_cross_entropy").default,
                                  (hidden, weight, bound["target"], bound.get("ignore_index", -100), head.dtype,
                                   tile_tokens, with_grads), key=DYNAMO)
            loss = fx_nodes.emit(graph, operator.getitem, (fused, 0), key=DYNAMO)
            if bound.get("reduction", "mean") == "mean":
                valid = fx_nodes.emit(graph, torch.ne, (bound["target"], bound.get("ignore_index", -100)), key=DYNAMO)
                count = fx_nodes.emit(graph, torch.sum, (valid,), key=DYNAMO)
                loss = fx_nodes.emit(graph, torch.div, (loss, count), key=DYNAMO)
        ce.replace_all_uses_with(loss)  # the head, its casts/views and the loss are dead now
        report.tiled.append({"tokens": int(tokens), "vocab": int(vocab), "tile_tokens": int(tile_tokens)})
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return report


def _loss_arguments(ce: fx.Node) -> tuple[str | None, dict]:
    """(reason the cross-entropy is not a plain token mean/sum or None, its bound arguments)."""
    bound = dict(inspect.signature(F.cross_entropy).bind(*ce.args, **ce.kwargs).arguments)
    if bound.get("weight") is not None or bound.get("label_smoothing", 0.0):
        return "class weights / label smoothing", bound
    if bound.get("reduction", "mean") not in ("sum", "mean") or any(
        bound.get(k) is not None for k in ("size_average", "reduce")
    ):
        return f"reduction {bound.get('reduction')!r}", bound
    if _value(bound["input"]).dim() != 2 or not isinstance(bound["target"], fx.Node):
        return "the loss input is not [tokens, classes]", bound
    return None, bound


def _is_loss(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (F.cross_entropy, op("linear_cross_entropy").default)


def keep_only_loss(gm: fx.GraphModule) -> bool:
    """`outputs="loss"`: every graph output that does not depend on a cross-entropy becomes None, so the logits
    (and anything else only returned) need not outlive the forward. False (graph unchanged) without a loss."""
    graph = gm.graph
    losses = {n for n in graph.nodes if _is_loss(n)}
    if not losses:
        return False
    (output,) = [n for n in graph.nodes if n.op == "output"]
    depends: dict[fx.Node, bool] = {}
    for node in graph.nodes:
        depends[node] = node in losses or any(depends.get(a, False) for a in node.all_input_nodes)

    def keep(value: Any) -> Any:
        if isinstance(value, (tuple, list)):
            return type(value)(keep(v) for v in value)
        return value if not isinstance(value, fx.Node) or depends[value] else None

    output.args = (keep(output.args[0]),)
    graph.eliminate_dead_code()
    gm.recompile()
    return True


def apply_tiling(gm: fx.GraphModule, tiling: Tiling, *, loss_only: bool) -> TilingReport:
    """The backend's entry: drop the outputs the caller does not want, then tile; logs one line when a loss
    asked to be tiled stays whole, with the reason."""
    if loss_only:
        keep_only_loss(gm)
    report = tile_loss(gm, tiling)
    if tiling.mlp:
        report.mlp = tile_token_wise_blocks(gm, tiling.tile_tokens)
    if report.skipped:
        logger.warning("AutoSP: %s", describe([report]))
    return report


def describe(reports: Sequence[TilingReport]) -> str:
    """One line: what was tiled, and why the rest was not."""
    tiled = [t for r in reports for t in r.tiled]
    skipped = [s for r in reports for s in r.skipped]
    blocks = [b for r in reports for b in r.mlp]
    parts = [f"loss tiled over {t['tokens']} tokens in tiles of {t['tile_tokens']}" for t in tiled]
    parts += [f"loss not tiled: {s}" for s in skipped]
    if blocks:
        parts.append(f"{len(blocks)} token-wise blocks tiled ({blocks[0]['module']}: {blocks[0]['tokens']} tokens "
                     f"in tiles of {blocks[0]['tile_tokens']})")
    return "; ".join(parts) or "nothing tiled"


# ------------------------------------------------------------------------------ token-wise blocks (MLP)

#: ops that act on each token independently (feature-dim matmuls, elementwise): a module made only of these
#: can run over token tiles with identical results
_TOKEN_WISE_FUNCTIONS = {
    torch._C._nn.linear, F.linear, F.silu, F.gelu, F.relu, F.sigmoid, torch.sigmoid, torch.tanh, torch.nn.functional.tanh,
    operator.mul, operator.add, operator.sub, torch.mul, torch.add, torch.sub,
}
_TOKEN_WISE_METHODS = {"mul", "add", "sub", "sigmoid", "tanh", "relu"}


def _is_token_wise(node: fx.Node) -> bool:
    if node.op == "call_function":
        return node.target in _TOKEN_WISE_FUNCTIONS
    return node.op == "call_method" and node.target in _TOKEN_WISE_METHODS


def _module_regions(graph: fx.Graph) -> dict[str, list[fx.Node]]:
    """Ops of each module call, by module path (every level of Dynamo's nn_module_stack), in program order
    (the module's lifted parameters, placeholders, are its inputs, not its ops)."""
    regions: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        for path, _cls in (node.meta.get("nn_module_stack") or {}).values():
            regions.setdefault(str(path), []).append(node)
    return regions


@dataclass
class _Block:
    path: str
    nodes: list[fx.Node]
    source: fx.Node  # the one activation entering the block, [..., tokens, features]
    result: fx.Node  # the one value leaving it
    weights: list[fx.Node]  # ops inside the module that make its weights from parameters only (run once)


def _weight_ops(nodes: list[fx.Node]) -> list[fx.Node]:
    """Ops of a module call that read parameters only (graph inputs) or each other: the ZeRO-2/3 gather of a
    sharded weight, a mixed-precision cast. They do not touch the tokens, so they run once, before the tiles."""
    weights: list[fx.Node] = []
    for node in nodes:
        if all(arg.op == "placeholder" or arg in weights for arg in node.all_input_nodes):
            weights.append(node)
    return weights


def _token_wise_block(path: str, nodes: list[fx.Node]) -> _Block | None:
    """The module call as a tileable block: only token-wise ops on the tokens (weights made from parameters
    aside), one activation in, one value out, and an intermediate larger than its input (else tiling saves
    nothing)."""
    weights = _weight_ops(nodes)
    nodes = [n for n in nodes if n not in weights]
    if not nodes:
        return None
    inside = set(nodes) | set(weights)
    if not all(_is_token_wise(n) for n in nodes):
        return None
    sources = set()
    for node in nodes:
        weight = node.args[1] if node.target in (torch._C._nn.linear, F.linear) and len(node.args) > 1 else None
        for arg in node.all_input_nodes:
            if arg not in inside and arg is not weight and not (
                node.target in (torch._C._nn.linear, F.linear) and arg in node.args[2:]
            ):
                sources.add(arg)
    leaving = [n for n in nodes if any(u not in inside for u in n.users)]
    if any(u not in inside for w in weights for u in w.users):
        return None  # a weight also used outside the module (tied): left where it is
    if len(sources) != 1 or len(leaving) != 1:
        return None
    (source,), (result,) = sources, leaving
    value, out = _value(source), _value(result)
    if not isinstance(value, Tensor) or not isinstance(out, Tensor) or value.dim() < 2:
        return None
    if out.shape[:-1] != value.shape[:-1] or out.numel() > value.numel() or any(u.op == "output" for u in result.users):
        return None  # a block whose output outgrows its input (an LM head) is whole after the tiles anyway
    biggest = max(_value(n).numel() for n in nodes if isinstance(_value(n), Tensor))
    return _Block(path, nodes, source, result, weights) if biggest > value.numel() else None


def auto_mlp_tile_tokens(num_tokens: int, features: int, intermediate: int) -> int:
    """Tokens per block tile: one tile's intermediate no larger than the block's input, at least MIN_TILE_TOKENS."""
    rows = math.ceil(num_tokens * features / intermediate)
    return max(1, min(num_tokens, max(MIN_TILE_TOKENS, rows)))


def tile_token_wise_blocks(gm: fx.GraphModule, tile_tokens: int | None = None) -> list[dict[str, Any]]:
    """Run each token-wise module call (the MLPs) over tiles of its tokens: split the input along the token dim,
    one copy of the block per tile, concatenate. Copies keep their module metadata, so SAC recomputes them tile
    by tile in backward; the [tokens, intermediate] values never exist whole. Returns what was tiled."""
    graph = gm.graph
    regions = _module_regions(graph)
    blocks = [b for path, nodes in regions.items() if (b := _token_wise_block(path, nodes)) is not None]
    paths = {b.path for b in blocks}
    tiled = []
    for block in blocks:
        if any(block.path.startswith(p + ".") for p in paths):  # the outermost token-wise module tiles
            continue
        source = _value(block.source)
        tokens = source.shape[-2]
        intermediate = max(_value(n).shape[-1] for n in block.nodes if isinstance(_value(n), Tensor))
        size = min(tokens, tile_tokens or auto_mlp_tile_tokens(tokens, source.shape[-1], intermediate))
        if size >= tokens:
            continue
        _tile_block(graph, block, size)
        tiled.append({"module": block.path, "tokens": int(tokens), "tile_tokens": int(size)})
    graph.lint()
    gm.recompile()
    return tiled


def _tile_block(graph: fx.Graph, block: _Block, size: int) -> None:
    meta = block.result.meta

    def emit(target: Any, args: tuple) -> fx.Node:
        node = fx_nodes.emit(graph, target, args, key=DYNAMO)
        node.meta["nn_module_stack"] = meta.get("nn_module_stack")
        return node

    for weight in block.weights:  # made once, ahead of every tile
        block.nodes[0].prepend(weight)
    with graph.inserting_before(block.nodes[0]):
        pieces = emit(torch.split, (block.source, size, -2))
        outputs = []
        for i in range(len(_value(pieces))):
            env = {block.source: emit(operator.getitem, (pieces, i))}
            for node in block.nodes:
                copy = graph.node_copy(node, lambda n: env.get(n, n))
                copy.meta[DYNAMO] = fx_nodes.run_fake(copy, DYNAMO)
                env[node] = copy
            outputs.append(env[block.result])
        joined = emit(torch.cat, (outputs, -2))
    block.result.replace_all_uses_with(joined)
    for node in reversed(block.nodes):
        graph.erase_node(node)
