# AutoSP against ALST on one GPU, side by side under the same emulated device budget (issue 47): gradient checks on
# the GPU, each method's longest trainable length predicted by the simulator and bracketed by two real runs (the
# prediction fits, one granule above is oom), steady-state step times at one length all methods fit, one table.
# Methods: autosp with its defaults, alst as ArcticTraining runs it, and the practitioners' baseline: per-layer
# activation checkpointing (ulysses[ac=layer] at one rank is single[ac=layer]: no all-to-all, HF-style checkpointing).
#
# On one H200 (about 8 minutes; DeepSpeed travels as wheels: bash tests/gpu/wheels.sh here first, carry .whl):
#   OUT=/some/dir bash tests/gpu/peer_check.sh
# The CPU rehearsal (the same script end to end, tiny sizes; tests/gpu/test_peer_check.py runs it, long profile):
#   OUT=/some/dir DEVICE=cpu PYTHON=.venv/bin/python bash tests/gpu/peer_check.sh
# Every setting below can be overridden from the environment. Records land in $OUT (at most 8 files come back from
# a device machine: log.txt, predicted.jsonl, check-*.json, search.jsonl, bench.jsonl, table.md, smi.csv).
set -u
: "${OUT:?set OUT to the folder the records go to}"
DEVICE=${DEVICE:-cuda}
if [[ $DEVICE == cpu ]]; then
    MODEL=${MODEL:-hf:tiny} BUDGET=${BUDGET:-48MiB} DTYPE=${DTYPE:-float32} SIM_DEVICE=${SIM_DEVICE:-cpu}
    CHECK_LEN=${CHECK_LEN:-128} GRANULARITY=${GRANULARITY:-512} MAX_LEN=${MAX_LEN:-32768} BACKEND=${BACKEND:-aot_eager}
else
    # TinyLlama-1.1B: untied LM head (alst refuses tied ones), its optimizer state fits the host's 128 GiB
    MODEL=${MODEL:-hf:tinyllama-1.1b} BUDGET=${BUDGET:-40GiB} DTYPE=${DTYPE:-bfloat16} SIM_DEVICE=${SIM_DEVICE:-h200-141gb}
    CHECK_LEN=${CHECK_LEN:-1024} GRANULARITY=${GRANULARITY:-16384} MAX_LEN=${MAX_LEN:-2097152} BACKEND=${BACKEND:-aot_eager}
fi
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-500}  # seconds for the whole script; every step is cut to what is left
METHODS=${METHODS:-"autosp alst single[ac=layer]"}  # single[ac=layer]: Ulysses at one rank, HF-style checkpointing

source tests/gpu/lib.sh
# `name[option=value]` -> the CLI's flags for search and simulate (bench takes the spec itself)
flags() { local m=${1%%[*} o=""; [[ $1 == *"["* ]] && o=${1#*[} && o=${o%]}; echo "--method $m ${o:+--${o//=/ }}"; }
RUN="--model $MODEL --world-size 1 --dtype $DTYPE --memory-budget $BUDGET"
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. predictions on the CPU, beside the GPU work below (one process per method)
predictions=()
for m in $METHODS; do
    step $(( DEADLINE / 2 )) $PY -m autosp simulate $(flags $m) $RUN --device $SIM_DEVICE --compile-backend $BACKEND \
        --search --granularity $GRANULARITY --max-len $MAX_LEN --out "$OUT/predicted.jsonl" &
    predictions+=($!)
done
# 2. gradient checks on the device (loss, every gradient, parameters after AdamW; alst's LM-head scale is its own)
for m in autosp alst; do
    KEEP=12 step 120 $PY -m autosp check $(flags $m) --model $MODEL --seq-len $CHECK_LEN --world-size 1 \
        --device $DEVICE --compile-backend $BACKEND --check-steps 1 --json-out "$OUT/check-$m.json"
done
wait "${predictions[@]}"  # (a bare `wait` would wait for the log's tee too)
# 3. each method at its predicted maximum and one granule above: two real runs bracket the measured maximum
for m in $METHODS; do
    predicted=$($PY tests/gpu/peer_table.py "$OUT" --predicted "$m")
    [[ -n $predicted ]] || { echo "=== no prediction for $m: its search starts from the granularity"; predicted=$GRANULARITY; }
    step 150 $PY -m autosp search $(flags $m) $RUN --device $DEVICE --compile-backend $BACKEND --steps 0 \
        --granularity $GRANULARITY --max-len $MAX_LEN --start-len $predicted --guide off --out "$OUT/search.jsonl"
done
# 4. steady-state step time at one length every method fits (the shortest measured maximum), interleaved
common=$($PY tests/gpu/peer_table.py "$OUT" --common-length)
if [[ -n $common ]]; then
    [[ $DEVICE == cuda ]] && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader \
        -l 1 > "$OUT/smi.csv" & smi=$!; }
    step 240 $PY -m autosp bench --methods "$(echo $METHODS | tr ' ' ,)" $RUN --device $DEVICE \
        --compile-backend $BACKEND --seq-lens $common --steps 3 --warmup 1 --ratio-to alst --out "$OUT/bench.jsonl"
    [[ -n ${smi:-} ]] && kill $smi
fi
# 5. the table, from the records
$PY tests/gpu/peer_table.py "$OUT" | tee "$OUT/table.md"
echo "=== [$(( $(date +%s) - t0 ))s] done"
