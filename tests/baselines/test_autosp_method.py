"""`autosp check`: the compiled method against single-process training (loss, every gradient, parameters after
two AdamW steps) on 2 and 4 gloo ranks, for the project Llama and unmodified HF transformers Llama."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import autosp
from autosp.errors import SequenceParallelError
from autosp.harness.check import check
from autosp.harness.config import ConfigError, DataConfig, RunConfig
from autosp.harness.launch import launch
from autosp.harness.runner import build_train_step, global_batch, validate


def _config(model: str, world_size: int, seq_len: int = 64, backend: str = "aot_eager", zero: int = 0,
            **kw) -> RunConfig:
    """Stage 0 unless a test is about a stage: the coverage here is the SP pass's (the ZeRO matrix runs 1-3)."""
    data = DataConfig(**{k: kw.pop(k) for k in ("ignore_fraction", "packed_documents", "pad_fraction", "pad_side")
                         if k in kw})
    return RunConfig(method="autosp", model=model, seq_len=seq_len, world_size=world_size, compile_backend=backend,
                     data=data, timeout_s=400, zero=zero, **kw)


def _check(model: str, world_size: int, **kw):
    report = check(_config(model, world_size, **kw))
    assert report.passed, report.format()
    return report


@pytest.mark.parametrize("model, world_size, options", [
    # GQA, batch > 1, uneven -100 runs; --sac auto with a budget nothing fits: every layer fully recomputed from
    # its input, which waits in host memory (--offload activations)
    ("tiny", 2, dict(batch_size=2, ignore_fraction=0.3, sac="auto", memory_budget=1, offload="activations")),
    pytest.param("tiny-mha", 4, dict(packed_documents=3), marks=pytest.mark.long),  # MHA, packed documents
    ("tiny", 4, dict(pad_fraction=0.25, ignore_fraction=0.2)),  # 2 KV heads < SP 4: replicated; padding mask
    # 2-D mesh: 2 SP groups x 2 data-parallel replicas (by default: the ZeRO 2 case below)
    pytest.param("small", 4, dict(sp_size=2, ignore_fraction=0.3), marks=pytest.mark.long),
    ("tiny", 2, dict(sp_size=1, ignore_fraction=0.3)),  # SP degree 1: compiled data parallelism only
    # attention in chunks of heads: MHA (KV heads split into the chunks) with tiling, recomputing attention, a mask
    ("tiny-mha", 2, dict(attention_chunks=2, tiling="auto:8", sac="full", ignore_fraction=0.3, pad_fraction=0.25)),
    # ... GQA with one KV head per rank (exchanged once, shared by the chunks), P=4 as Ulysses 2 x ring 2
    ("tiny", 4, dict(attention_chunks=2, ulysses_size=2, ignore_fraction=0.3)),
    pytest.param("small", 4, dict(attention_chunks=2), marks=pytest.mark.long),  # ... pure Ulysses over 4
])
def test_project_llama_matches_single_process(checks, model, world_size, options):
    checks.passed(_project_llama(model, world_size, options))


def _project_llama(model: str, world_size: int, options: dict) -> RunConfig:
    return _config(model, world_size, **{"sac": "off" if world_size == 4 else "sac", **options})


def test_sac_auto_budget_is_the_run_budget_less_the_resident_model_state():
    from autosp.compiler.memory import Policy
    from autosp.experiments.floor import floor_for
    from baselines.autosp_method import sac_policy

    cfg = RunConfig(method="autosp", model="tiny", seq_len=64, world_size=2, sac="auto", memory_budget=48 << 20)
    state = floor_for("autosp", "tiny", world_size=2, zero=0)
    batch = 2 * 64 * 8  # input_ids and labels, int64: in memory when the step starts, as the meter sees
    resident = state.params_bytes + state.optimizer_bytes + batch
    assert sac_policy(cfg, 0) == Policy("auto", budget_bytes=(48 << 20) - resident)
    assert sac_policy(cfg.replace(memory_budget=None), 0) == Policy("auto")  # the device's free memory / no limit
    assert sac_policy(cfg.replace(memory_budget=1), 0) == Policy("auto", budget_bytes=0)
    assert sac_policy(cfg.replace(sac="budget=1MiB"), 0) == Policy("auto", budget_bytes=1 << 20)
    # the optimizer state in host memory: no moments on the device
    assert sac_policy(cfg.replace(offload="optimizer"), 0) == Policy(
        "auto", budget_bytes=(48 << 20) - state.params_bytes - batch)


