//! Privileged containers in `microvm` pods through CRI on a private containerd (issue 18 part 5,
//! docs/devices.md "Privileged containers"). containerd writes a privileged container's spec with
//! every node of the *host's* /dev and a rule allowing every device; in a microVM the container
//! gets every device of the *guest* and none of the host's, every capability of the guest
//! kernel, /sys read-write and no masked /proc paths. Only the disks the pod holds from a device
//! plugin (cold-plugged from kubelet's PodResources API, played here by
//! `microvm_tests::podresources`) cross from the host.
//!
//! - a privileged container starts, sees the guest's devices (its /dev against the guest
//!   kernel's own list in /sys/dev), writes the guest's kernel log, mounts, makes device nodes,
//!   has every capability, and sees neither /dev/kvm nor any host disk (the bytes of the host's
//!   disks and of a loop device the pod does not hold are nowhere in the VM); the pod's disk is
//!   there at its CRI path; a non-privileged container with a host device is still refused,
//!   naming it;
//! - mount propagation with a privileged container: what it mounts under a Bidirectional volume
//!   reaches the pod's other container of that volume (HostToContainer) inside the guest and
//!   never the host; a mount the host makes under the volume later reaches both.
//!
//! The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by default; `kvm`: the embedded VMM, the nested
//! lane). Needs root, containerd, losetup, QEMU and vhost-device-vsock (scripts/install-deps.sh),
//! and `make kernel initrd`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use k8s_cri::v1::{
    ContainerConfig, Device, LinuxContainerConfig, LinuxContainerSecurityContext,
    LinuxSandboxSecurityContext, Mount, MountPropagation,
};
use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::loop_device::{write_cdi, LoopDevice};
use microvm_tests::microvm_pods::*;
use microvm_tests::podresources::{GetSupport, PodResourcesServer};

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The pods' namespace (`cri::pod_config`'s).
const NAMESPACE: &str = "microvm-tests";
/// The device plugin's resource name, also the CDI kind.
const RESOURCE: &str = "microvm.test/disk";
const EXIT_TIMEOUT: Duration = Duration::from_secs(180);
/// What kubelet masks and makes read-only in /proc for a container with the default procMount;
/// containerd clears both for a privileged one.
/// (Those the guest kernel has: it has no /proc/kcore or /proc/sysrq-trigger.)
const MASKED: &[&str] = &["/proc/keys", "/proc/timer_list"];
const READ_ONLY: &[&str] = &["/proc/sys"];

async fn start_ctrd(config: &Path) -> (PrivateContainerd, CriClient) {
    let (ctrd, cri) = start(config).await;
    cri.wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (ctrd, cri)
}

/// The shim config of the test backend; with `devices`, asking that kubelet socket and reading
/// CDI specs from that folder.
fn config(dir: &Path, devices: Option<(&Path, &Path)>) -> PathBuf {
    let config = write_config(dir, None);
    if let Some((socket, cdi)) = devices {
        let mut text = std::fs::read_to_string(&config).unwrap();
        text.push_str(&format!(
            "[devices]\npod_resources_socket = \"{}\"\ncdi_dirs = [\"{}\"]\n",
            socket.display(),
            cdi.display()
        ));
        std::fs::write(&config, text).unwrap();
    }
    config
}

/// Runs a privileged pod (containerd refuses privileged containers in a pod that is not).
async fn run_privileged_pod(ctrd: &PrivateContainerd, cri: &CriClient, name: &str) -> Pod {
    let mut config = ctrd.pod_config(name, HashMap::new()).unwrap();
    config
        .linux
        .get_or_insert_with(Default::default)
        .security_context = Some(LinuxSandboxSecurityContext {
        privileged: true,
        ..Default::default()
    });
    cri.run_pod_sandbox(config, "microvm")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RunPodSandbox {name}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        })
}

