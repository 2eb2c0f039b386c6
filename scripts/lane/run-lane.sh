#!/usr/bin/env bash
# Runs the embedded-VMM test binaries in the nested lane (docs/nested-lane.md), each in its own L1,
# as scripts/run-tests.sh does where this host's KVM cannot boot our guest:
#
#   scripts/lane/run-lane.sh [--events FILE] name=<exe>[@<containerd bin dir>] ...
#
# Each binary gets a fresh L1 (scripts/lane/run-in-l1.sh --vfio) running
# scripts/lane/embedded-vmm-tests.sh for it alone, bounded on the host by the binary's own bound
# plus L1's boot. So an L1 that gets stuck (frozen or stalled: its heartbeat stops, run-in-l1.sh
# kills it, exit 75) costs that binary, not the lane: the binary runs once more in a fresh L1,
# said with a RETRY line, and only if it had not finished (no `test result:` line). At most one
# retry a binary and MICROVM_LANE_RETRIES (default 3) in all; nothing else is retried: a binary
# whose tests failed, or that reached its bound in a live L1, counts as it ran (its unreported
# tests as failed, in run-tests.sh). Output: each binary's, as it runs, then the line
# `lane: N L1 boots, M freezes, S stalls, K retries`. --events FILE appends run-in-l1's events
# (boot, frozen, stalled, ...: see run-in-l1.sh) and `retry` lines there.
# Exit status: 0 when every binary passed, 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
events=
if [ "${1:-}" = --events ]; then
  events=$2
  shift 2
fi
own_events=
if [ -z "$events" ]; then
  events=$(mktemp)
  own_events=$events
fi
output=$(mktemp)
trap 'rm -f "$output" $own_events' EXIT
retries_left=${MICROVM_LANE_RETRIES:-3}

failed=0
for arg in "$@"; do
  name=${arg%%=*}
  # The binary's own bound, L1's boot (10-40 s), and stage 2's dump before the host's kill.
  timeout=$(( $("$here/embedded-vmm-tests.sh" --limit "$name") + 240 ))
  attempt=1
  while :; do
    "$here/run-in-l1.sh" --vfio --timeout "$timeout" --events "$events" -- \
      "$here/embedded-vmm-tests.sh" "$arg" 2>&1 | tee "$output"
    status=${PIPESTATUS[0]}
    if [ "$status" -eq 75 ] && ! grep -q '^test result:' "$output"; then
      if [ "$attempt" -lt 2 ] && [ "$retries_left" -gt 0 ]; then
        echo "RETRY: $name did not finish: its L1 got stuck ($(tail -n1 "$events")) and was killed; running $name again in a fresh L1"
        echo retry >>"$events"
        retries_left=$(( retries_left - 1 ))
        attempt=$(( attempt + 1 ))
        continue
      fi
      echo "lane: $name did not finish: its L1 got stuck again, or the lane's retries are used up; its tests count as failed"
    elif [ "$status" -eq 75 ]; then
      # L1 got stuck after the binary had reported: its result stands as it printed it.
      if grep -q '^test result: ok' "$output"; then status=0; fi
    fi
    break
  done
  [ "$status" -eq 0 ] || failed=1
done

count() { grep -cx "$1" "$events"; }
echo "lane: $(count boot) L1 boots, $(( $(count frozen) + $(count frozen-revived) )) freezes, $(( $(count stalled) + $(count stalled-revived) )) stalls, $(count retry) retries"
exit $failed
