"""DeepSpeed's AutoSP is a peer: the adapter runs it as documented and reports what happens, right or wrong."""

from autosp.harness.config import RunConfig
from autosp.harness.runner import run
from baselines.ds_autosp import autosp_config


def test_config_is_deepspeeds_documented_autosp_setup() -> None:
    config = autosp_config(RunConfig("ds-autosp", "tiny", 64, world_size=2), sp_size=2)
    assert config["compile"] == {"deepcompile": True, "passes": ["autosp"]}
    assert config["sequence_parallel_size"] == 2
    assert config["zero_optimization"]["stage"] in (0, 1)  # AutoSP composes with ZeRO 0/1 only


def test_run_on_project_llama_is_recorded_with_deepspeeds_own_outcome() -> None:
    single = run(RunConfig("single", "tiny", 64, steps=1, warmup=0))
    record = run(RunConfig("ds-autosp", "tiny", 64, world_size=2, steps=1, warmup=0, timeout_s=300))
    assert record.keys() == single.keys()  # same record schema whatever the outcome
    import deepspeed

    if deepspeed.__version__ == "0.19.8":
        # Known: its pass shards position_ids but not the [B,1,S,S] mask the model builds from them.
        assert record["status"] == "error" and "BackendCompilerFailed" in record["error"], record["error"]
    else:
        assert record["status"] in ("ok", "error"), record["error"]



def test_bfloat16_is_deepspeeds_mixed_precision_with_fp32_gradients() -> None:
    """DeepSpeed's bf16 with fp32 gradient accumulation and communication; its fp32 masters need a ZeRO optimizer,
    so ds-autosp runs stage 1 in mixed bf16; pure names DeepSpeed cannot run are refused, not run as mixed."""
    import pytest

    from autosp.harness.config import ConfigError
    from baselines.zero3 import zero3_config

    mixed = autosp_config(RunConfig("ds-autosp", "tiny", 64, world_size=2, dtype="bfloat16"), sp_size=2)
    assert mixed["zero_optimization"]["stage"] == 1 and mixed["bf16"] == {"enabled": True}
    assert mixed["communication_data_type"] == "fp32" and mixed["data_types"] == {"grad_accum_dtype": "fp32"}
    pure = autosp_config(RunConfig("ds-autosp", "tiny", 64, world_size=2, dtype="bfloat16-pure"), sp_size=2)
    assert pure["zero_optimization"]["stage"] == 0 and "communication_data_type" not in pure
    assert zero3_config(RunConfig("zero3", "tiny", 64, world_size=2, dtype="bfloat16"), 1000)["bf16"]["enabled"]
    with pytest.raises(ConfigError, match="zero3 has no bfloat16-pure training"):
        zero3_config(RunConfig("zero3", "tiny", 64, world_size=2, dtype="bfloat16-pure"), num_params=1000)
