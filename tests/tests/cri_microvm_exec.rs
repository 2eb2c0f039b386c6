//! Processes in a microvm pod's app containers through containerd (CRI and `ctr`), under the
//! QEMU backend with our guest kernel and initrd from build/: ExecSync (guest kernel, exit
//! codes, a missing binary), an interactive exec on a terminal with resizes, stdin piped
//! through and closed, ContainerStats from the guest's cgroup, Pause/Resume, a containerd
//! restart under a running pod. Needs what
//! tests/tests/cri_microvm.rs needs (root, Debian's containerd and ctr, QEMU,
//! vhost-device-vsock, `make kernel initrd`).
//!
//! After each test the pod is stopped and removed, and nothing of it may remain.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const CTR_TIMEOUT: Duration = Duration::from_secs(60);

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A pod named `name` with one running busybox container (`sleep`); returns both.
async fn pod_with_sleeper(ctrd: &PrivateContainerd, cri: &CriClient, name: &str) -> (Pod, String) {
    let pod = run_pod(ctrd, cri, name).await;
    let id = cri
        .create_container(
            &pod,
            container_config("sleeper", BUSYBOX_IMAGE, &["sleep", "3600"]),
        )
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (pod, id)
}

/// `ctr -a <sock> -n k8s.io ARGS` with the given stdio, not waited for.
fn spawn_ctr(ctrd: &PrivateContainerd, args: &[&str], stdio: [Stdio; 3]) -> Child {
    let [stdin, stdout, stderr] = stdio;
    ctrd.ctr_command()
        .args(args)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(stderr)
        .spawn()
        .expect("spawning ctr")
}

/// Waits for `child` at most `timeout`; kills it after that. Returns its exit code.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<i32> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status.code();
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The release of the guest kernel build/vmlinux points at (`release` next to it).
fn guest_kernel_release() -> String {
    let vmlinux = std::fs::canonicalize(repo().join("build/vmlinux")).unwrap();
    let release = vmlinux.parent().unwrap().join("release");
    std::fs::read_to_string(&release)
        .unwrap_or_else(|e| panic!("{}: {e}", release.display()))
        .trim()
        .to_string()
}

fn host_kernel_release() -> String {
    let out = Command::new("uname").arg("-r").output().unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

// ---- tests ----

/// ExecSync runs in the guest (our kernel, not the host's), reports exact exit codes (n and
/// 128+signal), and a missing binary fails promptly with an error naming it; the container
/// keeps running throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_sync_runs_in_the_guest_with_exact_exit_codes() {
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let (pod, cid) = pod_with_sleeper(&ctrd, &cri, "microvm-exec-sync").await;

    let t = Instant::now();
    let out = cri
        .exec_sync(&cid, &["uname", "-r"], 60)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let took = t.elapsed();
    let guest = guest_kernel_release();
    assert_eq!(out.exit_code, 0, "{out:?}");
    assert_eq!(out.stdout.trim(), guest, "{out:?}");
    assert_ne!(out.stdout.trim(), host_kernel_release(), "ran on the host");
    eprintln!("ExecSync uname -r: {:?} in {took:?}", out.stdout.trim());

    let out = cri
        .exec_sync(&cid, &["sh", "-c", "echo out; echo err >&2; exit 7"], 60)
        .await
        .unwrap();
    assert_eq!(
        (out.exit_code, out.stdout.as_str(), out.stderr.as_str()),
        (7, "out\n", "err\n"),
        "{out:?}"
    );
    let out = cri
        .exec_sync(&cid, &["sh", "-c", "kill -9 $$"], 60)
        .await
        .unwrap();
    assert_eq!(out.exit_code, 137, "SIGKILL is 128+9: {out:?}");

    let t = Instant::now();
    let err = cri
        .exec_sync(&cid, &["/no/such/binary", "arg"], 60)
        .await
        .expect_err("ExecSync of a missing binary must fail")
        .to_string();
    let took = t.elapsed();
    assert!(err.contains("/no/such/binary"), "{err}");
    assert!(took < Duration::from_secs(15), "took {took:?}: {err}");
    eprintln!("missing binary: ExecSync failed in {took:?}: {err}");

    // The container still runs and still execs.
    let out = cri.exec_sync(&cid, &["echo", "alive"], 60).await.unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "alive\n"));
    let status = cri.container_status(&cid).await.unwrap();
    assert_eq!(status.state, 1, "CONTAINER_RUNNING: {status:?}");

    remove_pod(&ctrd, &cri, &pod).await;
}