@pytest.mark.parametrize("world_size, options", [
    (2, dict(pad_fraction=0.25)),  # HF builds its own [B,1,S,S] padding mask inside the graph
    # HF's packed-sequence detection from position_ids (by default: tests/compiler/test_coverage.py, Qwen2 below)
    pytest.param(4, dict(ignore_fraction=0.3, packed_documents=2), marks=pytest.mark.long),
    (2, dict(ignore_fraction=0.3, tiling="auto:8", model="hf:tiny-tied")),  # tiled loss + MLPs, tied head
    # sliding window 16 < S (autosp::masked_attention, blocks skipped): with left padding; with packed documents
    (2, dict(pad_fraction=0.25, pad_side="left", model="hf-mistral-w16:tiny")),
    (4, dict(packed_documents=3, model="hf-qwen2-w16:tiny")),
])
def test_unmodified_hf_llama_matches_single_process(checks, world_size, options):
    checks.passed(_hf_llama(world_size, options))


def _hf_llama(world_size: int, options: dict) -> RunConfig:
    options = dict(options)
    return _config(options.pop("model", "hf:tiny"), world_size, **options)


@pytest.mark.parametrize("model, world_size, zero, options", [
    ("tiny", 4, 3, dict(ignore_fraction=0.3)),  # parameters sharded over 4, re-gathered in backward; GQA kv 2 < 4
    ("tiny", 4, 2, dict(sp_size=2, ignore_fraction=0.3)),  # shards over SP x DP, gradients / dp_size
    ("hf:tiny-tied", 2, 3, dict(ignore_fraction=0.3)),  # unmodified HF Llama, parametrized; head tied: one shard
    ("tiny", 2, 1, dict(packed_documents=2)),  # ZeroRedundancyOptimizer
    ("small", 2, 3, dict(attention_chunks=2, ignore_fraction=0.3)),  # GQA, 2 KV heads per rank split in 2 chunks
    # bf16 mixed precision against fp32 single-process training, bounded by the bf16 single process's own error
    ("tiny", 2, 0, dict(dtype="bfloat16", seq_len=128)),  # parameters cast where used (autosp.comm.precision)
    ("tiny", 2, 3, dict(dtype="bfloat16", seq_len=128)),  # bf16 gathers of fp32 master shards
])
def test_zero_stages_match_single_process(checks, model, world_size, zero, options):
    checks.passed(_zero_stage(model, world_size, zero, options))


def _zero_stage(model: str, world_size: int, zero: int, options: dict) -> RunConfig:
    return _config(model, world_size, zero=zero, **options)


@pytest.mark.parametrize("options, exact", [
    # one rank: nothing sharded, the planner and the activation offload as at P ranks: bit for bit (untiled: where
    # nothing fits the default tiles, whose tiles sum the loss's gradient in another order, as the last case)
    (dict(sac="auto", memory_budget=1, offload="activations", tiling="off", ignore_fraction=0.3), True),
    (dict(offload="optimizer", ignore_fraction=0.3), True),  # the host AdamW is torch's, on the same values
    (dict(tiling="auto:8", offload="auto,optimizer"), False),  # tiles sum the loss's gradient in another order
])
def test_one_rank_equals_single_process_training(checks, options, exact):
    report = checks.passed(_one_rank(options, exact))
    worst = max(*report.loss_errors, *report.grad_errors.values(), *report.param_errors.values())
    assert worst == 0.0 if exact else worst < 1e-4, report.format()


def _one_rank(options: dict, exact: bool) -> RunConfig:
    return _config("tiny", 1, **options)


@pytest.mark.parametrize("world_size, zero, options", [
    (2, 0, dict(ignore_fraction=0.3)),  # replicated: every rank steps every master on the host
    (2, 3, dict(ignore_fraction=0.3)),  # each rank's fp32 shard and its moments on the host
    ("bf16", 3, dict(dtype="bfloat16", seq_len=128)),  # bf16 shards on the device, fp32 masters on the host
    pytest.param(4, 3, dict(pad_fraction=0.25), marks=pytest.mark.long),
    pytest.param(2, 1, dict(packed_documents=2), marks=pytest.mark.long),  # ZeroRedundancyOptimizer's shares
    pytest.param(2, 2, dict(sp_size=1), marks=pytest.mark.long),
    pytest.param("bf16", 0, dict(dtype="bfloat16", seq_len=128), marks=pytest.mark.long),  # bf16 replicas
    pytest.param("bf16", 1, dict(dtype="bfloat16", seq_len=128), marks=pytest.mark.long),  # masters of one's share
])
def test_optimizer_state_in_host_memory_matches_single_process(checks, world_size, zero, options):
    """offload=optimizer (`autosp.comm.host_optimizer`): masters and AdamW moments on the host, the step on the
    CPU; loss, gradients and parameters after two steps as single-process training (fp32 tolerance; bf16 mixed
    within the mixed-precision bound). That the state really is on the host: the record test below."""
    checks.passed(_optimizer_in_host_memory(world_size, zero, options))