/// A busybox container running `script`, privileged or not, with the masked and read-only
/// /proc paths kubelet asks for.
fn container(name: &str, script: &str, privileged: bool) -> ContainerConfig {
    let mut c = container_config(name, BUSYBOX_IMAGE, &["sh", "-c", script]);
    c.linux = Some(LinuxContainerConfig {
        security_context: Some(LinuxContainerSecurityContext {
            privileged,
            masked_paths: MASKED.iter().map(|s| s.to_string()).collect(),
            readonly_paths: READ_ONLY.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }),
        ..Default::default()
    });
    c
}

fn device(container_path: &str, host_path: &str, permissions: &str) -> Device {
    Device {
        container_path: container_path.into(),
        host_path: host_path.into(),
        permissions: permissions.into(),
    }
}

/// What the device script prints, line by line, with a word first saying what the line is.
/// Few processes: the guest has some 600 devices, and each process is slow under emulation.
const DEVICE_SCRIPT: &str = r#"
ls -lR /dev | sed 's/^/ls /'
for c in char block; do echo "sysnums $c $(ls /sys/dev/$c | tr '\n' ' ')"; done
grep -H '^DEVNAME=' /sys/dev/char/*/uevent /sys/dev/block/*/uevent | sed 's/^/sys /'
for b in /sys/block/*; do echo "serial ${b#/sys/block/} $(cat $b/serial 2>/dev/null)"; done
for f in $(find /dev -type b); do
  echo "head $f $(dd if=$f bs=16 count=1 2>/dev/null | tr -c 'A-Za-z0-9!-' '.')"
  echo "sum $f $(dd if=$f bs=65536 count=1 2>/dev/null | md5sum | cut -d' ' -f1)"
done
echo "kernel $(uname -r)"
echo "lastcap $(cat /proc/sys/kernel/cap_last_cap)"
grep -E '^Cap(Eff|Prm|Bnd)' /proc/self/status | sed 's/^/cap /'
echo "sysfs $(awk '$2=="/sys"{print $4}' /proc/mounts)"
echo "procmounts $(awk '$2 ~ "^/proc/"{print $2}' /proc/mounts | tr '\n' ' ')"
m=microvm-privileged-kmsg-$(cat /proc/sys/kernel/random/uuid)
echo $m > /dev/kmsg && dmesg | grep -q $m && echo "kmsg ok"
mkdir -p /mnt/t && mount -t tmpfs -o size=1m t /mnt/t && echo mounted > /mnt/t/f && echo "tmpfs $(cat /mnt/t/f)" && umount /mnt/t
mknod /dev/made-here c 1 11 && head -c 1 /dev/made-here > /dev/null && echo "mknod ok"
echo "end of script"
"#;

/// The device nodes of `ls -lR /dev` lines: path -> (block|char, major, minor).
fn ls_nodes(ls: &[&str]) -> BTreeMap<String, (String, u32, u32)> {
    let mut dir = String::new();
    let mut nodes = BTreeMap::new();
    for l in ls {
        if let Some(d) = l.strip_suffix(':') {
            dir = d.to_string();
            continue;
        }
        let kind = match l.chars().next() {
            Some('b') => "block",
            Some('c') => "char",
            _ => continue,
        };
        // perms links owner group "major," minor month day time name
        let w: Vec<&str> = l.split_whitespace().collect();
        let (Some(ma), Some(mi), Some(name)) = (w.get(4), w.get(5), w.get(9)) else {
            panic!("unexpected ls line {l:?}");
        };
        let ma: u32 = ma.trim_end_matches(',').parse().unwrap();
        nodes.insert(
            format!("{dir}/{name}"),
            (kind.to_string(), ma, mi.parse().unwrap()),
        );
    }
    nodes
}

/// The lines of `out` that start with `word`, without it.
fn lines<'a>(out: &'a [String], word: &str) -> Vec<&'a str> {
    out.iter()
        .filter_map(|l| l.strip_prefix(word)?.strip_prefix(' '))
        .collect()
}

/// This process's bounding set (containerd, which the test starts, inherits it).
fn host_bounding_set() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let hex = status
        .lines()
        .find_map(|l| l.strip_prefix("CapBnd:"))
        .unwrap()
        .trim();
    u64::from_str_radix(hex, 16).unwrap()
}

/// The md5 of the first 64 KiB of the host's disks (not loop devices): none may be readable in
/// the VM.
fn host_disk_sums() -> BTreeMap<String, String> {
    let mut sums = BTreeMap::new();
    for e in std::fs::read_dir("/sys/block").unwrap().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("loop") || name.starts_with("zram") || name.starts_with("ram") {
            continue;
        }
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "dd if=/dev/{name} bs=65536 count=1 2>/dev/null | md5sum | cut -d' ' -f1"
            ))
            .output()
            .unwrap();
        let sum = String::from_utf8_lossy(&out.stdout).trim().to_string();
        // An empty or unreadable disk says nothing.
        let empty = "d41d8cd98f00b204e9800998ecf8427e";
        let zero_64k = "fcd6bcb56c1689fcef28b57c22475bad";
        if !sum.is_empty() && sum != empty && sum != zero_64k {
            sums.insert(name, sum);
        }
    }
    sums
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_container_gets_the_guests_devices_and_none_of_the_hosts() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let held = LoopDevice::new(dir.path(), "held", b"held-by-the-pod!");
    let stranger = LoopDevice::new(dir.path(), "stranger", b"host-only-disk!!");
    let cdi = dir.path().join("cdi");
    write_cdi(&cdi, RESOURCE, &[("d0", "/dev/xvda", &held, "rw")]);
    let server =
        PodResourcesServer::start(&dir.path().join("kubelet.sock"), GetSupport::Get).unwrap();
    server.add_pod(NAMESPACE, "privileged", &[(RESOURCE, &["d0"])]);
    let config = config(dir.path(), Some((server.socket(), &cdi)));
    let (ctrd, cri) = start_ctrd(&config).await;
    let host_sums = host_disk_sums();
    let pod = run_privileged_pod(&ctrd, &cri, "privileged").await;

    // The device plugin's disk comes as kubelet passes it; containerd adds the host's /dev.
    let mut c = container("privileged", DEVICE_SCRIPT, true);
    c.devices = vec![device("/dev/xvda", &held.path(), "rwm")];
    let exited = run_container_to_exit(&ctrd, &cri, &pod, c, EXIT_TIMEOUT).await;
    let out = exited.lines();
    let all = out.join("\n");
    assert_eq!(exited.status.exit_code, 0, "{all}");

    assert!(all.contains("end of script"), "{all}");
    // The guest kernel's devices, from its sysfs (/sys in the container is the guest's).
    let mut numbers: BTreeSet<(String, u32, u32)> = BTreeSet::new();
    for l in lines(&out, "sysnums") {
        let (kind, list) = l.split_once(' ').unwrap_or((l, ""));
        for n in list.split_whitespace() {
            let (ma, mi) = n.split_once(':').unwrap();
            numbers.insert((kind.to_string(), ma.parse().unwrap(), mi.parse().unwrap()));
        }
    }
    let mut guest: BTreeMap<(String, u32, u32), String> = BTreeMap::new();
    for l in lines(&out, "sys") {
        // /sys/dev/char/1:3/uevent:DEVNAME=null
        let rest = l.strip_prefix("/sys/dev/").unwrap();
        let (class, name) = rest.split_once("/uevent:DEVNAME=").unwrap();
        let (kind, n) = class.split_once('/').unwrap();
        let (ma, mi) = n.split_once(':').unwrap();
        guest.insert(
            (kind.to_string(), ma.parse().unwrap(), mi.parse().unwrap()),
            name.trim().to_string(),
        );
    }
    assert!(numbers.len() > 10, "no /sys/dev in the container:\n{all}");
    // Every node in the container is a device of the guest kernel.
    let nodes = ls_nodes(&lines(&out, "ls"));
    for (path, key) in &nodes {
        // /dev/made-here did not exist yet when the nodes were listed.
        assert!(
            numbers.contains(key),
            "{path} {key:?} is no device of the guest kernel:\n{all}"
        );
    }
    // And every device of the guest kernel (bar its console, its ptys, and ptmx, which is the
    // container's own devpts' as for runc) is in the container;
    // where the pod's disk is at its host path too (the host's /dev named it there, as runc's
    // privileged container has it), that path is the pod's disk.
    let pods_disk = nodes
        .get("/dev/xvda")
        .cloned()
        .unwrap_or_else(|| panic!("{all}"));
    for ((kind, ma, mi), name) in &guest {
        if name.is_empty() || name == "console" || name == "ptmx" || name.starts_with("pts/") {
            continue;
        }
        let path = format!("/dev/{name}");
        let want = if path == held.path() {
            pods_disk.clone()
        } else {
            (kind.clone(), *ma, *mi)
        };
        assert_eq!(
            nodes.get(&path),
            Some(&want),
            "the guest's {path} ({kind} {ma}:{mi}) is not in the container:\n{all}"
        );
    }
    assert_eq!(
        nodes.get(&held.path()),
        Some(&pods_disk),
        "the pod's disk at its host path:\n{all}"
    );
    // None of the host's: /dev/kvm is the host's (the guest kernel has no KVM).
    if Path::new("/dev/kvm").exists() {
        assert!(!nodes.contains_key("/dev/kvm"), "{all}");
        assert!(!numbers.contains(&("char".into(), 10, 232)), "{all}");
    }
    // No disk of the host and no loop device the pod does not hold is in the VM: their bytes
    // are nowhere; the VM's disks are the pod's own (their serials are the shim's).
    for (name, sum) in &host_sums {
        for l in lines(&out, "sum") {
            assert!(
                !l.ends_with(sum.as_str()),
                "the host's disk {name} is readable in the VM: {l}\n{all}"
            );
        }
    }
    assert!(!all.contains("host-only-disk!!"), "{all}");
    for l in lines(&out, "serial") {
        let (disk, serial) = l.split_once(' ').unwrap_or((l, ""));
        if disk.starts_with("vd") {
            assert!(serial.starts_with("microvm-"), "disk {disk}: {l}\n{all}");
        }
    }
    // The pod's disk, at its CRI path and as the guest's virtio disk.
    let heads = lines(&out, "head");
    assert!(heads.contains(&"/dev/xvda held-by-the-pod!"), "{all}");
    let cold = lines(&out, "serial")
        .into_iter()
        .find(|l| l.ends_with(" microvm-cold0"))
        .unwrap_or_else(|| panic!("no cold-plugged disk:\n{all}"));
    let disk = cold.split(' ').next().unwrap();
    assert!(
        heads.contains(&format!("/dev/{disk} held-by-the-pod!").as_str()),
        "{all}"
    );
    // Every capability, in every set: containerd gives a privileged container all of its own
    // (this test's, which it inherits), of which the guest kernel knows them all here.
    let last: u32 = lines(&out, "lastcap")[0].parse().unwrap();
    let every = host_bounding_set() & ((1u64 << (last + 1)) - 1);
    assert!(
        every & (1 << 21) != 0,
        "CAP_SYS_ADMIN is not in this test's bounding set"
    );
    let every = format!("{every:016x}");
    let caps = lines(&out, "cap");
    assert_eq!(caps.len(), 3, "{all}");
    for c in caps {
        assert!(
            c.ends_with(&every),
            "{c}: not every capability ({every})\n{all}"
        );
    }
    // /sys read-write, nothing masked or read-only in /proc; the guest's kernel log; mounts
    // and device nodes of its own.
    assert!(
        lines(&out, "sysfs")[0].split(',').any(|o| o == "rw"),
        "{all}"
    );
    assert_eq!(lines(&out, "procmounts"), [""], "{all}");
    assert_eq!(lines(&out, "kmsg"), ["ok"], "{all}");
    assert_eq!(lines(&out, "tmpfs"), ["mounted"], "{all}");
    assert_eq!(lines(&out, "mknod"), ["ok"], "{all}");
    // The kernel log written is the guest's, not the host's.
    let host_log = Command::new("dmesg").output().unwrap();
    assert!(!String::from_utf8_lossy(&host_log.stdout).contains("microvm-privileged-kmsg"));
    cri.remove_container(&exited.id).await.unwrap();

    // The same container without privileged: kubelet's masks, the default devices, no mounts.
    let plain = container("plain", DEVICE_SCRIPT, false);
    let exited = run_container_to_exit(&ctrd, &cri, &pod, plain, EXIT_TIMEOUT).await;
    let out = exited.lines();
    let all = out.join("\n");
    let masked = lines(&out, "procmounts")[0].to_string();
    for p in MASKED.iter().chain(READ_ONLY) {
        assert!(masked.split(' ').any(|m| m == *p), "{p} not masked: {all}");
    }
    assert!(lines(&out, "tmpfs").is_empty(), "{all}");
    assert!(lines(&out, "kmsg").is_empty(), "{all}");
    // Its device rules hold in the guest: the node it made of /dev/kmsg cannot be opened.
    assert!(lines(&out, "mknod").is_empty(), "{all}");
    assert!(!all.contains("held-by-the-pod!"), "{all}");
    cri.remove_container(&exited.id).await.unwrap();

    // A host device in a container that is not privileged is still refused, naming it.
    let host_node = ["/dev/kvm", "/dev/net/tun"]
        .into_iter()
        .find(|p| Path::new(p).exists())
        .expect("the host has /dev/kvm or /dev/net/tun");
    let mut c = container("host-device", "true", false);
    c.devices = vec![device(host_node, host_node, "rwm")];
    let id = cri.create_container(&pod, c).await.unwrap();
    let e = cri
        .start_container(&id)
        .await
        .expect_err("a host device reached a container that is not privileged")
        .to_string();
    assert!(e.contains(&format!("device {host_node} (c ")), "{e}");
    assert!(
        e.contains("cannot be given to a container in a microVM"),
        "{e}"
    );
    cri.remove_container(&id).await.unwrap();

    remove_pod(&ctrd, &cri, &pod).await;
    // The pod's disk was written by nobody; the stranger was never touched.
    assert_eq!(held.head(16), b"held-by-the-pod!");
    assert_eq!(stranger.head(16), b"host-only-disk!!");
}

/// The guest enforces a container's device rules (its cgroup's device program): a container
/// that is not privileged uses its own disk but not a node it makes of a device it was not given;
/// a privileged one uses every device. An UpdateContainerResources, whose device rules containerd
/// sends as its spec has them (the host's numbers), takes neither away: the guest keeps each
/// container's own rules.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_rules_hold_in_the_guest_and_an_update_keeps_them() {
    use k8s_cri::v1::LinuxContainerResources;
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let held = LoopDevice::new(dir.path(), "held", b"held-by-the-pod!");
    let cdi = dir.path().join("cdi");
    write_cdi(&cdi, RESOURCE, &[("d0", "/dev/xvda", &held, "rw")]);
    let server =
        PodResourcesServer::start(&dir.path().join("kubelet.sock"), GetSupport::Get).unwrap();
    server.add_pod(NAMESPACE, "device-rules", &[(RESOURCE, &["d0"])]);
    let config = config(dir.path(), Some((server.socket(), &cdi)));
    let (ctrd, cri) = start_ctrd(&config).await;
    let pod = run_privileged_pod(&ctrd, &cri, "device-rules").await;
    let mut ids = Vec::new();
    for (name, privileged) in [("plain", false), ("privileged", true)] {
        let mut c = container(name, "sleep 3600", privileged);
        c.devices = vec![device("/dev/xvda", &held.path(), "rwm")];
        let id = cri
            .create_container(&pod, c)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        ids.push(id);
    }
    // Its disk, and a node of the guest's kernel log it makes itself.
    let probe = "dd if=/dev/xvda bs=16 count=1 2>/dev/null; echo; \
                 [ -e /dev/made ] || mknod /dev/made c 1 11; \
                 if head -c 1 /dev/made > /dev/null; then echo made-OPENED; else echo made-denied; fi";
    let check = |when: &'static str| {
        let (cri, ids) = (cri.clone(), ids.clone());
        async move {
            for (id, made) in ids.iter().zip(["made-denied", "made-OPENED"]) {
                let out = cri.exec_sync(id, &["sh", "-c", probe], 60).await.unwrap();
                assert_eq!(
                    out.stdout,
                    format!("held-by-the-pod!\n{made}\n"),
                    "{when}, container {id}: {out:?}"
                );
            }
        }
    };
    check("after the start").await;
    for id in &ids {
        cri.update_container_resources(
            id,
            LinuxContainerResources {
                memory_limit_in_bytes: 200 << 20,
                ..Default::default()
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    }
    check("after an update").await;
    remove_pod(&ctrd, &cri, &pod).await;
}

/// `mount(8)` with `args`, panicking with its stderr on failure.
fn host_mount(args: &[&str]) {
    let out = Command::new("mount")
        .args(args)
        .output()
        .expect("running mount");
    assert!(
        out.status.success(),
        "mount {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Mounts a small tmpfs named `source` on `dir` (on the host) with one file, `hello`, saying
/// `text`.
fn host_tmpfs_saying(dir: &Path, source: &str, text: &str) {
    let dir_s = dir.display().to_string();
    host_mount(&["-t", "tmpfs", "-o", "size=1m", source, &dir_s]);
    std::fs::write(dir.join("hello"), text).unwrap();
}

/// Unmounts a test's host mount and every mount under it when dropped: a test that fails
/// leaves none behind on the host.
struct UnmountOnDrop(PathBuf);

impl Drop for UnmountOnDrop {
    fn drop(&mut self) {
        if host_mounts_under(&self.0).is_empty() {
            return;
        }
        let _ = Command::new("umount").arg("-R").arg(&self.0).status();
        if !host_mounts_under(&self.0).is_empty() {
            let _ = Command::new("umount")
                .args(["-R", "-l"])
                .arg(&self.0)
                .status();
        }
    }
}

/// The host's mount points under `dir`.
fn host_mounts_under(dir: &Path) -> BTreeSet<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .filter(|p| Path::new(p).starts_with(dir))
        .map(str::to_string)
        .collect()
}

/// Runs `cmd` in container `id` until it prints `want` (bounded), for mounts that propagate.
async fn wait_exec(cri: &CriClient, id: &str, cmd: &[&str], want: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let out = cri.exec_sync(id, cmd, 60).await.unwrap();
        if out.exit_code == 0 && out.stdout == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {cmd:?} in {id} gives {out:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn volume(container_path: &str, host_path: &str, propagation: MountPropagation) -> Mount {
    Mount {
        container_path: container_path.into(),
        host_path: host_path.into(),
        propagation: propagation as i32,
        ..Default::default()
    }
}

/// Mount propagation with a privileged container, as a CSI node plugin uses it: the privileged
/// container mounts under its Bidirectional volume, and the pod's other container, which has the
/// same volume HostToContainer, sees the mount (inside the guest: nothing goes to the host). A
/// mount the host makes under the volume after both started reaches both. The mount the
/// privileged container made stays for the other container after it is removed (also once the
/// guest has let go of the removed container's files), as a Bidirectional mount stays on the host
/// with runc; and a mount the host makes under the volume after that still reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_privileged_containers_bidirectional_mounts_reach_the_pods_other_containers() {
    let _serial = SERIAL.lock().await;
    let dir = tempfile::tempdir().unwrap();
    let config = config(dir.path(), None);
    let (ctrd, cri) = start_ctrd(&config).await;
    // containerd wants the source of a propagating volume on a shared mount.
    let vol = dir.path().join("vol");
    std::fs::create_dir_all(vol.join("later")).unwrap();
    std::fs::create_dir_all(vol.join("after-the-plugin")).unwrap();
    std::fs::create_dir_all(vol.join("sub")).unwrap();
    std::fs::write(vol.join("on-the-host"), "host file\n").unwrap();
    let vol_s = vol.display().to_string();
    host_mount(&["--bind", &vol_s, &vol_s]);
    // Whatever happens below, the test's host mounts go with it (before its folder does).
    let _unmount = UnmountOnDrop(vol.clone());
    host_mount(&["--make-rshared", &vol_s]);
    let mounts_before = host_mounts_under(&vol);
    let pod = run_privileged_pod(&ctrd, &cri, "propagation").await;

    let mut ids = Vec::new();
    for (name, privileged, propagation) in [
        (
            "csi-plugin",
            true,
            MountPropagation::PropagationBidirectional,
        ),
        (
            "consumer",
            false,
            MountPropagation::PropagationHostToContainer,
        ),
    ] {
        let mut c = container(name, "sleep 3600", privileged);
        c.mounts = vec![volume("/vol", &vol_s, propagation)];
        let id = cri
            .create_container(&pod, c)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        ids.push(id);
    }
    let (plugin, consumer) = (ids[0].clone(), ids[1].clone());

    // The privileged container mounts under its Bidirectional volume...
    let out = cri
        .exec_sync(
            &plugin,
            &[
                "sh",
                "-c",
                "mount -t tmpfs -o size=1m from-the-plugin /vol/sub && \
                 echo made-in-the-guest > /vol/sub/f && cat /vol/sub/f",
            ],
            60,
        )
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_str()),
        (0, "made-in-the-guest\n"),
        "{out:?}"
    );
    // ... which the other container sees, and the host does not.
    wait_exec(
        &cri,
        &consumer,
        &["cat", "/vol/sub/f"],
        "made-in-the-guest\n",
        "the plugin's mount in the consumer",
    )
    .await;
    assert!(
        !vol.join("sub/f").exists(),
        "a guest mount reached the host"
    );
    assert_eq!(host_mounts_under(&vol), mounts_before);

    // A mount the host makes under the volume now reaches both.
    let later = vol.join("later");
    host_tmpfs_saying(&later, "microvm-test-later", "from a later host mount\n");
    for id in [&plugin, &consumer] {
        wait_exec(
            &cri,
            id,
            &["cat", "/vol/later/hello"],
            "from a later host mount\n",
            "the host's later mount",
        )
        .await;
    }

    // The plugin goes; its mount stays for the consumer, whose volume still shows the host's.
    cri.stop_container(&plugin, 0).await.unwrap();
    cri.remove_container(&plugin).await.unwrap();
    let after_the_plugin = ["cat", "/vol/sub/f", "/vol/on-the-host"];
    let both = "made-in-the-guest\nhost file\n";
    wait_exec(
        &cri,
        &consumer,
        &after_the_plugin,
        both,
        "the consumer after the plugin went",
    )
    .await;
    // It stays: also once the guest has let go of the removed plugin's files in the shared
    // directory (the agent looks a removed container's folder up again every 2 s until the
    // host has removed it; virtio-fs's entries time out after about a second).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let out = cri
        .exec_sync(&consumer, &after_the_plugin, 60)
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_str()),
        (0, both),
        "the consumer 8 s after the plugin went: {out:?}"
    );
    // And a mount the host makes under the volume after the plugin went still reaches the
    // consumer.
    let after = vol.join("after-the-plugin");
    host_tmpfs_saying(
        &after,
        "microvm-test-after",
        "from a host mount after the plugin\n",
    );
    wait_exec(
        &cri,
        &consumer,
        &["cat", "/vol/after-the-plugin/hello"],
        "from a host mount after the plugin\n",
        "the host's mount after the plugin went",
    )
    .await;

    remove_pod(&ctrd, &cri, &pod).await;
    let _ = Command::new("umount").arg(&later).status();
    let _ = Command::new("umount").arg(&after).status();
    assert_eq!(
        host_mounts_under(&vol),
        mounts_before,
        "the pod left mounts under its volume"
    );
}