/// A pty pair (master, slave).
fn openpty() -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    // SAFETY: openpty(3) writes two fds into the given ints; name, termios and winsize may be
    // null.
    let rc = unsafe {
        libc::openpty(
            &mut master,
            &mut slave,
            std::ptr::null_mut(),
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned two fresh fds that nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

fn set_window_size(master: &OwnedFd, rows: u16, cols: u16) {
    let size = libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: TIOCSWINSZ reads a winsize from a pointer valid for the call.
    let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &size) };
    assert_eq!(rc, 0, "TIOCSWINSZ: {}", std::io::Error::last_os_error());
}

/// Reads the pty master until `want` shows up in what was read (bounded); returns all read.
fn read_until(master: &mut std::fs::File, seen: &mut String, want: &str, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 4096];
    while !seen.contains(want) {
        assert!(
            Instant::now() < deadline,
            "no {want:?} on the terminal within {timeout:?}; it shows:\n{seen}"
        );
        let mut pfd = libc::pollfd {
            fd: master.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: poll(2) on one pollfd that lives across the call.
        let ready = unsafe { libc::poll(&mut pfd, 1, 200) };
        if ready <= 0 {
            continue;
        }
        match master.read(&mut buf) {
            Ok(0) => panic!("the terminal closed before {want:?}; it shows:\n{seen}"),
            Ok(n) => seen.push_str(&String::from_utf8_lossy(&buf[..n]).replace('\r', "")),
            Err(e) => panic!("reading the terminal: {e}; it shows:\n{seen}"),
        }
    }
}

/// `ctr task exec -t` of `sh` on a terminal we hold: the exec's pty has the window size of ours
/// (`stty size` inside says so), follows a resize, and `exit 3` ends ctr with 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_exec_on_a_tty_follows_resizes() {
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let (pod, cid) = pod_with_sleeper(&ctrd, &cri, "microvm-exec-tty").await;

    let (master, slave) = openpty();
    set_window_size(&master, 31, 101);
    let stdio = || Stdio::from(slave.try_clone().unwrap());
    let mut cmd = ctrd.ctr_command();
    cmd.args(["task", "exec", "-t", "--exec-id", "tty1", &cid, "sh"])
        .stdin(stdio())
        .stdout(stdio())
        .stderr(stdio());
    // SAFETY: between fork and exec only async-signal-safe calls: setsid(2) makes ctr a session
    // leader so that the terminal (its stdin) becomes its controlling terminal (TIOCSCTTY), and
    // the resizes below reach it as SIGWINCH.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut cmd, || {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut ctr = cmd.spawn().expect("spawning ctr task exec -t");
    // The Command keeps its copies of the slave: only ctr may hold the terminal, or the master
    // would never see the end of it.
    drop(cmd);
    drop(slave);
    let mut term = std::fs::File::from(master.try_clone().unwrap());
    let mut seen = String::new();

    term.write_all(b"stty size; echo mark-$((40+2))\n").unwrap();
    read_until(&mut term, &mut seen, "mark-42", Duration::from_secs(60));
    assert!(
        seen.lines().any(|l| l.trim() == "31 101"),
        "stty size inside is not 31 101:\n{seen}"
    );

    set_window_size(&master, 45, 132);
    // ctr resizes the exec's pty on SIGWINCH (the kernel sends it to ctr's session); give it a
    // moment, then ask again.
    std::thread::sleep(Duration::from_millis(500));
    seen.clear();
    term.write_all(b"stty size; echo mark-$((50+3))\n").unwrap();
    read_until(&mut term, &mut seen, "mark-53", Duration::from_secs(30));
    assert!(
        seen.lines().any(|l| l.trim() == "45 132"),
        "stty size after the resize is not 45 132:\n{seen}"
    );

    term.write_all(b"exit 3\n").unwrap();
    // The terminal must be drained while ctr exits (a full pty would block it).
    let drain = std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = term.read_to_end(&mut sink);
    });
    let code = wait_bounded(&mut ctr, CTR_TIMEOUT);
    assert_eq!(code, Some(3), "ctr task exec -t of sh ending with `exit 3`");
    drop(master);
    // With ctr gone nobody holds the slave: the drain reads EIO and ends.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !drain.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the terminal stayed open after ctr exited"
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    // The container is unaffected.
    let status = cri.container_status(&cid).await.unwrap();
    assert_eq!(status.state, 1, "CONTAINER_RUNNING: {status:?}");
    remove_pod(&ctrd, &cri, &pod).await;
}

