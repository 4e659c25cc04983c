#!/bin/bash
# One H200 call: reference build (CUDA) while both GPU presets generate, then the conditioning measurements.
# Run from the repository root of the carried copy; wheels from ../../.devkit/whl, llama.cpp from ../../.devkit/llama.cpp.
# usage: bash bench/h5_gpu.sh OUT COMMIT MEASURE_BUDGET_S SEEDS DEPTHS
set -u
OUT=$1; COMMIT=$2; BUDGET=$3; SEEDS=$4; DEPTHS=$5
KIT=$(cd ../../.devkit && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KIT"/whl/*.whl 2>&1 | tail -3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h /tmp | tail -1; nproc
python3 bench/h5_conditioning.py --preset k3-gpu --preset k3-wide --generate-only --models /tmp/h5-models \
    --out "$OUT/gen" > "$OUT/generate.log" 2>&1 &
GEN=$!
python3 bench/h5_conditioning.py --llama-git "$KIT/llama.cpp" --llama-commit "$COMMIT" --build-only \
    --cache /tmp/sbcache --out "$OUT/build" > "$OUT/build.log" 2>&1
echo "build rc $?"; tail -3 "$OUT/build.log"
wait $GEN; echo "generate rc $?"; cat "$OUT/generate.log"
python3 bench/h5_conditioning.py --preset k3-gpu --preset k3-wide --llama-git "$KIT/llama.cpp" \
    --llama-commit "$COMMIT" --cache /tmp/sbcache --models /tmp/h5-models --seeds "$SEEDS" --depths "$DEPTHS" \
    --budget-s "$BUDGET" --out "$OUT" 2>&1 | tee "$OUT/measure.log"
