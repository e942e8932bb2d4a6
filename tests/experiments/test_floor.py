"""The analytic memory floor: parameter counts, sharding table, and the limit length it implies."""
from __future__ import annotations

import pytest

from autosp.experiments.floor import METHOD_SHARDING, floor_for, memory_floor, parameter_count
from autosp.harness.config import ConfigError
from autosp.models import get_preset

PAPER_METHODS = ["single", "autosp", "ulysses", "ulysses-compile", "ring", "zero3", "fsdp", "ds-autosp"]


@pytest.mark.parametrize(
    "name, published",
    [("llama-3.2-1b", 1.24e9), ("llama-3.2-3b", 3.21e9), ("llama-3.1-8b", 8.03e9), ("llama-2-13b", 13.0e9)],
)
def test_parameter_count_matches_published_models(name: str, published: float) -> None:
    assert parameter_count(get_preset(name)) == pytest.approx(published, rel=0.005)


def test_parameter_count_matches_the_built_model() -> None:
    from autosp.models import build_model

    model = build_model("small")
    assert parameter_count(get_preset("small")) == sum(p.numel() for p in model.parameters())


def test_every_method_has_an_entry_and_unknown_is_a_config_error() -> None:
    assert set(PAPER_METHODS) <= set(METHOD_SHARDING)
    with pytest.raises(ConfigError, match="METHOD_SHARDING"):
        floor_for("no-such-method", "tiny", world_size=2)


def test_model_state_is_sixteen_bytes_per_parameter_in_fp32_when_replicated() -> None:
    f = floor_for("ulysses", "llama-3.1-8b", world_size=8, zero=0)
    n = parameter_count(get_preset("llama-3.1-8b"))
    assert f.params_bytes + f.grads_bytes + f.optimizer_bytes == 16 * n
    assert f.gathered_unit_bytes == 0


def test_sharding_methods_divide_model_state_and_keep_whole_sequences() -> None:
    sp, z3 = floor_for("autosp", "llama-3.1-8b", world_size=8, zero=0), floor_for("zero3", "llama-3.1-8b", world_size=8)
    assert z3.params_bytes == pytest.approx(sp.params_bytes / 8, rel=1e-6)
    assert z3.gathered_unit_bytes > 0
    assert sp.tokens_per_rank_per_seq_token == pytest.approx(1 / 8)
    assert z3.tokens_per_rank_per_seq_token == 1.0
    # same per-token cost: the floor differs only in how it is split
    assert sp.activation_bytes_per_token == z3.activation_bytes_per_token


def test_limit_length_inverts_bytes_at_and_respects_granularity() -> None:
    f = floor_for("autosp", "tiny", world_size=2)
    budget = 64 << 20
    limit = f.max_seq_len(budget, granularity=512)
    assert limit % 512 == 0 and limit > 0
    assert f.bytes_at(limit) <= budget < f.bytes_at(limit + 512)
    assert f.max_seq_len(f.static_bytes) == 0  # nothing left for activations


def test_sequence_parallelism_lengthens_the_limit_over_single() -> None:
    budget = 64 << 20
    single = floor_for("single", "small", world_size=1).max_seq_len(budget)
    sp = floor_for("ulysses", "small", world_size=2, zero=0).max_seq_len(budget)
    assert 1.9 * single < sp <= 2.0 * single + 2


def test_bf16_halves_model_state_but_not_the_fp32_logits() -> None:
    preset = get_preset("tiny")
    f32 = memory_floor("single", preset, world_size=1, dtype="float32")
    b16 = memory_floor("single", preset, world_size=1, dtype="bfloat16")
    assert b16.static_bytes * 2 == f32.static_bytes
    assert b16.activation_bytes_per_token > f32.activation_bytes_per_token / 2