/// `ctr task exec` (no terminal) of `cat` with stdin from a pipe: every byte comes back on
/// stdout, and the exec exits 0 once the pipe is closed (stdin EOF reached the process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_stdin_is_piped_through_and_closed() {
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let (pod, cid) = pod_with_sleeper(&ctrd, &cri, "microvm-exec-stdin").await;

    // More than one pipe buffer (64 KiB) and not a multiple of any chunk size.
    let payload: Vec<u8> = (0..150_001u32)
        .map(|i| b"microvm stdin\n"[(i % 14) as usize])
        .collect();
    let mut ctr = spawn_ctr(
        &ctrd,
        &["task", "exec", "--exec-id", "cat1", &cid, "cat"],
        [Stdio::piped(), Stdio::piped(), Stdio::piped()],
    );
    let mut stdin = ctr.stdin.take().unwrap();
    let mut stdout = ctr.stdout.take().unwrap();
    let mut stderr = ctr.stderr.take().unwrap();
    let input = payload.clone();
    let writer = std::thread::spawn(move || stdin.write_all(&input).map(|()| drop(stdin)));
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        stdout.read_to_end(&mut out).map(|_| out)
    });
    let errors = std::thread::spawn(move || {
        let mut out = String::new();
        let _ = stderr.read_to_string(&mut out);
        out
    });
    let t = Instant::now();
    let code = wait_bounded(&mut ctr, CTR_TIMEOUT);
    let took = t.elapsed();
    let stderr = errors.join().unwrap();
    writer.join().unwrap().expect("writing ctr's stdin");
    let out = reader.join().unwrap().expect("reading ctr's stdout");
    assert_eq!(
        code,
        Some(0),
        "ctr task exec cat: stderr {stderr}\ncontainerd log:\n{}",
        ctrd.log_tail()
    );
    assert_eq!(out.len(), payload.len(), "bytes back from cat");
    assert!(out == payload, "cat's output differs from its input");
    eprintln!("stdin through cat: {} bytes in {took:?}", out.len());

    remove_pod(&ctrd, &cri, &pod).await;
}

