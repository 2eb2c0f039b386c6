#!/bin/sh
# The microvm-deploy DaemonSet's container (deploy/microvm-deploy.yaml): installs microvm on the
# node mounted at /host, keeps running, and uninstalls when the pod is stopped (SIGTERM).
set -eu
host=${MICROVM_DEPLOY_HOST:-/host}                 # the node's root
staging=/opt/microvm-staging                       # on the node: what `microvm install` copies from
prefix=/opt/microvm
here=${MICROVM_DEPLOY_ARTIFACTS:-/opt/microvm-deploy}   # in the image: the artifacts
ready=${MICROVM_DEPLOY_READY:-/tmp/microvm-installed}    # the readiness probe's file
# "true": install on nodes whose KVM cannot boot the guest, where pods run under QEMU's
# software emulation (TCG, no security boundary); otherwise such a node is refused.
allow_tcg=${MICROVM_ALLOW_SOFTWARE_EMULATION:-false}

log() { echo "microvm-deploy: $*"; }

on_node() { chroot "$host" "$@"; }

restart_containerd() {
  if on_node systemctl is-active --quiet containerd 2>/dev/null; then
    log "restarting containerd"
    on_node systemctl restart containerd
  else
    log "containerd is not a systemd service here: restart it yourself to load the change"
  fi
}

# Labels (value) or unlabels (null) this node through the API with the pod's service account.
label_node() {
  value=$1
  sa=/var/run/secrets/kubernetes.io/serviceaccount
  [ -n "${NODE_NAME:-}" ] && [ -f "$sa/token" ] || { log "no node name or token: label not changed"; return 0; }
  curl -fsS --cacert "$sa/ca.crt" -H "Authorization: Bearer $(cat "$sa/token")" \
    -H "Content-Type: application/merge-patch+json" -X PATCH \
    -d "{\"metadata\":{\"labels\":{\"microvm.io/installed\":$value}}}" \
    "https://${KUBERNETES_SERVICE_HOST}:${KUBERNETES_SERVICE_PORT}/api/v1/nodes/${NODE_NAME}" >/dev/null
}

uninstall() {
  log "uninstalling"
  label_node null || log "could not remove the node label"
  on_node "$prefix/bin/microvm" uninstall --prefix "$prefix" || log "uninstall failed (see above)"
  restart_containerd
  rm -rf "$host$staging"
  rm -f "$ready"
  exit 0
}

case "$allow_tcg" in
  true) tcg_flag=--allow-software-emulation ;;
  false) tcg_flag= ;;
  *) log "MICROVM_ALLOW_SOFTWARE_EMULATION must be true or false, not '$allow_tcg'"; exit 1 ;;
esac

log "staging the artifacts in $staging on the node"
rm -rf "$host$staging"
mkdir -p "$host$staging"
cp -a "$here/bin/." "$host$staging/"
on_node env MICROVM_VHOST_VSOCK="$staging/vhost-device-vsock" MICROVM_VIRTIOFSD="$staging/virtiofsd" \
  "$staging/microvm" install --prefix "$prefix" $tcg_flag \
  --kernel "$staging/vmlinux" --initrd "$staging/initrd.cpio"
restart_containerd
label_node '"true"'
touch "$ready"
trap uninstall TERM INT
log "installed; waiting (the pod's deletion uninstalls)"
while :; do sleep 3600 & wait $!; done