def _optimizer_in_host_memory(world_size: int | str, zero: int, options: dict) -> RunConfig:
    return _config("tiny", 2 if world_size == "bf16" else world_size, zero=zero, offload="optimizer", **options)


@pytest.mark.parametrize("world_size, options", [
    (1, dict(ignore_fraction=0.3)),  # one rank: each whole parameter fetched from host memory where it is used
    (2, dict(ignore_fraction=0.3)),  # ZeRO 3: each rank's shards in host memory, fetched, then gathered
    ("bf16", dict(dtype="bfloat16", seq_len=128)),  # bf16 shards in host memory, fp32 masters beside them
    pytest.param(4, dict(pad_fraction=0.25), marks=pytest.mark.long),
])
def test_parameters_in_host_memory_match_single_process(checks, world_size, options):
    """offload=optimizer,params (`autosp.comm.host_params`): the parameters (shards) in host memory, fetched to the
    device at each use in forward and again in backward, each gradient sent back to host memory as backward makes
    it; loss, gradients and parameters after two steps as single-process training (fp32 tolerance; bf16 mixed
    within the mixed-precision bound). That the state really leaves the device: the record test below."""
    checks.passed(_parameters_in_host_memory(world_size, options))


def _parameters_in_host_memory(world_size: int | str, options: dict) -> RunConfig:
    return _config("tiny", 2 if world_size == "bf16" else world_size, zero=3, offload="optimizer,params", **options)


#: each test that checks through `checks` (tests/baselines/checking.py): its configuration from its parameters
CONFIGS = {
    "test_project_llama_matches_single_process": _project_llama,
    "test_unmodified_hf_llama_matches_single_process": _hf_llama,
    "test_zero_stages_match_single_process": _zero_stage,
    "test_one_rank_equals_single_process_training": _one_rank,
    "test_optimizer_state_in_host_memory_matches_single_process": _optimizer_in_host_memory,
    "test_parameters_in_host_memory_match_single_process": _parameters_in_host_memory,
}


def test_parameters_in_host_memory_at_a_stage_other_than_3_are_refused_before_any_rank_starts():
    cfg = RunConfig(method="autosp", model="tiny", seq_len=64, world_size=2, zero=2, offload="optimizer,params")
    with pytest.raises(ConfigError, match="params keeps ZeRO-3 shards in host memory.*use zero=3") as info:
        validate(cfg)
    assert "\n" not in str(info.value)


def _mixed_precision_dtypes(method: str) -> dict:
    """One step under --dtype bfloat16: the dtypes of what autosp's compiled forward communicates and of the state."""
    cfg = RunConfig(method=method, model="tiny", seq_len=128, world_size=2, dtype="bfloat16",
                    compile_backend="aot_eager", timeout_s=300, zero=0)  # the cast parametrization (stage 3: matrix)
    strategy, sp_size = validate(cfg)
    step, device = build_train_step(cfg, strategy, sp_size)
    step.forward_backward(global_batch(cfg, sp_size).to(device))
    grads = {str(p.grad.dtype) for p in step.model.parameters()}
    step.optimizer_step()
    graphs = step.compiled.partition_records if method == "autosp" else []
    return {"all_to_all": [(str(n.args[0].meta["val"].dtype), str(n.meta["val"].dtype))
                           for r in graphs for n in r.fw_module.graph.nodes if "all_to_all" in str(n.target)],
            "params": {str(p.dtype) for p in step.model.parameters()}, "grads": grads,
            "moments": {str(t.dtype) for s in step.optimizer.state.values() for t in s.values() if t.dim()}}


def _mixed_precision_ranks() -> list[dict]:
    return [_mixed_precision_dtypes(method) for method in ("autosp", "ulysses")]


