"""autosp.compiler.tracing: the layer a graph break is reported in; HF's flex mask with a padding mask traced."""
import pytest
import torch

from autosp.compiler.sp.attention.flex import FLEX_ATTENTION
from autosp.compiler.tracing import breaking_module, data_dependent_shape_error, tracing_config
from tests.compiler.graphs import capture, count
from tests.compiler.hf_models import build_hf, build_hf_flex


def _breaks(x):
    torch._dynamo.graph_break()  # a helper called by a layer, as HF's attention interfaces are
    return x * 2


class Attention(torch.nn.Module):
    def forward(self, x):
        return _breaks(x)


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Attention(), Attention()])

    def forward(self, x):
        return self.layers[0](x) + 1


def test_a_graph_break_is_reported_in_the_innermost_layer_whose_forward_it_passes_through():
    model = Model()
    with pytest.raises(torch._dynamo.exc.Unsupported) as raised:
        torch.compile(model, fullgraph=True, backend="eager")(torch.randn(3))
    assert breaking_module(model, raised.value) == " in `layers.0` (Attention)"
    assert breaking_module(torch.nn.Linear(2, 2), raised.value) == ""  # a model the stack does not pass through


def test_hf_flex_attention_with_a_padding_attention_mask_traces_as_one_graph():
    """HF's flex mask tests the padding mask's values before applying it (a graph break); traced for AutoSP it
    applies it unread, and HF's own test is back afterwards."""
    import transformers.masking_utils as utils

    original = utils.fast_all
    model = build_hf_flex("llama-flex")
    ids = torch.randint(0, 64, (1, 32))
    mask = torch.ones(1, 32, dtype=torch.long)
    mask[:, 27:] = 0
    with tracing_config():
        gm, _ = capture(model, input_ids=ids, attention_mask=mask)
    assert count(gm, FLEX_ATTENTION) == model.config.num_hidden_layers
    assert utils.fast_all is original


def test_hf_eager_experts_loop_is_refused_naming_its_module_and_batched_mm():
    """HF Mixtral with experts_implementation="eager": the loop over the experts hit has a bound read from tensor
    values; the line names the experts module and the exact static-shape fix."""
    model = build_hf("mixtral-eager-experts")
    ids = torch.randint(0, 64, (1, 32))
    with pytest.raises(torch._dynamo.exc.UserError) as raised, tracing_config():
        torch._dynamo.reset()
        torch.compile(model, fullgraph=True, backend="eager", dynamic=False)(input_ids=ids, labels=ids)
    message = data_dependent_shape_error(model, raised.value)
    assert message.startswith("`model.layers.0.mlp.experts` (MixtralExperts) runs HF's eager experts loop"), message
    assert 'experts_implementation="batched_mm"' in message and "exact" in message and "\n" not in message
    # the same stack read against the model built with grouped_mm: the generic line, still naming the module
    generic = data_dependent_shape_error(build_hf("mixtral"), raised.value)
    assert "loop bound from tensor values in `model.layers.0.mlp.experts` (MixtralExperts)" in generic, generic
