//! Containers through the real agent binary, as PID 1 of fresh PID/mount/UTS/IPC namespaces
//! (root, util-linux unshare, Debian's busybox-static): ttrpc on one Unix socket, the raw stdio
//! streams on another, a busybox rootfs, libcontainer underneath.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio as ProcStdio};
use std::time::{Duration, Instant};

use agent_protocol::agent::*;
use agent_protocol::agent_ttrpc::AgentClient;

const AGENT: &str = env!("CARGO_BIN_EXE_microvm-agent");
const BUSYBOX: &str = "/bin/busybox";

fn ctx() -> ttrpc::context::Context {
    ttrpc::context::with_duration(Duration::from_secs(20))
}

struct Agent {
    child: Child,
    dir: PathBuf,
    client: AgentClient,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.client.shutdown(ctx(), &ShutdownRequest::new());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir("/sys/fs/cgroup/unified/microvm");
    }
}

fn rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("rootfs");
    for d in ["bin", "proc", "dev", "tmp", "etc"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    std::fs::copy(BUSYBOX, root.join("bin/busybox")).expect("copy busybox");
    for applet in [
        "sh", "echo", "cat", "sleep", "stty", "ls", "true", "hostname",
    ] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).expect("symlink");
    }
    root
}

fn start_agent(name: &str) -> Agent {
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "the agent's containers need root, as CI runs these tests"
    );
    assert!(
        Path::new(BUSYBOX).exists(),
        "{BUSYBOX} is missing: Debian's busybox-static (scripts/install-deps.sh)"
    );
    let dir = std::env::temp_dir().join(format!("agent-ctr-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("dir");
    let sock = dir.join("agent.sock");
    let mut child = Command::new("unshare")
        .args([
            "--pid",
            "--fork",
            "--mount",
            "--uts",
            "--ipc",
            "--propagation",
            "private",
        ])
        .arg(AGENT)
        .arg(format!("--listen=unix://{}", sock.display()))
        .arg(format!(
            "--stdio-listen=unix://{}",
            dir.join("stdio.sock").display()
        ))
        .stdout(ProcStdio::piped())
        .spawn()
        .expect("spawn unshare");
    let mut line = String::new();
    let mut out = std::io::BufReader::new(child.stdout.take().expect("stdout"));
    std::io::BufRead::read_line(&mut out, &mut line).expect("ready line");
    assert!(line.starts_with("microvm-agent: ready"), "{line}");
    let client = AgentClient::new(
        ttrpc::Client::connect(&format!("unix://{}", sock.display())).expect("connect"),
    );
    Agent { child, dir, client }
}

/// Which namespaces a test container gets: its own of each, or all but a PID namespace (it
/// shares the agent's, as a pod's containers share the pod's).
#[derive(Clone, Copy)]
enum Namespaces {
    Own,
    SharedPid,
}

fn spec_with(root: &Path, args: &[&str], terminal: bool, namespaces: Namespaces) -> Vec<u8> {
    let namespaces = match namespaces {
        Namespaces::Own => serde_json::json!([
            {"type": "pid"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}
        ]),
        Namespaces::SharedPid => {
            serde_json::json!([{"type": "mount"}, {"type": "ipc"}, {"type": "uts"}])
        }
    };
    serde_json::json!({
        "ociVersion": "1.0.2",
        "root": {"path": root, "readonly": true},
        "hostname": "ctr",
        "process": {
            "terminal": terminal,
            "args": args,
            "env": ["PATH=/bin", "TERM=xterm"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        },
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "mode=755", "size=1m"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["size=1m"]},
        ],
        "linux": {
            "namespaces": namespaces,
            "maskedPaths": ["/proc/kcore"],
            "readonlyPaths": ["/proc/sys"],
        },
    })
    .to_string()
    .into_bytes()
}

fn stdio(terminal: bool, stdin: bool) -> Stdio {
    Stdio {
        terminal,
        stdin,
        stdout: true,
        stderr: !terminal,
        ..Default::default()
    }
}

fn stream(agent: &Agent, id: &str, exec: &str, which: &str) -> UnixStream {
    let mut s = UnixStream::connect(agent.dir.join("stdio.sock")).expect("stdio connect");
    let exec = if exec.is_empty() { "-" } else { exec };
    s.write_all(format!("{id} {exec} {which}\n").as_bytes())
        .expect("header");
    s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    s
}

fn read_all(mut s: UnixStream) -> String {
    let mut out = String::new();
    s.read_to_string(&mut out).expect("read stream to EOF");
    out
}

fn create(agent: &Agent, id: &str, root: &Path, args: &[&str], terminal: bool, stdin: bool) {
    create_with(agent, id, root, args, (terminal, stdin), Namespaces::Own)
}

fn create_with(
    agent: &Agent,
    id: &str,
    root: &Path,
    args: &[&str],
    (terminal, stdin): (bool, bool),
    namespaces: Namespaces,
) {
    agent
        .client
        .create_container(
            ctx(),
            &CreateContainerRequest {
                container_id: id.into(),
                oci_spec_json: spec_with(root, args, terminal, namespaces),
                stdio: Some(stdio(terminal, stdin)).into(),
                ..Default::default()
            },
        )
        .expect("create");
}

fn start(agent: &Agent, id: &str) {
    agent
        .client
        .start_container(
            ctx(),
            &StartContainerRequest {
                container_id: id.into(),
                ..Default::default()
            },
        )
        .expect("start");
}

