"""Index chains on the shard (issue 26): the rotary cos/sin tables are computed on this rank's positions only, and
training stays single-process training (rope scaling, packed documents, padded shards, 2 and 4 ranks)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition

import autosp.comm  # noqa: F401
from autosp.compiler.sp import index_chains
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.harness.config import DataConfig
from autosp.models import build_model, get_preset
from autosp.models.data import make_batch
from tests.compiler.exactness import ExactnessRuns, exact_case
from tests.compiler.graphs import capture

SEQ, P = 64, 2
TRIG = {torch.ops.aten.cos.default, torch.ops.aten.sin.default}


def _partitioned(name: str, **data) -> tuple[list, int]:
    """(forward and backward graphs of rank 1 of 2, bytes the forward saves for backward) of `name` at SEQ tokens.
    The bytes are the saved values' storages: a narrow saved for backward keeps all of its base alive."""
    batch = make_batch(DataConfig(**data), batch_size=1, seq_len=SEQ, vocab_size=get_preset(name).vocab_size, seed=0)
    gm, inputs = capture(build_model(name, seed=0), **batch.model_kwargs())
    gm = sequence_parallel_pass(gm, sp_rank=1, sp_size=P, group_name="unused")
    graphs = []

    def partition(joint, joint_inputs, **kwargs):
        graphs.extend(default_partition(joint, joint_inputs, **kwargs))
        return graphs

    aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, partition_fn=partition)
    forward, backward = graphs
    saved = [n for n in backward.graph.nodes if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)
             and not n.name.startswith("tangents")]
    storages = {n.meta["val"].untyped_storage()._cdata: n.meta["val"].untyped_storage().nbytes() for n in saved}
    return graphs, sum(storages.values())


