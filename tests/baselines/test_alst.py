"""ALST is a peer: the adapter runs DeepSpeed's ALST components as ArcticTraining does and reports what happens."""
import pytest
import torch

from autosp.harness.check import check
from autosp.harness.config import ConfigError, RunConfig
from autosp.harness.strategy import get_strategy


@pytest.mark.parametrize("world_size", [1, 2])
def test_alst_is_exact_but_for_its_lm_head_gradient_which_tiled_loss_scales_by_the_tokens_per_rank(
        world_size: int) -> None:
    """`TiledFusedLogitsLoss` runs backward inside forward with an incoming gradient of 1 and later rescales only
    the hidden states' gradient by the real incoming one; the lm_head weight's gradient keeps the unnormalised sum
    (ArcticTraining divides the loss by the valid tokens afterwards), averaged over the P ranks: Σ valid / P times
    the true gradient. Everything else equals single-process training. One rank is ALST's single-GPU recipe (no
    Ulysses; tiled MLP and loss, checkpoint offload, ZeRO-3)."""
    import deepspeed

    seq_len = 256
    report = check(RunConfig("alst", "hf:tiny", seq_len, world_size=world_size, timeout_s=300), steps=1)
    assert report.status == "ok", report.error
    assert max(report.loss_errors) < 1e-6
    assert all(error < 1e-5 for group, error in report.grad_errors.items() if group != "lm_head"), report.format()
    if deepspeed.__version__ == "0.19.8":
        valid = seq_len - 1  # labels shifted: the last position has no target
        assert report.grad_errors["lm_head"] == pytest.approx(valid / world_size - 1, rel=1e-4), report.format()


@pytest.mark.parametrize("model, world_size, message", [
    ("tiny", 2, "use --model hf:tiny"),
    ("hf:tiny", 3, "query heads divisible by the SP degree 3"),
])
def test_alst_refuses_what_it_cannot_run_in_one_line(model: str, world_size: int, message: str) -> None:
    cfg = RunConfig("alst", model, 96, world_size=world_size)
    with pytest.raises(ConfigError, match=message):
        get_strategy("alst").validate(cfg, num_heads=8, num_kv_heads=4)


def test_alst_refuses_a_tied_lm_head_at_setup_which_deepspeed_zero3_fails_on(monkeypatch) -> None:
    """hf:tiny-tied (LM head = embedding, as llama-3.2-1b/3b): refused in one line; with the refusal lifted, the
    step fails inside DeepSpeed ZeRO-3's gradient hook (rank 0 of 2 on fake tensors: the same AttributeError a
    two-rank CPU run gives). When this stops failing, DeepSpeed trains tied heads under ALST: lift the refusal."""
    import baselines.alst as alst
    from autosp.experiments import simulate as sim
    from autosp.experiments.simulate.devices import get_device_model

    cfg = sim.simulate_config(RunConfig("alst", "hf:tiny-tied", 256, world_size=2, dtype="bfloat16"))
    device = get_device_model("cpu", 1 << 30)
    with pytest.raises(ConfigError, match="LM head is tied to its embedding"):
        sim.simulate_rank(cfg, device)
    monkeypatch.setattr(alst, "refuse_a_tied_lm_head", lambda model, name: None)
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'numel'"):
        sim.simulate_rank(cfg, device)


def test_alsts_host_optimizer_is_cpu_adam_on_a_gpu_and_torchs_adamw_where_the_op_cannot_build(monkeypatch) -> None:
    import deepspeed.ops.adam

    from baselines.alst import host_optimizer

    model = torch.nn.Linear(4, 4)
    cpu = RunConfig("alst", "hf:tiny", 64)
    assert host_optimizer(model, cpu)[1] == "torch"

    class Built(torch.optim.AdamW):
        def __init__(self, params, lr, adamw_mode):
            super().__init__(params, lr=lr)

    def cannot_build(*args, **kwargs):
        raise RuntimeError("Error building extension 'cpu_adam'\nninja: build stopped")

    gpu = cpu.replace(device="cuda")
    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", Built)
    assert host_optimizer(model, gpu)[1] == "deepspeed"
    monkeypatch.setattr(deepspeed.ops.adam, "DeepSpeedCPUAdam", cannot_build)
    optimizer, name = host_optimizer(model, gpu)
    assert name == "torch" and type(optimizer) is torch.optim.AdamW