/// ContainerStats (CRI) of a running container: its memory and CPU from the guest's cgroup;
/// `ctr task pause` freezes it (PAUSED), `ctr task resume` thaws it (RUNNING) and it still
/// execs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_stats_and_pause_resume() {
    use microvm_tests::cri::v1::runtime_service_client::RuntimeServiceClient;
    use microvm_tests::cri::v1::ContainerStatsRequest;
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let (pod, cid) = pod_with_sleeper(&ctrd, &cri, "microvm-exec-stats").await;
    // Some memory and CPU in the container's cgroup.
    let out = cri
        .exec_sync(
            &cid,
            &[
                "sh",
                "-c",
                "i=0; while [ $i -lt 2000 ]; do i=$((i+1)); done",
            ],
            60,
        )
        .await
        .unwrap();
    assert_eq!(out.exit_code, 0, "{out:?}");

    let path = ctrd.socket().to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    let mut runtime = RuntimeServiceClient::new(channel);
    let stats = tokio::time::timeout(
        CALL_TIMEOUT,
        runtime.container_stats(ContainerStatsRequest {
            container_id: cid.clone(),
        }),
    )
    .await
    .expect("ContainerStats in time")
    .unwrap_or_else(|e| panic!("ContainerStats: {e}\ncontainerd log:\n{}", ctrd.log_tail()))
    .into_inner()
    .stats
    .expect("stats");
    let memory = stats
        .memory
        .as_ref()
        .and_then(|m| m.working_set_bytes.as_ref())
        .map(|v| v.value)
        .unwrap_or(0);
    let cpu = stats
        .cpu
        .as_ref()
        .and_then(|c| c.usage_core_nano_seconds.as_ref())
        .map(|v| v.value)
        .unwrap_or(0);
    eprintln!("ContainerStats: working set {memory} bytes, cpu {cpu} ns");
    assert!(memory > 0, "no memory in ContainerStats: {stats:?}");
    assert!(cpu > 0, "no CPU time in ContainerStats: {stats:?}");

    let task_status = |ctrd: &PrivateContainerd| {
        let out = ctrd.ctr(&["task", "ls"], CTR_TIMEOUT).unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines()
            .find(|l| l.starts_with(cid.as_str()))
            .and_then(|l| l.split_whitespace().nth(2))
            .unwrap_or("?")
            .to_string()
    };
    let out = ctrd.ctr(&["task", "pause", &cid], CTR_TIMEOUT).unwrap();
    assert!(
        out.status.success(),
        "pause: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(task_status(&ctrd), "PAUSED");
    let out = ctrd.ctr(&["task", "resume", &cid], CTR_TIMEOUT).unwrap();
    assert!(
        out.status.success(),
        "resume: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(task_status(&ctrd), "RUNNING");
    let out = cri.exec_sync(&cid, &["echo", "thawed"], 60).await.unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "thawed\n"));

    remove_pod(&ctrd, &cri, &pod).await;
}

