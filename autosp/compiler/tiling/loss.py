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

import dataclasses
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

from autosp.comm.library import op
from autosp.compiler.fx import DYNAMO, dynamo_value, eliminate_dead_code, emit
from autosp.compiler.tiling import loss_op as tiled_loss_op  # noqa: F401  (defines the op the pass emits)
from autosp.compiler.tiling.mlp import MIN_TILE_TOKENS, tile_token_wise_blocks
from autosp.compiler.tiling.norm import fuse_rms_norms
from autosp.errors import ConfigError

logger = logging.getLogger("autosp")

_LINEARS = {torch._C._nn.linear, F.linear}
_CASTS = {"float", "to", "type"}
_VIEWS = {"view", "reshape", "flatten"}


# ------------------------------------------------------------------------------------------- the options


@dataclass(frozen=True)
class Tiling:
    """A parsed `tiling=` value: what to tile, and the tile size in tokens (None: chosen per graph)."""

    loss: bool = False
    mlp: bool = False
    norm: bool = False  # RMSNorms as `autosp_sp::rms_norm`, their fp32 values one chunk of tokens at a time
    #: the recurrences' kernels over tiles of the tokens, their state carried (`autosp.compiler.sp.tile_recurrences`,
    #: which the driver runs beside this pass: the recurrences are the SP stage's ops)
    recurrence: bool = False
    #: only the norms that upcast a 16-bit hidden state (`auto`): an fp32 model has no upcast copy to save, and its
    #: peak was higher fused (docs/measurements/2026-12-02-layer-backward.md)
    norm_upcasts_only: bool = False
    tile_tokens: int | None = None
    #: the memory planner's lever where a tiled graph still does not fit (`pipeline.compile_static`): each token-wise
    #: block's tiles halved this many times (`mlp.tile_token_wise_blocks`)
    mlp_halvings: int = 0
    #: `plan`: nothing tiled unless the memory planner finds the graph does not fit untiled; then tiled as `auto`
    #: (`when_tight`)
    planned: bool = False

    @property
    def enabled(self) -> bool:
        return self.loss or self.mlp or self.norm or self.recurrence

    def when_tight(self) -> Tiling:
        """What `plan` tiles where the graph does not fit untiled: `auto` (its tile size, if one was given)."""
        return dataclasses.replace(parse_tiling("auto"), tile_tokens=self.tile_tokens)


KINDS = ("loss", "mlp", "norm", "recurrence")


def parse_tiling(value: str | Tiling | None) -> Tiling:
    """`off`, or a comma-separated subset of `loss`, `mlp`, `norm`, `recurrence`, or `auto` (= all four, the norms only
    where they upcast a 16-bit hidden state), or `plan` (`auto` where the memory planner needs it, `Tiling.planned`),
    optionally `:<tokens per tile>` (e.g. `auto:1024`)."""
    if isinstance(value, Tiling):
        return value
    text = "off" if value is None else str(value).strip().lower()
    kind, _, size = text.partition(":")
    tile_tokens = None
    if size:
        if not size.isdigit() or int(size) < 1:
            raise ConfigError(
                f"tiling {value!r}: the tile size after ':' must be a positive token count, e.g. loss:1024")
        tile_tokens = int(size)
    if kind == "off" and not size:
        return Tiling()
    if kind == "plan":
        return Tiling(planned=True, tile_tokens=tile_tokens)
    kinds = set(KINDS) if kind == "auto" else set(kind.split(","))
    if not kinds or not kinds <= set(KINDS):
        raise ConfigError(
            f"unknown tiling {value!r}; choose off, plan, auto, or some of loss, mlp, norm, recurrence separated by "
            "commas "
            "(optionally :<tokens per tile>)"
        )
    return Tiling(loss="loss" in kinds, mlp="mlp" in kinds, norm="norm" in kinds, recurrence="recurrence" in kinds,
                  norm_upcasts_only=kind == "auto", tile_tokens=tile_tokens)


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
    norms: list[dict[str, Any]] = field(default_factory=list)  # fused RMSNorms: module, tokens, chunk_tokens
    #: tiled recurrences (gated delta rules, SSD scans, lightning attention): module, tokens, tile_tokens
    recurrences: list[dict[str, Any]] = field(default_factory=list)

    @property
    def halvable(self) -> bool:
        """Whether a token-wise block's tiles can be halved once more (`Tiling.mlp_halvings`)."""
        return any(block["tile_tokens"] > MIN_TILE_TOKENS for block in self.mlp)


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


