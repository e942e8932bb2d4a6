"""The simulator's step clock (`autosp.experiments.simulate.clock`): each op priced as the time model says, on fake
tensors, with numbers derivable by hand; and the `extra.time` every simulated record carries."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp.comm.ops import all_to_all
from autosp.compiler.memory import OFFLOAD_OP
from autosp.experiments import simulate as sim
from autosp.experiments.simulate.clock import StepClock
from autosp.experiments.simulate.devices import get_device_model
from autosp.experiments.simulate.tracker import LiveStorageTracker
from autosp.harness.config import RunConfig
from autosp.timing import DeviceRates

RATES = DeviceRates(name="hand", peak_flops=4e12, matmul_flops=2e12, attention_flops=1e12, memory_bytes_s=1e9,
                    peer_bytes_s=1e8, node_bytes_s=1e7, host_link_bytes_s=1e6, host_memory_bytes_s=1e5,
                    collective_latency_s=0.0, streams=True)


def clocked(program, rates: DeviceRates = RATES):
    """Run `program()` on fake tensors under a watching tracker whose clock is `rates`; the step's time."""
    tracker = LiveStorageTracker(get_device_model("h100-80gb"))
    with FakeTensorMode(allow_non_fake_inputs=True), tracker:
        tracker.reset_peak()
        tracker.clock = StepClock()
        program()
        return tracker.clock.trace.time(rates, gpus_per_node=8)


def test_a_matmul_costs_its_flops_at_the_matmul_rate():
    time = clocked(lambda: torch.randn(64, 128) @ torch.randn(128, 32))
    flops = 2 * 64 * 128 * 32
    assert time.executed_flops == flops
    assert time.by_class["matmul"] == pytest.approx(flops / 2e12)