/// A container whose init outgrows its memory limit (applied to its cgroup in the guest) is
/// OOM-killed there: it exits with 137, and the shim's TaskOOM (from the agent's GetOomEvent)
/// makes CRI report the reason `OOMKilled`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oom_kill_in_the_guest_reaches_cri_as_oomkilled() {
    use microvm_tests::cri::v1::{LinuxContainerConfig, LinuxContainerResources};
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let pod = run_pod(&ctrd, &cri, "microvm-exec-oom").await;
    let mut config = container_config(
        "hog",
        BUSYBOX_IMAGE,
        &["sh", "-c", "a=x; while true; do a=\"$a$a\"; done"],
    );
    config.linux = Some(LinuxContainerConfig {
        resources: Some(LinuxContainerResources {
            memory_limit_in_bytes: 24 << 20,
            ..Default::default()
        }),
        ..Default::default()
    });
    let exited = run_container_to_exit(&ctrd, &cri, &pod, config, Duration::from_secs(120)).await;
    let (id, status) = (exited.id, exited.status);
    assert_eq!(status.exit_code, 137, "{status:?}");
    // The TaskOOM event may reach containerd just after the exit.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut status = status;
    while status.reason != "OOMKilled" {
        if Instant::now() >= deadline {
            let console = Path::new(STATE_ROOT).join(&pod.id).join("vm/console.log");
            let console = std::fs::read_to_string(&console).unwrap_or_default();
            let tail: Vec<&str> = console.lines().rev().take(60).collect();
            panic!(
                "no OOMKilled reason: {status:?}\ncontainerd log:\n{}\nguest console (last lines, newest first):\n{}",
                ctrd.log_tail(),
                tail.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        status = cri.container_status(&id).await.unwrap();
    }
    eprintln!(
        "OOM kill in the guest: exit {}, reason {}",
        status.exit_code, status.reason
    );
    cri.remove_container(&id).await.unwrap();
    remove_pod(&ctrd, &cri, &pod).await;
}

/// UpdateContainerResources (CRI) of a running container reaches its cgroup in the guest: the
/// memory limit read inside the container follows the update.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_container_resources_reach_the_guest_cgroup() {
    use microvm_tests::cri::v1::runtime_service_client::RuntimeServiceClient;
    use microvm_tests::cri::v1::{LinuxContainerResources, UpdateContainerResourcesRequest};
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let (pod, cid) = pod_with_sleeper(&ctrd, &cri, "microvm-exec-update").await;
    let memory_max = [
        "sh",
        "-c",
        "cat /sys/fs/cgroup$(cut -d: -f3 /proc/self/cgroup)/memory.max",
    ];
    let before = cri.exec_sync(&cid, &memory_max, 60).await.unwrap();
    assert_eq!(before.exit_code, 0, "{before:?}");

    let path = ctrd.socket().to_path_buf();
    let channel = tonic::transport::Endpoint::from_static("http://localhost")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                let stream = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(stream))
            }
        }))
        .await
        .unwrap();
    let mut runtime = RuntimeServiceClient::new(channel);
    let limit: i64 = 48 << 20;
    tokio::time::timeout(
        CALL_TIMEOUT,
        runtime.update_container_resources(UpdateContainerResourcesRequest {
            container_id: cid.clone(),
            linux: Some(LinuxContainerResources {
                memory_limit_in_bytes: limit,
                ..Default::default()
            }),
            ..Default::default()
        }),
    )
    .await
    .expect("UpdateContainerResources in time")
    .unwrap_or_else(|e| {
        panic!(
            "UpdateContainerResources: {e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        )
    });
    let after = cri.exec_sync(&cid, &memory_max, 60).await.unwrap();
    assert_eq!(
        (after.exit_code, after.stdout.trim()),
        (0, limit.to_string().as_str()),
        "memory.max before the update: {:?}",
        before.stdout
    );
    eprintln!(
        "UpdateContainerResources: memory.max {} -> {}",
        before.stdout.trim(),
        after.stdout.trim()
    );
    remove_pod(&ctrd, &cri, &pod).await;
}

/// What a process inherits from its container's security settings, as /proc/self shows it:
/// user and groups, capability sets, no_new_privs, seccomp mode and filter count, the cgroup,
/// the rlimits. Printed by a child of `sh`, so an exec and the container's init compare alike.
const IDENTITY: &str = "grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp|Seccomp_filters):' /proc/self/status; cat /proc/self/cgroup; grep -E '^Max ' /proc/self/limits";

/// A busybox container whose init prints [`IDENTITY`], then `identity-end`, then sleeps.
fn identity_container(
    name: &str,
    security: microvm_tests::cri::v1::LinuxContainerSecurityContext,
) -> microvm_tests::cri::v1::ContainerConfig {
    let script = format!("{IDENTITY}; echo identity-end; exec sleep 3600");
    let mut config = container_config(name, BUSYBOX_IMAGE, &["sh", "-c", &script]);
    config.linux = Some(microvm_tests::cri::v1::LinuxContainerConfig {
        security_context: Some(security),
        ..Default::default()
    });
    config
}

