# Shared by the one-GPU scripts (peer_check.sh, throughput_check.sh): DeepSpeed's wheels installed where no package
# index is reachable, the environment every step runs in, the log in $OUT, and `step` (a command cut at its limit
# or at the script's deadline). Source it after OUT, DEADLINE and PY are set.
if ! $PY -c "import deepspeed" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then  # no package index on a device
    # machine: DeepSpeed and what it needs travel as wheels (tests/gpu/wheels.sh)
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export DS_BUILD_OPS=0 PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCHINDUCTOR_COMPILE_THREADS=8 \
    TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/peer-check-inductor}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
t0=$(date +%s)
left() { echo $(( DEADLINE - ($(date +%s) - t0) )); }
step() {  # step SECONDS CMD...: run CMD cut at SECONDS or at the deadline, whichever comes first
    local limit=$1; shift
    (( limit > $(left) )) && limit=$(left)
    (( limit < 10 )) && { echo "=== [$(( $(date +%s) - t0 ))s] skipped (deadline): $*"; return 124; }
    echo "=== [$(( $(date +%s) - t0 ))s] $*"
    timeout "$limit" "$@" 2>&1 | grep -v -e Warning -e "Unexpected exception logging" | tail -${KEEP:-4}
}
