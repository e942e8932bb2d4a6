"""Lowering a Dynamo graph for training with a partition function deciding what backward recomputes: Inductor
(its own pipeline, the partitioner swapped in for this call) or aot_eager (no-op compilers, for tests); and
`sac_backend`, a torch.compile backend that lowers with a checkpointing policy and no SP pass."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch.fx as fx
from torch._functorch import config as functorch_config
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from autosp.comm.library import op_name
from autosp.compiler.fx import AUTOSP_OFFLOAD_OPS, is_view
from autosp.compiler.memory import Policy, SacPolicy, make_partition_fn
from autosp.compiler.tiling import TILE_KEY
from autosp.errors import ConfigError

#: Inductor settings for the graphs of this backend. `allow_buffer_reuse` off: Inductor's wrapper reuses a freed
#: buffer for a later one of the same size instead of freeing it, which keeps it alive from its last use to the
#: reuse; it allows that when its own estimate of the graph's peak (`torch._inductor.memory.estimate_peak_memory`)
#: does not grow, but that estimate does not see what opaque ops allocate inside (SDPA backward's scratch, the
#: all-to-all's buffers), which is where a long sequence peaks. Measured (2 gloo ranks, `tiny`, S=15,360, ZeRO-3,
#: tiling auto, CPU meter): 4 MLP-tile buffers and 4 down-projection gradients (9.9 MiB) of layer 1's backward
#: were held through its attention backward for layer 0's MLP: peak 46.60 MiB, 39.99 MiB without the reuse
#: (aot_eager: 39.61). A freed buffer still serves a later allocation on a GPU (the caching allocator), and in-place
#: kernels (`inplace_buffers`) still write over a dying input.
#: `reorder_for_peak_memory` off: that pass reorders the fused nodes by its own estimate of the graph's peak, which
#: books `autosp_sp::offload`'s host copy as device memory, so it sees nothing freed by an offload and runs the
#: offloads late, their device tensors alive meanwhile. Measured (hf:tiny, 2 gloo ranks, S=11,264, ZeRO-3, 48 MiB,
#: the planner's plan estimated at 28.1 MiB): peak 49.83 MiB (oom) with it, 32.53 MiB without (aot_eager: 29.81).
#: The planner plans the program's order; Inductor keeps it.
INDUCTOR_MEMORY_CONFIG: dict[str, Any] = {"allow_buffer_reuse": False, "reorder_for_peak_memory": False}

#: `node.meta` key of a post-grad node's tile segment (`TileSegments`)
TILE_SEGMENT = "autosp_tile_segment"


class TileSegments(CustomGraphPass):
    """Inductor's last post-grad pass: the program cut where a run of one token tile's ops begins (`TILE_KEY`, set by
    the tiling pass; torch copies it onto the aot nodes a node traces to and onto their gradients' nodes), every node
    numbered with its segment (`TILE_SEGMENT`): a tile's run and the untagged nodes after it up to the next run (a
    gradient summed over the tiles). Neither views nor the offload pass's reloads cut (`_starts_a_run`). Inductor then
    fuses within a segment only (`_FusingWithinTiles`). Its uuid puts the rule in Inductor's and AOTAutograd's cache
    keys."""

    def __call__(self, graph: fx.Graph) -> None:
        segment, tile = 0, None
        for node in graph.nodes:
            mine = (node.meta.get("custom") or {}).get(TILE_KEY)
            if mine is not None and mine != tile and _starts_a_run(node):
                segment, tile = segment + 1, mine
            node.meta[TILE_SEGMENT] = segment

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,), extra=TILE_KEY)


def _starts_a_run(node: fx.Node) -> bool:
    """A tile's op that computes where the program runs its tile: not a placeholder (a value saved from the tile's
    forward), a view (a weight's transpose, which common-subexpression elimination leaves in the first tile, sits in
    backward where the last tile first uses it) or a reload (issued a tile ahead of its use, tagged as what it
    reloads)."""
    return node.op == "call_function" and not is_view(node) and op_name(node.target) not in AUTOSP_OFFLOAD_OPS


def _segments(node: Any) -> set[int]:
    """The tile segments a scheduler node's members (one, or those fused) make their values in: each member's latest
    origin's (the post-grad node it computes; the others are inputs inlined into it, such as a weight's transpose
    that common-subexpression elimination left in the first tile)."""
    made = (max((origin.meta[TILE_SEGMENT] for origin in member.node.origins if TILE_SEGMENT in origin.meta),
                default=None) for member in node.get_nodes() if member.node is not None)
    return {segment for segment in made if segment is not None}


class _FusingWithinTiles:
    """Inductor's heuristics (`V.choices`, delegated to) refusing a fusion of two tile segments' nodes. A fused kernel
    runs where its first member did, its later members' inputs computed ahead of it: a gradient summed over the tiles
    fused into one kernel ran every tile's backward ahead of the sum, out of the planner's order (the next tiles'
    reloads early, the earlier tiles' values held); the kernels inside a tile still fuse
    (docs/measurements/2026-12-06-tile-fusion.md)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def can_fuse(self, scheduler: Any, node1: Any, node2: Any, shared_data_score: int) -> bool:
        return len(_segments(node1) | _segments(node2)) <= 1 and self.inner.can_fuse(
            scheduler, node1, node2, shared_data_score)


def _fusing_within_tiles(inner_compile: Callable[..., Any]) -> Callable[..., Any]:
    """`inner_compile` (Inductor's compiler of one graph: forward, and backward lowered lazily at its first call) run
    with `_FusingWithinTiles` as Inductor's heuristics, the one place AutoSP sets them (`V.set_choices_handler`)."""
    from torch._inductor.virtualized import V

    def compile_graph(*args: Any, **kwargs: Any) -> Any:
        with V.set_choices_handler(_FusingWithinTiles(V.choices)):
            return inner_compile(*args, **kwargs)

    return compile_graph


def compile_with_partitioner(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    partition_fn: Any,
    inner: str = "inductor",
) -> Callable[..., Any]:
    """Compile a Dynamo graph for training with ``partition_fn`` deciding what backward recomputes.

    ``inductor``: Inductor's own pipeline (decompositions, joint-graph passes, caching) with the partitioner
    swapped in through ``torch._inductor.config.custom_partitioner_fn``, scoped to this call, and
    ``INDUCTOR_MEMORY_CONFIG`` and fusion within token tiles (`TileSegments`) for every graph it lowers.
    ``aot_eager``: aot_autograd with no-op compilers, for fast tests."""
    if inner == "inductor":
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        with inductor_config.patch(custom_partitioner_fn=partition_fn), functorch_config.patch(
            enable_autograd_cache=functorch_config.enable_autograd_cache and partition_fn.cacheable
        ):
            # config_patches, not the scope above: the backward graph is lowered lazily, at the first backward
            # call, and compile_fx re-applies its config_patches there
            return compile_fx(gm, example_inputs, inner_compile=_fusing_within_tiles(compile_fx_inner),
                              config_patches={**INDUCTOR_MEMORY_CONFIG, "post_grad_custom_post_pass": TileSegments()})
    if inner == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd

        # torch's own aot_eager compiler: its boxed calling convention frees each input (a saved activation, in
        # backward) after its last use, as Inductor's code does; `make_boxed_func(fx_g.forward)` held them all
        # until backward's end.
        from torch._dynamo.backends.debugging import boxed_nop

        backend = aot_autograd(
            fw_compiler=boxed_nop,
            bw_compiler=boxed_nop,
            partition_fn=partition_fn,
            keep_inference_input_mutations=True,
        )
        return backend(gm, example_inputs)
    raise ConfigError(f"unknown compile backend {inner!r} for SAC lowering; choose inductor or aot_eager")


def sac_backend(
    policy: str | Policy = SacPolicy.SAC, inner: str = "aot_eager", *, cacheable: bool = True, **planner: Any
) -> Callable[..., Any]:
    """A ``torch.compile`` backend applying ``policy`` (no SP pass): single-process SAC; the backend's
    ``partition_fn`` attribute exposes the partition records; ``planner``: `make_partition_fn`'s offload and
    host_budget."""
    partition_fn = make_partition_fn(policy, cacheable=cacheable, **planner)

    def backend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return compile_with_partitioner(gm, example_inputs, partition_fn=partition_fn, inner=inner)

    backend.partition_fn = partition_fn  # type: ignore[attr-defined]
    return backend