/// The container init's [`IDENTITY`] lines from its CRI log (waited for, bounded).
async fn init_identity(cri: &CriClient, ctrd: &PrivateContainerd, id: &str) -> Vec<String> {
    let status = cri.container_status(id).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = microvm_tests::cri::read_cri_log(Path::new(&status.log_path)).unwrap_or_default();
        let lines: Vec<String> = log.iter().map(|l| l.text.clone()).collect();
        if let Some(end) = lines.iter().position(|l| l == "identity-end") {
            return lines[..end].to_vec();
        }
        assert!(
            Instant::now() < deadline,
            "container {id} printed no identity-end: {lines:?}\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn lines_of(text: &str) -> Vec<String> {
    text.lines().map(str::to_string).collect()
}

/// Every exec (CRI ExecSync and a streaming `ctr task exec`) runs under its container's seccomp
/// filter (RuntimeDefault: mode 2, one filter, as the init), with the init's capability sets,
/// no_new_privs, user, groups, cgroup and rlimits: for a root container with default
/// capabilities (no no_new_privs: the filter is loaded before the capabilities are dropped, as
/// runc does), for one as user 1000 (no no_new_privs either: the user switch keeps the
/// capabilities the filter needs) and for one as user 1000:3000 with supplementary groups,
/// no_new_privs and a dropped capability.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn execs_inherit_seccomp_capabilities_user_and_cgroup_of_their_container() {
    use microvm_tests::cri::v1::security_profile::ProfileType;
    use microvm_tests::cri::v1::{
        Capability, Int64Value, LinuxContainerSecurityContext, SecurityProfile,
    };
    let _serial = SERIAL.lock().await;
    let (_dir, _config, ctrd, cri) = start_with_busybox().await;
    let pod = run_pod(&ctrd, &cri, "microvm-exec-seccomp").await;
    let runtime_default = || {
        Some(SecurityProfile {
            profile_type: ProfileType::RuntimeDefault as i32,
            ..Default::default()
        })
    };
    let containers = [
        (
            "root-default",
            LinuxContainerSecurityContext {
                seccomp: runtime_default(),
                ..Default::default()
            },
        ),
        (
            "user-default",
            LinuxContainerSecurityContext {
                seccomp: runtime_default(),
                run_as_user: Some(Int64Value { value: 1000 }),
                ..Default::default()
            },
        ),
        (
            "user-nnp",
            LinuxContainerSecurityContext {
                seccomp: runtime_default(),
                run_as_user: Some(Int64Value { value: 1000 }),
                run_as_group: Some(Int64Value { value: 3000 }),
                supplemental_groups: vec![4000, 5000],
                no_new_privs: true,
                capabilities: Some(Capability {
                    drop_capabilities: vec!["CHOWN".into()],
                    ..Default::default()
                }),
                ..Default::default()
            },
        ),
    ];
    for (name, security) in containers {
        let id = cri
            .create_container(&pod, identity_container(name, security))
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        cri.start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{name}: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
        let init = init_identity(&cri, &ctrd, &id).await;
        eprintln!("{name}: the init's identity:\n{}", init.join("\n"));
        assert!(
            init.iter().any(|l| l == "Seccomp:\t2"),
            "{name}: the init runs without its RuntimeDefault seccomp filter: {init:?}"
        );

        let out = cri
            .exec_sync(&id, &["sh", "-c", IDENTITY], 60)
            .await
            .unwrap();
        assert_eq!(out.exit_code, 0, "{name}: {out:?}");
        assert_eq!(
            lines_of(&out.stdout),
            init,
            "{name}: ExecSync differs from the container's init"
        );

        let exec_id = format!("identity-{name}");
        let ctr = spawn_ctr(
            &ctrd,
            &[
                "task",
                "exec",
                "--exec-id",
                &exec_id,
                &id,
                "sh",
                "-c",
                IDENTITY,
            ],
            [Stdio::null(), Stdio::piped(), Stdio::piped()],
        );
        let out = tokio::task::spawn_blocking(move || {
            let mut ctr = ctr;
            let mut stdout = ctr.stdout.take().unwrap();
            let mut stderr = ctr.stderr.take().unwrap();
            let reader = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stdout.read_to_string(&mut s);
                s
            });
            let errors = std::thread::spawn(move || {
                let mut s = String::new();
                let _ = stderr.read_to_string(&mut s);
                s
            });
            // Bounded: a hung exec is killed, which ends both readers.
            let code = wait_bounded(&mut ctr, CTR_TIMEOUT);
            (code, reader.join().unwrap(), errors.join().unwrap())
        })
        .await
        .unwrap();
        assert_eq!(out.0, Some(0), "{name}: ctr task exec: {}", out.2);
        assert_eq!(
            lines_of(&out.1),
            init,
            "{name}: a streaming exec differs from the container's init"
        );
    }
    remove_pod(&ctrd, &cri, &pod).await;
}

