"""Causal-mask recognition: fires exactly on masks that are `kv <= q`, never on near misses."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autosp.compiler.analysis import attention_args, is_attention
from autosp.compiler.masks import recognise_causal_masks
from autosp.harness.config import DataConfig
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from tests.compiler.graphs import capture

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


def _rewrite(mask_fn, keep=None):
    model = MaskedAttention(mask_fn)
    x = torch.randn(2, S, 16)
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


def _hf_graph(seq_len=48, **data):
    model = build_model("hf:tiny", seed=0)
    batch = make_batch(DataConfig(**data), batch_size=2, seq_len=seq_len, vocab_size=get_preset("tiny").vocab_size,
                       seed=0)
    return capture(model, **batch.model_kwargs())


def test_hf_llama_mask_without_padding_is_recognised_causal_in_every_layer():
    gm, _ = _hf_graph()
    assert recognise_causal_masks(gm, 48) == get_preset("tiny").num_layers
    assert not _square_nodes(gm, 48)


@pytest.mark.parametrize("data", [{"pad_fraction": 0.25}, {"packed_documents": 3}])
def test_hf_llama_padding_or_packed_documents_are_not_causal(data):
    gm, _ = _hf_graph(**data)
    with pytest.warns(UserWarning, match=r"dense \(2, 1, 48, 48\) torch.bool attention mask"):
        assert recognise_causal_masks(gm, 48) == 0
