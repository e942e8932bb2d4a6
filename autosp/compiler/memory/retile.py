"""What the planner tells the driver about tiling (`pipeline.compile_static`, `_lower_tiled`): tile the graph first,
halve the token-wise blocks' tiles, or keep the larger tiles; raised from inside aot_autograd's partition call."""
from __future__ import annotations


class TileFirst(Exception):
    """`plan_partition(tile_first=True)` found that the graph, as it is, does not fit its budget with every value
    kept on the device: the driver tiles it (`tiling="plan"`) and partitions that instead."""


class KeepLargerTiles(Exception):
    """`plan_partition(larger_tiles_peak=p)` found that no rung fits and that the halved tiles peak no lower than
    `p` (the same graph with the larger tiles): the driver lowers the larger tiles instead (`pipeline._lower_tiled`)."""


class TileSmaller(Exception):
    """`plan_partition(smaller_tiles_below=b)` found that no rung fits the budget and that the ladder's plan peaks
    below `b` (the peak of the same graph with larger tiles): the driver halves the token-wise blocks' tiles and
    partitions that instead (`pipeline.compile_static`). `peak`: this graph's estimated peak."""

    def __init__(self, peak: int, budget: int) -> None:
        super().__init__(f"estimated peak {peak} bytes over the budget of {budget} on every rung")
        self.peak = peak
