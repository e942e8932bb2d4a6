"""Passes 3 and 5, ZeRO inside the graphs: gradients reduced in buckets inside backward, parameter gathers issued a
layer ahead."""
