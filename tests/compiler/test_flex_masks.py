"""Flex attention's block mask built by rows (`autosp/compiler/sp/attention/flex_masks.py`, issue 27): the same block tensors
as HF's dense path, and no [S, S] tensor left in the graph for it."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.fx as fx

from autosp.compiler.sp.attention.flex import FLEX_ATTENTION
from autosp.compiler.sp.attention.flex_masks import build_block_masks_by_rows
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tracing import tracing_config
from tests.compiler.graphs import capture, partitioned
from tests.compiler.hf_models import build_hf_flex
from tests.compiler.models import Decoder, DecoderConfig, allow_flex_backward_on_cpu

CASES = {  # (HF family or None: the decoder, sequence length, packed documents per row, batch rows)
    "llama-causal": ("llama-flex", 300, 1, 1),  # three blocks of 128 positions, the last one partial
    "mistral-window-documents": ("mistral-flex", 300, 3, 1),
    "mistral-window-documents-short": ("mistral-flex", 31, 3, 1),  # the exactness tests' length: one partial block
    "mistral-documents-two-rows": ("mistral-flex", 300, 4, 2),  # each row its own documents: a [2, 1, S, S] mask
    "head-mods": (None, 300, 1, 1),  # per-head windows: a [B, H, S, S] mask, built in each layer
}


def _inputs(seq_len: int, documents: int, rows: int) -> dict:
    ids = torch.randint(0, 64, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    kwargs = {"input_ids": ids}
    if documents > 1:
        positions = []
        for row in range(rows):  # documents of even lengths, their ends 70 positions later in each next row
            bounds = [0, *(k * seq_len // documents + 70 * row for k in range(1, documents)), seq_len]
            positions.append(torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])]))
        kwargs["position_ids"] = torch.stack(positions)
    return kwargs


def _graph(case: str) -> tuple[fx.GraphModule, list, int, int]:
    """(the graph, its inputs, the sequence length, how many block masks it builds)."""
    family, seq_len, documents, rows = CASES[case]
    kwargs = _inputs(seq_len, documents, rows)
    if family is None:
        allow_flex_backward_on_cpu()
        torch.manual_seed(0)
        model = Decoder(DecoderConfig(attention="flex"))
        kwargs["labels"] = kwargs["input_ids"]
    else:
        model = build_hf_flex(family)
    with tracing_config():
        gm, inputs = capture(model, **kwargs)
    return gm, inputs, seq_len, 1 if family else model.cfg.layers


def _block_tensors(gm: fx.GraphModule, inputs: list) -> list[list[torch.Tensor]]:
    """Every flex HOP's block-mask tensors, as the graph computes them on `inputs`."""
    seen = []

    class Recorder(fx.Interpreter):
        def call_function(self, target, args, kwargs):
            if target is FLEX_ATTENTION:
                seen.append([t for t in args[4] if isinstance(t, torch.Tensor)])
            return super().call_function(target, args, kwargs)

    with torch.no_grad():
        Recorder(gm).run(*inputs)
    return seen


def _square(gm: fx.GraphModule, seq_len: int, key: str = "example_value") -> list[str]:
    """Nodes with two dims of the sequence length or of it padded to the block size."""
    lengths = {seq_len, -(-seq_len // 128) * 128}
    values = ((n, n.meta.get(key)) for n in gm.graph.nodes)
    return [n.name for n, v in values if isinstance(v, torch.Tensor) and sum(d in lengths for d in v.shape) >= 2]


@pytest.mark.parametrize("case", CASES)
def test_block_tensors_equal_hf_dense_path_and_no_square_mask_is_left(case):
    gm, inputs, seq_len, masks = _graph(case)
    assert _square(gm, seq_len)  # the dense mask HF builds: the test can see it
    dense = _block_tensors(copy.deepcopy(gm), inputs)
    assert build_block_masks_by_rows(gm) == masks
    gm.graph.lint()
    gm.recompile()
    assert not _square(gm, seq_len)
    rows = _block_tensors(gm, inputs)
    assert len(rows) == len(dense) >= 2
    for by_rows, by_dense in zip(rows, dense):
        assert len(by_rows) == len(by_dense) == 8
        for a, b in zip(by_rows, by_dense):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_mask_reading_what_its_mask_mod_is_not_given_stays_dense_with_its_cost_named():
    gm, _, seq_len, _ = _graph("mistral-window-documents")
    for node in list(gm.graph.nodes):  # the HOPs no longer give their mask_mod the document ids the mask reads
        if node.target is FLEX_ATTENTION:
            node.args = (*node.args[:-1], node.args[-1][:1])
    with pytest.warns(UserWarning, match=rf"dense \(1, 1, {seq_len}, {seq_len}\) torch.bool flex_attention mask "
                                         r"that builds the block mask of .*layers.0.self_attn.* O\(S\^2\)"):
        assert build_block_masks_by_rows(gm) == 0
    assert _square(gm, seq_len)


@pytest.mark.parametrize("case", ["llama-causal", "mistral-window-documents"])
def test_compiled_forward_and_backward_hold_no_sequence_by_sequence_tensor(case):
    gm, inputs, seq_len, _ = _graph(case)
    gm = sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    graphs = partitioned(gm, inputs)
    assert len(graphs) == 2
    for graph in graphs:
        assert not _square(graph, seq_len, "val")


def test_block_sums_keep_the_model_heads_when_the_pass_gives_a_rank_its_own():
    """Rank 1's mask_mod reads h + 2 after the pass; the block sums, over all heads, are still the model's."""
    from torch.nn.attention.flex_attention import create_mask

    gm, _, seq_len, _ = _graph("head-mods")
    gm = sequence_parallel_pass(gm, sp_rank=1, sp_size=2, group_name="unused")
    sums = [n for n in gm.graph.nodes if n.target is torch.ops.autosp_sp.flex_block_sums.default]
    assert sums
    dense = create_mask(lambda b, h, q, kv: (kv <= q) & (q - kv < 8 * (h + 1)), 1, 4, seq_len, seq_len)
    padded = -(-seq_len // 128) * 128
    dense = torch.nn.functional.pad(dense, (0, padded - seq_len, 0, padded - seq_len))
    expected = dense.view(1, 4, padded // 128, 128, padded // 128, 128).sum(dim=(3, 5))
    for node in sums:
        assert torch.equal(node.target(*node.args), expected)
