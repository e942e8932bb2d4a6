"""Attention under sequence parallelism: the all-to-alls around it (Ulysses), the hybrid with ring attention, hand-written
and flex attention, and masks in O(S)."""
