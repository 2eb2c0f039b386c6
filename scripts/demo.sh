#!/usr/bin/env bash
# `make demo`: a busybox pod in a microVM through containerd's CRI (tests/src/bin/demo.rs):
# check-host picks the VM backend (the embedded VMM where this host can boot our guest kernel,
# QEMU otherwise, saying why), a private containerd with the `microvm` handler runs the pod, a
# container prints the guest's `uname -r` and exits with a chosen code, a second one serves a page
# with busybox httpd that the demo fetches on the host from the pod's IP, then the pod is removed,
# containerd stopped, and the demo checks that nothing was left behind. `make build` built it.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${CARGO_TARGET_DIR:-target}/release/microvm-demo
if [ ! -x "$bin" ]; then
  echo "$bin is missing: run \`make build\`" >&2
  exit 1
fi
exec "$bin" "$@"
