"""Sequence mixing besides attention on planted models (one rank's rewrite, no process group): a causal convolution
becomes a halo exchange without padding; a non-causal convolution, a scan (cumsum) and a nonlinear recurrence along
the sharded sequence are refused in one line, never sharded silently."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autosp.comm  # noqa: F401
from autosp.comm.library import op
from autosp.compiler.sp.walk import sequence_parallel_pass
from autosp.errors import SequenceParallelError
from tests.compiler.graphs import capture


class Mixer(nn.Module):
    """Embedding, one sequence-mixing step of kind `mixing`, causal SDPA, a token loss."""

    def __init__(self, mixing: str, width: int = 16, kernel: int = 4) -> None:
        super().__init__()
        self.mixing = mixing
        self.embed = nn.Embedding(32, width)
        self.conv = nn.Conv1d(width, width, kernel, groups=width,
                              padding=kernel - 1 if mixing != "centred-conv" else kernel // 2)
        self.cell = nn.Linear(width, width)
        self.head = nn.Linear(width, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        length = x.shape[1]
        if self.mixing in ("causal-conv", "centred-conv"):
            x = self.conv(x.transpose(1, 2))[..., :length].transpose(1, 2)
        elif self.mixing == "cumsum":
            x = x.cumsum(dim=1)
        elif self.mixing == "tanh-recurrence":  # h_t = tanh(x_t + W h_{t-1}): no affine state map to compose
            h, states = torch.zeros_like(x[:, 0]), []
            for t in range(length):
                h = torch.tanh(x[:, t] + self.cell(h))
                states.append(h)
            x = torch.stack(states, dim=1)
        q = x.unflatten(-1, (2, -1)).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, q, q, is_causal=True).transpose(1, 2).flatten(2)
        return F.cross_entropy(self.head(x).reshape(-1, 32), ids.reshape(-1))


def _rewrite(mixing: str, sp_rank: int = 1):
    torch.manual_seed(0)
    gm, _ = capture(Mixer(mixing), ids=torch.randint(0, 32, (2, 16)))
    return sequence_parallel_pass(gm, sp_rank=sp_rank, sp_size=2, group_name="unused")


def test_a_causal_convolution_gets_a_halo_from_the_previous_rank_and_no_padding():
    gm = _rewrite("causal-conv")
    halos = [n for n in gm.graph.nodes if n.target == op("from_previous_rank").default]
    convs = [n for n in gm.graph.nodes if n.target in (torch.conv1d, F.conv1d)]
    assert len(halos) == 1 and len(convs) == 1
    assert halos[0].meta["example_value"].shape == (2, 16, 3)  # kernel - 1 positions of every channel
    assert convs[0].args[4] == 0 and convs[0].meta["example_value"].shape == (2, 16, 8)  # the shard, unpadded


@pytest.mark.parametrize(("mixing", "phrase"), [
    ("centred-conv", "not causal"),
    ("cumsum", "scans along the sharded sequence"),
    ("tanh-recurrence", "sharded sequence"),
])
def test_sequence_mixing_that_cannot_be_sharded_exactly_is_refused_in_one_line(mixing, phrase):
    with pytest.raises(SequenceParallelError) as refusal:
        _rewrite(mixing)
    message = str(refusal.value)
    assert phrase in message and "\n" not in message, message
