# shellcheck shell=bash
# What the scripts of scripts/, scripts/lane/ and kernel-config/ share. Sourced, never run:
#   . "$(dirname "$0")/lib.sh"          (from scripts/; ../lib.sh from scripts/lane/)
#
#   log MSG, die MSG   one message style on stderr: `<name>: MSG`, `<name>: error: MSG` (die then
#                      exits 1). <name> is $log_name: set it before sourcing, else the script's
#                      file name without .sh.
#   ensure_packages PKG...   installs the Debian packages among PKG... that are missing.
#   cache              the cache outside the repository: ${MICROVM_CACHE:-/var/cache/microvm}.
#   cache_key          the key of a cache folder: a hash of what is on stdin (a script's inputs:
#                      versions, the script itself, ...); the same inputs give the same key.
#   install_crate      a crate's exact version from crates.io into a cache folder, built once.
#   private_apt DIR SUITE    apt-get/apt-cache options for another Debian suite's packages.

log_name=${log_name:-$(basename "$0" .sh)}
# shellcheck disable=SC2034 # for the scripts that source this
cache=${MICROVM_CACHE:-/var/cache/microvm}

log() { echo "$log_name: $*" >&2; }
die() { echo "$log_name: error: $*" >&2; exit 1; }

# Installs the Debian packages among its arguments that are not installed, and nothing else;
# `apt-get update` only when installing fails without it (no or stale package lists). Needs root
# only when something is missing. apt's output goes to stderr.
ensure_packages() {
  local absent=() p
  for p in "$@"; do
    # dpkg-query prints "install ok installed" for an installed package.
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
      absent+=("$p")
    fi
  done
  [ ${#absent[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "need root to install Debian packages: ${absent[*]}"
  log "installing ${absent[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${absent[@]}" >&2; then
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${absent[@]}" >&2
  fi
}

# The key of a cache folder ($cache/<what>-<key>): the first 16 hex digits of the SHA-256 of
# stdin. Callers hash what their output depends on, so new inputs build anew and the same inputs
# find the folder an earlier run filled.
cache_key() { sha256sum | cut -c1-16; }

# install_crate CRATE VERSION ROOT CHECK [CARGO-INSTALL-ARG...]
# Installs crates.io's CRATE, exactly VERSION, into ROOT (its binary: ROOT/bin/CRATE) unless ROOT
# holds it already and `CHECK BINARY` accepts it (`true` when being there is enough; a check
# prints why it rejects a binary on stderr). Built outside any workspace target dir so it does not
# disturb the project's build; --locked takes the crate's published Cargo.lock, what its authors
# tested. Installed into a temporary root beside ROOT first, checked, and moved into place whole,
# so an interrupted or rejected build leaves no half cache entry. The environment (RUSTFLAGS)
# and the extra arguments (--target) go to cargo install. Progress goes to stderr. It holds the
# EXIT trap (removing its temporary folders) while it builds.
install_crate() {
  local crate=$1 version=$2 root=$3 check=$4 build stage
  shift 4
  if [ -x "$root/bin/$crate" ] && "$check" "$root/bin/$crate" 2>/dev/null; then
    log "$crate $version already installed in $root"
    return 0
  fi
  command -v cargo >/dev/null || die "cargo not found (install a Rust toolchain)"
  mkdir -p "$(dirname "$root")"
  build=$(mktemp -d "${TMPDIR:-/tmp}/$crate-build.XXXXXX")
  stage=$(mktemp -d "$(dirname "$root")/.$crate-$version.XXXXXX")
  chmod 755 "$stage"
  # shellcheck disable=SC2064 # the paths are fixed now; the function's locals are gone at exit.
  trap "rm -rf $(printf '%q ' "$build" "$stage")" EXIT
  log "installing $crate $version into $root (compiles for a few minutes)"
  CARGO_TARGET_DIR="$build" cargo install --locked --version "=$version" --root "$stage" "$@" "$crate" >&2 ||
    die "cargo install of $crate $version failed"
  [ -x "$stage/bin/$crate" ] || die "cargo install did not produce $crate"
  "$check" "$stage/bin/$crate" || die "$crate $version as built fails its check ($check)"
  rm -rf "$root"
  mv "$stage" "$root"
  rm -rf "$build"
  trap - EXIT
}

# private_apt DIR SUITE: fills the array apt_opts with the options that make apt-get and apt-cache
# use a private apt state in DIR (an empty folder) for Debian's SUITE (main, from
# MICROVM_DEBIAN_MIRROR or deb.debian.org; the system's keyring), and reads SUITE's package list
# into it. Never touches the system's apt state: with these options `apt-get download` fetches
# SUITE's packages into the current folder, to be unpacked with `dpkg -x`, never installed.
private_apt() {
  local dir=$1 suite=$2 mirror=${MICROVM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
  mkdir -p "$dir/lists/partial" "$dir/archives/partial" "$dir/etc/preferences.d"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$dir/sources.list"
  # shellcheck disable=SC2034 # for the caller
  apt_opts=(
    -o "Dir::State::Lists=$dir/lists"
    -o "Dir::Etc::SourceList=$dir/sources.list"
    -o "Dir::Etc::SourceParts=-"
    -o "Dir::Etc::PreferencesParts=$dir/etc/preferences.d"
    -o "Dir::Cache::Archives=$dir/archives"
    -o "Dir::Cache::pkgcache="
    -o "Dir::Cache::srcpkgcache="
    -o "APT::Get::List-Cleanup=0"
    -o "APT::Sandbox::User=root"
  )
  log "reading $suite's package list"
  apt-get "${apt_opts[@]}" update -qq >&2
}
