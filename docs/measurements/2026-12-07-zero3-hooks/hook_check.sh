#!/bin/bash
# Calibrations with the two codes, interleaved, two each; run alone under the lock:
#   flock ~/.autosp-measure.lock hook_check.sh AFTER_CHECKOUT BEFORE_CHECKOUT OUT_DIR
# (this page: AFTER = 065754d's code before its commit, BEFORE = e1639a7; one virtual environment, the after one's)
set -e
AFTER=$1 BEFORE=$2 OUT=$3
mkdir -p "$OUT"
for i in 1 2; do
  for which in after before; do
    checkout=$AFTER; [ $which = before ] && checkout=$BEFORE
    (cd "$checkout" && PYTHONPATH=$checkout /usr/bin/time -f "%e s wall %U+%S CPU-s" "$AFTER/.venv/bin/python" -m autosp \
        calibrate --world-size 2 --repeats 7 --out "$OUT/$which-$i.csv") > "$OUT/$which-$i.log" 2>&1
  done
done
