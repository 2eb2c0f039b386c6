//! A pod's embedded VMM in a process of its own (`vmm_process = true`, docs/security.md "The
//! VMM's confinement"), through CRI on a private containerd (tests/src/containerd.rs): the
//! shim's `__vmm` child runs every thread under a seccomp filter with no_new_privs and only
//! the virtio-fs server's five capabilities, in its own mount, PID, network, IPC and UTS
//! namespaces, with a root that holds only `/run` (the VM's work folder and the page
//! templates' folder) and a `/proc` of its own; a container runs and answers (virtio-fs and vsock work from inside the
//! jail); kill -9 of the VMM process ends the pod with the reason in the shim's log, and
//! removing the pod leaves nothing. The embedded VMM boots our Linux guest only where
//! `microvm check-host` says so (the nested lane here, docs/nested-lane.md), hence `#[ignore]`
//! where make test runs the pod suites on QEMU. Needs root, containerd, and `make kernel
//! initrd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use microvm_tests::cri::container_config;
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;

fn field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .map(|v| v.trim().to_string())
        .unwrap_or_default()
}

fn ns(pid: i32, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap_or_default()
}

/// CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_SETGID, CAP_SETUID (bits 0, 1, 3, 6, 7).
const FS_SERVER_CAPS: &str = "00000000000000cb";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the embedded VMM boots our Linux guest only in the nested lane here (docs/nested-lane.md)"]
async fn a_pods_vmm_runs_jailed_in_a_process_of_its_own_and_its_death_ends_the_pod() {
    require_root();
    let dir = tempfile::tempdir().unwrap();
    let config = write_config_for(dir.path(), None, "kvm");
    // The default, said here so that MICROVM_TEST_VMM_PROCESS=0 runs of the suites keep it.
    let text = std::fs::read_to_string(&config).unwrap();
    let mut text: String = text
        .lines()
        .filter(|l| !l.starts_with("vmm_process"))
        .map(|l| format!("{l}\n"))
        .collect();
    text.push_str("vmm_process = true\n");
    std::fs::write(&config, text).unwrap();
    let (ctrd, cri) = start(&config).await;
    cri.wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));

    let started = Instant::now();
    let pod = run_pod(&ctrd, &cri, "microvm-vmm-process").await;
    eprintln!(
        "RunPodSandbox with the VMM process: {:?}",
        started.elapsed()
    );
    let shims = shim_pids(&ctrd, &pod.id);
    assert_eq!(shims.len(), 1, "{shims:?}");
    let shim = shims[0];
    let vmms = vmm_process_pids(shim);
    assert_eq!(vmms.len(), 1, "one VMM process under the shim: {vmms:?}");
    let vmm = vmms[0];

    // The VMM process runs the shim's own running binary (the kernel's link to it, so that a
    // binary replaced on disk meanwhile is not what it starts), named as the shim is for ps.
    let exe_id = |pid: i32| {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(format!("/proc/{pid}/exe")).unwrap();
        (m.dev(), m.ino())
    };
    assert_eq!(
        exe_id(vmm),
        exe_id(shim),
        "the VMM process runs the shim's binary"
    );
    let argv0 = |pid: i32| {
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
        cmd.split(|&b| b == 0).next().unwrap_or_default().to_vec()
    };
    let shim_exe = std::fs::read_link(format!("/proc/{shim}/exe")).unwrap();
    assert_eq!(
        argv0(vmm),
        shim_exe.as_os_str().as_encoded_bytes(),
        "ps names the VMM process by the shim's path"
    );

    // Every thread: filtered, no_new_privs, only the file server's capabilities.
    let mut names = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{vmm}/task")).unwrap() {
        let dir = entry.unwrap().path();
        let name = std::fs::read_to_string(dir.join("comm"))
            .unwrap()
            .trim()
            .to_string();
        let status = std::fs::read_to_string(dir.join("status")).unwrap();
        eprintln!(
            "VMM thread {name}: Seccomp {} NoNewPrivs {} CapEff {} CapBnd {}",
            field(&status, "Seccomp:"),
            field(&status, "NoNewPrivs:"),
            field(&status, "CapEff:"),
            field(&status, "CapBnd:")
        );
        assert_eq!(field(&status, "Seccomp:"), "2", "{name}");
        assert_eq!(field(&status, "NoNewPrivs:"), "1", "{name}");
        for set in ["CapEff:", "CapPrm:", "CapBnd:"] {
            assert_eq!(field(&status, set), FS_SERVER_CAPS, "{name} {set}");
        }
        assert_eq!(field(&status, "CapInh:"), "0000000000000000", "{name}");
        names.push(name);
    }
    for want in ["vmm-devices", "vmm-vcpu0"] {
        assert!(names.iter().any(|n| n == want), "{want} in {names:?}");
    }
    // Its own namespaces, PID 1 of its PID namespace.
    for kind in ["mnt", "pid", "net", "ipc", "uts"] {
        assert_ne!(ns(vmm, kind), ns(shim, kind), "{kind} namespace");
    }
    let status = std::fs::read_to_string(format!("/proc/{vmm}/status")).unwrap();
    assert_eq!(
        field(&status, "NSpid:").split_whitespace().last(),
        Some("1"),
        "{status}"
    );
    // Its root: /run only (the work folder and the templates' folder at their own paths).
    let root = PathBuf::from(format!("/proc/{vmm}/root"));
    let mut top: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    top.sort();
    // /proc: a procfs of its own PID namespace (subset=pid), through which the file server
    // reaches the share.
    assert_eq!(top, ["proc", "run"], "the VMM's root");
    for host in [
        "etc",
        "dev",
        "sys",
        "usr",
        "var",
        "proc/sys",
        "proc/sysrq-trigger",
    ] {
        assert!(!root.join(host).exists(), "/{host} is reachable");
    }
    let run: Vec<String> = std::fs::read_dir(root.join("run"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    eprintln!("the VMM's /run holds {run:?}");
    assert!(run
        .iter()
        .all(|n| n == "microvm" || n.starts_with("microvm-page-templates")));

    // The pod works: a container runs in the VM (virtio-fs serves its rootfs, vsock the agent).
    let exited = run_container_to_exit(
        &ctrd,
        &cri,
        &pod,
        container_config(
            "hello",
            BUSYBOX_IMAGE,
            &["sh", "-c", "echo hello from the jail"],
        ),
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(exited.status.exit_code, 0, "{:?}", exited.status);
    assert_eq!(exited.stdout(), ["hello from the jail"]);
    cri.remove_container(&exited.id).await.unwrap();

    // kill -9 of the VMM process: the shim sees it through the pidfd and the pod ends with
    // the reason in its log.
    // SAFETY: kill(2) of the VMM process found above.
    assert_eq!(unsafe { libc::kill(vmm, libc::SIGKILL) }, 0);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = cri
            .pod_sandbox_status(&pod.id, false)
            .await
            .ok()
            .and_then(|s| s.status)
            .map(|s| s.state)
            .unwrap_or_default();
        // SANDBOX_NOTREADY = 1.
        if state == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the pod stays ready after its VMM died\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default();
    assert!(
        log.contains("the VMM process was killed by signal 9"),
        "the reason is not in the log:\n{}",
        ctrd.log_tail()
    );
    assert!(!Path::new(&format!("/proc/{vmm}")).exists(), "reaped");
    remove_pod(&ctrd, &cri, &pod).await;
}
