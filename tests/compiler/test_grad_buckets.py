"""How gradients are grouped into buckets (`autosp.compiler.zero.grad_buckets._group`), on graph nodes carrying only the
gradients' sizes: the multi-rank run in test_sharding.py checks the collectives themselves."""
import pytest
import torch
import torch.fx as fx

from autosp.compiler.zero.grad_buckets import GradientReduction, _Entry, _group

KIB = 1024


def _entries(sizes_and_layers: list[tuple[int, str | None]], dtype=torch.float32) -> list[_Entry]:
    graph = fx.Graph()
    entries = []
    for i, (nbytes, layer) in enumerate(sizes_and_layers):
        node = graph.placeholder(f"g{i}")
        node.meta["val"] = torch.empty(nbytes // torch.tensor([], dtype=dtype).element_size(), dtype=dtype)
        entries.append(_Entry(i, node, node, layer, i))
    return entries


# backward's order: lm_head, then layers 1 and 0 (two gradients each), then the embedding
GRADIENTS = [(6 * KIB, None), (3 * KIB, "layers.1"), (3 * KIB, "layers.1"), (3 * KIB, "layers.0"),
             (3 * KIB, "layers.0"), (6 * KIB, None)]


@pytest.mark.parametrize("sharded, buckets", [
    # stages 0/1 (DDP): across layers, the first bucket capped at 8 KiB, then 12 KiB
    (False, [[0], [1, 2, 3, 4], [5]]),
    # stages 2/3 (FSDP2): one layer per bucket, whatever the caps
    (True, [[0], [1, 2], [3, 4], [5]]),
])
def test_buckets_fill_across_layers_only_below_stage_2(sharded, buckets):
    reduction = GradientReduction("g", 2, 1, sharded, bucket_bytes=12 * KIB, first_bucket_bytes=8 * KIB)
    assert [[e.position for e in b] for b in _group(_entries(GRADIENTS), reduction)] == buckets


def test_a_bucket_never_mixes_dtypes():
    reduction = GradientReduction("g", 2, 1, False)
    entries = _entries(GRADIENTS[:2]) + _entries(GRADIENTS[2:], dtype=torch.bfloat16)
    assert [len(b) for b in _group(entries, reduction)] == [2, 4]
