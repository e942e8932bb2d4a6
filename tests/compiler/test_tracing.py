"""autosp.compiler.tracing: the layer a graph break is reported in."""
import pytest
import torch

from autosp.compiler.tracing import breaking_module


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
