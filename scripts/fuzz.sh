#!/usr/bin/env bash
# `make fuzz` and the CI smoke run (scripts/fuzz-smoke.sh): builds the coverage-guided targets of
# fuzz/ with cargo-fuzz (libFuzzer; docs/fuzzing.md) and runs each for FUZZ_SECONDS, starting
# from its seed corpus in the repository (fuzz/seeds/<target>) plus what earlier runs found
# (FUZZ_CORPUS, outside the repository). Prints one line per target (executions, coverage,
# corpus, crashes) and exits non-zero when any target crashed, hung or ran out of memory; the
# input that did it is kept in fuzz/artifacts/<target>/.
#
# Usage: scripts/fuzz.sh [--write-seeds] [TARGET...]   (default: every target)
#   FUZZ_SECONDS    seconds of fuzzing per target (default 600)
#   FUZZ_CORPUS     where the growing corpora live (default $MICROVM_CACHE/fuzz-corpus;
#                   "none": a fresh temporary one, so only the repository's seeds count)
#   FUZZ_TIMEOUT    seconds one input may take before it counts as a hang (default 10)
#   FUZZ_RSS_MB     memory limit of a target process (default 2048)
#   FUZZ_SANITIZER  none (default) or address (AddressSanitizer: needs nightly features, so it
#                   sets RUSTC_BOOTSTRAP=1 for the build; each execution slower)
#   FUZZ_TARGET_DIR where the targets are built (default fuzz/target)
#   FUZZ_CODEGEN_UNITS  codegen units of the build (default 1: slower to build, faster to run)
#   FUZZ_BUILD      1 (default) builds the targets first; 0 runs those already in FUZZ_TARGET_DIR
#   FUZZ_JOBS       targets run side by side (default 1; each takes one core)
#   --write-seeds   writes each target's seed corpus (fuzz/src/seeds.rs) into fuzz/seeds/
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

write_seeds=0
if [ "${1:-}" = --write-seeds ]; then
  write_seeds=1
  shift
fi

CARGO_FUZZ_VERSION=0.13.2
FUZZ_SECONDS=${FUZZ_SECONDS:-600}
FUZZ_TIMEOUT=${FUZZ_TIMEOUT:-10}
FUZZ_RSS_MB=${FUZZ_RSS_MB:-2048}
FUZZ_SANITIZER=${FUZZ_SANITIZER:-none}
export MICROVM_CACHE=${MICROVM_CACHE:-/var/cache/microvm}
FUZZ_CORPUS=${FUZZ_CORPUS:-$MICROVM_CACHE/fuzz-corpus}

bin_dir=$(scripts/install-cargo-tool.sh cargo-fuzz "$CARGO_FUZZ_VERSION" | tail -n 1)
export PATH="$bin_dir:$PATH"

case "$FUZZ_SANITIZER" in
  none) build_env=() ;;
  address) build_env=(RUSTC_BOOTSTRAP=1) ;;
  *) echo "FUZZ_SANITIZER must be none or address" >&2; exit 2 ;;
esac

targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi

target_dir=${FUZZ_TARGET_DIR:-$root/fuzz/target}
if [ "${FUZZ_BUILD:-1}" != 0 ]; then
  echo "== fuzz: building ${#targets[@]} targets (cargo-fuzz $CARGO_FUZZ_VERSION, sanitizer $FUZZ_SANITIZER)"
  # cargo-fuzz's default build: optimized, with debug assertions and overflow checks.
  (cd fuzz && env "${build_env[@]}" cargo fuzz build -s "$FUZZ_SANITIZER" \
    --target-dir "$target_dir" --codegen-units "${FUZZ_CODEGEN_UNITS:-1}")
fi
triple=$(rustc -vV | sed -n 's/^host: //p')
bins=$target_dir/$triple/release

if [ $write_seeds -eq 1 ]; then
  for t in "${targets[@]}"; do
    rm -rf "fuzz/seeds/$t"
    mkdir -p "fuzz/seeds/$t"
    MICROVM_FUZZ_WRITE_SEEDS=$root/fuzz/seeds/$t "$bins/$t" -runs=0 >/dev/null 2>&1 || true
    echo "$t: $(ls "fuzz/seeds/$t" | wc -l) seeds"
  done
  exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# The targets' scratch mount point goes in here (an empty folder on the host: each target process
# mounts its own tmpfs on it in a mount namespace of its own, fuzz/src/scratch.rs), so two runs
# side by side do not share it and the trap removes it.
export TMPDIR=$tmp
if [ "$FUZZ_CORPUS" = none ]; then
  FUZZ_CORPUS=$tmp/corpus
fi

# run_target T: runs target T and writes its table line (and, if it crashed, what it said) to
# $tmp/T.out.
run_target() {
  local t=$1 work seeds artifacts log status=0 execs rate last cov ft corp result artifact kind
  work=$FUZZ_CORPUS/$t
  seeds=$root/fuzz/seeds/$t
  artifacts=$root/fuzz/artifacts/$t
  mkdir -p "$work" "$seeds" "$artifacts"
  log=$tmp/$t.log
  "$bins/$t" "$work" "$seeds" \
    -max_total_time="$FUZZ_SECONDS" -timeout="$FUZZ_TIMEOUT" -rss_limit_mb="$FUZZ_RSS_MB" \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$log" 2>&1 || status=$?
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)
  last=$(grep -E '^#[0-9]+' "$log" | tail -n 1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$last")
  ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$last")
  corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$last")
  if [ $status -eq 0 ]; then
    result="no crash"
  else
    artifact=$(sed -n 's/.*Test unit written to \(.*\)$/\1/p' "$log" | tail -n 1)
    kind=$(grep -oE 'deadly signal|timeout|out-of-memory|leak' "$log" | head -n 1 || true)
    result="CRASH (${kind:-exit $status}): ${artifact:-see below}"
  fi
  {
    printf '%-16s %10s %8s %8s %8s %7s  %s\n' "$t" "${execs:-?}" "${rate:-?}" "${cov:-?}" \
      "${ft:-?}" "${corp:-?}" "$result"
    if [ $status -ne 0 ]; then
      # What the target said (the panic and its place), for the log.
      grep -E -A12 "panicked at|ERROR: libFuzzer" "$log" | head -n 40 | sed 's/^/    /' || true
    fi
  } >"$tmp/$t.out"
}

# FUZZ_JOBS targets at a time (each is one process on one core), printed in the list's order.
jobs_max=${FUZZ_JOBS:-1}
running=0
for t in "${targets[@]}"; do
  if [ $running -ge "$jobs_max" ]; then
    wait -n || true
    running=$((running - 1))
  fi
  run_target "$t" &
  running=$((running + 1))
done
wait
crashed=0
printf '%-16s %10s %8s %8s %8s %7s  %s\n' target executions exec/s cov features corpus result
for t in "${targets[@]}"; do
  cat "$tmp/$t.out" 2>/dev/null || printf '%-16s %s\n' "$t" "CRASH (its run ended without a result)"
  # Passed: its table line says so (a target whose run wrote none crashed).
  head -n 1 "$tmp/$t.out" 2>/dev/null | grep -q '  no crash$' || crashed=$((crashed + 1))
done
# The closing line (scripts/run-tests.sh counts it): targets run, and those that crashed, hung or
# ran out of memory.
echo "fuzz: ${#targets[@]} targets, $crashed crashed"
[ $crashed -eq 0 ] || echo "replay a crash with $bins/TARGET ARTIFACT (the artifact named above)"
[ $crashed -eq 0 ]
