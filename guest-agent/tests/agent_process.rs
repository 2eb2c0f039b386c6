//! The real agent binary, served over a Unix socket and called through the real ttrpc stack:
//! once as an ordinary process, once as PID 1 of fresh PID, mount and UTS namespaces (its init
//! path: base mounts, hostname, reaper, and Shutdown's reboot(), which in a PID namespace ends
//! only that namespace).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use agent_protocol::agent::{CheckRequest, ShutdownRequest};
use agent_protocol::agent_ttrpc::AgentClient;

const AGENT: &str = env!("CARGO_BIN_EXE_microvm-agent");

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_duration(Duration::from_secs(10))
}

/// A fresh temporary folder for test `name`, removed when the value is dropped.
fn temp_dir(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("agent-process-{name}-"))
        .tempdir()
        .expect("a temporary folder")
}

/// Reads the agent's stdout up to its ready line, which must be the first line.
fn wait_ready(stdout: ChildStdout, sock: &Path) -> BufReader<ChildStdout> {
    let mut reader = BufReader::new(stdout);
    let mut line = String::new();
    reader.read_line(&mut line).expect("read ready line");
    assert_eq!(
        line,
        format!("microvm-agent: ready (unix://{})\n", sock.display())
    );
    reader
}

fn wait_exit(child: &mut Child, within: Duration) -> std::process::ExitStatus {
    let deadline = Instant::now() + within;
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("agent did not exit within {within:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn check_matches_this_host(client: &AgentClient) {
    let resp = client.check(ctx(), &CheckRequest::new()).expect("check");
    assert_eq!(resp.agent_version, env!("CARGO_PKG_VERSION"));
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    assert_eq!(resp.kernel_release, release.trim());
    assert!(resp.online_vcpus >= 1);
    let meminfo = std::fs::read_to_string("/proc/meminfo").expect("meminfo");
    assert!(meminfo.contains(&format!(" {} kB", resp.mem_total_kib)));
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("boot_id");
    assert_eq!(resp.boot_id, boot_id.trim());
}

#[test]
fn serves_check_then_exits_on_shutdown_as_ordinary_process() {
    let dir_tmp = temp_dir("plain");
    let dir = dir_tmp.path().to_path_buf();
    let sock = dir.join("agent.sock");
    let mut child = Command::new(AGENT)
        .arg("--listen")
        .arg(format!("unix://{}", sock.display()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn agent");
    let _stdout = wait_ready(child.stdout.take().expect("stdout"), &sock);
    let client = AgentClient::new(
        ttrpc::Client::connect(&format!("unix://{}", sock.display())).expect("connect"),
    );
    check_matches_this_host(&client);
    client
        .shutdown(ctx(), &ShutdownRequest::new())
        .expect("shutdown");
    let status = wait_exit(&mut child, Duration::from_secs(10));
    assert!(status.success(), "{status}");
}

fn mountinfo_has(mountinfo: &str, target: &str, fstype: &str) -> bool {
    mountinfo.lines().any(|line| {
        let mut halves = line.split(" - ");
        let before = halves.next().unwrap_or_default();
        let after = halves.next().unwrap_or_default();
        before.split(' ').nth(4) == Some(target) && after.split(' ').next() == Some(fstype)
    })
}

#[test]
fn as_pid1_of_a_namespace_mounts_names_serves_and_reboots_only_its_namespace() {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "creating namespaces needs root, as CI runs this test"
    );
    let dir_tmp = temp_dir("pid1");
    let dir = dir_tmp.path().to_path_buf();
    let sock = dir.join("agent.sock");
    let host_name = std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname");
    let mut child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--propagation",
            "private",
        ])
        .arg(AGENT)
        .arg(format!("--listen=unix://{}", sock.display()))
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn unshare (util-linux)");
    let _stdout = wait_ready(child.stdout.take().expect("stdout"), &sock);

    // The agent's pid as this namespace sees it: unshare's only child.
    let children = std::fs::read_to_string(format!("/proc/{0}/task/{0}/children", child.id()))
        .expect("children");
    let agent_pid: u32 = children.trim().parse().expect("one child");
    let status = std::fs::read_to_string(format!("/proc/{agent_pid}/status")).expect("status");
    let nspid = status
        .lines()
        .find(|l| l.starts_with("NSpid:"))
        .expect("NSpid");
    assert!(
        nspid.ends_with("\t1"),
        "agent is PID 1 of its namespace: {nspid}"
    );

    let mountinfo =
        std::fs::read_to_string(format!("/proc/{agent_pid}/mountinfo")).expect("mountinfo");
    for (target, fstype) in [
        ("/proc", "proc"),
        ("/sys", "sysfs"),
        ("/dev", "devtmpfs"),
        ("/run", "tmpfs"),
        ("/sys/fs/cgroup", "cgroup2"),
    ] {
        assert!(
            mountinfo_has(&mountinfo, target, fstype),
            "{fstype} on {target} missing:\n{mountinfo}"
        );
    }
    // Its hostname changed in its UTS namespace only.
    let ns_name = Command::new("nsenter")
        .args([
            "--uts",
            "-t",
            &agent_pid.to_string(),
            "cat",
            "/proc/sys/kernel/hostname",
        ])
        .output()
        .expect("nsenter");
    assert_eq!(String::from_utf8_lossy(&ns_name.stdout).trim(), "microvm");
    assert_eq!(
        std::fs::read_to_string("/proc/sys/kernel/hostname").expect("hostname"),
        host_name
    );

    let client = AgentClient::new(
        ttrpc::Client::connect(&format!("unix://{}", sock.display())).expect("connect"),
    );
    check_matches_this_host(&client);
    // Shutdown: reply, then reboot(), which ends the PID namespace (its init dies of SIGHUP).
    client
        .shutdown(ctx(), &ShutdownRequest::new())
        .expect("shutdown replies");
    wait_exit(&mut child, Duration::from_secs(10));
    assert!(
        !Path::new(&format!("/proc/{agent_pid}")).exists() || {
            // the pid may have been reused; it is no longer our agent
            std::fs::read_to_string(format!("/proc/{agent_pid}/cmdline"))
                .map(|c| !c.contains("microvm-agent"))
                .unwrap_or(true)
        }
    );
}
