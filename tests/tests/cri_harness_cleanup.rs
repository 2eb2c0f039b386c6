//! The test harness itself: a pod that could not be removed through CRI (containerd gone, as
//! when a test panics with its containerd wedged) is still cleaned up when its
//! [`PrivateContainerd`] is dropped, so one failing test does not fail the leak checks of the
//! tests after it. Needs root and containerd; runs on the default test backend (QEMU on hosts
//! whose KVM cannot boot our guest).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::Path;
use std::time::Duration;

use microvm_tests::containerd::CniOptions;
use microvm_tests::cri::container_config;
use microvm_tests::lifecycle::MICROVM_STATE_ROOT;
use microvm_tests::microvm_pods::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_left_by_a_dead_containerd_is_cleaned_up_when_the_instance_drops() {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let config = write_config(dir.path(), None);
    let (mut ctrd, cri) = start_with_cni(&config, CniOptions::default()).await;
    cri.wait_ready(&[ctrd.busybox_image()], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let pod_config = ctrd.pod_config("left-behind", Default::default()).unwrap();
    let pod = cri
        .run_pod_sandbox(pod_config, "microvm")
        .await
        .unwrap_or_else(|e| panic!("RunPodSandbox: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let id = cri
        .create_container(
            &pod,
            container_config("sleeper", ctrd.busybox_image(), &["sleep", "3600"]),
        )
        .await
        .unwrap();
    cri.start_container(&id).await.unwrap();
    let netns = cri
        .pod_netns_path(&pod.id)
        .await
        .unwrap()
        .expect("a CNI pod has a network namespace");
    let state = Path::new(MICROVM_STATE_ROOT).join(&pod.id);
    assert!(state.is_dir(), "no state directory {}", state.display());
    assert!(netns.exists(), "no netns {}", netns.display());
    let shim_socket = ctrd.shim_socket(&pod.id);

    ctrd.kill_containerd();
    drop(ctrd);

    assert!(
        !state.exists(),
        "the pod's state directory {} is left",
        state.display()
    );
    assert!(
        !netns.exists(),
        "the pod's netns {} is left",
        netns.display()
    );
    assert!(
        !shim_socket.exists(),
        "the shim's socket {} is left",
        shim_socket.display()
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !mounts.contains(&pod.id),
        "mounts of pod {} are left:\n{mounts}",
        pod.id
    );
}
