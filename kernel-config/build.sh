#!/usr/bin/env bash
# Builds the microvm guest kernel: tinyconfig + kernel-config/fragments/*.config, uncompressed vmlinux.
#
#   kernel-config/build.sh                       # Debian's linux-source package
#   KERNEL_SRC=/path/to/tree kernel-config/build.sh   # another tree (e.g. a PVM guest kernel), same fragments
#
# Output is cached outside the repo by a hash of the inputs (fragments, this script, the kernel
# source identity): $CACHE/kernel-<hash>/{vmlinux,config,release}. ./build/vmlinux is linked to
# it, and the vmlinux path is printed as the last line on stdout. Progress goes to stderr.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/.." && pwd)
cache=${MICROVM_CACHE:-/var/cache/microvm}
fragments_dir=$here/fragments
jobs=${JOBS:-$(nproc)}

log() { echo "kernel-config: $*" >&2; }
die() { echo "kernel-config: error: $*" >&2; exit 1; }

# --- Debian packages: install only what is missing; `apt-get update` only if install fails. -----
ensure_packages() {
  local missing=() p
  for p in "$@"; do
    if [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" != "install ok installed" ]; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  [ "$(id -u)" -eq 0 ] || die "need root to install Debian packages: ${missing[*]}"
  log "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2; then
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
  fi
}

ensure_packages build-essential flex bison bc libelf-dev libssl-dev cpio dwarves python3 xz-utils

# --- Fragments: every symbol line must follow a one-line comment saying why. -------------------
shopt -s nullglob
fragments=("$fragments_dir"/*.config)
[ ${#fragments[@]} -gt 0 ] || die "no fragments in $fragments_dir"
for f in "${fragments[@]}"; do
  awk -v f="$f" '
    /^CONFIG_[A-Za-z0-9_]+=/ || /^# CONFIG_[A-Za-z0-9_]+ is not set$/ {
      if (!(prev ~ /^#/) || prev ~ /^# CONFIG_/) { printf "%s:%d: %s has no comment line above it\n", f, NR, $0; bad = 1 }
    }
    { prev = $0 }
    END { exit bad }' "$f" >&2 || die "every symbol in a fragment needs a comment saying why"
done

# --- Kernel source: Debian linux-source, unpacked once into the cache, or KERNEL_SRC. ------------
mkdir -p "$cache"
if [ -n "${KERNEL_SRC:-}" ]; then
  src=$(cd "$KERNEL_SRC" && pwd) || die "KERNEL_SRC=$KERNEL_SRC is not a directory"
  [ -f "$src/Makefile" ] && [ -d "$src/arch/x86" ] || die "KERNEL_SRC=$src does not look like a Linux tree"
  # Identity of an arbitrary tree: its git commit and uncommitted diff, else every file's size+mtime.
  if git -C "$src" rev-parse --verify -q HEAD >/dev/null 2>&1; then
    src_id="tree:$src git:$(git -C "$src" rev-parse HEAD) diff:$(git -C "$src" diff HEAD | sha256sum | cut -c1-64)"
  else
    src_id="tree:$src files:$(cd "$src" && find . -type f -not -path './.git/*' -printf '%P %s %T@\n' | LC_ALL=C sort | sha256sum | cut -c1-64)"
  fi
else
  tarball=$(ls /usr/src/linux-source-*.tar.xz 2>/dev/null | sort -V | tail -n1 || true)
  if [ -z "$tarball" ]; then
    ensure_packages linux-source
    tarball=$(ls /usr/src/linux-source-*.tar.xz 2>/dev/null | sort -V | tail -n1 || true)
    [ -n "$tarball" ] || die "linux-source installed but no /usr/src/linux-source-*.tar.xz"
  fi
  pkg=$(dpkg -S "$tarball" 2>/dev/null | cut -d: -f1 || true)
  pkg_version=$(dpkg-query -W -f='${Version}' "${pkg:-none}" 2>/dev/null || echo unknown)
  # Hashing the tarball (~140 MB) takes a second; remember it per (path, size, mtime).
  stamp=$(stat -c '%s %Y' "$tarball")
  sumfile=$cache/src/$(basename "$tarball").sha256
  mkdir -p "$cache/src"
  if [ -f "$sumfile" ] && [ "$(head -n1 "$sumfile")" = "$stamp" ]; then
    tar_sha=$(sed -n 2p "$sumfile")
  else
    tar_sha=$(sha256sum "$tarball" | cut -c1-64)
    printf '%s\n%s\n' "$stamp" "$tar_sha" >"$sumfile"
  fi
  src_id="debian:${pkg:-unknown}=$pkg_version sha256:$tar_sha"
  src=$cache/src/linux-$tar_sha
  top=$(basename "$tarball" .tar.xz)
  if [ ! -f "$src/.unpacked" ]; then
    log "unpacking $tarball ($pkg $pkg_version) into $src"
    rm -rf "$src" "$src.tmp"
    mkdir -p "$src.tmp"
    tar -xJf "$tarball" -C "$src.tmp"
    mv "$src.tmp/$top" "$src"
    rmdir "$src.tmp"
    touch "$src/.unpacked"
  fi
fi

# --- Cache key: fragments (names and contents), this script, the source identity. ---------------
key=$( {
  echo "src $src_id"
  echo "script $(sha256sum "$0" | cut -c1-64)"
  for f in "${fragments[@]}"; do echo "fragment $(basename "$f") $(sha256sum "$f" | cut -c1-64)"; done
} | sha256sum | cut -c1-16)
out=$cache/kernel-$key

link_and_print() {
  mkdir -p "$repo/build"
  ln -sfn "$out/vmlinux" "$repo/build/vmlinux"
  log "release $(cat "$out/release"), vmlinux $(stat -c %s "$out/vmlinux") bytes"
  echo "$out/vmlinux"
}

if [ -f "$out/vmlinux" ] && [ -f "$out/release" ] && [ -f "$out/config" ]; then
  log "cached: $out"
  link_and_print
  exit 0
fi

# --- Configure: tinyconfig, merge fragments, olddefconfig, then verify. -------------------------
obj=$cache/build-$key
mkdir -p "$obj"
mk=(make -C "$src" O="$obj" ARCH=x86_64 -j"$jobs")
log "source $src_id"
log "configuring in $obj"
"${mk[@]}" -s tinyconfig >&2
# merge_config.sh -m: merge onto the existing .config only; olddefconfig resolves the rest.
(cd "$obj" && "$src/scripts/kconfig/merge_config.sh" -m -O "$obj" "$obj/.config" "${fragments[@]}" >&2)
"${mk[@]}" -s olddefconfig >&2

# Every symbol a fragment asks for must have exactly that value in the final .config.
python3 - "$obj/.config" "${fragments[@]}" <<'PY' >&2 || die "the final .config does not match the fragments (see above)"
import re, sys
final = {}
for line in open(sys.argv[1]):
    m = re.match(r'^(CONFIG_\w+)=(.*)$', line.strip())
    if m:
        final[m.group(1)] = m.group(2)
        continue
    m = re.match(r'^# (CONFIG_\w+) is not set$', line.strip())
    if m:
        final[m.group(1)] = 'n'
bad = []
for path in sys.argv[2:]:
    for n, line in enumerate(open(path), 1):
        line = line.strip()
        m = re.match(r'^(CONFIG_\w+)=(.*)$', line)
        if m:
            sym, want = m.group(1), m.group(2)
        else:
            m = re.match(r'^# (CONFIG_\w+) is not set$', line)
            if not m:
                continue
            sym, want = m.group(1), 'n'
        got = final.get(sym)
        # An absent symbol is off: fine when "is not set" was asked for.
        if got == want or (want == 'n' and got is None):
            continue
        bad.append(f"  {path.rsplit('/', 1)[-1]}:{n}: {sym} wanted {want}, got {got if got is not None else 'missing'}")
if bad:
    print("kernel-config: symbols requested by fragments but missing or different in the final .config:")
    print("\n".join(bad))
    sys.exit(1)
PY
log "config verified against ${#fragments[@]} fragments"

# --- Build an uncompressed vmlinux and store it. ------------------------------------------------
log "building vmlinux with -j$jobs (cold: ~10 minutes on 2 cores)"
start=$(date +%s)
"${mk[@]}" vmlinux >&2
release=$("${mk[@]}" -s kernelrelease)
log "built in $(( $(date +%s) - start )) s"

rm -rf "$out.tmp"
mkdir -p "$out.tmp"
cp "$obj/vmlinux" "$out.tmp/vmlinux"
cp "$obj/.config" "$out.tmp/config"
echo "$release" >"$out.tmp/release"
printf '%s\n' "$src_id" >"$out.tmp/source"
rm -rf "$out"
mv "$out.tmp" "$out"
# The object tree is only needed for incremental rebuilds of the same key; drop it to save ~1 GB.
[ -n "${KEEP_BUILD_DIR:-}" ] || rm -rf "$obj"
link_and_print
