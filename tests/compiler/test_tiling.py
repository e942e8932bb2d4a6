"""Tiled loss: the LM head + cross-entropy rewritten into tiles is exact (loss and every gradient), never holds
more than one tile's logits, and says why when it leaves a loss whole (single process, aot_eager)."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autosp.compiler.lowering import compile_with_partitioner
from autosp.compiler.memory import make_partition_fn
from autosp.compiler.tiling.loss import (
    MIN_TILE_TOKENS,
    TilingReport,
    apply_tiling,
    auto_tile_tokens,
    parse_tiling,
)
from autosp.compiler.tiling.loss_op import tiled_cross_entropy
from autosp.harness.config import ConfigError
from autosp.models import build_model, get_preset

SEQ = 64


def _batch(vocab: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, 5:20] = -100  # uneven runs of ignored labels across tiles
    labels[1, 40:] = -100
    return ids, labels


def _tiled(model: torch.nn.Module, tiling: str, *, loss_only: bool = True, sac: str = "sac"):
    """(compiled model, tiling reports, [(compiled graph, its example inputs)])."""
    reports: list[TilingReport] = []
    graphs: list = []

    def backend(gm, example_inputs):
        reports.append(apply_tiling(gm, parse_tiling(tiling), loss_only=loss_only))
        graphs.append((compile_with_partitioner(gm, example_inputs, partition_fn=make_partition_fn(sac),
                                                inner="aot_eager"), example_inputs))
        return graphs[-1][0]

    return torch.compile(model, backend=backend, fullgraph=True), reports, graphs


def _eager(name: str, ids: torch.Tensor, labels: torch.Tensor) -> torch.nn.Module:
    reference = build_model(name)
    reference(input_ids=ids, labels=labels).loss.backward()
    return reference


def _assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_tiled_loss_and_mlp_are_exact_on_hf_llama_with_tied_embeddings():
    """HF's ForCausalLMLoss (labels shifted in the graph, logits returned), the head tied to the embedding."""
    ids, labels = _batch()
    reference = _eager("hf:tiny-tied", ids, labels)
    model = build_model("hf:tiny-tied")
    compiled, reports, _ = _tiled(model, "auto:16")
    out = compiled(input_ids=ids, labels=labels)
    out.loss.backward()
    assert reports[0].tiled == [{"tokens": 2 * SEQ, "vocab": 512, "tile_tokens": 16}] and not reports[0].skipped
    assert len(reports[0].mlp) == 2  # the MLPs of both layers (not the LM head: its output is whole anyway)
    assert out.logits is None  # outputs="loss"
    torch.testing.assert_close(out.loss, reference(input_ids=ids, labels=labels).loss, rtol=1e-6, atol=1e-6)
    _assert_same_gradients(model, reference)


# the tiled ops' own code, run under the meter so it sees their inner tensors too
_OP_BODIES = {torch.ops.autosp_sp.linear_cross_entropy.default: tiled_cross_entropy}


class _LiveActivations(TorchDispatchMode):
    """Peak bytes of live per-token tensors of width `features` ([..., features], contiguous in it; tensors
    shaped like a parameter, i.e. weight gradients, excluded), by storage: logits for features = vocab, MLP
    intermediates for features = intermediate_size."""

    def __init__(self, features: int, parameter_shapes: set = frozenset()) -> None:
        super().__init__()
        self.features, self.parameter_shapes, self.live, self.peak = features, parameter_shapes, {}, 0
        self.made = 0  # matmuls whose result is [..., features] (logits for features = vocab)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in _OP_BODIES:
            with self:
                return _OP_BODIES[func](*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.matmul.default, torch.ops.aten.mm.default) and out.shape[-1] == self.features:
            self.made += 1
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == self.features and t.stride(-1) == 1 \
                    and tuple(t.shape) not in self.parameter_shapes:
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        ptr = t.untyped_storage().data_ptr()
        refs, _ = self.live.get(ptr, (0, 0))
        self.live[ptr] = (refs + 1, t.untyped_storage().nbytes())
        weakref.finalize(t, self._release, ptr)
        self.peak = max(self.peak, sum(nbytes for refs, nbytes in self.live.values() if refs > 0))

    def _release(self, ptr: int) -> None:
        refs, nbytes = self.live[ptr]
        self.live[ptr] = (refs - 1, nbytes)


@pytest.mark.parametrize("tiling, bound_tokens", [("loss:16", 16), ("off", None)])
def test_live_logits_at_the_peak_are_at_most_one_tile(tiling, bound_tokens):
    """Counted over forward and backward of the compiled graph (called directly: Dynamo refuses to run under a
    dispatch mode); untiled, all 128 tokens' logits (and their fp32 copies) are alive."""
    ids, labels = _batch()
    compiled, _, graphs = _tiled(build_model("tiny"), tiling)
    compiled(input_ids=ids, labels=labels)  # compiles
    ((graph, example_inputs),) = graphs
    meter = _LiveActivations(features=512)
    with meter:
        (loss,) = [t for t in graph(*example_inputs) if t is not None and t.dim() == 0]
        loss.backward()
    one_tile = 16 * 512 * 4
    if bound_tokens is None:
        assert meter.peak >= 2 * SEQ * 512 * 4  # the meter sees whole logits when nothing is tiled
    else:
        assert 0 < meter.peak <= one_tile
        assert meter.made == 2 * SEQ // bound_tokens  # each tile's logits made once: none recomputed in backward