def test_causal_attention_costs_its_key_pairs_forward_and_two_and_a_half_times_that_backward():
    def program():
        q = torch.randn(1, 2, 16, 8, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    time = clocked(program)
    forward = 4 * 1 * 2 * 8 * (16 * 17 / 2)  # QK^T and PV over the 136 causal pairs of each head
    assert time.by_class["attention"] == pytest.approx(3.5 * forward / 1e12)


def test_attention_runs_at_the_rate_its_key_length_was_measured_at():
    """The cpu row's attention rate by key length (`autosp calibrate`): a kernel over 16 keys, between rows measured
    at 8 and 32 keys, runs at the rate half-way between them in log2 of the length, not at the one attention rate."""
    from dataclasses import replace

    def program():
        q = torch.randn(1, 2, 16, 8, requires_grad=True)
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()

    by_keys = replace(RATES, attention_by_keys=((8, 2e11), (32, 6e11)))
    forward = 4 * 1 * 2 * 8 * (16 * 17 / 2)
    assert clocked(program, by_keys).by_class["attention"] == pytest.approx(3.5 * forward / 4e11)
    assert clocked(program).by_class["attention"] == pytest.approx(3.5 * forward / 1e12)


def test_an_elementwise_op_costs_the_bytes_it_reads_and_writes_and_a_view_nothing():
    def program():
        a, b = torch.randn(1000), torch.randn(1000)  # randn: 4,000 bytes written each
        (a + b).view(10, 100)                           # 12,000 bytes; the view is free

    assert clocked(program).by_class["memory"] == pytest.approx(20_000 / 1e9)


def test_an_op_whose_output_is_its_inputs_storage_costs_only_its_overhead():
    """aten._unsafe_view (a reshape's view that its schema does not mark as one: the partitioner's graphs hold
    dozens per layer) moves no bytes; an in-place op on the same storage still reads it."""
    from dataclasses import replace

    def program():
        a = torch.randn(1000)                              # 4,000 bytes written
        torch.ops.aten._unsafe_view(a, [10, 100])           # free but its overhead
        a.mul_(2.0)                                          # 4,000 bytes read (written where they lie)

    time = clocked(program, replace(RATES, op_overhead_s=1e-6))
    assert time.by_class["memory"] == pytest.approx(8_000 / 1e9 + 3e-6)


def test_an_offloaded_value_is_copied_at_the_host_link_beside_the_compute():
    def program():
        x = torch.randn(250)            # 1,000 bytes: 1 us of memory time
        OFFLOAD_OP(x)                   # 1,000 bytes at 1 MB/s: 1 ms on the copy stream, read by nothing
        torch.randn(64, 64) @ torch.randn(64, 64)

    time = clocked(program)
    assert time.by_class["copy"] == pytest.approx(1e-3)
    compute = time.by_class["memory"] + time.by_class["matmul"]
    assert time.iteration_s == pytest.approx(1e-6 + 1e-3)  # the copy ends the step
    assert time.exposed_copy_s == pytest.approx(1e-6 + 1e-3 - compute)


def test_an_all_to_all_sends_its_share_over_the_peer_link_and_its_reader_waits_for_it():
    def program():
        x = torch.randn(4, 1000)                 # 16,000 bytes
        all_to_all(x, 0, 1, 4, "default").sum()  # 3/4 of 16,000 bytes at 100 MB/s: 120 us

    time = clocked(program)
    assert time.by_class["collective"] == pytest.approx(12_000 / 1e8)
    assert time.exposed_collective_s == pytest.approx(12_000 / 1e8)


def test_deepspeeds_ulysses_all_to_all_is_a_collective_over_its_group():
    """alst's attention all-to-all (DeepSpeed's custom op, its group by name): priced as the all-to-all it runs, not
    as the bytes of a memory-bound op."""
    pytest.importorskip("deepspeed")
    import torch.distributed as dist
    from deepspeed.sequence.layer import _dim_zero_all_to_all_op

    from autosp.experiments.simulate.world import fake_world

    with fake_world(4):
        group = dist.group.WORLD.group_name
        time = clocked(lambda: _dim_zero_all_to_all_op(torch.randn(4, 1000), group))  # 3/4 of 16,000 bytes
    assert time.by_class["collective"] == pytest.approx(12_000 / 1e8)


def test_zero3_hook_calls_cost_their_host_seconds_and_no_op_overhead():
    from dataclasses import replace

    rates = replace(RATES, zero3_hook_s=1e-3, op_overhead_s=1e-6)
    clock = StepClock()
    clock.zero3_hooks(3)  # three calls of DeepSpeed's parameter coordinator
    assert clock.trace.time(rates, gpus_per_node=8).by_class["zero3_hooks"] == pytest.approx(3e-3)


def test_alsts_simulated_step_tells_the_clock_each_call_of_zero3s_coordinator(monkeypatch):
    """alst's program (ZeRO-3 over every weight of hf:tiny, TiledMLP's shards re-gathering theirs): each call of
    DeepSpeed's parameter coordinator in the measured step (fetch or release, counted here apart from the moment its
    clock starts; the warm-up step before it makes as many) is one in the step's trace, beside the gathers the clock
    prices as ops."""
    from dataclasses import replace

    from autosp.experiments.simulate import clock, programs
    from baselines.deepspeed_env import import_deepspeed

    import_deepspeed("zero3")
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as Coordinator

    clocks, calls = [], []
    monkeypatch.setattr(programs, "StepClock", lambda: clocks.append(clock.StepClock()) or clocks[-1])

    def spied(name: str):
        method = getattr(Coordinator, name)

        def call(self, *args, **kwargs):
            if clocks:  # the measured step's, from its clock on
                calls.append(name)
            return method(self, *args, **kwargs)
        return call

    for name in ("fetch_sub_module", "release_sub_module"):
        monkeypatch.setattr(Coordinator, name, spied(name))
    traces = []
    time = clock.OpTrace.time
    monkeypatch.setattr(clock.OpTrace, "time", lambda self, *args: traces.append(self) or time(self, *args))
    sim.extrapolate._PREDICTIONS.clear()
    cfg = RunConfig(method="alst", model="hf:tiny", world_size=2, seq_len=512, dtype="bfloat16")
    assert sim.simulate(cfg, get_device_model("h100-80gb"))["status"] == "ok"
    [trace] = traces
    hooks = sum(quantity for op_class, quantity, *_ in trace.events if op_class == "zero3_hooks")
    gathers = sum(1 for op_class, _, kind, *_ in trace.events if kind == "all_gather")
    assert 0 < gathers <= hooks == len(calls) and {"fetch_sub_module", "release_sub_module"} <= set(calls)
    assert trace.time(replace(RATES, zero3_hook_s=1e-3), 8).by_class["zero3_hooks"] == pytest.approx(hooks * 1e-3)


def test_a_collective_waits_for_the_slower_rank_by_the_square_root_of_the_work_since_the_previous_one():
    """The wait grows with this rank's work since its previous collective (`DeviceRates.rank_wait_seconds`): 4 ms of
    work before it, twice the 1 ms figure; none for a collective right after another; a one-rank group neither waits
    nor ends the stretch of work."""
    import math
    from dataclasses import replace

    from autosp.experiments.simulate.clock import OpTrace

    trace = OpTrace()
    trace.add("matmul", 2e12 * 4e-3)                           # 4 ms at the matmul rate
    trace.add("collective", 0.0, kind="all_reduce", group=2)  # waits 2 x 100 us
    trace.add("collective", 0.0, kind="all_reduce", group=2)  # no work before it: no wait
    trace.add("matmul", 2e12 * 1e-3)
    trace.add("collective", 0.0, kind="all_gather", group=1)  # one rank: free, and the stretch goes on
    trace.add("memory", 1e9 * 1e-3)                            # 1 ms at the memory rate
    trace.add("collective", 0.0, kind="all_reduce", group=2)  # waits sqrt(2) x 100 us
    waits = 2e-4 + 1e-4 * math.sqrt(2)
    time = trace.time(replace(RATES, streams=False, collective_wait_s=1e-4), gpus_per_node=8)
    assert time.by_class["collective"] == pytest.approx(waits)
    assert time.iteration_s == time.exposed_collective_s + 6e-3 == pytest.approx(6e-3 + waits)
    assert trace.time(replace(RATES, streams=False), gpus_per_node=8).iteration_s == pytest.approx(6e-3)


def test_on_a_cpu_the_same_ops_run_in_line():
    def program():
        OFFLOAD_OP(torch.randn(250))
        torch.randn(64, 64) @ torch.randn(64, 64)

    from dataclasses import replace

    time = clocked(program, replace(RATES, streams=False))
    assert time.exposed_copy_s == pytest.approx(1e-3)
    assert time.iteration_s == pytest.approx(sum(time.by_class.values()))


@pytest.mark.parametrize("method, options, model", [("autosp", {"sac": "auto"}, "tiny"),
                                                    ("ulysses", {"ac": "layer"}, "tiny"), ("zero3", {}, "tiny"),
                                                    ("alst", {}, "hf:tiny")])
def test_every_simulated_record_carries_its_predicted_time(method, options, model):
    """Rank 0's step on an h100 node: the record's tokens/s per GPU and MFU follow from its iteration time."""
    sim.extrapolate._PREDICTIONS.clear()
    cfg = RunConfig(method=method, model=model, world_size=2, seq_len=512, dtype="bfloat16",
                    **options)
    record = sim.simulate(cfg, get_device_model("h100-80gb"))
    assert record["status"] == "ok", record["error"]
    time = record["extra"]["time"]
    assert time["prediction"] is True and time["rates"] == "h100-80gb"
    assert time["iteration_s"] >= sum(time["seconds_by_class"][c] for c in ("matmul", "attention", "memory")
                                      if c in time["seconds_by_class"])
    assert time["tokens_per_s_per_gpu"] == pytest.approx(record["dp_size"] * 512 / time["iteration_s"] / 2)
    assert time["mfu"] == pytest.approx(time["model_flops_per_gpu"] / time["iteration_s"] / 989e12)
    assert time["seconds_by_class"]["collective"] > 0 and time["exposed_collective_s"] > 0


def test_devices_that_share_a_simulated_program_each_get_their_own_time():
    """a100-80gb and mi250-gcd round alike, so the second reuses the first's simulation (`predict_peak`'s cache):
    the same peak, but the trace is priced on each device's rates (a GCD's 181 vs an A100's 312 TFLOP/s)."""
    sim.extrapolate._PREDICTIONS.clear()
    cfg = RunConfig(method="autosp", model="tiny", world_size=2, seq_len=512, dtype="bfloat16")
    a100, gcd = (sim.simulate(cfg, get_device_model(name)) for name in ("a100-80gb", "mi250-gcd"))
    assert a100["peak_mem_bytes"] == gcd["peak_mem_bytes"]
    a100_time, gcd_time = a100["extra"]["time"], gcd["extra"]["time"]
    assert gcd_time["seconds_by_class"]["matmul"] == pytest.approx(a100_time["seconds_by_class"]["matmul"] * 312 / 181)
    assert gcd_time["iteration_s"] > a100_time["iteration_s"]


def test_an_exchange_with_the_previous_rank_is_the_all_gather_it_is_implemented_as():
    from autosp.comm.neighbours import from_previous_rank

    def program():
        from_previous_rank(torch.randn(1000), 4, "default")  # every rank's 4,000 bytes gathered: 3/4 of 16,000 sent

    assert clocked(program).by_class["collective"] == pytest.approx(12_000 / 1e8)


def test_the_ssd_scan_costs_its_declared_chunked_matmuls_forward_and_three_times_that_backward():
    from autosp.comm.library import op

    def program():
        x = torch.randn(1, 32, 4, 8, requires_grad=True)  # [B, L, H, P]
        B, C = torch.randn(1, 32, 2, 16), torch.randn(1, 32, 2, 16)  # [B, L, G, N]
        op("ssd_scan")(x, torch.randn(1, 32, 4), -torch.rand(4), B, C, None, None, 8, True, 0.0, float("inf"),
                       "transformers.models.mamba2.modeling_mamba2", 0).sum().backward()

    forward = 2 * 32 * 4 * (8 * (16 + 8) + 2 * 8 * 16)  # 2 L H (Q (N + P) + 2 P N)
    assert clocked(program).by_class["matmul"] == pytest.approx(4 * forward / 2e12)


def test_a_simulated_hybrids_step_carries_its_state_exchanges_and_its_scans_flops():
    """Qwen3.5 tiny at P=2 (one gated delta-net layer, then full attention), 512 tokens: the state entering rank 1's
    shard is a [1, 4, 16, 16] fp32 state (4 value heads, head dims 16; in a bf16 model too), gathered from both ranks
    forward and its gradient backward; the scan runs on rank 0's 256 tokens with 16 + 16 value channels (the [I | 0]
    probe)."""
    sim.extrapolate._PREDICTIONS.clear()
    cfg = RunConfig(method="autosp", model="hf-qwen3.5:tiny", world_size=2, seq_len=512, dtype="bfloat16")
    peak, _ = sim.extrapolate.predict_peak(cfg, get_device_model("h100-80gb"))
    events = peak.trace.events
    state = 4 * 16 * 16 * 4
    exchanges = [e for e in events if e[0] == "collective" and e[2] == "all_gather" and e[1] == 2 * state]
    assert len(exchanges) == 2  # the state forward, its gradient backward
    chunk, dk, dv = 64, 16, 32
    scan = 4 * 256 * (chunk * (6 * dk + 4 * dv) + 2 * chunk * chunk / 3 + 6 * dk * dv)
    matmuls = [e[1] for e in events if e[0] == "matmul"]
    assert any(q == pytest.approx(scan) for q in matmuls) and any(q == pytest.approx(3 * scan) for q in matmuls)
    from autosp.experiments.simulate.speed import time_record
    from autosp.timing import device_rates

    h100 = device_rates("h100-80gb")
    time = time_record(peak.trace.time(h100, 8), cfg, h100, 1)
    assert time["mfu"] is None and time["model_flops_per_gpu"] is None and time["iteration_s"] > 0  # not Llama's


def test_model_flops_count_each_familys_layers_and_none_where_llamas_count_would_misstate_them():
    """MFU's model FLOPs: Llama's layers; a sliding window in every layer (Mistral) or the upper half (Qwen2) counts
    the keys each query sees; Mixtral's tokens run their top-k experts and the router; latent, sparse and
    linear-attention families are not counted (the record's MFU is None)."""
    from autosp.experiments.flops import layer_flops
    from autosp.experiments.simulate.speed import model_flops
    from autosp.models.hf import MOE_EXPERTS, MOE_TOP_K

    def flops(model: str) -> float | None:
        return model_flops(RunConfig(method="autosp", model=model, world_size=2, seq_len=512), dp_size=1)

    full, window = layer_flops("tiny", 512), layer_flops("tiny", 512, window=64)  # tiny: 2 layers
    assert flops("tiny") == flops("hf:tiny") == 3 * (2 * full.total + 2 * 512 * 64 * 512)
    assert flops("tiny") - flops("hf-mistral-w64:tiny") == pytest.approx(3 * 2 * (full.attention - window.attention))
    assert flops("tiny") - flops("hf-qwen2-w64:tiny") == pytest.approx(3 * (full.attention - window.attention))
    extra_mlp = (MOE_TOP_K - 1) * full.mlp + 2 * 512 * 64 * MOE_EXPERTS
    assert flops("hf-mixtral:tiny") - flops("tiny") == pytest.approx(3 * 2 * extra_mlp)
    assert flops("hf-qwen3.5:tiny") is flops("hf-deepseek-v3:tiny") is flops("hf-deepseek-v32:tiny") is None


def test_a_simulated_step_runs_the_measured_steps_finite_check():
    """Every measured step checks its gradients before AdamW (`runner.nonfinite_gradient`: a norm per gradient, then
    an all-reduce of the answer, one int64); the simulated step runs it too, so the time model prices it."""
    from autosp.experiments.simulate import clock

    traces = []
    time = clock.OpTrace.time
    sim.extrapolate._PREDICTIONS.clear()
    cfg = RunConfig(method="ulysses", model="tiny", world_size=2, seq_len=256, ac="layer")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(clock.OpTrace, "time", lambda self, *args: traces.append(self) or time(self, *args))
        assert sim.simulate(cfg, get_device_model("cpu", 1 << 30))["status"] == "ok"
    [trace] = traces
    assert any(op_class == "collective" and kind == "all_reduce" and quantity == 8
               for op_class, quantity, kind, *_ in trace.events)


def test_a_recomputed_attention_is_priced_as_attention_inside_the_partitioners_rng_wrappers():
    """A recomputed SDPA runs inside run_and_save_rng_state in forward and run_with_rng_state in backward (its
    dropout's RNG, functionalized): priced as attention both times, 1 + 1 + 2.5 forward FLOPs a layer against the
    kept attention's 1 + 2.5 (these were priced as memory-bound ops: the forward attention went missing)."""
    attention = {}
    for sac in ("off", "full"):
        sim.extrapolate._PREDICTIONS.clear()
        cfg = RunConfig(method="autosp", model="tiny", world_size=2, seq_len=512, dtype="bfloat16", sac=sac,
                        tiling="off", offload="off")
        record = sim.simulate(cfg, get_device_model("h100-80gb"))
        assert record["status"] == "ok", record["error"]
        attention[sac] = record["extra"]["time"]["seconds_by_class"]["attention"]
    assert attention["full"] == pytest.approx(attention["off"] * 4.5 / 3.5)