fn wait(agent: &Agent, id: &str, exec: &str) -> u32 {
    agent
        .client
        .wait_process(
            ctx(),
            &WaitProcessRequest {
                container_id: id.into(),
                exec_id: exec.into(),
                ..Default::default()
            },
        )
        .expect("wait")
        .exit_status
}

fn remove(agent: &Agent, id: &str) {
    agent
        .client
        .remove_container(
            ctx(),
            &RemoveContainerRequest {
                container_id: id.into(),
                ..Default::default()
            },
        )
        .expect("remove");
}

fn exec(agent: &Agent, id: &str, exec_id: &str, args: &[&str], terminal: bool, stdin: bool) {
    let process = serde_json::json!({
        "terminal": terminal, "args": args, "env": ["PATH=/bin"], "cwd": "/",
        "user": {"uid": 0, "gid": 0},
    });
    agent
        .client
        .exec_process(
            ctx(),
            &ExecProcessRequest {
                container_id: id.into(),
                exec_id: exec_id.into(),
                process_json: process.to_string().into_bytes(),
                stdio: Some(stdio(terminal, stdin)).into(),
                ..Default::default()
            },
        )
        .expect("exec registers");
}

fn start_exec(agent: &Agent, id: &str, exec_id: &str) -> ttrpc::Result<StartExecResponse> {
    agent.client.start_exec(
        ctx(),
        &StartExecRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        },
    )
}

#[test]
fn containers_stdio_exits_exec_and_tty() {
    let agent = start_agent("main");
    let root = rootfs(&agent.dir);

    // Output on both streams (connected before Start), exact exit code.
    create(
        &agent,
        "c1",
        &root,
        &["sh", "-c", "echo out; hostname; echo err >&2; exit 3"],
        false,
        false,
    );
    let out = stream(&agent, "c1", "", "stdout");
    let err = stream(&agent, "c1", "", "stderr");
    start(&agent, "c1");
    assert_eq!(read_all(out), "out\nctr\n");
    assert_eq!(read_all(err), "err\n");
    assert_eq!(wait(&agent, "c1", ""), 3);
    remove(&agent, "c1");

    // A long-running container: exec into it, missing binary, SIGKILL -> 137.
    create(&agent, "c2", &root, &["sleep", "100"], false, false);
    start(&agent, "c2");
    exec(&agent, "c2", "e1", &["echo", "hi"], false, false);
    let out = stream(&agent, "c2", "e1", "stdout");
    start_exec(&agent, "c2", "e1").expect("exec starts");
    assert_eq!(read_all(out), "hi\n");
    assert_eq!(wait(&agent, "c2", "e1"), 0);

    exec(&agent, "c2", "e2", &["/nonexistent"], false, false);
    let started = Instant::now();
    let failure = start_exec(&agent, "c2", "e2").expect_err("missing binary");
    assert!(started.elapsed() < Duration::from_secs(10));
    eprintln!("missing binary: {failure:?}");

    // stdin piped to cat, then closed: cat echoes and exits 0.
    exec(&agent, "c2", "e3", &["cat"], false, true);
    let mut input = stream(&agent, "c2", "e3", "stdin");
    let out = stream(&agent, "c2", "e3", "stdout");
    start_exec(&agent, "c2", "e3").expect("cat starts");
    input.write_all(b"piped data\n").expect("stdin");
    input
        .shutdown(std::net::Shutdown::Write)
        .expect("close stdin");
    assert_eq!(read_all(out), "piped data\n");
    assert_eq!(wait(&agent, "c2", "e3"), 0);

    // A terminal exec: stty sees the pty and its new size.
    exec(
        &agent,
        "c2",
        "t1",
        &["sh", "-c", "read x; stty size"],
        true,
        true,
    );
    let mut tty_in = stream(&agent, "c2", "t1", "stdin");
    let tty_out = stream(&agent, "c2", "t1", "stdout");
    start_exec(&agent, "c2", "t1").expect("tty exec starts");
    agent
        .client
        .resize_pty(
            ctx(),
            &ResizePtyRequest {
                container_id: "c2".into(),
                exec_id: "t1".into(),
                width: 100,
                height: 40,
                ..Default::default()
            },
        )
        .expect("resize");
    tty_in.write_all(b"go\n").expect("tty input");
    assert_eq!(wait(&agent, "c2", "t1"), 0);
    let screen = read_all(tty_out);
    assert!(screen.contains("40 100"), "{screen:?}");

    let pids = agent
        .client
        .list_pids(
            ctx(),
            &ListPidsRequest {
                container_id: "c2".into(),
                ..Default::default()
            },
        )
        .expect("pids");
    assert!(!pids.pids.is_empty());

    agent
        .client
        .signal_process(
            ctx(),
            &SignalProcessRequest {
                container_id: "c2".into(),
                signal: 9,
                ..Default::default()
            },
        )
        .expect("kill");
    assert_eq!(wait(&agent, "c2", ""), 137);
    remove(&agent, "c2");

    // An init sharing a PID namespace leaves a child holding its stdout when it exits: the child
    // is killed at the exit, so the output ends (within the stream's 20 s read bound, well
    // before the child's 100 s).
    create_with(
        &agent,
        "c3",
        &root,
        &["sh", "-c", "sleep 100 & echo left"],
        (false, false),
        Namespaces::SharedPid,
    );
    let out = stream(&agent, "c3", "", "stdout");
    start(&agent, "c3");
    assert_eq!(wait(&agent, "c3", ""), 0);
    let started = Instant::now();
    assert_eq!(read_all(out), "left\n");
    eprintln!(
        "shared PID namespace: output ended {:?} after the exit",
        started.elapsed()
    );
    remove(&agent, "c3");
}
