"""RMSNorms as `autosp_sp::rms_norm` (`--tiling norm`, part of `auto`): the kernel equals the module (forward
bitwise, backward to rounding), the pass fuses Llama's norms and nothing else, training stays exact at 1, 2 and 4
ranks, and one layer's backward peak (the planner's liveness replay of the partitioned graph, rank 0 of 2, every
layer recomputed) falls by the norms' fp32 values."""
from __future__ import annotations

import pytest
import torch
from torch._functorch.aot_autograd import aot_module_simplified

from autosp.compiler.tiling.rms_norm_op import rms_norm
from autosp.compiler.memory.partitioner import make_partition_fn
from autosp.compiler.memory.planner import backward_inputs, live_at_peak
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tiling.loss import apply_tiling, parse_tiling
from autosp.models import build_model, get_preset
from autosp.models.data import DataConfig, make_batch
from autosp.models.llama import LlamaRMSNorm
from tests.compiler.exactness import ExactnessRuns, exact_case
from tests.compiler.graphs import capture
from tests.compiler.test_tiling import _assert_same_gradients, _batch, _eager, _tiled


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_the_kernel_equals_the_module(dtype, tolerance):
    """The weight's gradient is summed chunk by chunk (in fp32), the rest follows autograd's own formulas."""
    torch.manual_seed(0)
    norm = LlamaRMSNorm(48, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 37, 48, dtype=dtype, requires_grad=True)
    grad = torch.randn(2, 37, 48, dtype=dtype)
    expected = norm(x)
    dx, dw = torch.autograd.grad(expected, (x, norm.weight), grad)
    out, _ = rms_norm(x, norm.weight, 1e-5, 8)  # 5 chunks, the last one short
    assert torch.equal(out, expected)
    fx_, fw = torch.autograd.grad(out, (x, norm.weight), grad)
    torch.testing.assert_close(fx_, dx, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(fw, dw, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("name", ["tiny", "hf:tiny"])
def test_llama_norms_are_fused_and_training_is_exact(name):
    ids, labels = _batch()
    reference = _eager(name, ids, labels)
    model = build_model(name)
    compiled, reports, _ = _tiled(model, "norm")
    compiled(input_ids=ids, labels=labels).loss.backward()
    layers = get_preset(name.removeprefix("hf:")).num_layers
    assert len(reports[0].norms) == 2 * layers + 1  # input and post-attention norms of each layer, the final one
    _assert_same_gradients(model, reference)


def test_auto_fuses_only_the_norms_that_upcast():
    """`auto` leaves an fp32 model's norms (no upcast copy to save) as they are; `norm` fuses them."""
    ids, labels = _batch()
    for tiling, fused in (("auto:16", 0), ("loss,mlp,norm:16", 5)):
        torch._dynamo.reset()
        compiled, reports, _ = _tiled(build_model("tiny"), tiling)
        compiled(input_ids=ids, labels=labels)
        assert len(reports[0].norms) == fused, tiling


def test_a_layer_norm_is_left_as_it_is():
    from tests.compiler.models import build_decoder

    model = build_decoder()
    ids = torch.randint(0, 64, (1, 32))
    _, reports, _ = _tiled(model, "norm")
    torch._dynamo.reset()
    compiled, reports, _ = _tiled(model, "norm")
    compiled(input_ids=ids, labels=ids)
    assert reports[0].norms == []


def _backward_peak(tiling: str, seq_len: int) -> int:
    """The liveness replay's backward peak of rank 0 of 2, bf16 `tiny`, every layer recomputed (`full`), attention
    in two chunks of heads (so that its own scratch binds less)."""
    model = build_model("tiny", dtype=torch.bfloat16)
    batch = make_batch(DataConfig(), batch_size=1, seq_len=seq_len, vocab_size=get_preset("tiny").vocab_size, seed=0)
    gm, inputs = capture(model, **batch.model_kwargs())
    gm = sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused", attention_chunks=2)
    apply_tiling(gm, parse_tiling(tiling), loss_only=True)
    partition = make_partition_fn("full", cacheable=False, offload="off")
    aot_module_simplified(gm, inputs, fw_compiler=lambda g, _: g.forward, partition_fn=partition)
    record = partition.records[-1]
    return live_at_peak(record.bw_module, backward_inputs(record.fw_module, record.bw_module,
                                                          record.num_fwd_outputs))[0]


def test_fused_norms_lower_one_layers_backward_peak():
    """Unfused, the peak is a norm's backward with four fp32 hidden-sized values alive (the recomputed upcast, the
    gradient's upcast, two products); fused, it moves to attention's backward, at least one of them lower."""
    tokens = 8192  # rank 0's share of 16,384
    plain, fused = _backward_peak("loss,mlp:256", 2 * tokens), _backward_peak("auto:256", 2 * tokens)  # bf16
    fp32_hidden = tokens * get_preset("tiny").hidden_size * 4
    assert fused <= plain - fp32_hidden, (plain, fused)


#: each case with the line `model.tiling` must hold (so a case that stopped fusing would fail)
CASES = {
    "P=2, every layer recomputed, saved values in host memory": (
        2, exact_case(builder="autosp.models.build_model", name="hf:tiny", vocab=512,
                      compile_options={"tiling": "loss,mlp,norm:16", "outputs": "loss", "sac": "budget=1B"})),
    "P=4, ZeRO 3": (
        4, exact_case(builder="autosp.models.build_model", name="tiny", vocab=512,
                      compile_options={"tiling": "norm", "zero": 3})),
}


@pytest.fixture(scope="module")
def runs() -> ExactnessRuns:
    return ExactnessRuns(CASES)


TILED = {"P=2, every layer recomputed, saved values in host memory": "5 RMSNorms in chunks of 16 tokens",
         "P=4, ZeRO 3": "5 RMSNorms in chunks of 16 tokens"}


@pytest.mark.parametrize("case", [pytest.param(name, marks=pytest.mark.long) if CASES[name][0] == 4 else name
                                  for name in CASES])
def test_fused_norms_are_exact_across_ranks(runs, case):
    assert TILED[case] in runs.assert_exact(case)["tiling"]
