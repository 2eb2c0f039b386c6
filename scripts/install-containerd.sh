#!/usr/bin/env bash
# Unpacks another Debian suite's containerd into the cache outside the repo, for the tests that
# run the pod suites against it, and prints the folder holding its binaries.
# Never installs anything: the package is fetched with a private apt state (its own lists and
# sources, the system's keyring) and unpacked with `dpkg -x`.
#
#   scripts/install-containerd.sh trixie   # containerd 1.7.x
#   scripts/install-containerd.sh sid      # containerd 2.x
#
# Cached in $MICROVM_CACHE/containerd-<suite>-<version>/ (usr/bin/containerd, ctr, shims); the
# version is the one the suite serves when the cache is first filled, recorded in `version`,
# and kept until the cache is removed (a suite moves on; a test run should not).
set -euo pipefail
# shellcheck source=SCRIPTDIR/lib.sh
. "$(dirname "$0")/lib.sh"
suite=${1:?usage: install-containerd.sh trixie|sid}
case "$suite" in trixie|sid) ;; *) log "unknown suite $suite"; exit 2 ;; esac

# A previous run's unpacked containerd of this suite.
for done in "$cache"/containerd-"$suite"-*/version; do
  if [ -f "$done" ]; then
    echo "$(dirname "$done")/usr/bin"
    exit 0
  fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
private_apt "$work" "$suite"
version=$(apt-cache "${apt_opts[@]}" show containerd 2>/dev/null | awk '/^Version:/ { print $2; exit }')
[ -n "$version" ] || die "$suite has no containerd package"
(cd "$work" && apt-get "${apt_opts[@]}" download "containerd=$version" >&2)
deb=$(ls "$work"/containerd_*.deb)
out=$cache/containerd-$suite-${version//[^A-Za-z0-9.+~-]/_}
rm -rf "$out.tmp"
mkdir -p "$out.tmp"
dpkg -x "$deb" "$out.tmp"
"$out.tmp/usr/bin/containerd" --version >&2
echo "$version" >"$out.tmp/version"
mv "$out.tmp" "$out"
echo "$out/usr/bin"
