#!/bin/bash
# Poll the background job of bench/h200_ladder.sh for at most MAX seconds (until it is done), then bring back
# its log, the snapshot of rounds/ and the round logs under OUT. STOP=1 asks the job to stop before its next
# record (it finishes the one in progress). Stop it at once with `kill -- -$(cat WORK/pid)`.
# usage: [STOP=1] bash bench/h200_poll.sh OUT WORK MAX
OUT=$1; WORK=$2; MAX=$3
end=$((SECONDS + MAX))
[ "${STOP:-0}" = 1 ] && touch "$WORK/stop"
while [ $SECONDS -lt $end ] && [ ! -f "$WORK/done" ]; do sleep 5; done
[ -f "$WORK/done" ] && echo "JOB DONE" || echo "job still running"
cp "$WORK/state.tgz" "$OUT/" 2>/dev/null
(cd "$WORK" && tar czf "$OUT/logs.tgz" --exclude=state.tgz --exclude='*.part' .)
grep -E "^== |rc |verdict|tier|REJECT|BASELINE|gain|rror" "$WORK/job.log" | tail -60