def test_returned_logits_keep_the_loss_whole_and_say_why(caplog):
    ids, labels = _batch()
    compiled, reports, _ = _tiled(build_model("tiny"), "loss", loss_only=False)
    out = compiled(input_ids=ids, labels=labels)
    assert out.logits is not None and not reports[0].tiled
    assert "outputs='loss'" in reports[0].skipped[0]
    assert "loss not tiled" in caplog.text


def test_tiling_option_and_automatic_tile_size():
    assert parse_tiling("off").enabled is False and parse_tiling(None).enabled is False
    assert parse_tiling("loss:1024").tile_tokens == 1024 and parse_tiling("auto").loss
    assert parse_tiling("auto").recurrence and parse_tiling("recurrence").enabled
    assert not parse_tiling("loss").recurrence
    for bad in ("loss:0", "loss:x", "mlp-ish"):
        with pytest.raises(ConfigError, match="tiling"):
            parse_tiling(bad)
    p = get_preset("llama-3.1-8b")
    # logits of a tile no larger than the hidden states: ~31 tiles for Llama-3's vocabulary / hidden ratio
    assert auto_tile_tokens(65536, p.hidden_size, p.vocab_size) == 2093
    assert auto_tile_tokens(1000, p.hidden_size, p.vocab_size) == MIN_TILE_TOKENS  # efficient matmuls first
    assert auto_tile_tokens(100, p.hidden_size, p.vocab_size) == 100


def test_tiled_mlp_never_holds_a_whole_intermediate():
    """With SAC the MLP is recomputed in backward tile by tile: the live [tokens, intermediate] bytes at the peak
    (forward and backward) shrink by the number of tiles (the same few values, each a tile instead of whole)."""
    ids, labels = _batch()
    reference = _eager("tiny", ids, labels)
    peaks = {}
    for tiling in ("loss", "auto:16"):  # the project Llama, exact with the loss tiled, then the MLPs too
        torch._dynamo.reset()
        model = build_model("tiny")
        compiled, reports, graphs = _tiled(model, tiling)
        compiled(input_ids=ids, labels=labels)
        ((graph, example_inputs),) = graphs
        meter = _LiveActivations(features=176, parameter_shapes={tuple(p.shape) for p in model.parameters()})
        with meter:
            (loss,) = [t for t in graph(*example_inputs) if t is not None and t.dim() == 0]
            loss.backward()
        peaks[tiling] = meter.peak
        _assert_same_gradients(model, reference)
    assert [b["tile_tokens"] for b in reports[0].mlp] == [16, 16]  # both layers' MLPs, 4 tiles each
    assert 0 < peaks["auto:16"] * 4 <= peaks["loss"]


class _Scaled(torch.nn.Module):
    """A weight made inside its module from the parameter (as a ZeRO-3 gather or a mixed-precision cast is)."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * 1.0


def test_mlp_whose_weights_are_made_inside_the_module_is_tiled():
    """The ops that make a weight from parameters run once ahead of the tiles; the MLP is still tiled, exactly."""
    from torch.nn.utils import parametrize

    ids, labels = _batch()
    reference = _eager("tiny", ids, labels)
    model = build_model("tiny")
    for layer in model.model.layers:
        for linear in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            parametrize.register_parametrization(linear, "weight", _Scaled())
    torch._dynamo.reset()
    compiled, reports, _ = _tiled(model, "auto:16")
    compiled(input_ids=ids, labels=labels).loss.backward()
    assert [b["tile_tokens"] for b in reports[0].mlp] == [16, 16]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_dead_code_elimination_keeps_in_place_writes_into_a_buffer_read_later() -> None:
    """FX counts Dynamo's `buf[..., :d].copy_(x)` (a method call whose result nobody reads) as pure and drops it, so
    MLA's key buffer stayed uninitialised after the tiling pass; the compiler's elimination keeps it."""
    import torch.fx as fx

    from autosp.compiler.fx import nodes as fx_nodes

    def fill(x):
        buf = x.new_empty(4)
        buf[:2].copy_(x[:2])
        buf[2:].copy_(x[2:] * 2)
        return buf

    def copies(graph: fx.Graph) -> int:
        return sum(n.op == "call_method" and n.target == "copy_" for n in graph.nodes)

    ours, fx_default = fx.symbolic_trace(fill), fx.symbolic_trace(fill)
    fx_nodes.eliminate_dead_code(ours.graph)
    fx_default.graph.eliminate_dead_code()
    assert copies(ours.graph) == 2 and copies(fx_default.graph) == 0
    ours.recompile()
    assert torch.equal(ours(torch.arange(4.0)), torch.tensor([0.0, 1.0, 4.0, 6.0]))
