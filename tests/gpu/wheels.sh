# The wheels a device machine lacks for tests/gpu/*.sh, gathered here into .whl/ (git-ignored), at the versions
# constraints.txt pins: DeepSpeed as a pure-Python wheel built with DS_BUILD_OPS=0 (no op compiled; on the GPU its
# CPU Adam is JIT-built at first use, or alst falls back to torch's AdamW), and what DeepSpeed needs that the device
# image does not hold (its package list: /work/.library/device/KINDS.md): hjson, pydantic and its own needs.
# The device is Python 3.12 on x86-64, so binary wheels are fetched for that platform.
# Usage, from the repository root: bash tests/gpu/wheels.sh   (then name .whl in the device run's carry)
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude="$(git rev-parse --git-path info/exclude)"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir .whl
pin() { sed -n "s/^$1==//p" constraints.txt; }
DS_BUILD_OPS=0 bin/autosp-env python -m pip wheel --quiet --no-deps --no-build-isolation -w .whl "deepspeed==$(pin deepspeed)"
platforms=()
for n in 28 27 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
bin/autosp-env python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 -d .whl \
    "hjson==$(pin hjson)" "pydantic==$(pin pydantic)" "pydantic-core==$(pin pydantic-core)" \
    "annotated-types==$(pin annotated-types)" "typing-inspection==$(pin typing-inspection)" \
    "typing-extensions==$(pin typing-extensions)"
ls -l .whl
du -sh .whl
