#!/bin/bash
# A lease's first call, from the repository's root on the box (the kit carried as .carry/kit: bench/make_kit.sh):
# the plan of the card lent that fits BUDGET_S started (bench/lease.sh), then polled until the call's 600 s are
# nearly spent; later calls poll on (bash bench/h200_poll.sh OUT /root/job MAX).
# BUDGET_S: the device time left (`status`) less the machine's start, ~150 s.
# usage: bash .carry/kit/first.sh OUT BUDGET_S
set -u
[ $# -eq 2 ] || { echo "usage: bash $0 OUT BUDGET_S" >&2; exit 1; }
OUT=$1; BUDGET=$2; t0=$SECONDS
bash bench/lease.sh .carry/kit /root/job "$BUDGET" || exit 1
bash bench/h200_poll.sh "$OUT/p1" /root/job $((570 - (SECONDS - t0)))
