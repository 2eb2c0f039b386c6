//! Host-side file safety of a `microvm` pod's shared filesystem, through CRI on a private
//! containerd (docs/virtio-fs.md "Host-side file safety", docs/qemu-backend.md "virtiofsd").
//!
//! A container with containerd's default capabilities (`CAP_MKNOD`, `CAP_FSETID`, `CAP_CHOWN`
//! and `CAP_FOWNER` among them: no privileged flag) attacks the host through what the pod
//! shares: a hostPath volume (a directory of the test on the host's disk) and its own rootfs,
//! both served to the guest over virtio-fs by a host process running as root. After it exits
//! the test looks at the host directory itself:
//!
//! - device nodes (`/dev/mem`'s 1:1, a disk's 8:0) are refused and absent from the host, in the
//!   volume and in the rootfs; a mknod on the guest's own tmpfs works (so the refusal is the
//!   host's, not the guest's device rules);
//! - the overlayfs whiteout (0:0), FIFOs and a set-group-ID directory still work;
//! - writing a set-user-ID file the host put there clears the bit on the host;
//! - `chmod u+s` / `g+s` of a file is refused on the embedded VMM, with no bit on the host.
//!   The Rust virtiofsd (QEMU backend) cannot refuse it (docs/qemu-backend.md): there the test
//!   asserts that it went through, so a change of virtiofsd's behaviour shows.
//!
//! The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by default; `kvm` is the embedded VMM, run
//! in the nested lane). Needs root, containerd, QEMU, vhost-device-vsock and
//! virtiofsd (scripts/install-deps.sh), and `make kernel initrd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use k8s_cri::v1::Mount;
use microvm_tests::cri::container_config;
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;

const EXIT_TIMEOUT: Duration = Duration::from_secs(120);

/// The container's attacks, one `name=ok|refused` line each, then its view of the volume.
const ATTACKS: &str = r##"
r() { n=$1; shift; if "$@" 2>/dev/null; then echo "$n=ok"; else echo "$n=refused"; fi; }
r guest-tmpfs-mem mknod /dev/probe-mem c 1 1
r mem mknod /vol/mem c 1 1
r kmem mknod /vol/kmem c 1 2
r sda mknod /vol/sda b 8 0
r rootfs-mem mknod /rootfs-mem c 1 1
r whiteout mknod /vol/whiteout c 0 0
r fifo mkfifo /vol/fifo
r plain sh -c 'echo data > /vol/plain'
r suid-chmod chmod 4755 /vol/plain
r sgid-chmod chmod 2755 /vol/plain
r rootfs-suid sh -c 'echo "#!/bin/sh" > /rootfs-suid && chmod 4755 /rootfs-suid'
r sgid-dir sh -c 'mkdir /vol/team && chmod 2775 /vol/team'
r write-suid sh -c 'echo pwn >> /vol/image-suid'
ls -ln /vol
"##;

fn host_mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .mode()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_cannot_plant_device_nodes_or_set_id_files_on_the_host() {
    require_root();
    let hypervisor = test_hypervisor();
    let (dir, _config, ctrd, cri) = start_with_busybox().await;
    let vol = dir.path().join("vol");
    std::fs::create_dir(&vol).unwrap();
    // A set-user-ID-root program the host put into the volume (as an image's would be).
    let image_suid = vol.join("image-suid");
    std::fs::write(&image_suid, "#!/bin/sh\n").unwrap();
    std::fs::set_permissions(&image_suid, std::fs::Permissions::from_mode(0o4755)).unwrap();

    let pod = run_pod(&ctrd, &cri, "fs-policy").await;
    let mut attacker = container_config("attacker", BUSYBOX_IMAGE, &["sh", "-c", ATTACKS]);
    attacker.mounts.push(Mount {
        container_path: "/vol".into(),
        host_path: vol.display().to_string(),
        ..Default::default()
    });
    let exited = run_container_to_exit(&ctrd, &cri, &pod, attacker, EXIT_TIMEOUT).await;
    let out = exited.stdout();
    let text = out.join("\n");
    let result = |name: &str| -> &str {
        out.iter()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .unwrap_or_else(|| panic!("no result for {name}:\n{text}"))
    };
    println!("{hypervisor}: the container saw:\n{text}");
    assert_eq!(exited.status.exit_code, 0, "{text}");

    // The guest itself lets the container make a device node (on its own tmpfs): what is
    // refused below is refused by the host side.
    assert_eq!(result("guest-tmpfs-mem"), "ok", "{text}");
    for name in ["mem", "kmem", "sda", "rootfs-mem"] {
        assert_eq!(result(name), "refused", "{hypervisor}: {name}\n{text}");
    }
    for name in ["mem", "kmem", "sda"] {
        assert!(
            std::fs::symlink_metadata(vol.join(name)).is_err(),
            "{hypervisor}: {name} is on the host\n{text}"
        );
    }
    // What stays allowed.
    for name in ["whiteout", "fifo", "plain", "sgid-dir", "write-suid"] {
        assert_eq!(result(name), "ok", "{hypervisor}: {name}\n{text}");
    }
    let whiteout = std::fs::symlink_metadata(vol.join("whiteout")).unwrap();
    assert!(whiteout.file_type().is_char_device() && whiteout.rdev() == 0);
    assert!(std::fs::symlink_metadata(vol.join("fifo"))
        .unwrap()
        .file_type()
        .is_fifo());
    assert_eq!(
        host_mode(&vol.join("team")) & (libc::S_IFMT | 0o7777),
        libc::S_IFDIR | 0o2775
    );
    // Writing the set-user-ID program cleared its bit on the host.
    assert_eq!(
        std::fs::read_to_string(&image_suid).unwrap(),
        "#!/bin/sh\npwn\n"
    );
    assert_eq!(host_mode(&image_suid) & 0o7777, 0o755, "{hypervisor}");

    if hypervisor == "kvm" {
        // The embedded VMM refuses set-ID bits on files.
        for name in ["suid-chmod", "sgid-chmod", "rootfs-suid"] {
            assert_eq!(result(name), "refused", "{name}\n{text}");
        }
        assert_eq!(host_mode(&vol.join("plain")) & 0o7777, 0o644, "{text}");
    } else {
        // virtiofsd has no option to refuse them (docs/qemu-backend.md): root's `chmod` sets
        // them on root's files and the last one (g+s) is on the host. Asserted so that a
        // virtiofsd that starts refusing them shows here, and the docs follow.
        for name in ["suid-chmod", "sgid-chmod", "rootfs-suid"] {
            assert_eq!(result(name), "ok", "{hypervisor}: {name}\n{text}");
        }
        assert_eq!(host_mode(&vol.join("plain")) & 0o7777, 0o2755, "{text}");
    }

    cri.remove_container(&exited.id).await.unwrap();
    remove_pod(&ctrd, &cri, &pod).await;
}
