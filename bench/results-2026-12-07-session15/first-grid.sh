# The cheapest lease: the MLA decode split's grid at span 131072 (bench/mla_depth.py: the head form against the
# rows form's tiles, at k3-wide-long's and k3-gpu-long's widths, kernels alone on random inputs), nothing else.
set -u
OUT=$1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .carry/kit/whl/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GRID="16,64,4,2,264;32,64,8,2,264,1;64,64,8,2,264,1;32,64,16,2,264,1;16,64,8,2,264,1;32,64,8,3,264,1;32,64,8,2,132,1"
timeout 300 python3 bench/mla_depth.py --preset k3-wide-long --preset k3-gpu-long --spans 131072 --no-prefill \
  --decode-grid "$GRID" --out "$OUT/grid.json" > "$OUT/grid.log" 2>&1
echo "grid rc $?"; cut -c1-300 "$OUT/grid.log"
