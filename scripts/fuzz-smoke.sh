#!/usr/bin/env bash
# CI's fuzz smoke run (docs/fuzzing.md): the fuzz package's format and lints, then every target
# over its seed corpus plus FUZZ_SMOKE_SECONDS of fuzzing from a fresh corpus. Fails when a
# target fails on a seed or on what those seconds find. The build is the long part: codegen
# units are raised for it (the targets run a little slower, the build is several times faster).
# Two targets run side by side: at the end of a CI run both cores are free.
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== fuzz package: fmt"
# (Clippy on the fuzz package checks it without the fuzzing instrumentation, so it cannot share
# this build: it is `make lint`'s.)
cargo fmt --manifest-path fuzz/Cargo.toml -- --check

echo "== fuzz smoke"
FUZZ_SECONDS=${FUZZ_SMOKE_SECONDS:-10} FUZZ_CORPUS=none FUZZ_CODEGEN_UNITS=${FUZZ_CODEGEN_UNITS:-16} \
  FUZZ_JOBS=${FUZZ_JOBS:-2} exec scripts/fuzz.sh "$@"
