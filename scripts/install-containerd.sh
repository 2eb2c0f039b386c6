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
suite=${1:?usage: install-containerd.sh trixie|sid}
case "$suite" in trixie|sid) ;; *) echo "install-containerd: unknown suite $suite" >&2; exit 2 ;; esac
cache=${MICROVM_CACHE:-/var/cache/microvm}
mirror=${MICROVM_DEBIAN_MIRROR:-http://deb.debian.org/debian}

# A previous run's unpacked containerd of this suite.
for done in "$cache"/containerd-"$suite"-*/version; do
  if [ -f "$done" ]; then
    echo "$(dirname "$done")/usr/bin"
    exit 0
  fi
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/etc/preferences.d"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" >"$work/sources.list"
apt_opts=(
  -o "Dir::State::Lists=$work/lists"
  -o "Dir::Etc::SourceList=$work/sources.list"
  -o "Dir::Etc::SourceParts=-"
  -o "Dir::Etc::PreferencesParts=$work/etc/preferences.d"
  -o "Dir::Cache::Archives=$work/archives"
  -o "Dir::Cache::pkgcache="
  -o "Dir::Cache::srcpkgcache="
  -o "APT::Get::List-Cleanup=0"
  -o "APT::Sandbox::User=root"
)
echo "install-containerd: reading $suite's package list" >&2
apt-get "${apt_opts[@]}" update -qq >&2
version=$(apt-cache "${apt_opts[@]}" show containerd 2>/dev/null | awk '/^Version:/ { print $2; exit }')
[ -n "$version" ] || { echo "install-containerd: $suite has no containerd package" >&2; exit 1; }
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