class _Op(nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.fn(x, y)


#: (op on x [2, 6, 4] (the sequence in dim 1) and y [4], output dim narrowed, {operand: its narrowed dim} or None
#: when the op is not token-wise along it)
RULES = [
    (lambda x, y: x * y, 1, {"x": 1}),  # y broadcasts
    (lambda x, y: torch.maximum(x, y), 1, {"x": 1}),
    (lambda x, y: x.float(), 1, {"x": 1}),
    (lambda x, y: x.transpose(0, 1), 0, {"x": 1}),
    (lambda x, y: x.permute(2, 0, 1), 2, {"x": 1}),
    (lambda x, y: x[:, None], 2, {"x": 1}),
    (lambda x, y: x[..., :2], 1, {"x": 1}),
    (lambda x, y: x[0], 0, {"x": 1}),
    (lambda x, y: torch.cat((x, x), -1), 1, {"x": 1}),
    (lambda x, y: torch.stack((x, x), 0), 2, {"x": 1}),
    (lambda x, y: x @ y[:, None], 1, {"x": 1}),  # rows of the product
    (lambda x, y: y[None, None] @ x.transpose(1, 2), 2, {"transpose": 2}),  # its columns
    (lambda x, y: x[:, :1].expand(2, 6, 4), 1, {}),  # broadcast: only the size changes
    (lambda x, y: x[:, 1:], 1, None),  # a slice of the narrowed dim
    (lambda x, y: torch.cat((x, x), 1), 1, None),
    (lambda x, y: x.cumsum(1), 1, None),  # a scan
    (lambda x, y: x.view(2, 24), 1, None),
    (lambda x, y: torch.rand_like(x), 1, None),
    (lambda x, y: x.add_(1), 1, None),
]


@pytest.mark.parametrize("fn, dim, expected", RULES)
def test_token_wise_ops_map_the_narrowed_dim_to_their_inputs(fn, dim, expected):
    gm, _ = capture(_Op(fn), x=torch.randn(2, 6, 4), y=torch.randn(4))
    (node,) = [n for n in gm.graph.nodes if n.op == "output"][0].all_input_nodes
    plan = index_chains._narrowed_inputs(node, dim)
    if expected is None:
        assert plan is None
    else:
        inputs, _ = plan
        assert {n.name.removeprefix("l_").removesuffix("_"): d for n, d in inputs.items()} == expected


@pytest.mark.parametrize("name, data", [("tiny", {}), ("hf:tiny", {"packed_documents": 3})])
def test_rotary_tables_have_the_local_rows_and_leave_the_saved_values(name, data, monkeypatch):
    # the project Llama (`inv_freq @ positions`, plain causal) and HF Llama (`positions * inv_freq`; packed
    # documents: position_ids also build the mask, so they stay full and the narrow stops below them)
    graphs, saved = _partitioned(name, **data)
    trig = [n for g in graphs for n in g.graph.nodes if n.target in TRIG]
    assert trig and all(n.meta["val"].shape[1] == SEQ // P for n in trig), [tuple(n.meta["val"].shape) for n in trig]
    monkeypatch.setattr(index_chains, "narrow_index_chains", lambda ctx: 0)
    _, saved_full = _partitioned(name, **data)
    head_dim = get_preset(name).head_dim
    tables = 2 * (SEQ - SEQ // P) * head_dim * 4  # cos and sin, fp32, the other rank's rows
    assert saved_full - saved >= tables, (saved_full, saved)


class ScanPositions(nn.Module):
    """One attention layer whose rotary positions come from a scan (`cumsum` over the sequence): not token-wise, so
    the narrow must stop below it, and the tables are [S, D] (sequence first) rather than HF's [B, S, D]."""

    def __init__(self, vocab: int = 64, heads: int = 4, head_dim: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.embed = nn.Embedding(vocab, heads * head_dim)
        self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, vocab, bias=False)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        batch, seq = input_ids.shape
        positions = torch.ones(seq, device=input_ids.device).cumsum(0) - 1
        freqs = positions[:, None] * self.inv_freq
        table = torch.cat((freqs, freqs), dim=-1)
        cos, sin = table.cos(), table.sin()
        q, k, v = self.qkv(self.embed(input_ids)).view(batch, seq, 3, self.heads, self.head_dim).transpose(1, 3).unbind(2)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            half = x.shape[-1] // 2
            return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

        o = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        logits = self.out(o.transpose(1, 2).reshape(batch, seq, -1))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)


def build_scan_positions(seed: int = 0) -> ScanPositions:
    torch.manual_seed(seed)
    return ScanPositions().train()


def test_the_narrow_stops_below_a_scan_over_the_sequence():
    model = build_scan_positions()
    ids = torch.randint(0, 64, (1, SEQ))
    gm, _ = capture(model, input_ids=ids, labels=ids)
    gm = sequence_parallel_pass(gm, sp_rank=1, sp_size=P, group_name="unused")
    (scan,) = [n for n in gm.graph.nodes if n.target == "cumsum"]
    assert scan.meta["example_value"].shape == (SEQ,)  # the positions' scan runs on the whole sequence
    assert all(user.target == "narrow" for user in scan.users)
    trig = [n for n in gm.graph.nodes if n.target in ("cos", "sin")]
    assert trig and all(n.meta["example_value"].shape == (SEQ // P, 8) for n in trig)


#: name -> (world size, case): HF Llama with rope scaling, packed documents (position_ids restarting) and a length the
#: world size does not divide (the last shard padded), against single-process training over two AdamW steps
CASES = {
    "llama3-packed-2": (2, exact_case(builder="tests.compiler.hf_models.build_hf", family="llama3-rope", seq_len=61,
                                      batch_size=2, documents=3)),
    "yarn-2": (2, exact_case(builder="tests.compiler.hf_models.build_hf", family="llama-yarn", seq_len=64)),
    "scan-positions-2": (2, exact_case(builder="tests.compiler.test_index_chains.build_scan_positions", seq_len=63)),
    "llama3-packed-4": (4, exact_case(builder="tests.compiler.hf_models.build_hf", family="llama3-rope", seq_len=62,
                                      documents=2)),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


@pytest.mark.parametrize("case", ["llama3-packed-2", "yarn-2", "scan-positions-2"])
def test_rope_scaling_and_packed_documents_are_exact(runs, case):
    runs.assert_exact(case)


def test_rope_scaling_and_packed_documents_are_exact_on_four_ranks(runs):
    runs.assert_exact("llama3-packed-4")
