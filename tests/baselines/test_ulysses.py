import pytest

from autosp.harness.config import ConfigError, RunConfig
from baselines.base import get_strategy
from tests.baselines.checking import assert_check_passes


@pytest.mark.parametrize("method, world_size, options", [
    ("ulysses", 4, dict(ignore_fraction=0.3)),  # 2 KV heads < 4 ranks: repeated to 4 before the all-to-all
    # 2 SP groups x 2 data-parallel replicas; packed documents + padding: the full-sequence mask in local attention
    ("ulysses-ac", 4, dict(sp_size=2, packed_documents=3, pad_fraction=0.2, ignore_fraction=0.1)),
    # GQA: 2 KV heads split over 2 ranks, 2 rows
    ("ulysses-compile", 2, dict(ignore_fraction=0.3, batch_size=2, compile_backend="aot_eager")),
    # bf16 mixed precision against fp32 single-process training, bounded by the bf16 single process's own error
    ("ulysses", 2, dict(dtype="bfloat16", seq_len=128)),
])
def test_ulysses_matches_single_process(method: str, world_size: int, options: dict) -> None:
    report = assert_check_passes(method, world_size, **options)
    assert report.sp_size == options.get("sp_size", world_size)


def test_ulysses_rejects_heads_not_divisible_by_sp() -> None:
    with pytest.raises(ConfigError, match="attention heads do not split"):
        get_strategy("ulysses").validate(RunConfig("ulysses", "tiny", 96, world_size=3), 4, 2)


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_hand_written_sp_refuses_hf_models_it_cannot_hook(method: str) -> None:
    with pytest.raises(ConfigError, match="project preset"):
        get_strategy(method).validate(RunConfig(method, "hf:tiny", 64, world_size=2), 4, 2)


def test_ulysses_at_zero_stage_3_matches_single_process() -> None:
    """DeepSpeed-Ulysses with FSDP2 sharding every layer over all ranks: the like-for-like baseline of autosp at 3."""
    report = assert_check_passes("ulysses", 2, zero=3, ignore_fraction=0.3)
    assert report.passed
