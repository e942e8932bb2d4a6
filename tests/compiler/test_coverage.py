"""AutoSP on patterns people train (issue 12): each against single-process training on 2 and 4 gloo ranks."""
from __future__ import annotations

import pytest

from tests.baselines.checking import assert_check_passes
from tests.compiler.exactness import assert_exact


@pytest.mark.parametrize("model, world_size, seq_len, options", [
    ("hf:tiny", 4, 65, dict(ignore_fraction=0.2)),  # 4k+1: HF's explicit [B,1,S,S] mask is padded; rank 3 has 3 pads
    ("tiny", 2, 63, dict(batch_size=2, packed_documents=2)),  # project Llama: is_causal off, document mask
])
def test_sequence_length_not_divisible_by_sp_degree_is_exact(model, world_size, seq_len, options):
    assert_check_passes("autosp", world_size, model=model, seq_len=seq_len, compile_backend="aot_eager", sac="off",
                        **options)


@pytest.mark.parametrize("world_size, seq_len", [(2, 64), (4, 61)])
def test_hand_written_soft_capped_attention_and_a_logging_call_are_exact(world_size, seq_len):
    # a logger.warning in forward would break the graph; eager attention with tanh soft-capping
    assert_exact(world_size, seq_len=seq_len, attention="eager", softcap=20.0, log_in_forward=True)


def test_unmodified_hf_gemma2_eager_attention_is_exact():
    # soft-capped eager attention, a sliding-window layer (window 16 < 30 tokens), 30 tokens on 4 ranks (2 padded)
    assert_exact(4, builder="tests.compiler.models.build_hf_gemma2", seq_len=30)


def test_hybrid_ulysses_ring_forced_groups_of_two_is_exact():
    # tiny: 4 query / 2 KV heads on 4 ranks, Ulysses inside pairs of ranks, ring across the 2 pairs
    assert_check_passes("autosp", 4, model="tiny", seq_len=64, compile_backend="aot_eager", sac="off",
                        ulysses_size=2, ignore_fraction=0.2)


@pytest.mark.parametrize("world_size, seq_len, compile_options", [
    (4, 62, {}),  # 2 query heads on 4 ranks: u=2 chosen, ring over 2 groups; 1 KV head < u: replicated; padded
    (2, 64, {"ulysses_size": 1}),  # pure ring
])
def test_hybrid_ulysses_ring_on_two_query_heads_is_exact(world_size, seq_len, compile_options):
    assert_exact(world_size, seq_len=seq_len, heads=2, kv_heads=1, compile_options=compile_options)


@pytest.mark.parametrize("world_size, seq_len, batch_size", [(2, 64, 2), (4, 62, 1)])
def test_mixture_of_experts_top2_of_4_is_exact(world_size, seq_len, batch_size):
    # router top-k, argsort of (token, expert) pairs, repeat_interleave over the merged token dim, index_add_ back
    assert_exact(world_size, seq_len=seq_len, batch_size=batch_size, experts=4, top_k=2)


@pytest.mark.parametrize("world_size, seq_len", [(2, 64), (4, 61)])
def test_residual_dropout_uses_the_single_device_mask(world_size, seq_len):
    assert_exact(world_size, seq_len=seq_len, residual_dropout=0.3)


def test_unmodified_hf_qwen3_moe_is_exact():
    assert_exact(2, builder="tests.compiler.models.build_hf_qwen3_moe", seq_len=31)  # odd length: padded
