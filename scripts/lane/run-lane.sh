#!/usr/bin/env bash
# Runs the embedded-VMM test binaries in the nested lane (docs/nested-lane.md), as
# scripts/run-tests.sh does where this host's KVM cannot boot our guest:
#
#   scripts/lane/run-lane.sh [--events FILE] name=<exe>[@<containerd bin dir>] ...
#
# All of them in one L1 (scripts/lane/run-in-l1.sh --vfio running
# scripts/lane/embedded-vmm-tests.sh), one after the other, each under its own bound inside L1
# and L1 under the sum of their bounds plus its boot: one boot and check-host instead of one a
# binary (15-30 s each on an idle host, a minute on a busy one). MICROVM_LANE_L1=each gives each
# binary an L1 of its own instead (each under its own bound plus a boot).
#
# L1 sees this host's files through a page-cached 9p mount (scripts/lane/l1-init): a binary
# replaced on the host while L1 runs reads there as a mix of old and new pages, and a shim
# started from it crashes. So nothing the lane runs may be rebuilt while it runs:
# scripts/run-tests.sh hands it a copy of the binaries (MICROVM_BIN_DIR).
#
# When an L1 does not get to the end (it got stuck: frozen or stalled, its heartbeat stopped
# and run-in-l1.sh killed it, exit 75; or it crashed or reached its bound), the binaries it had
# not begun run in a fresh L1, said with a RETRY line. The binary it was running when it got
# stuck runs there again too, once: a stuck L1 is L1's failure, not the binary's. A binary that
# was running when L1 crashed or timed out is not run again, nor is one whose tests failed or
# that reached its own bound in a live L1: they count as they ran (their unreported tests as
# failed, in run-tests.sh). At most MICROVM_LANE_RETRIES (default 3) fresh L1s after the first.
# Output: each binary's, as it runs, then the line `lane: N L1 boots, M freezes, S stalls,
# K retries`. --events FILE appends run-in-l1's events (boot, frozen, stalled, ...: see
# run-in-l1.sh) and `retry` lines there.
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

declare -A result=()
declare -A stuck_once=()
# run_in_l1s BINARY...: the binaries in one L1, and what it left undone in fresh ones.
run_in_l1s() {
  local pending=("$@") arg name timeout status again cut
  while [ ${#pending[@]} -gt 0 ]; do
    # Each binary's own bound, L1's boot (10-40 s), and stage 2's dump before the host's kill.
    timeout=240
    for arg in "${pending[@]}"; do
      timeout=$(( timeout + $("$here/embedded-vmm-tests.sh" --limit "${arg%%=*}") ))
    done
    "$here/run-in-l1.sh" --vfio --timeout "$timeout" --events "$events" -- \
      "$here/embedded-vmm-tests.sh" "${pending[@]}" 2>&1 | tee "$output"
    status=${PIPESTATUS[0]}
    while read -r name state; do result[$name]=$state; done < <(outcomes "$output")

    # What this L1 left undone: the binary it was in (reported no result) and those it never began.
    again=()
    cut=
    for arg in "${pending[@]}"; do
      name=${arg%%=*}
      case "${result[$name]:-}" in
        ok|FAILED) ;;
        begun)
          # Stuck in L1 while it ran: once more. Otherwise (its bound, a crash): as it ran.
          if [ "$status" -eq 75 ] && [ -z "${stuck_once[$name]:-}" ]; then
            stuck_once[$name]=1
            cut=$name
            again+=("$arg")
          fi
          ;;
        *) again+=("$arg") ;;
      esac
    done
    [ ${#again[@]} -gt 0 ] || break
    # A live L1 that got to the end (status 0 or 1) left nothing undone; anything else did.
    case "$status" in 0|1) break ;; esac
    if [ "$retries_left" -le 0 ]; then
      echo "lane: ${again[*]%%=*} did not run: L1 did not get to the end (exit $status: $(tail -n1 "$events")) and the lane's retries are used up; their tests count as failed"
      break
    fi
    echo "RETRY: L1 did not get to the end (exit $status: $(tail -n1 "$events"))${cut:+ while $cut ran}; running ${again[*]%%=*} in a fresh L1"
    echo retry >>"$events"
    retries_left=$(( retries_left - 1 ))
    pending=("${again[@]}")
  done
}

if [ "${MICROVM_LANE_L1:-one}" = each ]; then
  for arg in "$@"; do run_in_l1s "$arg"; done
else
  run_in_l1s "$@"
fi

failed=0
for arg in "$@"; do
  name=${arg%%=*}
  if [ "${result[$name]:-}" != ok ]; then
    failed=1
    [ -n "${result[$name]:-}" ] || echo "lane: $name did not run"
  fi
done

count() { grep -cx "$1" "$events"; }
echo "lane: $(count boot) L1 boots, $(( $(count frozen) + $(count frozen-revived) )) freezes, $(( $(count stalled) + $(count stalled-revived) )) stalls, $(count retry) retries"
exit $failed
