"""Causal-mask recognition: fires exactly on masks that are `kv <= q`, never on near misses."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import json


from autosp.compiler.sp.attention import masked_attention
from autosp.compiler.fx.sdpa import attention_args, is_attention
from autosp.compiler.sp.attention.masks import express_structured_masks, recognise_causal_masks
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.harness.config import DataConfig
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from tests.compiler.graphs import capture, partitioned

S = 24


class MaskedAttention(nn.Module):
    """One attention whose boolean mask `mask_fn(q_positions, kv_positions)` is built in the graph."""

    def __init__(self, mask_fn):
        super().__init__()
        self.mask_fn = mask_fn
        self.proj = nn.Linear(16, 48)

    def forward(self, x, keep=None):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        pos = torch.arange(s, device=x.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask_fn(pos[:, None], pos[None, :], keep))


def _rewrite(mask_fn, keep=None, device="cpu"):
    model = MaskedAttention(mask_fn).to(device)
    x = torch.randn(2, S, 16, device=device)
    gm, inputs = capture(model, x=x, keep=keep)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        count = recognise_causal_masks(gm, S)
    gm.recompile()
    return count, gm, model(x, keep), inputs


CAUSAL = {
    "kv<=q": lambda q, kv, _: kv <= q,
    "q>=kv": lambda q, kv, _: q >= kv,
    "kv<q+1": lambda q, kv, _: kv < q + 1,
    "tril(ones)": lambda q, kv, _: torch.ones(S, S, dtype=torch.bool).tril(),
    "causal & ones": lambda q, kv, _: torch.ones((), dtype=torch.bool) & (kv <= q),
    "not(kv>q)": lambda q, kv, _: ~(kv > q),
}
NEAR_MISSES = {
    "off-by-one kv<q": lambda q, kv, _: kv < q,
    "off-by-one kv<=q+1": lambda q, kv, _: kv <= q + 1,
    "window": lambda q, kv, _: (kv <= q) & (q - kv < 4),
    "anti-causal": lambda q, kv, _: kv >= q,
    "tril(-1)": lambda q, kv, _: torch.ones(S, S, dtype=torch.bool).tril(-1),
    "causal & kv>0": lambda q, kv, _: (kv <= q) & (kv > 0),
    "causal | diagonal+1": lambda q, kv, _: (kv <= q) | (kv == q + 1),
}


@pytest.mark.parametrize("name", CAUSAL)
def test_causal_mask_becomes_is_causal_with_the_same_output(name):
    count, gm, expected, inputs = _rewrite(CAUSAL[name])
    assert count == 1
    (attention,) = [n for n in gm.graph.nodes if is_attention(n)]
    assert attention_args(attention)["attn_mask"] is None and attention_args(attention)["is_causal"]
    assert not _square_nodes(gm, S)  # the mask subgraph is dropped
    torch.testing.assert_close(gm(*inputs)[0], expected, rtol=0, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_causal_mask_built_on_the_gpu_is_recognised():
    """The mask's constant is evaluated where the graph runs (an H200 once failed here: cuda vs cpu tensors)."""
    count, gm, expected, inputs = _rewrite(CAUSAL["kv<=q"], device="cuda")
    assert count == 1
    torch.testing.assert_close(gm(*inputs)[0], expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_miss_mask_is_kept(name):
    count, gm, _, _ = _rewrite(NEAR_MISSES[name])
    assert count == 0
    (attention,) = [n for n in gm.graph.nodes if is_attention(n)]
    assert attention_args(attention)["attn_mask"] is not None


def test_mask_from_a_user_input_is_kept_even_if_all_true():
    count, _, _, _ = _rewrite(lambda q, kv, keep: (kv <= q) & keep[None, :], torch.ones(S, dtype=torch.bool))
    assert count == 0


def _square_nodes(gm, seq_len):
    values = ((n, n.meta.get("example_value")) for n in gm.graph.nodes)
    return [n for n, v in values if isinstance(v, torch.Tensor) and list(v.shape).count(seq_len) >= 2]


def _hf_graph(seq_len=48, name="hf:tiny", **data):
    model = build_model(name, seed=0)
    batch = make_batch(DataConfig(**data), batch_size=2, seq_len=seq_len, vocab_size=get_preset("tiny").vocab_size,
                       seed=0)
    return capture(model, **batch.model_kwargs())


def test_hf_llama_mask_without_padding_is_recognised_causal_in_every_layer():
    gm, _ = _hf_graph()
    assert recognise_causal_masks(gm, 48) == get_preset("tiny").num_layers
    assert not _square_nodes(gm, 48)


@pytest.mark.parametrize("data", [{"pad_fraction": 0.25}, {"packed_documents": 3}])
def test_hf_llama_padding_or_packed_documents_are_not_causal_but_structured(data):
    gm, _ = _hf_graph(**data)
    assert recognise_causal_masks(gm, 48) == 0
    assert express_structured_masks(gm, 48) == get_preset("tiny").num_layers
    assert not _square_nodes(gm, 48)


def test_user_supplied_dense_mask_is_kept_with_its_cost_named():
    model = MaskedAttention(lambda q, kv, dense: dense)
    gm, _ = capture(model, x=torch.randn(2, S, 16), keep=torch.rand(S, S) > 0.5)
    with pytest.warns(UserWarning, match=rf"dense \({S}, {S}\) torch.bool attention mask .* O\(S\^2\)"):
        assert express_structured_masks(gm, S) == 0
    assert attention_args(next(n for n in gm.graph.nodes if is_attention(n)))["attn_mask"] is not None


@pytest.mark.parametrize("name, data", [
    ("hf:tiny", {}),
    ("hf-mistral-w16:tiny", {}),
    ("hf:tiny", {"pad_fraction": 0.25, "pad_side": "left"}),
    ("hf:tiny", {"packed_documents": 3}),
])
def test_compiled_forward_and_backward_hold_no_sequence_by_sequence_tensor(name, data):
    seq_len = 96  # no other dim of the tiny preset (64, 16, 32, 176, 512) equals it
    gm, inputs = _hf_graph(seq_len, name, **data)
    gm = sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    graphs = partitioned(gm, inputs)
    assert len(graphs) == 2
    for graph in graphs:
        square = [n.name for n in graph.graph.nodes
                  if isinstance(n.meta.get("val"), torch.Tensor) and list(n.meta["val"].shape).count(seq_len) >= 2]
        assert not square


def _op_masks(seq_len):
    """(rows, program) of masks for the op tests: query rows [S, 1], key rows [1, S], batch rows [B, 1, 1, S]."""
    pos = torch.arange(seq_len)
    doc = (pos >= 13).long() + (pos >= 30).long()
    keep = torch.ones(2, seq_len, dtype=torch.bool)
    keep[1, :7] = False
    scattered = torch.randint(0, 3, (seq_len,), generator=torch.Generator().manual_seed(0))
    causal_window = [["le", ["row", 1], ["row", 0]], ["gt", ["row", 1], ["row", 2]], ["and", ["step", 0], ["step", 1]]]
    return {
        # window x documents x key padding (fully masked query rows in batch row 1)
        "window, documents, padding": ([pos[:, None], pos[None, :], (pos - 5)[:, None], doc[:, None], doc[None, :],
                                        keep[:, None, None, :]],
                                       causal_window + [["eq", ["row", 3], ["row", 4]], ["and", ["step", 2], ["step", 3]],
                                                        ["and", ["step", 4], ["row", 5]]]),
        # an attention sink (key 0 for every query) beside a window: the span must reach back to key 0
        "sink or window": ([pos[:, None], pos[None, :], (pos - 5)[:, None]],
                           causal_window + [["eq", ["row", 1], ["const", 0]], ["or", ["step", 2], ["step", 3]]]),
        # document ids that are not sorted: bounds rule nothing out, the exact mask decides
        "scattered ids, not causal": ([scattered[:, None], scattered[None, :]],
                                      [["ne", ["row", 0], ["row", 1]], ["not", ["step", 0]]]),
    }


@pytest.mark.parametrize("kernel", ["cpu flash", "tensor ops (other devices)"])
@pytest.mark.parametrize("name", ["window, documents, padding", "sink or window", "scattered ids, not causal"])
def test_masked_attention_matches_dense_attention_in_value_and_gradient(monkeypatch, name, kernel):
    """GQA, several blocks of query rows and key tiles (blocks of 16), against SDPA with the dense mask; the
    backward through SDPA's CPU kernels and through the tensor-op gradient other devices run."""
    monkeypatch.setattr(masked_attention, "BLOCK_ELEMENTS", 64)
    if kernel != "cpu flash":
        monkeypatch.setattr(masked_attention, "BLOCK_GRADIENTS", {})
    torch.manual_seed(0)
    q = torch.randn(2, 4, 40, 8, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 8, requires_grad=True) for _ in range(2))
    rows, program = _op_masks(40)[name]
    program = json.dumps(program)
    mask = masked_attention.run_program(program, rows)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    out = torch.ops.autosp_sp.masked_attention(q, k, v, rows, program, None, True)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    grad = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_masked_attention_runs_each_query_block_on_the_keys_it_sees_only(monkeypatch):
    """A causal window of 5 with the first 20 keys padded in every batch row: blocks of 16 queries attend to
    [max(20, q0 - 4), q1) only, and the first block (its keys all padding) is skipped."""
    monkeypatch.setattr(masked_attention, "BLOCK_ELEMENTS", 64)
    pos = torch.arange(64)
    rows = [pos[:, None], pos[None, :], (pos - 5)[:, None], (pos >= 20).expand(2, 64)[:, None, None, :]]
    program = json.dumps([["le", ["row", 1], ["row", 0]], ["gt", ["row", 1], ["row", 2]],
                          ["and", ["step", 0], ["step", 1]], ["and", ["step", 2], ["row", 3]]])
    plan = masked_attention._Plan(program, rows, 64, 16)  # bounds per tile of 16 keys: no exact mask outside
    assert [plan.key_span(i) for i in range(4)] == [slice(0, 0), slice(16, 32), slice(16, 48), slice(32, 64)]
    blocks = masked_attention._attended_blocks(torch.randn(2, 4, 64, 8), rows, program)
    assert [(queries.start, keys.start, keys.stop) for queries, keys, _ in blocks] == [(16, 20, 32), (32, 28, 48),
                                                                                      (48, 44, 64)]
