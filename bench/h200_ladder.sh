#!/bin/bash
# The sparkinfer ladder on one H200, as one background job: a device call returns within 10 minutes, so a
# first call starts this under setsid and later calls poll it (bench/h200_poll.sh). Everything comes from the
# carried kit (the box reaches neither PyPI nor GitHub; docs/reference-pin.md, docs/isolation.md): wheels,
# bubblewrap's .deb, a git bundle of this repository, llama.cpp's pinned tree as a git repository.
#   1. set up; the reference built at its pin (k3-gpu-h200's preflight) beside the k3-wide generation;
#   2. main at BASE, then for each STEP: main fast-forwarded to it and a sealed main round of k3-gpu-h200,
#      scored against the frontier the previous round left (its receipt, ledger line and slots in rounds/);
#   3. k3-wide-h200 calibrated (WIDE_SEEDS seeds), then its BASELINE round and an A/A round of the same main;
#   4. the diagnosis profile at the last step.
# A snapshot of rounds/ and reference.lock ($WORK/state.tgz) follows every sealed record.
# The first record of a bare box renews the reference-build anchor (--renew-reference-anchor, recorded in it): every
# bare box builds llama.cpp again from the verified pinned tree, and nvcc's output is not byte-reproducible (on
# 2026-12-01 libggml-cuda.so differed between two boxes, the other 12 files matched), so the build sealed on an
# earlier box cannot match. WIDE_FIRST=1 runs step 3 before step 2. The job's pid is in $WORK/pid: stop it with
# `kill -- -$(cat $WORK/pid)` (never `pkill -f <pattern>` from a command line that contains the pattern: it kills
# its own shell), or `touch $WORK/stop` to stop before the next record.
# usage: setsid bash bench/h200_ladder.sh WORK KIT BASE STEP... > WORK/job.log 2>&1 < /dev/null &
set -u
WORK=$1; KIT=$(cd "$2" && pwd); BASE=$3; shift 3
HERE=$(cd "$(dirname "$0")/.." && pwd)
LLAMA_COMMIT=b260ed1d9705ddc92fef432356d8274055b3d58d  # the carried git form of the pinned sdist tree
export PYTHONUNBUFFERED=1 SCOREBOARD_CACHE=/tmp/sbcache COLUMNS=160
export SCOREBOARD_REFERENCE_SOURCE="git+file://$KIT/llama.cpp@$LLAMA_COMMIT"
BLOCKS=${BLOCKS:-4}; REPS=${REPS:-2}; WIDE_SEEDS=${WIDE_SEEDS:-3}
stamp() { echo "== $* at $SECONDS s ($(date -u +%H:%M:%S))"; }
snap() { (cd /root/sb && tar czf "$WORK/state.tgz.part" rounds reference.lock && mv "$WORK/state.tgz.part" "$WORK/state.tgz"); }
summary() {  # the verdict block of a round log
  grep -E -A6 "^verdict" "$1" | cut -c1-200; grep -E "^receipt|rror|refus" "$1" | tail -4
}
echo $$ > "$WORK/pid"
RENEW=--renew-reference-anchor  # the first record on this box (see above); cleared once one is sealed
go() { [ ! -f "$WORK/stop" ] || { stamp "stopped by $WORK/stop"; touch "$WORK/done"; exit 0; }; }
stamp setup
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KIT"/whl/*.whl 2>&1 | tail -2
mkdir -p /opt/bwrap && dpkg -x "$KIT"/bubblewrap_*.deb /opt/bwrap && export PATH=/opt/bwrap/usr/bin:$PATH
bwrap --version; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git clone -q -b main "$KIT/sb.bundle" /root/sb && cd /root/sb || exit 1
git config user.email box@scoreboard; git config user.name box
git reset -q --hard "$BASE" && git log --oneline -1
site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
echo "$PWD" > "$site/scoreboard-local.pth"  # no pip -e: it would leave build files that make the tree dirty
d="$site/scoreboard-0.1.0.dist-info"; mkdir -p "$d"
printf 'Metadata-Version: 2.1\nName: scoreboard\nVersion: 0.1.0\n' > "$d/METADATA"
printf '[scoreboard.engines]\nllamacpp = engines.llamacpp.engine:LlamaCppEngine\nsparkinfer = engines.sparkinfer.engine:SparkInferEngine\n' > "$d/entry_points.txt"
python3 -m scoreboard engines | tail -3
stamp "preflight (reference build) beside the k3-wide generation"
python3 -c "from pathlib import Path; from scoreboard.lockfile import load_lock; from scoreboard.weights.verify import ensure_generated; ensure_generated(load_lock(Path('reference.lock')), 'k3-wide')" > "$WORK/gen-wide.log" 2>&1 &
GEN=$!
python3 "$HERE/bench/preflight.py" k3-gpu-h200 $RENEW > "$WORK/preflight.log" 2>&1; echo "preflight rc $?"; tail -2 "$WORK/preflight.log"
wait $GEN; echo "k3-wide generation rc $? (done at $SECONDS s)"; tail -2 "$WORK/gen-wide.log"
ladder() {
  i=0
  for step in "$@"; do
    i=$((i + 1)); go
    git merge -q --ff-only "$step" || { echo "fast-forward to $step failed"; break; }
    stamp "step $i: $(git log --oneline -1 | cut -c1-100)"
    python3 -m scoreboard round run --target k3-gpu-h200 --blocks "$BLOCKS" --reps "$REPS" $RENEW > "$WORK/step$i.log" 2>&1
    rc=$?; echo "step $i rc $rc"; summary "$WORK/step$i.log"; snap
    grep -q "^verdict:" "$WORK/step$i.log" && RENEW=  # a completed round is the new anchor
  done
}
wide() {
  go; stamp "k3-wide-h200 calibration, $WIDE_SEEDS seeds"
  python3 -m scoreboard gate calibrate k3-wide-h200 --seeds "$WIDE_SEEDS" $RENEW > "$WORK/wide-cal.log" 2>&1
  echo "calibrate rc $?"; tail -25 "$WORK/wide-cal.log"; snap
  for name in baseline aa; do
    go; stamp "k3-wide-h200 $name round"
    python3 -m scoreboard round run --target k3-wide-h200 --blocks "$BLOCKS" --reps "$REPS" $RENEW > "$WORK/wide-$name.log" 2>&1
    echo "wide $name rc $?"; summary "$WORK/wide-$name.log"; snap
    grep -q "^verdict:" "$WORK/wide-$name.log" && RENEW=
  done
}
if [ "${WIDE_FIRST:-0}" = 1 ]; then wide; ladder "$@"; else ladder "$@"; wide; fi
go
stamp "profile at the last step"
python3 "$HERE/bench/h200_profile.py" --target k3-gpu-h200 --out "$WORK/prof-k3-gpu-h200.json" > "$WORK/prof.log" 2>&1
echo "profile rc $?"
python3 -m scoreboard verify 2>&1 | tail -3
stamp done
touch "$WORK/done"