def test_each_zero_stage_divides_what_it_shards_over_the_world_size() -> None:
    n = parameter_count(get_preset("llama-3.1-8b"))
    stages = [floor_for("autosp", "llama-3.1-8b", world_size=8, zero=z) for z in (0, 1, 2, 3)]
    assert stages[0].optimizer_bytes == 8 * n and stages[1].optimizer_bytes == pytest.approx(n, rel=1e-6)
    assert stages[1].grads_bytes == 4 * n and stages[2].grads_bytes == pytest.approx(n / 2, rel=1e-6)
    assert stages[2].gathered_unit_bytes == 4 * n  # the gathered model, kept from forward to backward
    assert stages[3].static_bytes == pytest.approx(floor_for("zero3", "llama-3.1-8b", world_size=8).static_bytes)
    assert [f.static_bytes for f in stages] == sorted((f.static_bytes for f in stages), reverse=True)
    with pytest.raises(ConfigError, match=r"ulysses-compile runs ZeRO stage\(s\) \[0\], not 3"):
        floor_for("ulysses-compile", "tiny", world_size=2, zero=3)


def test_mixed_precision_keeps_fp32_master_state_and_a_bf16_compute_copy() -> None:
    n = parameter_count(get_preset("llama-3.1-8b"))
    f = floor_for("autosp", "llama-3.1-8b", world_size=8, dtype="bfloat16", mixed_precision=True, zero=0)
    assert f.params_bytes + f.grads_bytes + f.optimizer_bytes == 16 * n and f.gathered_unit_bytes == 2 * n
    assert f.precision == "bfloat16-mixed"
    with pytest.raises(ConfigError, match="16-bit"):
        floor_for("autosp", "tiny", world_size=2, mixed_precision=True)


