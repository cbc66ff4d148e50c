#!/usr/bin/env bash
# The GPU device check, in one call on a lent GPU machine (docs/kernels.md, "The device check"):
#   correctness   the Pallas Triton kernels (paged decode, partial attention; float, int8, fp8 pages)
#                 against the jnp references;
#   bandwidth     paged decode's HBM bytes/s against the device copy bandwidth, batch 1-64,
#                 contexts 1k-32k, bf16 / int8 / fp8 pages;
#   engine_speed  kvjax.engine on SmolLM2-135M's shapes (random bf16 weights): TTFT cold and with a
#                 prefix hit at 1k / 4k tokens, decode tokens/s at batch 1 / 8 / 64;
#   blend_speed   CacheBlend (15%) against full recompute, TTFT of a multi-chunk prompt.
# Each stage is guarded (a failure is recorded and the next runs); ~8 minutes on an H200.
# Writes $OUT/device_check.md and $OUT/device_check.json (OUT defaults to ./device_check_out).
#
#   bash experiments/device_wheels.sh                # here, once: the wheels the machine lacks
#   bash experiments/device_check.sh                 # there, with .device_wheels carried
#   bash experiments/device_check.sh --dry-run       # anywhere: every stage on the CPU, tiny
#
# The wheels in .device_wheels/ (cp312 builds, experiments/device_check/wheels.txt) are installed
# offline into a temporary folder first, when the interpreter is CPython 3.12 (the machine's).
# PYTHON picks the interpreter (default python3); DEVICE_CHECK_COMMIT names the commit in the
# report where the copy of the tree has no .git.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
OUT="${OUT:-$PWD/device_check_out}"
mkdir -p "$OUT"
export OUT
WHEELS=.device_wheels
if compgen -G "$WHEELS/*.whl" > /dev/null && "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))'; then
  SITE="$(mktemp -d /tmp/device_check_site.XXXXXX)"
  trap 'rm -rf "$SITE"' EXIT
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
elif [[ " $* " != *" --dry-run "* ]]; then
  echo "device_check.sh: no cp312 wheels installed from $WHEELS/ (bash experiments/device_wheels.sh, then carry it);" \
    "without blake3 and gguf the engine_speed and blend_speed stages fail" >&2
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
"$PYTHON" -m experiments.device_check --out "$OUT" "$@"
