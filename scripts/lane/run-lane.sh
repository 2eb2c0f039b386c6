#!/usr/bin/env bash
# Runs the embedded-VMM test binaries in the nested lane (docs/nested-lane.md), as
# scripts/run-tests.sh does where this host's KVM cannot boot our guest:
#
#   scripts/lane/run-lane.sh [--events FILE] [--second-l1-when FILE] name=<exe>[@<containerd bin dir>] ...
#
# The binaries go into a queue, the longest first (embedded-vmm-tests.sh --expected), and an L1
# (scripts/lane/run-in-l1.sh --vfio running scripts/lane/embedded-vmm-tests.sh --queue) takes
# them one after the other, each under its own bound inside L1 and L1 under the sum of their
# bounds plus its boot: one boot and check-host for many binaries (15-30 s each on an idle host,
# a minute on a busy one). With --second-l1-when FILE, a second L1 joins on the same queue once
# FILE exists (run-tests.sh creates it when the host's own tests are done and leave a core idle),
# if anything is still queued: L1 is one TCG vCPU, one core, so one L1 leaves the other core idle
# once the host's tests end. Each L1's binaries run one at a time; two L1s take turns on the
# queue. Their output streams through as it runs, line by line, the second's lines prefixed
# `L1 #2: `.
#
# L1 sees this host's files through a page-cached 9p mount (scripts/lane/l1-init): a binary
# replaced on the host while L1 runs reads there as a mix of old and new pages, and a shim
# started from it crashes. So nothing the lane runs may be rebuilt while it runs:
# scripts/run-tests.sh hands it a copy of the binaries (MICROVM_BIN_DIR).
#
# When an L1 does not get to the end (it got stuck: frozen or stalled, its heartbeat stopped
# and run-in-l1.sh killed it, exit 75; or it crashed or reached its bound), what is still queued
# runs in a fresh L1, said with a RETRY line. The binary it was running when it got stuck goes
# back into the queue too (up to twice for a frozen L1, once for a stalled one): a stuck L1 is L1's
# failure, not the binary's; its tests that had passed there are not run again (a `lane: NAME
# kept N passed tests ...` line counts them). A binary that was
# running when L1 crashed or timed out is not run again, nor is one whose tests failed or that
# reached its own bound in a live L1: they count as they ran (their unreported tests as failed,
# in run-tests.sh). At most MICROVM_LANE_RETRIES (default 5) fresh L1s after the first, for each
# of the two. Output: each binary's, then the line `lane: N L1 boots, M freezes, S stalls,
# K retries`. --events FILE appends run-in-l1's events (boot, frozen, stalled, ...: see
# run-in-l1.sh) and `retry` lines there.
# Exit status: 0 when every binary passed, 1 otherwise.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
events=
second_when=
while [ $# -gt 0 ]; do
  case "$1" in
    --events) events=$2; shift 2 ;;
    --second-l1-when) second_when=$2; shift 2 ;;
    *) break ;;
  esac
done
own_events=
if [ -z "$events" ]; then
  events=$(mktemp)
  own_events=$events
fi
# The queue, shared read-write with each L1 at the same path (run-in-l1.sh --writable).
queue=$(mktemp -d /tmp/microvm-lane-queue.XXXXXX)
trap 'rm -rf "$queue" $own_events' EXIT
mkdir "$queue/todo" "$queue/taken" "$queue/stuck"
: >"$queue/results"
i=0
for arg in "$@"; do
  name=${arg%%=*}
  printf '%s %s\n' "$("$here/embedded-vmm-tests.sh" --expected "$name")" "$arg"
done | sort -rn -s -k1,1 | while read -r _ arg; do
  i=$(( i + 1 ))
  printf '%s\n' "$arg" >"$queue/todo/$(printf '%02d' "$i")-${arg%%=*}"
done
queued() { [ -n "$(ls -A "$queue/todo")" ]; }

# passed_in FILE NAME: the tests of binary NAME that FILE shows passed (`test T ... ok`, in the part
# after NAME's `== NAME on the embedded vmm` header), one a line.
passed_in() {
  awk -v n="$2" '
    /^== [a-z0-9_]+ on the embedded vmm/ { mine = ($2 == n); next }
    mine && /^test [^ ]+ \.\.\. ok$/ { print $2 }
  ' "$1"
}

# outcomes FILE: a line `NAME ok|FAILED|begun` for each binary FILE shows began
# (embedded-vmm-tests.sh's `== NAME on the embedded vmm` header), with its `test result:` if it
# printed one.
outcomes() {
  awk '
    /^== [a-z0-9_]+ on the embedded vmm/ { name = $2; state[name] = "begun"; order[++n] = name; next }
    /^test result: ok\./ && name != "" { state[name] = "ok"; next }
    /^test result: FAILED\./ && name != "" { state[name] = "FAILED"; next }
    END { for (i = 1; i <= n; i++) print order[i], state[order[i]] }
  ' "$1"
}

