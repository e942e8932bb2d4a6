# How fast, at the lengths AutoSP exists for (issue 43): llama-3.2-1b with the memory planner on one GPU at 32K, 128K
# and 256K tokens, each length's predicted step (the simulator's time model, on the CPU beside the GPU work) beside
# its measured steady-state step (>= 3 timed steps after a warm-up), nvidia-smi sampled every second, one table.
#
# On one H200 (at most 8 minutes; the deadline is inside):
#   OUT=/some/dir bash tests/gpu/throughput_check.sh
# The CPU rehearsal (the same script end to end, tiny sizes; tests/gpu/test_throughput_check.py runs it, long
# profile):
#   OUT=/some/dir DEVICE=cpu PYTHON=.venv/bin/python bash tests/gpu/throughput_check.sh
# Every setting below can be overridden from the environment. Records land in $OUT (log.txt, predicted.jsonl,
# runs.jsonl, windows.csv, smi.csv, table.md: at most 8 files come back from a device machine).
set -u
: "${OUT:?set OUT to the folder the records go to}"
DEVICE=${DEVICE:-cuda}
if [[ $DEVICE == cpu ]]; then
    MODEL=${MODEL:-tiny} LENGTHS=${LENGTHS:-"256 512 1024"} DTYPE=${DTYPE:-float32} SIM_DEVICE=${SIM_DEVICE:-cpu}
    BUDGET=${BUDGET:-1GiB} PLANNER=${PLANNER:-"--sac auto --tiling auto"}
else
    # the 262K setting: the planner's recompute, host memory for saved values and the optimizer state
    MODEL=${MODEL:-llama-3.2-1b} LENGTHS=${LENGTHS:-"32768 131072 262144"} DTYPE=${DTYPE:-bfloat16}
    SIM_DEVICE=${SIM_DEVICE:-h200-141gb} BUDGET=${BUDGET:-}
    PLANNER=${PLANNER:-"--sac auto --tiling auto --offload auto,optimizer:torch --host-memory-budget 100GiB"}
fi
BACKEND=${BACKEND:-aot_eager} STEPS=${STEPS:-3} WARMUP=${WARMUP:-1}
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-470}  # seconds for the whole script; every step is cut to what is left

source tests/gpu/lib.sh
RUN="--method autosp --model $MODEL --world-size 1 --dtype $DTYPE --compile-backend $BACKEND $PLANNER"
[[ -n $BUDGET ]] && RUN="$RUN --memory-budget $BUDGET"
[[ $DEVICE == cuda ]] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# 1. predictions on the CPU, beside the GPU work below (one process per length)
predictions=()
for n in $LENGTHS; do
    step $(( DEADLINE / 2 )) $PY -m autosp simulate $RUN --device $SIM_DEVICE --seq-len $n \
        --out "$OUT/predicted.jsonl" &
    predictions+=($!)
done
# 2. each length measured: a warm-up, then the timed steps; nvidia-smi every second, each run's window noted
[[ $DEVICE == cuda ]] && { nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv,noheader \
    -l 1 > "$OUT/smi.csv" & smi=$!; }
echo "seq_len,start,end" > "$OUT/windows.csv"
for n in $LENGTHS; do
    start=$(date +%s.%N)
    step $(( DEADLINE / 3 )) $PY -m autosp run $RUN --device $DEVICE --seq-len $n --steps $STEPS --warmup $WARMUP \
        --out "$OUT/runs.jsonl"
    echo "$n,$start,$(date +%s.%N)" >> "$OUT/windows.csv"
done
[[ -n ${smi:-} ]] && kill $smi
wait "${predictions[@]}"  # (a bare `wait` would wait for the log's tee too)
# 3. the table, from the records
$PY tests/gpu/throughput_table.py "$OUT" | tee "$OUT/table.md"
echo "=== [$(( $(date +%s) - t0 ))s] done"
