#!/bin/bash
# Poll the background job of bench/h200_ladder.sh for at most MAX seconds (until it is done, or gone without
# finishing), then bring back its log, the snapshot of rounds/ and the round logs under OUT. STOP=1 asks the
# job to stop before its next record (it finishes the one in progress). Stop it at once with
# `kill -- -$(cat WORK/pid)`. While it waits it copies them every EVERY seconds (default 30).
# usage: [STOP=1] bash bench/h200_poll.sh OUT WORK MAX
mkdir -p "$1" && OUT=$(cd "$1" && pwd) && WORK=$(cd "$2" && pwd) || exit 1
MAX=$3
end=$((SECONDS + MAX))
[ "${STOP:-0}" = 1 ] && touch "$WORK/stop"
alive() { [ ! -f "$WORK/pid" ] || kill -0 "$(cat "$WORK/pid")" 2>/dev/null; }
# what the job left so far, under OUT (each file written whole, then moved into place): a call cut off at the
# device's limit still brings back the latest copy, not nothing (one lease's round ran out of device time mid-poll)
bring() {
  [ ! -f "$WORK/state.tgz" ] || { cp "$WORK/state.tgz" "$OUT/.state.tgz" && mv "$OUT/.state.tgz" "$OUT/state.tgz"; }
  (cd "$WORK" && tar czf "$OUT/.logs.tgz" --exclude=state.tgz --exclude='*.part' . 2>/dev/null) &&
    mv "$OUT/.logs.tgz" "$OUT/logs.tgz"
}
last=$SECONDS
while [ $SECONDS -lt $end ] && [ ! -f "$WORK/done" ] && alive; do
  sleep 5
  [ $((SECONDS - last)) -lt "${EVERY:-30}" ] || { bring; last=$SECONDS; }
done
if [ -f "$WORK/done" ]; then echo "JOB DONE"
elif ! alive; then echo "job $(cat "$WORK/pid") is not running and left no done file: it died"
else echo "job still running"; fi
bring
grep -E "^== |rc |verdict|tier|REJECT|BASELINE|gain|rror" "$WORK/job.log" | tail -60
