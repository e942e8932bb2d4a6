"""ZeRO stages of autosp.compile on 2 gloo ranks: the sharding ops' values and gradients, what each stage keeps
resident, and which collectives the graphs run (gradients reduced per layer bucket inside backward, parameters
gathered in one collective per layer; stage 3 re-gathers, stage 2 does not; nothing else is ever re-run)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import autosp
from autosp.comm.sharding import full_name, resolve_stage
from autosp.errors import SequenceParallelError
from autosp.harness.config import DataConfig
from autosp.harness.launch import launch
from autosp.models import build_model
from autosp.models.data import make_batch


def _ops_rank() -> None:
    rank, world, group = dist.get_rank(), dist.get_world_size(), dist.group.WORLD.group_name
    shard = (torch.arange(3, dtype=torch.float32) + 10 * rank).requires_grad_()
    full = torch.ops.autosp_sp.all_gather_shard(shard, world, group, 2, True, torch.bfloat16)
    assert full.dtype == torch.bfloat16 and full.tolist() == [0, 1, 2, 10, 11, 12]  # cast before the gather
    weight = torch.arange(6, dtype=torch.bfloat16) * (rank + 1)
    (full * weight).sum().backward()
    # d/d(shard_r) = (sum over ranks of the weights at r's positions) / dp_size, in the shard's fp32
    expected = (torch.arange(6.0) * 3)[3 * rank:3 * rank + 3] / 2
    assert shard.grad.dtype == torch.float32 and torch.equal(shard.grad, expected)


def _module_rank() -> dict:
    """The module's one launch (starting 2 ranks costs more than a check): the ops, then every stage."""
    try:
        _ops_rank()
        ops = "ok"
    except AssertionError:
        import traceback

        ops = traceback.format_exc()
    return {"ops": ops, "stages": _stages_rank()}


@pytest.fixture(scope="module")
def two_ranks():
    outcome = launch(_module_rank, world_size=2, timeout_s=600)
    assert outcome.status == "ok", outcome.traceback
    return outcome.results


def test_gather_casts_then_gathers_and_its_gradient_is_a_scaled_fp32_reduce_scatter(two_ranks):
    assert [r["ops"] for r in two_ranks] == ["ok", "ok"], two_ranks[0]["ops"]