# run_l1s K: L1s on the queue until it is empty: the first, and fresh ones for what a stuck or
# crashed one left (L1 #K; the second's lines prefixed `L1 #2: `).
run_l1s() {
  local k=$1 chunk=$queue/chunk.$1 retries_left=${MICROVM_LANE_RETRIES:-5} timeout f name state status cut l1 kept allowed stuck
  local prefix=
  [ "$k" -eq 1 ] || prefix="L1 #$k: "
  while queued; do
    # Each queued binary's own bound, L1's boot (10-40 s), and stage 2's dump before the host's kill.
    timeout=240
    for f in "$queue"/todo/*; do
      timeout=$(( timeout + $("$here/embedded-vmm-tests.sh" --limit "${f##*/[0-9][0-9]-}") ))
    done
    # Its output line by line (a line from the other L1 never lands inside one of its own).
    "$here/run-in-l1.sh" --vfio --writable "$queue" --timeout "$timeout" --events "$events" -- \
      "$here/embedded-vmm-tests.sh" --queue "$queue" >"$chunk" 2>&1 &
    l1=$!
    tail -n +1 -F --pid="$l1" "$chunk" 2>/dev/null | sed -u "s/^/$prefix/"
    wait "$l1"
    status=$?

    # What each binary it began came to; one it was in when it got stuck goes back: twice when L1
    # froze (a halted vCPU that an interrupt does not wake is the emulator's fault, never the
    # binary's), once when it stalled (a busy L1 that runs nothing could be ours).
    cut=
    allowed=1
    ! grep -q '^run-in-l1: L1 frozen and was killed' "$chunk" || allowed=2
    while read -r name state; do
      echo "$name $state" >>"$queue/results"
      stuck=$(cat "$queue/stuck/$name" 2>/dev/null || echo 0)
      if [ "$state" = begun ] && [ "$status" -eq 75 ] && [ "$stuck" -lt "$allowed" ]; then
        echo $(( stuck + 1 )) >"$queue/stuck/$name"
        # Its tests that passed before L1 got stuck are not run again: their names go into its
        # queue entry after its argument (embedded-vmm-tests.sh skips them), and they are
        # counted here, on a line run-tests.sh adds to the retry's own result line.
        mapfile -t kept < <(passed_in "$chunk" "$name")
        f=$(echo "$queue"/taken/[0-9][0-9]-"$name")
        if [ ${#kept[@]} -gt 0 ] && [ -f "$f" ]; then
          { cat "$f"; printf '%s\n' "${kept[@]}"; } >"$f.new" && mv "$f.new" "$f"
          echo "lane: $name kept ${#kept[@]} passed tests from L1 #$k before it got stuck: ${kept[*]}"
        fi
        mv "$f" "$queue/todo/" && cut=$name
      fi
    done < <(outcomes "$chunk")
    # A live L1 that got to the end (status 0 or 1) found the queue empty.
    case "$status" in 0|1) break ;; esac
    queued || break
    if [ "$retries_left" -le 0 ]; then
      echo "lane: L1 #$k did not get to the end (exit $status: $(tail -n1 "$events")) and its retries are used up"
      break
    fi
    echo "RETRY: L1 #$k did not get to the end (exit $status: $(tail -n1 "$events"))${cut:+ while $cut ran}; a fresh L1 takes what is queued"
    echo retry >>"$events"
    retries_left=$(( retries_left - 1 ))
  done
}

run_l1s 1 &
first=$!
if [ -n "$second_when" ] && [ "$(nproc)" -ge 2 ]; then
  while kill -0 "$first" 2>/dev/null; do
    if [ -e "$second_when" ]; then
      if queued; then
        echo "lane: a second L1 joins the first on the queue ($(cd "$queue/todo" && printf '%s\n' * | sed 's/^[0-9]*-//' | xargs))"
        run_l1s 2
      fi
      break
    fi
    sleep 5
  done
fi
wait "$first"

failed=0
for arg in "$@"; do
  name=${arg%%=*}
  state=$(awk -v n="$name" '$1 == n { s = $2 } END { print s }' "$queue/results")
  if [ "$state" != ok ]; then
    failed=1
    [ -n "$state" ] || echo "lane: $name did not run"
  fi
done

count() { grep -cx "$1" "$events"; }
echo "lane: $(count boot) L1 boots, $(( $(count frozen) + $(count frozen-revived) )) freezes, $(( $(count stalled) + $(count stalled-revived) )) stalls, $(count retry) retries"
exit $failed