/// containerd restarted under a running pod (`systemctl restart containerd`: SIGTERM, then
/// started again on the same root and state), its shim, VM and containers running on: a
/// container that exits while containerd is down is reported exited with its own code after
/// the restart, a running one stays RUNNING, its log goes on in the same CRI log file, exec
/// works, and removing the pod leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_lives_through_a_containerd_restart() {
    let _serial = SERIAL.lock().await;
    let (_dir, _config, mut ctrd, cri) = start_with_busybox().await;
    let pod = run_pod(&ctrd, &cri, "microvm-restart").await;
    let ticker = cri
        .create_container(
            &pod,
            container_config(
                "ticker",
                BUSYBOX_IMAGE,
                &[
                    "sh",
                    "-c",
                    "i=0; while true; do echo tick $i; i=$((i+1)); sleep 1; done",
                ],
            ),
        )
        .await
        .unwrap();
    cri.start_container(&ticker).await.unwrap();
    let quitter = cri
        .create_container(
            &pod,
            container_config("quitter", BUSYBOX_IMAGE, &["sh", "-c", "sleep 6; exit 3"]),
        )
        .await
        .unwrap();
    cri.start_container(&quitter).await.unwrap();
    let log_path = cri.container_status(&ticker).await.unwrap().log_path;
    let ticks = || {
        microvm_tests::cri::read_cri_log(Path::new(&log_path))
            .unwrap_or_default()
            .len()
    };
    let shims = shim_pids(&ctrd, &pod.id);

    // Down for longer than the quitter has left: its exit happens with nobody listening.
    ctrd.restart_containerd(Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{e}"));
    let cri = CriClient::connect(ctrd.socket(), Duration::from_secs(30))
        .await
        .unwrap();
    // CRI answers "not initialized yet" while containerd reloads its pods (it asks each shim).
    let deadline = Instant::now() + Duration::from_secs(90);
    while let Err(e) = cri
        .wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(5))
        .await
    {
        assert!(
            Instant::now() < deadline,
            "{e}\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        shim_pids(&ctrd, &pod.id),
        shims,
        "the pod's shim ran on through the restart"
    );
    let sandbox = cri.pod_sandbox_status(&pod.id, false).await.unwrap();
    assert_eq!(
        sandbox.status.map(|s| s.state),
        Some(microvm_tests::cri::v1::PodSandboxState::SandboxReady as i32),
        "containerd log:\n{}",
        ctrd.log_tail()
    );
    let quit = cri
        .wait_container_exited(&quitter, Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(
        quit.exit_code,
        3,
        "the exit while containerd was down: {quit:?}\ncontainerd's warnings and errors:\n{}",
        warnings(&ctrd)
    );
    let status = cri.container_status(&ticker).await.unwrap();
    assert_eq!(
        status.state,
        microvm_tests::cri::v1::ContainerState::ContainerRunning as i32,
        "{status:?}"
    );
    let out = cri
        .exec_sync(&ticker, &["echo", "after"], 60)
        .await
        .unwrap();
    assert_eq!((out.exit_code, out.stdout.as_str()), (0, "after\n"));
    // Its output reaches the same log file again.
    let before = ticks();
    let deadline = Instant::now() + Duration::from_secs(30);
    while ticks() < before + 3 {
        assert!(
            Instant::now() < deadline,
            "the ticker's log stopped at {before} lines after the restart\ncontainerd log:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    remove_pod(&ctrd, &cri, &pod).await;
}

/// containerd's log lines at warn and error level (the whole run's).
fn warnings(ctrd: &PrivateContainerd) -> String {
    std::fs::read_to_string(ctrd.dir().join("containerd.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("level=warn") || l.contains("level=error"))
        .collect::<Vec<_>>()
        .join("\n")
}
