#!/usr/bin/env bash
# Installs the pinned cargo-deny (deny.toml: licenses, bans, sources) from crates.io into the
# cache (scripts/install-cargo-tool.sh: $MICROVM_CACHE/cargo-deny-<version>-<key>, built once per
# version and toolchain) and prints the directory holding its binary as the last line.
# Usage: scripts/install-cargo-deny.sh; then `"$dir/cargo-deny" check licenses bans sources`.
set -euo pipefail
cd "$(dirname "$0")/.."

CARGO_DENY_VERSION=0.20.2
exec nice -n "${INSTALL_NICE:-0}" scripts/install-cargo-tool.sh cargo-deny "$CARGO_DENY_VERSION"
