"""Where a node is in the model, read from Dynamo's module stack: a call to a module-level kernel module (HF's
``use_kernel_func_from_hub`` wrappers, recorded as a global ``G[...]``) is still placed in the model's module."""
from __future__ import annotations

import torch

from autosp.compiler.fx.layers import global_callee, layer_of_path, module_path, user_path
from autosp.compiler.sp.spec import node_label
from tests.compiler.graphs import capture


class _Kernel(torch.nn.Module):
    """A module-level function wrapped as a module, as transformers 5.25 wraps ``causal_conv1d_fn``."""

    def forward(self, x):
        return torch.nn.functional.conv1d(x, torch.ones(4, 1, 3), padding=2, groups=4)[..., : x.shape[-1]]


causal_kernel = _Kernel()


class _Mixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return causal_kernel(self.proj(x).transpose(1, 2)).transpose(1, 2)


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_Mixer()])

    def forward(self, x):
        return self.layers[0](x)


def test_a_node_inside_a_module_level_kernel_is_named_by_the_model_module_it_runs_in():
    gm, _ = capture(_Model(), x=torch.randn(1, 8, 4))
    conv = next(n for n in gm.graph.nodes if n.target is torch.conv1d)
    assert any(path.startswith("G[") for path, _ in conv.meta["nn_module_stack"].values())  # the case under test
    assert module_path(conv).endswith("layers.0")
    assert global_callee(conv) == "causal_kernel"
    assert layer_of_path(module_path(conv)).endswith("layers.0")  # its decoder layer is found too
    label = node_label(conv)
    assert label == f"layers.0 ({conv.name} in causal_kernel)", label  # as the model names it: no Dynamo root
    proj = next(n for n in gm.graph.nodes if n.target is torch._C._nn.linear)
    assert global_callee(proj) is None and node_label(proj) == f"layers.0.proj ({proj.name})"


def test_a_module_path_is_shown_as_the_model_names_it():
    assert user_path("L['self'].model.layers.0.mlp") == "model.layers.0.mlp"
    assert user_path("L['args'][0].model.embed_tokens") == "model.embed_tokens"
    assert user_path("L['self']") == "the model"
    assert user_path("G['causal_conv1d_fn']") == "G[causal_conv1d_fn]"