def test_bfloat16_is_mixed_precision_bf16_all_to_alls_over_fp32_state():
    outcome = launch(_mixed_precision_ranks, world_size=2, timeout_s=300)
    assert outcome.status == "ok", outcome.traceback
    autosp_run, ulysses_run = outcome.results[0]
    assert autosp_run["all_to_all"] == [("torch.bfloat16", "torch.bfloat16")] * 8  # 4 per attention, 2 layers
    for run in (autosp_run, ulysses_run):
        assert run["params"] == run["grads"] == run["moments"] == {"torch.float32"}, run


def test_a_dropped_gradient_shard_fails_the_check():
    cfg = RunConfig(method="autosp-dropped-shard", model="tiny", seq_len=64, world_size=2, zero=2,
                    compile_backend="aot_eager", timeout_s=400)
    report = check(cfg, steps=1, extra_imports=["tests.dropped_shard_method"])
    assert not report.passed and report.worst_grad.parameter == "model.layers.1.mlp.up_proj.weight"
    assert 0.1 < report.worst_grad.error < 1.0  # the last rank's half of that gradient is missing


def test_each_method_runs_its_longest_length_stage_by_default_and_the_floor_agrees():
    """autosp, ulysses and ring default to stage 3 (like with like, and each one's longest trainable length)."""
    from autosp.experiments.floor import floor_for
    from autosp.harness.records import new_record
    from autosp.harness.strategy import get_strategy

    expected = {"autosp": 3, "ulysses": 3, "ring": 3, "zero3": 3, "fsdp": 3, "ulysses-compile": 0}
    for method, stage in expected.items():
        cfg = RunConfig(method=method, model="tiny", seq_len=64, world_size=2)
        assert get_strategy(method).zero_stage(cfg) == floor_for(method, "tiny", world_size=2).zero == stage, method
        assert new_record(cfg, sp_size=2)["zero"] == stage


def test_a_stage_the_method_cannot_run_is_a_config_error_before_any_rank_starts():
    with pytest.raises(ConfigError, match=r"--method ulysses-compile runs ZeRO stage\(s\) \[0\], not --zero 3"):
        validate(RunConfig(method="ulysses-compile", model="tiny", seq_len=64, world_size=2, zero=3))
    with pytest.raises(ConfigError, match=r"--method zero3 runs ZeRO stage\(s\) \[3\], not --zero 1"):
        validate(RunConfig(method="zero3", model="tiny", seq_len=64, world_size=2, zero=1))


@pytest.mark.slow
@pytest.mark.long  # by default: tests/compiler/test_sac.py's inductor SAC against eager
@pytest.mark.parametrize("model, options", [("tiny", {}), ("tiny-mha", dict(attention_chunks=2))])
def test_inductor_with_sac_matches_single_process(model, options):
    _check(model, 2, backend="inductor", sac="sac", ignore_fraction=0.3, **options)


def test_bad_sizes_are_config_errors_before_any_rank_starts():
    one_rank = RunConfig(method="autosp", model="tiny", seq_len=64, world_size=1)
    validate(one_rank)  # one rank: a group of one, where stage 0 is what runs (and what records say)
    assert validate(one_rank)[0].zero_stage(one_rank) == validate(one_rank)[0].zero_stage(one_rank.replace(zero=3)) == 0
    validate(RunConfig(method="autosp", model="tiny", seq_len=65, world_size=4))  # any length: shards are padded
    validate(RunConfig(method="autosp", model="tiny", seq_len=48, world_size=3))  # hybrid: a ring over 3 ranks
    with pytest.raises(ConfigError, match=r"--ulysses-size 3 must divide the SP degree 4 and the 4 query heads; "
                                          r"valid: \[1, 2, 4\]"):
        validate(RunConfig(method="autosp", model="tiny", seq_len=48, world_size=4, ulysses_size=3))
    with pytest.raises(ConfigError, match=r"--attention-chunks 4 must divide the 2 query heads each rank attends "
                                          r"\(4 over 2\); valid: \[1, 2\]"):
        validate(RunConfig(method="autosp", model="tiny", seq_len=48, world_size=2, attention_chunks=4))
    with pytest.raises(ConfigError, match=r"--attention-chunks must be positive"):
        RunConfig(method="autosp", model="tiny", seq_len=48, world_size=2, attention_chunks=0)


