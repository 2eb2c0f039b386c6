#!/usr/bin/env bash
# Unpacks the QEMU that runs the nested lane's L1 (docs/nested-lane.md) into the cache outside the
# repo and prints the path of its qemu-system-x86_64. It is bookworm-backports' QEMU (10.0.x), built
# for this Debian release's own libraries, so it runs here without installing anything: the
# packages are fetched with a private apt state (its own lists and sources, the system's keyring)
# and unpacked with `dpkg -x`. The system's QEMU (bookworm's 7.2, the QEMU backend of the host
# tests) is left as it is.
#
# Cached in $MICROVM_CACHE/qemu-<hash>-<version>/ (hash over this script: the suite and the
# packages it names; and scripts/lib.sh's private_apt); the version is the one the suite serves
# when the cache is first filled and is kept until the cache is removed: a suite moves on, a test
# run should not.
set -euo pipefail
# shellcheck source=SCRIPTDIR/../lib.sh
. "$(dirname "$0")/../lib.sh"
suite=bookworm-backports
# qemu-system-x86: the emulator; qemu-system-data: its firmware (qboot.rom, option ROMs).
packages=(qemu-system-x86 qemu-system-data)

hash=$({ cat "$0"; declare -f private_apt; } | cache_key)
for done in "$cache"/qemu-"$hash"-*/version; do
  if [ -f "$done" ]; then
    echo "$(dirname "$done")/usr/bin/qemu-system-x86_64"
    exit 0
  fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
private_apt "$work" "$suite"
# The suite's version of qemu-system-x86 (the newest it serves), and the same of the others.
version=$(apt-cache "${apt_opts[@]}" show qemu-system-x86 2>/dev/null |
  awk '/^Version:/ { print $2 }' | grep -F '~bpo' | sort -V | tail -n1)
[ -n "$version" ] || die "$suite has no qemu-system-x86"
(cd "$work" && apt-get "${apt_opts[@]}" download "${packages[@]/%/=$version}" >&2)
out=$cache/qemu-$hash-${version//[^A-Za-z0-9.+~-]/_}
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
for deb in "$work"/*.deb; do
  dpkg -x "$deb" "$out.tmp"
done
bin=$out.tmp/usr/bin/qemu-system-x86_64
# Every library it needs must already be here (the system's QEMU brought them).
if missing=$(ldd "$bin" | grep 'not found'); [ -n "$missing" ]; then
  log "QEMU $version needs libraries this system lacks:"
  echo "$missing" >&2
  exit 1
fi
"$bin" -L "$out.tmp/usr/share/qemu" --version | head -n1 >&2
echo "$version" >"$out.tmp/version"
mv "$out.tmp" "$out"
echo "$out/usr/bin/qemu-system-x86_64"
