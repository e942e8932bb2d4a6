# The optimizer state in host memory (--offload optimizer, autosp/comm/host_optimizer.py) on one GPU: pinned host
# buffers, non_blocking copies, DeepSpeed's CPU Adam by default on CUDA (issue 26, item 2). Not run yet: written for
# when a device is lent. Usage, from the repository root on a machine with one GPU (an H200: h200-141gb):
#   OUT=/some/dir bash tests/gpu/optimizer_offload_check.sh
# 1) exactness against single-process training on the GPU (DeepSpeed's CPU Adam, then torch's AdamW on the host);
# 2) llama-3.2-1b, bf16 mixed, one rank: simulated and measured device peak and host bytes without / with it.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
exec > >(tee $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; timeout ${TMO:-240} "$@" 2>&1 | grep -v Warning | tail -${LINES_KEPT:-3}; }
for adam in deepspeed torch; do
    LINES_KEPT=10 step python3 -m autosp check --method autosp --model tiny --seq-len 256 --world-size 1 --device cuda \
        --compile-backend aot_eager --offload optimizer:$adam
done
COMMON="--method autosp --model llama-3.2-1b --world-size 1 --dtype bfloat16 --sac auto --tiling auto --seq-len ${LEN:-65536}"
for offload in auto auto,optimizer; do
    step python3 -m autosp simulate $COMMON --offload $offload --device ${SIM_DEVICE:-h200-141gb} --out $OUT/simulated.jsonl
    step python3 -m autosp run $COMMON --offload $offload --device cuda --compile-backend aot_eager --steps 2 --warmup 1 \
        --out $OUT/measured.jsonl
done
python3 - "$OUT" <<'PY'
import json, sys
for name in ("simulated", "measured"):
    for line in open(f"{sys.argv[1]}/{name}.jsonl"):
        r = json.loads(line)
        host = r["extra"].get("breakdown", r["extra"].get("memory", {})).get("host_offloaded_bytes")
        print(name, r["config"]["offload"], r["status"], r["peak_mem_bytes"], "host", host,
              r["extra"].get("optimizer_offload"))
PY
echo "=== [$(( $(date +%s) - t0 ))s] done"
