"""autosp.compiler.sp.attribution: an internal error inside a step of the SP walk reaches the user as one line naming
the node, its module path and the pattern the walk saw, not as torch's raw error (issue 46, D4)."""
import pytest
import torch

import autosp.comm  # noqa: F401
from autosp.compiler.fx.layers import module_path
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.errors import SequenceParallelError
from tests.compiler.graphs import capture
from tests.compiler.hf_models import build_hf


def _planted_linear(x, weight, bias=None):
    """A linear whose batch of weights the pass cannot adapt (planted): torch's own shape error on the shard."""
    return torch.bmm(x, weight.t()[None].expand(2, -1, -1))


def test_an_internal_shape_error_names_the_node_module_and_pattern():
    model = build_hf("llama")
    ids = torch.randint(0, 64, (1, 32))
    gm, _ = capture(model, input_ids=ids, labels=ids)
    planted = next(n for n in gm.graph.nodes if n.target is torch._C._nn.linear
                   and (module_path(n) or "").endswith("model.layers.0.mlp.down_proj"))
    planted.target = _planted_linear
    with pytest.raises(SequenceParallelError) as refusal:
        sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    message = str(refusal.value)
    assert message.startswith(f"AutoSP's SP pass failed at model.layers.0.mlp.down_proj ({planted.name}) "
                              "(_planted_linear) in running the op on this rank's shard"), message
    # the pattern seen: the activation sharded along the sequence, the weight full
    seen = f"seeing [{planted.args[0].name}: sequence on dim 1, 16 of 32; down_proj_parameters_weight_: full (64, 64)]"
    assert seen in message, message
    assert "RuntimeError: Expected size for first two dimensions of batch2 tensor" in message, message
    assert "\n" not in message


def test_an_error_inside_a_step_names_that_step(monkeypatch):
    """A step's own internal error (here a planted KeyError in the index frontier) names that step's function."""
    from autosp.compiler.sp import indices

    def broken(ctx, node):
        return {}[node.name]

    monkeypatch.setattr(indices, "is_frontier", lambda ctx, node: broken(ctx, node))
    gm, _ = capture(build_hf("llama"), input_ids=torch.randint(0, 64, (1, 32)))
    with pytest.raises(SequenceParallelError) as refusal:
        sequence_parallel_pass(gm, sp_rank=0, sp_size=2, group_name="unused")
    message = str(refusal.value)
    assert message.startswith("AutoSP's SP pass failed at ") and "in sp/walk.py:_rewrite" in message, message
    assert "KeyError" in message and "\n" not in message

