"""levers: each memory lever added in turn lengthens the estimated max sequence; the tiled terms vanish."""
from __future__ import annotations

from autosp.experiments.levers import LEVERS, lever_table, token_bytes
from autosp.models import get_preset


def test_each_lever_lengthens_the_sequence_and_offload_moves_saved_bytes_to_host() -> None:
    table = lever_table("llama-3.1-8b", world_size=8, device_bytes=80 << 30, dtype="bfloat16-pure")
    lengths = table["max sequence"].tolist()
    assert len(lengths) == len(LEVERS) + 1 and lengths == sorted(lengths) and len(set(lengths)) == len(lengths)
    assert table["host bytes / rank"].iloc[-1] != "-" and table["host bytes / rank"].iloc[-2] == "-"


def test_mixed_precision_state_leaves_8b_no_room_until_it_is_sharded() -> None:
    """--dtype bfloat16 keeps fp32 masters and moments (16 bytes a parameter): 134.6 GiB replicated on 80 GiB."""
    table = lever_table("llama-3.1-8b", world_size=8, device_bytes=80 << 30, dtype="bfloat16")
    lengths = table["max sequence"].tolist()
    sharded = 1 + LEVERS.index("sharded state")
    assert lengths[:sharded] == [0] * sharded and 0 < lengths[sharded] < lengths[sharded + 1]


def test_tiling_removes_the_loss_and_mlp_working_sets() -> None:
    preset = get_preset("llama-3.1-8b")
    untiled = token_bytes(preset, {"sac"}, elem=2)
    tiled = token_bytes(preset, {"sac", "tiled loss", "tiled mlp"}, elem=2)
    assert untiled.loss_working == preset.vocab_size * 10 and tiled.loss_working == 0
    assert untiled.mlp_working == 4 * preset.intermediate_size * 2 and tiled.mlp_working == 0
    assert tiled.saved_on_device == untiled.saved_on_device
