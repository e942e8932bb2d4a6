"""Passes 3 and 5, ZeRO inside the graphs: gradients reduced over SP x DP in buckets inside backward (`grad_buckets`),
ZeRO 2/3 parameter gathers bucketed per layer and issued a layer ahead (`prefetch`). The names below are what the
driver imports; the modules are private to this package."""
from __future__ import annotations

from autosp.compiler.zero.grad_buckets import Bucket, GradientReduction, bucket_gradient_reduction
from autosp.compiler.zero.prefetch import GatherBucket, prefetch_gathers

__all__ = ["Bucket", "GatherBucket", "GradientReduction", "bucket_gradient_reduction", "prefetch_gathers"]
