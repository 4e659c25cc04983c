#!/bin/bash
# One device lease, planned per card: the device answers a call for an H200 mostly with an H100, and a round refuses
# a box of another node class than its target's, so a lease carries a plan for each card it may get and runs the
# one that matches. KIT/plan.<card> (card: h200, h100; lower case, the first word of nvidia-smi's name after
# "NVIDIA") is a file of shell assignments for bench/h200_ladder.sh (PHASES, GPU_TARGET, GEN_WEIGHTS, CAL_SEEDS,
# BUILD_FIRST, ...) plus BASE and STEPS (commits in KIT/sb.bundle, as hashes: the clone has no local branches but
# main). The job starts under setsid, as h200_ladder.sh asks; poll it with bench/h200_poll.sh WORK.
# A card without a plan file stops here, with nothing started.
# usage (on the box, in the repository's root): bash bench/lease.sh KIT WORK
set -u
[ $# -eq 2 ] || { echo "usage: bash $0 KIT WORK" >&2; exit 1; }
KIT=$(cd "$1" && pwd) || exit 1
WORK=$2
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=$(echo "$name" | sed -E 's/^NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
plan="$KIT/plan.$card"
echo "card: ${name:-none} -> plan $plan"
[ -n "$card" ] && [ -f "$plan" ] || { echo "no plan for this card ($plan): nothing started; carry one (bench/lease.sh's header)" >&2; exit 1; }
BASE= STEPS=
set -a
# shellcheck disable=SC1090  # the plan is the kit's, carried by the developer who made it
. "$plan"
set +a
[ -n "$BASE" ] || { echo "$plan sets no BASE" >&2; exit 1; }
cat "$plan"
mkdir -p "$WORK"
# shellcheck disable=SC2086  # STEPS is a list of commits
setsid bash "$(dirname "$0")/h200_ladder.sh" "$WORK" "$KIT" "$BASE" $STEPS > "$WORK/job.log" 2>&1 < /dev/null &
echo "job started (pid $!): bash bench/h200_poll.sh OUT $WORK MAX"
