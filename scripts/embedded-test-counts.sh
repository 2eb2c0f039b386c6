#!/usr/bin/env bash
# How many tests scripts/run-tests.sh expects of the embedded-VMM test executables, taken from
# the executables' own lists (`EXE --list --format terse`; with `--ignored`: the #[ignore]d ones),
# so a test counts however it was written (#[test], #[tokio::test], a macro that makes tests).
# run-tests.sh sources this file; run on its own it prints the counts for the executables named:
#
#   scripts/embedded-test-counts.sh kvm_linux_guest=<exe> kvm_vfio_passthrough=<exe> cri_microvm=<exe> ...
#
# (`NAME=EXE`, the cargo target name first, as run-tests.sh's `executables` prints them.)

# tests_listed EXE [--ignored]: how many tests the test executable EXE has (with --ignored: how
# many of them are #[ignore]d). Fails when EXE cannot list them.
tests_listed() {
  local list
  list=$("$1" --list --format terse "${@:2}") || return 1
  grep -c ': test$' <<<"$list" || true
}

# count_embedded_tests NAME=EXE...: sets, over the executables given,
#   n_vfio      kvm_vfio_passthrough's ignored tests (VFIO passthrough: only the lane has a device)
#   n_sharing   the ignored tests of cri_microvm_page_sharing and cri_microvm_vmm_process
#   n_linux     the ignored tests of the plain run that run on the embedded VMM instead (and are
#               counted there): kvm_linux_guest's, plus n_vfio and n_sharing
#   n_embedded  the tests the embedded-VMM run reports: kvm_linux_guest's and
#               kvm_vfio_passthrough's ignored tests, and every test of the pod suites
#   unlisted    the names whose executable could not list its tests (not counted above)
count_embedded_tests() {
  local arg name exe all ignored n_linux_guest=0
  n_vfio=0 n_sharing=0 n_embedded=0 unlisted=()
  for arg in "$@"; do
    name=${arg%%=*}
    exe=${arg#*=}
    if ! all=$(tests_listed "$exe") || ! ignored=$(tests_listed "$exe" --ignored); then
      unlisted+=("$name")
      continue
    fi
    case "$name" in
      kvm_linux_guest) n_linux_guest=$ignored; n_embedded=$(( n_embedded + ignored )) ;;
      kvm_vfio_passthrough) n_vfio=$ignored; n_embedded=$(( n_embedded + ignored )) ;;
      cri_microvm_page_sharing|cri_microvm_vmm_process)
        n_sharing=$(( n_sharing + ignored )); n_embedded=$(( n_embedded + all )) ;;
      *) n_embedded=$(( n_embedded + all )) ;;
    esac
  done
  n_linux=$(( n_linux_guest + n_vfio + n_sharing ))
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -uo pipefail
  count_embedded_tests "$@"
  echo "n_linux=$n_linux n_vfio=$n_vfio n_sharing=$n_sharing n_embedded=$n_embedded unlisted=${unlisted[*]}"
fi
