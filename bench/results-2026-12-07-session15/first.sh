# The lease's first call (run from the repository's root on the box): the kit installed, the job started
# (bench/lease.sh: the plan of the card lent), and beside the reference build the MLA split grid at span 131072
# (bench/mla_depth.py, a diagnosis); on an H100, bench/pick_split.py turns the grid into the job's replan: step 29's
# fastest rows-form tile if it beats the head form by 15% at k3-wide's widths, else the plan's A/A round.
set -u
OUT=$1
cp -r .carry/kit /root/kit && chmod 600 /root/kit/signing.key
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir /root/kit/whl/*.whl 2>&1 | tail -2
bash bench/lease.sh /root/kit /root/job
card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
GRID="16,64,4,2,264;32,64,8,2,264,1;64,64,8,2,264,1;32,64,16,2,264,1;16,64,8,2,264,1;32,64,8,3,264,1"
timeout 240 python3 bench/mla_depth.py --preset k3-wide-long --preset k3-gpu-long --spans 131072 --no-prefill \
  --decode-grid "$GRID" --out "$OUT/grid.json" > "$OUT/grid.log" 2>&1
echo "grid rc $?"; grep -E '"us"|error' "$OUT/grid.log" | cut -c1-260
case "$card" in *H100*)
  python3 bench/pick_split.py "$OUT/grid.json" --preset k3-wide-long --current 16,64,4,2,264,0 --min-gain 0.15 \
    --step 32,64,8,2,264,1=287f20a --step 64,64,8,2,264,1=289538e --step 32,64,16,2,264,1=a391812 \
    --step 16,64,8,2,264,1=8b8f6cf --step 32,64,8,3,264,1=cee071d --replan /root/job/replan
  cat /root/job/replan;;
esac
bash bench/h200_poll.sh "$OUT/p1" /root/job 300