class _GraphBreak(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)

    def forward(self, input_ids):
        h = self.emb(input_ids).view(1, 8, 2, 4).transpose(1, 2)
        if h.sum() > 0:  # data-dependent control flow: Dynamo must break the graph here
            h = h * 2
        return F.scaled_dot_product_attention(h, h, h).sum()


def _compile_graph_break() -> str:
    model = autosp.compile(_GraphBreak(), backend="eager")
    try:
        model(torch.zeros(1, 8, dtype=torch.long))
    except SequenceParallelError as e:
        return str(e)
    return "no error"


def test_graph_break_names_dynamos_reason():
    outcome = launch(_compile_graph_break, world_size=1, timeout_s=120)
    assert outcome.status == "ok", outcome.traceback
    assert "Dynamo broke it" in outcome.results[0] and "data-dependent" in outcome.results[0].lower()


def test_the_optimizer_offload_is_booked_as_host_memory_in_the_record():
    """One rank (the meter is deterministic there), fp32: masters, gradient buffers and AdamW's two moments are 16 B
    per parameter in host memory (+ AdamW's 4-byte step count per tensor), the device holds 8 B per parameter less
    when the step starts (the moments), and the CPU meter books the host buffers apart from the device peak. A host
    budget below the state is `oom` naming the host before anything is compiled."""
    from autosp.harness.runner import run
    from autosp.models import build_model

    params = list(build_model("tiny", seed=0).parameters())
    n, tensors = sum(p.numel() for p in params), len(params)
    cfg = RunConfig(method="autosp", model="tiny", seq_len=256, world_size=1, zero=0, compile_backend="aot_eager",
                    sac="sac", steps=1, timeout_s=300)
    plain, offloaded = run(cfg), run(cfg.replace(offload="optimizer"))
    assert plain["status"] == offloaded["status"] == "ok", (plain["error"], offloaded["error"])
    assert offloaded["implementation"].endswith("-offload:optimizer")
    assert offloaded["extra"]["optimizer_offload"] == {
        "host_bytes": 16 * n + 4 * tensors, "device_bytes_saved": 8 * n,
        "implementation": "torch.optim.adamw.AdamW torch (host tensors)"}
    memory, plain_memory = offloaded["extra"]["memory"], plain["extra"]["memory"]
    assert plain_memory["host_offloaded_bytes"] == 0 and "optimizer_offload" not in plain["extra"]
    assert memory["host_offloaded_bytes"] >= 16 * n + 4 * tensors  # + the CPU step's temporaries
    assert plain_memory["resident_at_step_start_bytes"] - memory["resident_at_step_start_bytes"] == 8 * n + 4 * tensors
    assert plain["peak_mem_bytes"] - offloaded["peak_mem_bytes"] >= 8 * n
    short = run(cfg.replace(offload="optimizer", host_memory_budget=16 * n))
    assert short["status"] == "oom" and short["error"].count("host memory") == 1, short["error"]


def test_the_parameter_offload_leaves_the_device_neither_parameters_nor_all_gradients_at_once():
    """One rank, fp32, a length short enough that the step's peak is where backward has made the gradients: with
    offload=optimizer,params the meter finds no parameter resident when the step starts (4 B per parameter fewer)
    and a peak lower by those and by most of the gradients (each sent to host memory as backward makes it, so at
    most a layer's are on the device), both booked as host memory instead."""
    from autosp.harness.runner import run
    from autosp.models import build_model

    n = sum(p.numel() for p in build_model("tiny", seed=0).parameters())
    cfg = RunConfig(method="autosp", model="tiny", seq_len=16, world_size=1, zero=0, compile_backend="aot_eager",
                    sac="sac", steps=1, timeout_s=300, offload="optimizer")
    kept, moved = run(cfg), run(cfg.replace(offload="optimizer,params"))
    assert kept["status"] == moved["status"] == "ok", (kept["error"], moved["error"])
    assert moved["implementation"].endswith("-offload:optimizer,params")
    before, after = kept["extra"]["memory"], moved["extra"]["memory"]
    assert before["resident_at_step_start_bytes"] - after["resident_at_step_start_bytes"] == 4 * n
    assert kept["peak_mem_bytes"] - moved["peak_mem_bytes"] >= 4 * n + 4 * n // 3  # measured: 4 n + 315 KB
    assert after["host_offloaded_bytes"] - before["host_offloaded_bytes"] == 8 * n  # parameters and gradients
    assert moved["extra"]["optimizer_offload"]["device_bytes_saved"] == 16 * n  # + the moments (8 n)
