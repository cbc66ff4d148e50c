#!/usr/bin/env bash
# Downloads the wheels the GPU machine lacks (experiments/device_check/wheels.txt: pinned, each
# one's own requirements already there) into .device_wheels/ (gitignored), as builds for that
# machine: CPython 3.12, manylinux x86-64, no dependencies resolved. Run it here, where pip
# reaches PyPI; name .device_wheels in the device call's carry. Run from anywhere:
#   bash experiments/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
rm -rf .device_wheels
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .device_wheels -r experiments/device_check/wheels.txt
ls -l .device_wheels
