import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.runner import build_train_step, global_batch
from autosp.harness.strategy import get_strategy
from tests.baselines.checking import check_config
from tests.baselines.gloo import run_ranks


@pytest.mark.parametrize("method, world_size, options", [
    ("ulysses", 4, dict(ignore_fraction=0.3, zero=0)),  # 2 KV heads < 4 ranks: repeated to 4 before the all-to-all
    # 2 SP groups x 2 data-parallel replicas; packed documents + padding: the full-sequence mask in local attention
    ("ulysses", 4, dict(ac="layer", zero=0, sp_size=2, packed_documents=3, pad_fraction=0.2, ignore_fraction=0.1)),
    # GQA: 2 KV heads split over 2 ranks, 2 rows
    ("ulysses-compile", 2, dict(ignore_fraction=0.3, batch_size=2, compile_backend="aot_eager")),
    # bf16 mixed precision against fp32 single-process training, bounded by the bf16 single process's own error
    ("ulysses", 2, dict(dtype="bfloat16", seq_len=128, zero=0)),
])
def test_ulysses_matches_single_process(checks, method: str, world_size: int, options: dict) -> None:
    report = checks.passed(_ulysses(method, world_size, options))
    assert report.sp_size == options.get("sp_size", world_size)


def _ulysses(method: str, world_size: int, options: dict) -> RunConfig:
    return check_config(method, world_size, **options)


def test_ulysses_rejects_heads_not_divisible_by_sp() -> None:
    with pytest.raises(ConfigError, match="attention heads do not split"):
        get_strategy("ulysses").validate(RunConfig("ulysses", "tiny", 96, world_size=3), 4, 2)


@pytest.mark.parametrize("method", ["ulysses", "ring"])
def test_hand_written_sp_refuses_hf_models_it_cannot_hook(method: str) -> None:
    with pytest.raises(ConfigError, match="project preset"):
        get_strategy(method).validate(RunConfig(method, "hf:tiny", 64, world_size=2), 4, 2)


def test_ulysses_at_zero_stage_3_matches_single_process(checks) -> None:
    """DeepSpeed-Ulysses with FSDP2 sharding every layer over all ranks: the like-for-like baseline of autosp at 3."""
    checks.passed(_at_zero_stage_3())


def _at_zero_stage_3() -> RunConfig:
    return check_config("ulysses", 2, zero=3, ignore_fraction=0.3)


class _Shapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [(str(func), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def _steps_build_no_square_mask(rank: int, world_size: int, seq_len: int) -> None:
    for method, data in (("ulysses", DataConfig(packed_documents=3, pad_fraction=0.2)), ("ring", DataConfig())):
        cfg = RunConfig(method, "tiny", seq_len, world_size=world_size, data=data, zero=0)
        step, _ = build_train_step(cfg, get_strategy(method), world_size)
        with _Shapes() as seen:
            step.forward_backward(global_batch(cfg, world_size))
        sequence_dims = {seq_len, seq_len // world_size}
        square = [(op, shape) for op, shape in seen.shapes if sum(d in sequence_dims for d in shape) >= 2]
        assert not square, f"{method}: {square[:3]}"


def test_hand_written_sp_steps_build_no_sequence_by_sequence_mask() -> None:
    """Ulysses with packed documents and padding runs the full mask from its O(S) rows (autosp::masked_attention);
    neither it nor the ring lets the model build a mask of the shard's positions. (96 and 48 are no tiny dim.)"""
    run_ranks(2, _steps_build_no_square_mask, 96)


def test_the_retired_spelling_names_the_one_spelling() -> None:
    """One spelling per method (issue 42): `ulysses-ac` was `ulysses[ac=layer]` at ZeRO 0."""
    with pytest.raises(ConfigError, match=r"^method 'ulysses-ac' is now spelled ulysses\[ac=layer\] with --zero 0"):
        get_strategy("ulysses-ac")


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {
    "test_ulysses_matches_single_process": _ulysses,
    "test_ulysses_at_zero_stage_3_matches_single_process": _at_zero_stage_3,
}
