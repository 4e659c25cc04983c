#!/bin/bash
# One H200 call: the diagnosis profile (bench/h200_profile.py) of sparkinfer at this checkout, per GPU target.
# The box reaches no PyPI: the wheels come from the carried kit (.devkit/whl, see .devkit/README.txt).
# usage (repository root of the carried copy): bash bench/h200_profile.sh OUT KIT TARGET...
set -u
OUT=$1; KIT=$(cd "$2" && pwd); shift 2
export PYTHONUNBUFFERED=1 SCOREBOARD_CACHE=/tmp/sbcache
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KIT"/whl/*.whl 2>&1 | tail -2
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "$PWD" > "$site/scoreboard-local.pth"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
python3 -X importtime -c "import torch; torch.cuda.init()" 2> "$OUT/importtime.txt"
python3 -c "import time; t=time.perf_counter(); import torch; torch.zeros(1, device='cuda'); print('torch import + cuda init s', round(time.perf_counter()-t, 2))"
for t in "$@"; do
  echo "== $t at $SECONDS s"
  python3 bench/h200_profile.py --target "$t" --out "$OUT/prof-$t.json" > "$OUT/prof-$t.log" 2>&1
  echo "rc $?"; tail -3 "$OUT/prof-$t.log"
done
echo "== done at $SECONDS s"
