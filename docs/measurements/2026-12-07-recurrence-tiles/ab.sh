#!/bin/bash
# A/B (docs/measurements/2026-12-07-recurrence-tiles.md): Qwen3.5 tiny, P=2, 4,096 tokens, the gated delta rule whole
# and in tiles (the automatic tile), interleaved A B A B; records in $1 (default: the current directory).
# Run from the repository root, alone on the machine.
set -euo pipefail
out=${1:-.}
for i in 1 2; do
  for t in off recurrence; do
    bin/autosp-env autosp run --method autosp --model hf-qwen3.5:tiny --world-size 2 --seq-len 4096 --tiling "$t" \
      --steps 5 --warmup 1 --out "$out/ab-$t.jsonl"
  done
done
