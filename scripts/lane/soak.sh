#!/usr/bin/env bash
# Measures how often the nested lane's L1 gets stuck (docs/nested-lane.md, "Measured"): boots L1
# BOOTS times, JOBS at a time, each running CMD under scripts/lane/run-in-l1.sh with this
# environment (so MICROVM_LANE_QEMU, MICROVM_LANE_CPU, MICROVM_LANE_APPEND choose the variation),
# and prints one line per boot and a summary:
#
#   scripts/lane/soak.sh [-n BOOTS] [-j JOBS] [-o DIR] [-l LABEL] [--vfio] [--timeout S] -- CMD...
#
# Each boot's whole output is kept in DIR/boot-<n>.log (default: a new /tmp/microvm-soak.XXXXXX).
# The summary counts L1 boots, L1-minutes (wall time of the boots), freezes and stalls (run-in-l1's
# watch: revived by an NMI or killed), timeouts, crashes and boots whose command failed; it is
# also appended to DIR/summary.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=SCRIPTDIR/../lib.sh
. "$here/../lib.sh"
boots=10 jobs=1 out= label= lane_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    -n) boots=$2; shift 2 ;;
    -j) jobs=$2; shift 2 ;;
    -o) out=$2; shift 2 ;;
    -l) label=$2; shift 2 ;;
    --vfio) lane_args+=(--vfio); shift ;;
    --timeout) lane_args+=(--timeout "$2"); shift 2 ;;
    --) shift; break ;;
    *) echo "usage: $0 [-n BOOTS] [-j JOBS] [-o DIR] [-l LABEL] [--vfio] [--timeout S] -- CMD..." >&2; exit 2 ;;
  esac
done
[ $# -gt 0 ] || { log "no command"; exit 2; }
[ -n "$out" ] || out=$(mktemp -d /tmp/microvm-soak.XXXXXX)
mkdir -p "$out"
label=${label:-qemu=${MICROVM_LANE_QEMU:-system} cpu=${MICROVM_LANE_CPU:-max} append=${MICROVM_LANE_APPEND:-}}
log "$label: $boots L1 boots, $jobs at a time, logs in $out"

one() {
  local n=$1 start status
  shift
  start=$SECONDS
  "$here/run-in-l1.sh" "${lane_args[@]}" --events "$out/boot-$n.events" -- "$@" >"$out/boot-$n.log" 2>&1 < /dev/null
  status=$?
  echo "$n $status $(( SECONDS - start ))" >"$out/boot-$n.result"
  log "boot $n: exit $status after $(( SECONDS - start )) s; $(grep -v '^boot$' "$out/boot-$n.events" 2>/dev/null | sort | uniq -c | xargs)"
}

n=0
running=()
while [ "$n" -lt "$boots" ] || [ ${#running[@]} -gt 0 ]; do
  # Reap finished boots.
  still=()
  for pid in "${running[@]}"; do
    if kill -0 "$pid" 2>/dev/null; then still+=("$pid"); else wait "$pid"; fi
  done
  running=("${still[@]}")
  if [ "$n" -lt "$boots" ] && [ ${#running[@]} -lt "$jobs" ]; then
    n=$(( n + 1 ))
    one "$n" "$@" &
    running+=($!)
    sleep 2
    continue
  fi
  sleep 5
done

count() { cat "$out"/boot-*.events 2>/dev/null | grep -cx "$1"; }
seconds=$(cat "$out"/boot-*.result | awk '{ s += $3 } END { print s + 0 }')
failed=$(cat "$out"/boot-*.result | awk '$2 != 0 && $2 != 75 && $2 != 124 && $2 != 125' | wc -l)
summary="$label: $(ls "$out"/boot-*.result | wc -l) L1 boots, $(( seconds / 60 )) L1-minutes, $(( $(count frozen) + $(count frozen-revived) )) freezes ($(count frozen-revived) revived by an NMI), $(( $(count stalled) + $(count stalled-revived) )) stalls ($(count stalled-revived) revived), $(count timeout) timeouts, $(count crashed) crashes, $failed failed commands"
echo "$summary" | tee -a "$out/summary"