def test_floor_command_prints_stage_precision_and_the_paper_ratios(capsys) -> None:
    from autosp.cli import main

    assert main(["floor", "--models", "llama-3.1-8b", "--methods", "autosp:0,autosp:3,zero3,ulysses"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16-mixed" in out and "5.6x" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("llama-3.1-8b")]
    # a method without a stage runs its own default, 3 for ulysses as for autosp (like for like)
    assert [(r[1], r[2]) for r in rows] == [("autosp", "0"), ("autosp", "3"), ("zero3", "3"), ("ulysses", "3")]
    assert int(rows[0][6]) == 0 < int(rows[2][6]) < int(rows[1][6])  # 8B replicated in mixed precision: no fit


def test_a_tiled_loss_removes_the_logits_term() -> None:
    preset = get_preset("llama-3.1-8b")
    whole = memory_floor("autosp", preset, world_size=8, dtype="bfloat16")
    tiled = memory_floor("autosp", preset, world_size=8, dtype="bfloat16", tiled_loss=True)
    assert whole.activation_bytes_per_token - tiled.activation_bytes_per_token == preset.vocab_size * 4
    assert tiled.activation_bytes_per_token == preset.num_layers * preset.hidden_size * 2
    assert tiled.static_bytes == whole.static_bytes


def test_offload_keeps_one_layer_input_on_the_device_and_counts_the_rest_as_host() -> None:
    """The least an offloading plan keeps: the input of the layer in backward, the next one reloaded late."""
    preset = get_preset("llama-3.1-8b")
    kept = floor_for("autosp", "llama-3.1-8b", world_size=8, dtype="bfloat16", tiled_loss=True, zero=3)
    offloaded = floor_for("autosp", "llama-3.1-8b", world_size=8, dtype="bfloat16", tiled_loss=True, zero=3,
                          offload=True)
    layer_input = preset.hidden_size * 2
    assert offloaded.activation_bytes_per_token == layer_input
    assert offloaded.host_bytes_per_token == kept.activation_bytes_per_token - layer_input
    assert offloaded.host_bytes_at(8192) == offloaded.host_bytes_per_token * 8192 / 8
    assert offloaded.max_seq_len(80 << 30) > kept.max_seq_len(80 << 30) and kept.host_bytes_per_token == 0


def test_the_floor_is_below_the_planners_simulated_peak_where_it_reloads_late() -> None:
    """tiny, one rank, 2,048 tokens, 1 MiB, `--offload activations`: nothing fits, so the planner moves the layer
    boundaries to host memory and reloads them late; the offloading floor counts the one layer input on the device
    that leaves (not two: that many a reload a layer ahead keeps), and it is below the simulated peak."""
    from autosp.experiments import simulate as sim
    from autosp.experiments.floor import run_floor
    from autosp.experiments.simulate.devices import MIB, get_device_model
    from autosp.harness.config import RunConfig

    cfg = RunConfig(method="autosp", model="tiny", seq_len=2048, world_size=1, compile_backend="aot_eager",
                    sac="auto", offload="activations", tiling="auto")
    record = sim.simulate(cfg, get_device_model("cpu", MIB))
    (plan,) = record["extra"]["sac_auto"]
    assert plan["reload"] == "late" and plan["offload_scope"] == "boundaries"
    floor, preset = run_floor(cfg), get_preset("tiny")
    assert floor.activation_bytes_per_token == preset.hidden_size * 4  # one fp32 layer input, the loss tiled
    assert floor.bytes_at(cfg.seq_len) <= record["extra"]["breakdown"]["allocator_blocks_bytes"]


def test_a_runs_floor_is_at_the_zero_stage_its_method_runs() -> None:
    """A search starts from its run's floor: `autosp:0` at stage 0 (the simulated table once took stage 3's for
    it, 4x too long a start), a method's default stage when none is given."""
    from autosp.experiments.floor import run_floor
    from autosp.harness.config import RunConfig

    def floor(method: str, zero: int | None):
        return run_floor(RunConfig(method, "llama-3.2-1b", 1, world_size=8, dtype="bfloat16", zero=zero))

    z0, z3 = floor("autosp", 0), floor("autosp", 3)
    assert (z0.zero, z3.zero) == (0, 3) and z0.static_bytes > z3.static_bytes
    assert floor("ulysses", None).zero == 3 and floor("fsdp", None).zero == 3


def test_the_optimizer_offload_leaves_the_device_its_compute_dtype_parameters_and_gradients():
    """--offload optimizer: no moments on the device, parameters and gradients in the compute dtype (no separate
    cast copies at stages 0/1), 16 B per stepped element in host memory (as the CPU meter and simulator book it:
    tests/baselines/test_autosp_method.py, tests/experiments/test_simulate.py)."""
    from autosp.experiments.floor import floor_for

    n = floor_for("autosp", "tiny", world_size=1).parameter_count
    plain = floor_for("autosp", "tiny", world_size=1, zero=0, dtype="bfloat16")
    moved = floor_for("autosp", "tiny", world_size=1, zero=0, dtype="bfloat16", optimizer_offload=True)
    assert (plain.params_bytes, plain.optimizer_bytes, plain.gathered_unit_bytes) == (4 * n, 8 * n, 2 * n)
    assert (moved.params_bytes, moved.grads_bytes, moved.optimizer_bytes, moved.gathered_unit_bytes,
            moved.host_state_bytes) == (2 * n, 2 * n, 0, 0, 16 * n)
    sharded = floor_for("autosp", "tiny", world_size=2, zero=3, optimizer_offload=True)
    assert (sharded.params_bytes, sharded.optimizer_bytes, sharded.host_state_bytes) == (
        4 * -(-n // 2), 0, 16 * -(-n // 2))
    hosted = floor_for("autosp", "tiny", world_size=1, zero=0, dtype="bfloat16", optimizer_offload=True,
                       params_offload=True)  # --offload optimizer,params: one unit fetched, the rest on the host
    assert (hosted.params_bytes, hosted.grads_bytes, hosted.host_state_bytes) == (0, 0, 16 * n + 4 * n)
    assert 0 < hosted.gathered_unit_bytes == floor_for("autosp", "tiny", world_size=2, zero=3, dtype="bfloat16",
                                                       optimizer_offload=True).gathered_unit_bytes  # ZeRO 3's unit
