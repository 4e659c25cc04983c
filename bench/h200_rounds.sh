#!/bin/bash
# One H200 call: the GPU target calibrated, then a BASELINE round and an A/A round of the same main, all sealed.
# The box reaches neither PyPI nor GitHub: everything comes from the carried kit (docs/reference-pin.md,
# docs/isolation.md): wheels, bubblewrap's .deb, a git bundle of this repository, llama.cpp's pinned tree.
# usage (repository root of the carried copy): bash bench/h200_rounds.sh OUT KIT TARGET SEEDS BLOCKS REPS
set -u
OUT=$1; KIT=$(cd "$2" && pwd); TARGET=$3; SEEDS=$4; BLOCKS=$5; REPS=$6
LLAMA_COMMIT=b260ed1d9705ddc92fef432356d8274055b3d58d  # the carried git form of the pinned sdist tree
export PYTHONUNBUFFERED=1 SCOREBOARD_CACHE=/tmp/sbcache
export SCOREBOARD_REFERENCE_SOURCE="git+file://$KIT/llama.cpp@$LLAMA_COMMIT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KIT"/whl/*.whl 2>&1 | tail -2
mkdir -p /opt/bwrap && dpkg -x "$KIT"/bubblewrap_*.deb /opt/bwrap && export PATH=/opt/bwrap/usr/bin:$PATH
bwrap --version; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git clone -q -b main "$KIT/sb.bundle" /root/sb && cd /root/sb && git log --oneline -1
if ! python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>"$OUT/pip.log"; then
  # no setuptools on the box: register the package and its engine entry points by hand
  site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
  echo "$PWD" > "$site/scoreboard-local.pth"
  d="$site/scoreboard-0.1.0.dist-info"; mkdir -p "$d"
  printf 'Metadata-Version: 2.1\nName: scoreboard\nVersion: 0.1.0\n' > "$d/METADATA"
  printf '[scoreboard.engines]\nllamacpp = engines.llamacpp.engine:LlamaCppEngine\nsparkinfer = engines.sparkinfer.engine:SparkInferEngine\n' > "$d/entry_points.txt"
fi
python3 -m scoreboard engines
snap() { tar czf "$OUT/state.tgz" rounds reference.lock; echo "== $1 done at $SECONDS s"; }
python3 -m scoreboard gate calibrate --target "$TARGET" --seeds "$SEEDS" > "$OUT/calibrate.log" 2>&1; echo "calibrate rc $?"
tail -40 "$OUT/calibrate.log"; snap calibrate
for name in baseline aa; do
  python3 -m scoreboard round run --target "$TARGET" --blocks "$BLOCKS" --reps "$REPS" > "$OUT/$name.log" 2>&1
  echo "$name rc $?"; tail -25 "$OUT/$name.log"; snap "$name"
done
python3 -m scoreboard verify 2>&1 | tail -3
