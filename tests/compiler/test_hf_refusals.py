"""Unmodified HF models whose sequence mixing AutoSP cannot shard yet (issue 27): each is refused in one line, at
the SP pass, naming the layer where the graph has one to name (one rank's rewrite, no process group). Their short
convolutions are sharded now (issue 45, `test_hf_hybrids`); the Mamba scans after them are what is refused."""
from __future__ import annotations

import pytest
import torch
import transformers

import autosp.comm  # noqa: F401
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.compiler.tracing import install_output_hooks
from autosp.errors import SequenceParallelError
from tests.compiler.graphs import capture
from tests.compiler.hf_models import COMMON

#: family -> (model class, config class, overrides, what the refusal says)
REFUSED = {
    "mamba2": ("Mamba2ForCausalLM", "Mamba2Config",  # a scan only
               dict(num_heads=8, head_dim=16, expand=2, n_groups=1, state_size=16, chunk_size=16),
               "no attention found"),
    "jamba": ("JambaForCausalLM", "JambaConfig",
              dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                   expert_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
              "model.layers.0.mamba ("),
    "falcon-h1": ("FalconH1ForCausalLM", "FalconH1Config",  # Mamba2 and attention side by side in every layer
                  dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_chunk_size=16,
                       head_dim=16), "model.layers.0.mamba ("),
    "bamba": ("BambaForCausalLM", "BambaConfig",
              dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16),
              "model.layers.0.mamba ("),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                         dict(layer_types=["mamba", "attention"], num_local_experts=4, num_experts_per_tok=2,
                              mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8, mamba_chunk_size=16,
                              shared_intermediate_size=32), "model.layers.0.mamba ("),
}


@pytest.mark.parametrize("family", list(REFUSED))
def test_unsupported_sequence_mixing_is_refused_in_one_line(family):
    model_class, config_class, overrides, phrase = REFUSED[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**COMMON, **overrides})
    model = getattr(transformers, model_class)._from_config(config).train()
    install_output_hooks(model)
    ids = torch.randint(0, 64, (1, 32))
    gm, _ = capture(model, input_ids=ids, labels=ids)
    with pytest.raises(SequenceParallelError) as refusal:
        sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    message = str(refusal.value)
    assert phrase in message and "\n" not in message, message
    assert phrase == "no attention found" or "sequence parallelism" in message, message  # why, and what to do
