#!/usr/bin/env bash
# Wheels for `make gpu-check` on a GPU machine that has torch, transformers and peft but reaches
# no registry (benchmarks/README.md). A device call carries at most 64 MiB with the working tree
# (~11 MB), so they come in two folders:
#   .whl      what the engine imports that such a machine lacks, and trl, accelerate, datasets
#             with their small dependencies (~7 MB): carried by the gpu-check call itself;
#   .whl-big  pyarrow and pandas (~56 MB), which datasets and trl import: carried by a call just
#             before it, installed into the same folder (the machine keeps /tmp while it is warm).
# Without .whl-big the trl row of the table says it was skipped; every other row runs.
#
#   bash scripts/gpu_wheels.sh [PYTHON_VERSION]      # default 3.12, the GPU machine's so far
set -euo pipefail
version="${1:-3.12}"
python="${PYTHON:-python3}"
download() {
    local folder="$1"; shift
    rm -rf "$folder"
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$folder" "$@"
    echo "$folder: $(ls "$folder" | wc -l) wheels, $(du -sh "$folder" | cut -f1)"
}
download .whl pydantic pydantic-core annotated-types typing-inspection typing-extensions omegaconf \
    tenacity httpx-sse \
    trl==1.16.0 accelerate datasets==5.0.0 dill multiprocess xxhash fsspec psutil python-dateutil pytz tzdata
# pyarrow 21: the smallest that datasets 5.0 takes (26 would not fit the call with the tree)
download .whl-big pyarrow==21.0.0 pandas
cat <<'TXT'
Then, on the device (two calls, back to back):
  1. carry [".whl-big"]: python -m pip install -q --no-index --no-deps --no-compile --target /tmp/opentinker-gpu-site .whl-big/*.whl
  2. carry [".whl"]:     make gpu-check WHEELS=.whl
TXT
