#!/bin/bash
# One device lease, planned per card: the device answers a call for an H200 mostly with an H100, and a round refuses
# a box of another node class than its target's, so a lease carries a plan for each card it may get and runs the
# one that matches. KIT/plan.<card> (card: h200, h100; lower case, the first word of nvidia-smi's name after
# "NVIDIA") is a file of shell assignments for bench/h200_ladder.sh (PHASES, GPU_TARGET, GEN_WEIGHTS, CAL_SEEDS,
# BUILD_FIRST, ...) plus BASE and STEPS (commits in KIT/sb.bundle, as hashes: the clone has no local branches but
# main). The job starts under setsid, as h200_ladder.sh asks; poll it with bench/h200_poll.sh WORK.
# A card without a plan file stops here, with nothing started.
# BUDGET_S, when given, is the device time the lease may still spend (the `status` budget less the machine's
# start): a kit may carry cheaper plans beside the full one, KIT/plan.<card>.<anything>, each declaring the device
# time it needs as a line NEEDS_S=<seconds>; the lease runs the plan of the card that needs the most within the
# budget (a plan without NEEDS_S needs 0), and without a budget plan.<card> itself. So a lease that comes after
# failed starts runs what still fits (a diagnosis rather than a round cut off in its speed stage), with no plan
# edited by hand between calls.
# usage (on the box, in the repository's root): bash bench/lease.sh KIT WORK [BUDGET_S]
set -u
[ $# -eq 2 ] || [ $# -eq 3 ] || { echo "usage: bash $0 KIT WORK [BUDGET_S]" >&2; exit 1; }
KIT=$(cd "$1" && pwd) || exit 1
WORK=$2
BUDGET=${3:-}
case "$BUDGET" in ''|*[!0-9]*) [ -z "$BUDGET" ] || { echo "BUDGET_S must be whole seconds, not '$BUDGET'" >&2; exit 1; };; esac
name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
card=$(echo "$name" | sed -E 's/^NVIDIA //; s/ .*//' | tr 'A-Z' 'a-z')
plan="$KIT/plan.$card"
needs() {  # a plan's NEEDS_S (0 without one); a line that is not whole seconds is refused, never read as 0
  local lines bad
  lines=$(grep -E '^NEEDS_S=' "$1")
  bad=$(echo "$lines" | grep -vE '^(NEEDS_S=[0-9]+)?$' | head -1)
  [ -z "$bad" ] || { echo "$1: NEEDS_S must be whole seconds (NEEDS_S=900), not '$bad'" >&2; return 1; }
  lines=$(echo "$lines" | tail -1); echo "${lines#NEEDS_S=}" | sed 's/^$/0/'
}
if [ -n "$card" ] && [ -n "$BUDGET" ]; then
  best=-1
  for f in "$KIT/plan.$card" "$KIT/plan.$card".*; do
    [ -f "$f" ] || continue
    n=$(needs "$f") || { echo "nothing started: correct that line of $f" >&2; exit 1; }
    if [ "$n" -le "$BUDGET" ] && [ "$n" -gt "$best" ]; then best=$n; plan=$f; fi
  done
  [ "$best" -ge 0 ] || { echo "no plan for this card fits the budget of $BUDGET s ($KIT/plan.$card*: NEEDS_S): nothing started; carry a plan.$card.<name> with a smaller NEEDS_S (a \`start\` or \`diag\` phase alone), or lease when more device time is left" >&2; exit 1; }
  echo "budget ${BUDGET} s: the plan that needs the most within it needs ${best} s"
fi
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