def _find_head(ce_input: fx.Node, output: fx.Node) -> _Head | str:
    """The LM head feeding `ce_input`, or the reason it cannot be tiled."""
    steps: list[fx.Node] = []
    node = ce_input
    dtype = dynamo_value(ce_input).dtype
    below = ce_input  # the chain node consuming `node`
    while not (node.op == "call_function" and node.target in _LINEARS):
        if len(node.users) != 1:
            return f"{node.name} (between the head and the loss) has other users"
        if _cast_dtype(node) is not None or _is_method(node, {"contiguous"}):
            pass
        elif _is_method(node, _VIEWS) or node.target in (torch.reshape, torch.flatten):
            steps.append(node)
        elif node.target is operator.getitem and _keeps_last_dim(node.args[1], dynamo_value(node.args[0]).dim()):
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
    if dtype not in (torch.float32, dynamo_value(linear).dtype):
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
        node = emit(graph, step.target, tuple(args), dict(step.kwargs), key=DYNAMO)
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
        vocab, hidden_size = dynamo_value(head.linear).shape[-1], dynamo_value(head.linear.args[0]).shape[-1]
        with graph.inserting_before(ce):
            hidden = _hidden_through(graph, head, vocab, hidden_size)
            tokens = dynamo_value(hidden).shape[0]
            tile_tokens = tiling.tile_tokens or auto_tile_tokens(tokens, hidden_size, vocab)
            weight = head.linear.args[1]
            with_grads = dynamo_value(hidden).requires_grad or dynamo_value(weight).requires_grad
            fused = emit(graph, op("linear_cross_entropy").default,
                                  (hidden, weight, bound["target"], bound.get("ignore_index", -100), head.dtype,
                                   tile_tokens, with_grads), key=DYNAMO)
            loss = emit(graph, operator.getitem, (fused, 0), key=DYNAMO)
            if bound.get("reduction", "mean") == "mean":
                valid = emit(graph, torch.ne, (bound["target"], bound.get("ignore_index", -100)), key=DYNAMO)
                count = emit(graph, torch.sum, (valid,), key=DYNAMO)
                loss = emit(graph, torch.div, (loss, count), key=DYNAMO)
        ce.replace_all_uses_with(loss)  # the head, its casts/views and the loss are dead now
        report.tiled.append({"tokens": int(tokens), "vocab": int(vocab), "tile_tokens": int(tile_tokens)})
    eliminate_dead_code(graph)
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
    if dynamo_value(bound["input"]).dim() != 2 or not isinstance(bound["target"], fx.Node):
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
    eliminate_dead_code(graph)
    gm.recompile()
    return True


def apply_tiling(gm: fx.GraphModule, tiling: Tiling, *, loss_only: bool) -> TilingReport:
    """The backend's entry: drop the outputs the caller does not want, then tile; logs one line when a loss
    asked to be tiled stays whole, with the reason."""
    if loss_only:
        keep_only_loss(gm)
    report = tile_loss(gm, tiling)
    if tiling.norm:
        report.norms = fuse_rms_norms(gm, tiling.tile_tokens, upcasts_only=tiling.norm_upcasts_only)
    if tiling.mlp:
        report.mlp = tile_token_wise_blocks(gm, tiling.tile_tokens, halvings=tiling.mlp_halvings)
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
    norms = [n for r in reports for n in r.norms]
    if norms:
        parts.append(f"{len(norms)} RMSNorms in chunks of {norms[0]['chunk_tokens']} tokens")
    recurrences = [n for r in reports for n in r.recurrences]
    if recurrences:
        parts.append(f"{len(recurrences)} recurrences tiled ({recurrences[0]['module']}: {recurrences[0]['tokens']} "
                     f"tokens in tiles of {recurrences[0]['tile_tokens']})")
    return "; ".join(parts) or "nothing tiled"