def _stage_rank(zero: int) -> dict:
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    compiled = autosp.compile(model, backend="aot_eager", sac="sac", zero=zero)
    optimizer = compiled.make_optimizer(torch.optim.AdamW, lr=1e-3)
    batch = make_batch(DataConfig(), batch_size=1, seq_len=64, vocab_size=256, seed=0)
    loss = compiled(**batch.model_kwargs()).loss
    with torch.profiler.profile() as prof:
        loss.backward()
    optimizer.step()
    (record,) = compiled.partition_records
    backward = [str(n.target) for n in record.bw_module.graph.nodes]
    gradient_collective = "all_reduce" if zero < 2 else "reduce_scatter"
    issued = [i for i, t in enumerate(backward) if t.startswith(f"_c10d_functional.{gradient_collective}")]
    forward = [str(n.target) for n in record.fw_module.graph.nodes]
    params = list(model.parameters())
    state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    if hasattr(optimizer, "optim"):  # ZeroRedundancyOptimizer: the local optimizer holds this rank's state
        state = [t for s in optimizer.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    # state_dict: the model's own names and full values at every stage, and an unsharded checkpoint loads back
    plain = build_model("tiny", seed=1).state_dict()
    saved = model.state_dict()
    model.load_state_dict(plain)
    loaded = compiled.full_parameters()
    refused = zero < 2  # stages 2/3: a wrong shape is refused in one line naming it (below: torch's own message)
    if zero >= 2:
        try:
            model.load_state_dict({**plain, "model.norm.weight": torch.zeros(3)})
        except SequenceParallelError as e:
            refused = "model.norm.weight has shape (3,)" in str(e)
    return {
        "refuses_wrong_shape": refused,
        "state_dict_full": sorted(saved) == sorted(plain) and all(saved[k].shape == plain[k].shape for k in plain),
        "state_dict_loads": all(torch.equal(loaded[k], plain[k]) for k in plain),
        "full_bytes": full_bytes,
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
        "state_bytes": sum(t.numel() * t.element_size() for t in state),
        "num_params": len(names),
        "names": sorted(full_name(n) for n, _ in model.named_parameters()) == sorted(names),
        "backward": record.collectives_in_backward,
        "forward_all_to_all": sum("all_to_all" in str(n.target) for n in record.fw_module.graph.nodes),
        "buckets": [(b.layers, b.num_params) for b in compiled.gradient_buckets],
        "gather_buckets": [[(b.layer and b.layer.rsplit(".", 2)[-2:], b.num_params, b.prefetched) for b in graph]
                           for graph in compiled.gather_buckets],
        # what the process group ran during backward, whoever issued it (graph, hooks)
        "gradient_collectives_run": sum(e.name.startswith("c10d::") and gradient_collective in e.name.replace(
            "allreduce", "all_reduce") for e in prof.events()),
        # the first bucket's reduction starts before backward's last all-to-all, i.e. overlaps the rest of backward
        "issued_inside_backward": bool(issued)
        and issued[0] < max(i for i, t in enumerate(backward) if "all_to_all" in t),
        # parameter all-gathers issued before layer 0's attention
        "gathers_before_attention": sum("all_gather" in t for t in forward[:next(
            i for i, t in enumerate(forward) if "all_to_all" in t)]),
    }


def _mixed_precision_rank() -> dict:
    """Stage 3 with bf16 compute over fp32 master shards against the same model computed in fp32."""
    batch = make_batch(DataConfig(), batch_size=1, seq_len=64, vocab_size=256, seed=0)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch._dynamo.reset()
        compiled = autosp.compile(build_model("tiny", seed=0), backend="aot_eager", zero=3, compute_dtype=dtype)
        compiled(**batch.model_kwargs()).loss.backward()
        masters = {p.dtype for p in compiled.parameters()} | {p.grad.dtype for p in compiled.parameters()}
        assert masters == {torch.float32}, masters  # master shards and their (fp32-reduced) gradients
        grads[dtype] = compiled.full_gradients()
    return {name: float((grads[torch.bfloat16][name] - ref).norm() / ref.norm())
            for name, ref in grads[torch.float32].items() if ref.norm() > 0}


def _stages_rank() -> list[dict]:
    return [_stage_rank(zero) for zero in (0, 1, 2, 3)] + [_mixed_precision_rank()]


def test_each_stage_shards_what_it_promises_and_reruns_only_the_stage3_gather(two_ranks):
    results = [r["stages"] for r in two_ranks]
    for zero in (0, 1, 2, 3):
        _check_stage(zero, results[0][zero], [result[zero] for result in results])
    # bf16 compute: gradients within bf16 rounding (8 mantissa bits, 2^-8 = 3.9e-3 per operation, grown through
    # the layers) of the fp32 computation, and not identical to it (the parameters really were cast)
    mixed = results[0][4]
    assert 1e-4 < max(mixed.values()) < 3e-2, mixed


def _check_stage(zero: int, r: dict, ranks: list[dict]) -> None:
    full, world = r["full_bytes"], 2
    assert r["names"] and r["state_dict_full"] and r["state_dict_loads"] and r["refuses_wrong_shape"]
    # parameters and gradients: replicated below stage 2, one flat shard (padded to a multiple of P) from stage 2
    assert r["param_bytes"] == full if zero < 2 else full / world <= r["param_bytes"] < full / world + 4 * 64
    assert r["grad_bytes"] == r["param_bytes"]
    # AdamW's two moments: of every parameter at stage 0, of this rank's share from stage 1
    states = sum(o["state_bytes"] for o in ranks)
    assert states == pytest.approx(2 * full * (world if zero == 0 else 1), rel=0.01)
    if zero > 0:
        assert max(o["state_bytes"] for o in ranks) < 0.75 * 2 * full
    backward = r["backward"]
    # gradients reduced in buckets, one collective each (all-reduce at 0/1, reduce-scatter at 2/3), not one per
    # parameter. Stages 0/1 as DDP: tiny's 0.6 MiB of gradients fit DDP's 1 MiB first bucket, one all-reduce after
    # the last gradient. Stages 2/3 as FSDP2, per layer: lm_head + final norm, layer 1, layer 0, the embedding (in
    # the order backward produces them), the first issued while backward still runs
    layers = [[layer and layer.rsplit(".", 2)[-2:] for layer in layers] for layers, _ in r["buckets"]]
    expected = [[None], [["layers", "1"]], [["layers", "0"]], [None]]
    assert layers == ([[None, ["layers", "1"], ["layers", "0"]]] if zero < 2 else expected), r["buckets"]
    assert sum(n for _, n in r["buckets"]) == r["num_params"]
    assert r["gradient_collectives_run"] == len(r["buckets"]) and r["issued_inside_backward"] == (zero >= 2)
    assert sum("reduce_scatter_sum" in c for c in backward) == 0
    # stages 2/3 gather one bucket per layer (9 parameters each), each issued during the bucket before it (on gloo
    # too); stage 3 gathers again in backward every parameter backward needs (all but the embedding table, whose
    # backward needs only the token ids), in backward's order
    forward, regathered = r["gather_buckets"]
    layer = [["layers", "0"], ["layers", "1"]]
    assert forward == ([(None, 1, False), (layer[0], 9, True), (layer[1], 9, True), (None, 2, True)]
                       if zero >= 2 else [])
    assert regathered == ([(None, 2, False), (layer[1], 9, True), (layer[0], 9, True)] if zero == 3 else [])
    assert sum("all_gather" in c for c in backward) == len(regathered)
    # before layer 0's attention: the embedding's gather, layer 0's and (issued ahead) layer 1's
    assert r["gathers_before_attention"] == (3 if zero >= 2 else 0)
    # the SP all-to-alls: the backward runs each forward exchange's inverse once, never a recomputed forward one
    assert sum("all_to_all" in c for c in backward) == r["forward_all_to_all"]


def test_a_bad_stage_names_the_choices():
    with pytest.raises(SequenceParallelError, match=r"choose a ZeRO stage in \[0, 1, 2, 3\]"):
        autosp.compile(torch.nn.Linear(2, 2), zero=4)


@pytest.mark.parametrize("zero, group_size, backend, stage", [
    (None, 4, "gloo", 3),  # the default: the longest trainable length
    (None, 2, "cpu:gloo,cuda:nccl", 3),
    (None, 1, "gloo", 0),  # one rank shares nothing: every stage is stage 0
    (3, 1, "nccl", 0),
    (None, 2, "mpi", 1),  # no coalesced gather: the default falls back to sharding AdamW state only
    (1, 2, "ucc", 1),
    (0, 8, "nccl", 0),
])
def test_the_stage_that_runs(zero, group_size, backend, stage):
    assert resolve_stage(zero, group_size, backend) == stage


@pytest.mark.parametrize("zero, backend, device_type, stage", [
    (None, "gloo", "cuda", 1),  # ranks sharing a GPU (AUTOSP_SHARE_GPUS=1): no coalesced gather of CUDA tensors
    (0, "gloo", "cuda", 0),
    (None, "cpu:gloo,cuda:nccl", "cuda", 3),  # CUDA tensors go over nccl
    (None, "gloo", "cpu", 3),
])
def test_gloo_runs_stages_2_and_3_on_cpu_tensors_only(zero, backend, device_type, stage):
    assert resolve_stage(zero, 2, backend, device_type) == stage


def test_zero_3_over_gloo_on_cuda_tensors_is_refused_in_one_line_with_the_reason():
    # gloo's coalesced all-gather reads CUDA tensors as host memory: the rank died with SIGSEGV (pytorch#152645)
    with pytest.raises(SequenceParallelError, match=r"^zero=3 .* gloo runs on CPU tensors only \(on CUDA tensors the "
                                                    r"rank dies with SIGSEGV, pytorch/pytorch#152645\): use nccl"):
        resolve_stage(3, 2, "gloo", "cuda")


def test_a_stage_the_backend_cannot_run_is_refused_in_one_line():
    with pytest.raises(SequenceParallelError, match="zero=3 .* mpi backend lacks: use gloo or nccl, or zero=0/1"):
        resolve_stage(3, 2, "mpi")
