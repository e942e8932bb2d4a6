# The checks run by hand on a one-GPU machine (an H200 on 2026-11-30, the closing note of that session has the
# numbers): the CUDA context probe, a CUDA gradient check with padding, and llama-3.2-1b per-rank peaks at P=2 with
# the ranks sharing the GPU over gloo (AUTOSP_SHARE_GPUS=1), to set beside `autosp simulate --device h200-141gb`.
# Usage, from the repository root: OUT=/some/dir bash tests/gpu/one_gpu_checks.sh  (DeepSpeed needed for ulysses;
# wheels in .whl/ are installed first if present, for a machine without a package index)
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export DS_BUILD_OPS=0 PYTHONPATH=/tmp/site:$PWD AUTOSP_SHARE_GPUS=1 PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8
exec > >(tee $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 tests/gpu/context_probe.py $OUT/context.json
t0=$(date +%s)
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*"; timeout ${TMO:-150} "$@" 2>&1 | grep -v Warning | tail -4; }
step python3 -m autosp check --method autosp --model tiny --seq-len 256 --world-size 2 --device cuda --compile-backend aot_eager --pad-fraction 0.25
R="python3 -m autosp run --device cuda --world-size 2 --model llama-3.2-1b --dtype bfloat16 --steps 2 --warmup 1 --zero 0 --out $OUT/runs.jsonl"
step $R --method autosp --seq-len 16384 --compile-backend aot_eager
step $R --method ulysses --seq-len 16384
step $R --method autosp --seq-len 32768 --compile-backend aot_eager --tiling auto
step $R --method autosp --seq-len 32768 --compile-backend aot_eager --tiling auto --offload activations
step $R --method autosp --seq-len 32768 --compile-backend aot_eager --tiling auto --zero 3  # the last --zero wins
# Inductor fuses within a token tile only (lowering.TileSegments, Inductor choices handler: on torch 2.11 here;
# docs/measurements/2026-12-06-tile-fusion.md)
TMO=200 step $R --method autosp --seq-len 32768 --compile-backend inductor --tiling auto
# offload under Inductor: its peak beside the aot_eager offload line above (Inductor once issued every reload at
# the start of backward: docs/measurements/2026-12-06-inductor-reloads.md)
TMO=200 step $R --method autosp --seq-len 32768 --compile-backend inductor --tiling auto --offload activations
echo "=== [$(( $(date +%s) - t0 ))s] done"
