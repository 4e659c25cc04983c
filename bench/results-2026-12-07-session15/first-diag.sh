# A diagnosis lease (too little device time left for a sealed round): the MLA split grid at span 131072 first
# (bench/mla_depth.py), bench/pick_split.py's fastest rows-form step (any gain), then as the job (bench/lease.sh,
# PHASES=diag, no reference build) the depth profile of k3-wide-long at BASE and at that step: the in-process clock,
# no gate, no seal.
set -u
OUT=$1
cp -r .carry/kit /root/kit && chmod 600 /root/kit/signing.key && rm -rf /root/kit/testwhl
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir /root/kit/whl/*.whl 2>&1 | tail -2
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "card: $card"
GRID="16,64,4,2,264;32,64,8,2,264,1;64,64,8,2,264,1;32,64,16,2,264,1;16,64,8,2,264,1;32,64,8,3,264,1"
timeout 150 python3 bench/mla_depth.py --preset k3-wide-long --preset k3-gpu-long --spans 131072 --no-prefill \
  --decode-grid "$GRID" --out "$OUT/grid.json" > "$OUT/grid.log" 2>&1
echo "grid rc $?"; grep -E '"us"|error' "$OUT/grid.log" | cut -c1-260
python3 bench/pick_split.py "$OUT/grid.json" --preset k3-wide-long --current 16,64,4,2,264,0 --min-gain -1 \
  --step 32,64,8,2,264,1=287f20a --step 64,64,8,2,264,1=289538e --step 32,64,16,2,264,1=a391812 \
  --step 16,64,8,2,264,1=8b8f6cf --step 32,64,8,3,264,1=cee071d --replan /tmp/pick
V=$(. /tmp/pick; echo "$STEPS"); [ -n "$V" ] || V=287f20a
c=$(echo "$card" | sed -E 's/^NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
cat > "/root/kit/plan.$c" <<PLAN
PHASES="diag"
BUILD_FIRST=0
GPU_TARGET=k3-wide-long-$c
GEN_WEIGHTS=k3-wide-long
BASE=fbc05bb
STEPS=""
BESIDE="fbc05bb $V"
PROFILE_ARGS_BESIDE="--forms kernels --depths 131072 --prefill 2048 --reps 3"
PLAN
bash bench/lease.sh /root/kit /root/job
bash bench/h200_poll.sh "$OUT/p1" /root/job 200
