#!/usr/bin/env bash
# Installs a cargo subcommand the project's checks need (cargo-fuzz for `make fuzz` and
# scripts/fuzz-smoke.sh, cargo-deny for scripts/cargo-deny.sh) from crates.io into a cache outside
# the repository, keyed by a hash of its inputs: the crate, its version, the toolchain that builds
# it, this script and the install function of scripts/lib.sh. A new toolchain or version installs
# anew; the same inputs reuse the cache.
# Usage: scripts/install-cargo-tool.sh CRATE VERSION
# Prints the directory holding the tool's binary as its last line.
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"

crate=${1:?usage: install-cargo-tool.sh CRATE VERSION}
version=${2:?usage: install-cargo-tool.sh CRATE VERSION}

command -v cargo >/dev/null || die "cargo not found (install a Rust toolchain)"
key=$({ echo "$crate $version"; rustc -vV; cat "$0"; declare -f install_crate; } | cache_key)
root="$cache/$crate-$version-$key"
install_crate "$crate" "$version" "$root" true
echo "$root/bin"
