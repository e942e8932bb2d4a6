# The memory planner (--sac auto --offload auto) on one GPU at long lengths: the simulator's predicted device
# peak and host bytes beside the measured ones (issue 26), llama-3.2-1b, bf16 mixed, one rank, tiled loss and MLP.
# Usage, from the repository root on a machine with one GPU (an H200: h200-141gb):
#   OUT=/some/dir bash tests/gpu/planner_check.sh
# Each length: `autosp simulate` (fake tensors, on the CPU) then `autosp run` (the GPU); the last lines compare them.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
exec > >(tee $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
COMMON="--method autosp --model llama-3.2-1b --world-size 1 --dtype bfloat16 --sac auto --offload auto --tiling auto"
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; timeout ${TMO:-240} "$@" 2>&1 | grep -v Warning | tail -3; }
for len in ${LENGTHS:-65536 262144}; do
    step python3 -m autosp simulate $COMMON --device ${SIM_DEVICE:-h200-141gb} --seq-len $len --out $OUT/simulated.jsonl
    step python3 -m autosp run $COMMON --device cuda --compile-backend aot_eager --steps 2 --warmup 1 --seq-len $len \
        --out $OUT/measured.jsonl
done
python3 tests/gpu/planner_compare.py $OUT/simulated.jsonl $OUT/measured.jsonl
echo "=== [$(( $(date +%s) - t0 ))s] done"
