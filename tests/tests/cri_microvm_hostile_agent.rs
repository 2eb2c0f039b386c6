//! A hostile guest through CRI (issue 18, "the shim trusts nothing the guest says" and "bounded
//! host state"): a container may own the guest kernel, hence the agent. These pods boot the
//! agent built with its HOSTILE TEST HOOKS (guest-agent/src/hostile.rs,
//! `guest-agent/build-initrd.sh --hostile-test-hooks` -> build/initrd-hostile.cpio, never the
//! product initrd), which a container's `MICROVM_HOSTILE_TEST` environment turns on, and the
//! tests check through containerd that the host holds:
//!
//! - OOM events for another pod's container, for the pod's sandbox and for made-up ids, sent as
//!   fast as the long poll is asked, mark nothing OOM-killed; the pod's own container gets one
//!   TaskOOM per coalescing window; an agent that ends every long poll at once (GetOomEvent,
//!   WaitProcess) does not make the shim spin; neither containerd's log (which carries the
//!   shim's) nor the events are flooded; the shim still answers and the other pod is untouched;
//! - an error string of almost 4 MiB full of forged log lines reaches the CRI user cut to
//!   about 4 KiB, naming the call that failed, and the log holds no forged line and no huge one;
//! - a guest flooding its serial console (1.5 MiB) keeps the console log on the host within its
//!   bound (1 MiB), with the newest lines;
//!
//! and every pod leaves nothing behind. Each test fails against the shim before these bounds
//! (docs/shim.md, "Tests", says how).
//!
//! The backend is `MICROVM_TEST_HYPERVISOR` (QEMU by default; the nested lane runs them on the
//! embedded VMM: docs/nested-lane.md). Needs root, containerd, QEMU and vhost-device-vsock
//! (scripts/install-deps.sh), `make kernel` and the hostile initrd
//! (`guest-agent/build-initrd.sh --hostile-test-hooks`, or `MICROVM_HOSTILE_INITRD`).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_cri::v1::{ContainerConfig, ContainerState, KeyValue};
use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, CriError, Pod};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;

/// The tests of this file share /run/microvm; they run one at a time.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The environment variable that turns the agent's hostile hooks on for a container.
const HOSTILE_ENV: &str = "MICROVM_HOSTILE_TEST";
/// The forged log line the hooks' big error carries (guest-agent/src/hostile.rs).
const FORGED: &str = "FORGED-BY-GUEST";
const FORGED_LINE_START: &str = "time=\"1999-12-31T23:59:59";

/// The hostile agent's initrd: `MICROVM_HOSTILE_INITRD`, else build/initrd-hostile.cpio.
fn hostile_initrd() -> PathBuf {
    let path = std::env::var_os("MICROVM_HOSTILE_INITRD")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| repo().join("build/initrd-hostile.cpio"));
    assert!(
        path.exists(),
        "{} does not exist: build it with `guest-agent/build-initrd.sh --hostile-test-hooks` \
         (or `make initrd-hostile`)",
        path.display()
    );
    path
}

/// A private containerd whose `microvm` pods boot the hostile agent, with busybox ready.
async fn start_hostile() -> (tempfile::TempDir, PrivateContainerd, CriClient) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let config = write_config_with_initrd(dir.path(), &hostile_initrd());
    let (ctrd, cri) = start(&config).await;
    cri.wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    (dir, ctrd, cri)
}

/// A busybox container that sleeps, with the hostile hooks `actions` (none: a plain one).
fn sleeper(name: &str, actions: Option<&str>) -> ContainerConfig {
    let mut c = container_config(name, BUSYBOX_IMAGE, &["sleep", "3600"]);
    if let Some(actions) = actions {
        c.envs.push(KeyValue {
            key: HOSTILE_ENV.into(),
            value: actions.into(),
        });
    }
    c
}

async fn create_and_start(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    pod: &Pod,
    c: ContainerConfig,
) -> String {
    let id = cri
        .create_container(pod, c)
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.start_container(&id)
        .await
        .unwrap_or_else(|e| panic!("StartContainer: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    id
}

/// containerd's log (which carries the shim's lines), whole.
fn containerd_log(ctrd: &PrivateContainerd) -> String {
    std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default()
}

/// `ctr events` of the instance, collected by a thread until dropped.
struct EventLog {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl EventLog {
    fn start(ctrd: &PrivateContainerd) -> Self {
        let mut child = ctrd
            .ctr_command()
            .arg("events")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .expect("ctr events");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("piped");
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        // Subscribed before anything it must see happens.
        std::thread::sleep(Duration::from_millis(500));
        EventLog { child, lines }
    }

    /// The container ids of the TaskOOM events seen so far.
    fn oom_ids(&self) -> Vec<String> {
        self.lines
            .lock()
            .unwrap()
            .iter()
            .filter(|l| l.contains("/tasks/oom"))
            .filter_map(|l| {
                let json = &l[l.find('{')?..];
                let v: serde_json::Value = serde_json::from_str(json).ok()?;
                Some(v.get("container_id")?.as_str()?.to_string())
            })
            .collect()
    }

    fn count(&self) -> usize {
        self.lines.lock().unwrap().len()
    }
}

impl Drop for EventLog {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// CPU time of the shim's async threads (tokio's workers and the main thread: where the agent
/// client, the watchers and the task service run; not the VMM's vCPU threads) of `pid`.
fn shim_async_cpu(pid: i32) -> Duration {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    let mut total = 0u64;
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Duration::ZERO;
    };
    for t in tasks.flatten() {
        let tid = t.file_name().to_string_lossy().to_string();
        let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
        if !(comm.starts_with("tokio-") || tid == pid.to_string()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
            continue;
        };
        // Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
        let rest = &stat[stat.rfind(')').map_or(0, |i| i + 2)..];
        let f: Vec<&str> = rest.split_whitespace().collect();
        let utime: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0);
        let stime: u64 = f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
        total += utime + stime;
    }
    Duration::from_millis(total * 1000 / ticks)
}

/// The one shim process of `pod`.
fn shim_pid(ctrd: &PrivateContainerd, pod: &Pod) -> i32 {
    let pids = shim_pids(ctrd, &pod.id);
    assert_eq!(pids.len(), 1, "shims of {}: {pids:?}", pod.id);
    pids[0]
}

/// ExecSync `echo alive` in `id`, which must answer within `within`.
async fn assert_answers(cri: &CriClient, ctrd: &PrivateContainerd, id: &str, within: Duration) {
    let started = Instant::now();
    let out = cri
        .exec_sync(id, &["echo", "alive"], 0)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "ExecSync in {id}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        });
    assert_eq!((out.exit_code, out.stdout.trim()), (0, "alive"), "{out:?}");
    assert!(
        started.elapsed() < within,
        "ExecSync in {id} took {:?}",
        started.elapsed()
    );
}

/// The pod's shim answers containerd (the task service's State, which the shim answers itself
/// without the guest) within `within`, with `id` running.
fn assert_shim_answers(ctrd: &PrivateContainerd, id: &str, within: Duration) {
    let started = Instant::now();
    let out = ctrd
        .ctr(&["task", "ls"], within)
        .unwrap_or_else(|e| panic!("ctr task ls: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && started.elapsed() < within,
        "ctr task ls: {} after {:?}: {text}{}",
        out.status,
        started.elapsed(),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.lines()
            .any(|l| l.starts_with(id) && l.contains("RUNNING")),
        "{id} is not RUNNING in:\n{text}"
    );
}

/// OOM events for another pod's container, the pod's sandbox and made-up ids, sent as fast as
/// asked, with every GetOomEvent and WaitProcess long poll ended at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_oom_events_mark_no_other_container_and_neither_spin_nor_flood() {
    const ATTACK: Duration = Duration::from_secs(20);
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_hostile().await;
    let victim_pod = run_pod(&ctrd, &cri, "hostile-victim").await;
    let victim = create_and_start(&ctrd, &cri, &victim_pod, sleeper("victim", None)).await;
    let events = EventLog::start(&ctrd);
    let attacker_pod = run_pod(&ctrd, &cri, "hostile-attacker").await;
    let shim = shim_pid(&ctrd, &attacker_pod);
    let actions = format!(
        "oom-flood:{victim}:{}:{},wait-spin",
        victim_pod.id, attacker_pod.id
    );
    let started = Instant::now();
    let attacker = create_and_start(
        &ctrd,
        &cri,
        &attacker_pod,
        sleeper("attacker", Some(&actions)),
    )
    .await;
    // The flood begins once the long poll pending when the hooks were set ends (up to 30 s):
    // the shim then logs about the made-up ids (as ignored, or, without the bounds, as OOM
    // kills). The window is measured from there.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !containerd_log(&ctrd).contains("hostile-bogus-") {
        assert!(
            Instant::now() < deadline,
            "the hostile agent's OOM flood did not reach the shim:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log_before = containerd_log(&ctrd).lines().count();
    let cpu_before = shim_async_cpu(shim);
    let window = Instant::now();
    // The shim answers meanwhile, through the hostile agent too.
    assert_answers(&cri, &ctrd, &attacker, Duration::from_secs(60)).await;
    assert_answers(&cri, &ctrd, &victim, Duration::from_secs(60)).await;
    tokio::time::sleep(ATTACK.saturating_sub(window.elapsed())).await;
    let cpu = shim_async_cpu(shim).saturating_sub(cpu_before);
    let wall = window.elapsed();
    let attacked_for = started.elapsed();

    // Another pod's container is not marked OOM-killed, nor the sandboxes, nor made-up ids.
    let status = cri.container_status(&victim).await.unwrap();
    assert_ne!(
        status.reason, "OOMKilled",
        "the attacker's agent marked the other pod's container OOM-killed"
    );
    assert_eq!(status.state, ContainerState::ContainerRunning as i32);
    let ooms = events.oom_ids();
    let foreign: Vec<&String> = ooms.iter().filter(|id| **id != attacker).collect();
    assert!(
        foreign.is_empty(),
        "TaskOOM for ids that are no live container of the attacker's pod: {foreign:?}"
    );
    // The pod's own container: one TaskOOM per coalescing window, so at least one (the flood
    // did reach the shim) and no flood.
    let own = ooms.len();
    let most = (attacked_for.as_secs() / shim::task::events::OOM_COALESCE.as_secs() + 1) as usize;
    assert!(
        (1..=most).contains(&own),
        "{own} TaskOOM for the attacker's own container in {attacked_for:?} (1..={most} \
         expected); containerd's log about OOM ends with:\n{}",
        containerd_log(&ctrd)
            .lines()
            .filter(|l| l.contains("OOM"))
            .rev()
            .take(10)
            .collect::<Vec<_>>()
            .join("\n")
    );
    // No spinning: the shim's async threads were mostly idle while the agent answered at once.
    assert!(
        cpu < wall / 4,
        "the shim's async threads used {cpu:?} of CPU in {wall:?} under the flood"
    );
    // No flood in containerd's log (the shim's lines are in it) or in its events.
    let log = containerd_log(&ctrd);
    let new_lines: Vec<&str> = log.lines().skip(log_before).collect();
    let oom_lines = new_lines.iter().filter(|l| l.contains("OOM")).count();
    assert!(
        oom_lines <= 30 && new_lines.len() <= 300,
        "containerd's log grew by {} lines ({oom_lines} about OOM) during the attack; the last:\n{}",
        new_lines.len(),
        new_lines[new_lines.len().saturating_sub(20)..].join("\n")
    );
    assert!(
        events.count() <= 200,
        "{} events during the attack",
        events.count()
    );
    eprintln!(
        "hostile OOM flood for {attacked_for:?}: {own} TaskOOM (own container), shim async CPU \
         {cpu:?} in {wall:?}, containerd log +{} lines, {} events",
        new_lines.len(),
        events.count()
    );
    drop(events);

    // The other pod is untouched; both leave nothing behind.
    assert_answers(&cri, &ctrd, &victim, Duration::from_secs(60)).await;
    // The attacker's pod stops although its agent never reports its container's exit (the
    // host's SIGKILL counts after a grace), and leaves nothing, while the victim still runs.
    cri.stop_pod_sandbox(&attacker_pod.id)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    cri.remove_pod_sandbox(&attacker_pod.id)
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_pod_gone_while_others_run(&ctrd, &attacker_pod.id, Duration::from_secs(20));
    assert_answers(&cri, &ctrd, &victim, Duration::from_secs(60)).await;
    cri.stop_container(&victim, 0).await.unwrap();
    let stopped = cri.container_status(&victim).await.unwrap();
    assert_ne!(stopped.reason, "OOMKilled", "{stopped:?}");
    remove_pod(&ctrd, &cri, &victim_pod).await;
}

/// An agent error of almost 4 MiB, full of forged log lines and terminal escapes: the CRI
/// error is cut to about 4 KiB and names the failed call; the log gets no forged line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_agent_errors_reach_cri_cut_and_the_log_on_one_line() {
    const MAX_CRI_ERROR: usize = 6 << 10;
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_hostile().await;
    let pod = run_pod(&ctrd, &cri, "hostile-errors").await;

    // StartContainer fails with the huge error: the user reads a bounded one.
    let id = cri
        .create_container(&pod, sleeper("bigerror-start", Some("big-error-start")))
        .await
        .unwrap_or_else(|e| panic!("CreateContainer: {e}\ncontainerd log:\n{}", ctrd.log_tail()));
    let err = cri
        .start_container(&id)
        .await
        .expect_err("the hostile agent fails StartContainer");
    let message = match &err {
        CriError::Rpc { status, .. } => status.message().to_string(),
        other => panic!("StartContainer did not fail with a CRI error: {other}"),
    };
    assert!(
        message.len() <= MAX_CRI_ERROR,
        "the CRI error is {} bytes: {}...",
        message.len(),
        &message[..message.len().min(300)]
    );
    for needle in [
        "starting container",
        "agent call StartContainer",
        "hostile agent: this error is almost 4 MiB long",
        "cut: the agent sent",
    ] {
        assert!(message.contains(needle), "no {needle:?} in: {message}");
    }
    assert!(!message.contains('\u{1b}'), "a terminal escape reached CRI");

    // WaitProcess fails with it: the shim logs the failure on one line, and the container ends.
    let waited = create_and_start(
        &ctrd,
        &cri,
        &pod,
        sleeper("bigerror-wait", Some("big-error-wait")),
    )
    .await;
    let status = cri
        .wait_container_exited(&waited, Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    assert_eq!(status.exit_code, 255, "{status:?}");

    // The shim's warning about it is in containerd's log (so the check below looks at it).
    let deadline = Instant::now() + Duration::from_secs(10);
    while !containerd_log(&ctrd).contains("waiting for process") {
        assert!(
            Instant::now() < deadline,
            "no shim line about the failed wait:\n{}",
            ctrd.log_tail()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let log = containerd_log(&ctrd);
    let forged: Vec<&str> = log
        .lines()
        .filter(|l| l.trim_start().starts_with(FORGED_LINE_START))
        .collect();
    assert!(
        forged.is_empty(),
        "{} forged lines in containerd's log, the first: {}",
        forged.len(),
        forged[0]
    );
    let longest = log.lines().map(str::len).max().unwrap_or(0);
    assert!(
        longest <= 64 << 10,
        "a line of {longest} bytes in containerd's log"
    );
    let mentions = log.lines().filter(|l| l.contains(FORGED)).count();
    assert!(mentions <= 10, "{mentions} lines quote the forged text");
    assert!(
        !log.contains('\u{1b}'),
        "a terminal escape reached containerd's log"
    );

    remove_pod(&ctrd, &cri, &pod).await;
}

/// The console log pair's size on the host.
fn console_bytes(pod: &Pod) -> u64 {
    let log = Path::new(STATE_ROOT).join(&pod.id).join("vm/console.log");
    let older = Path::new(STATE_ROOT).join(&pod.id).join("vm/console.log.1");
    [log, older]
        .iter()
        .map(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .sum()
}

/// The guest writes 1.5 MiB of numbered lines to its console: the host's console log stays
/// within its 1 MiB bound and ends with the newest lines.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_console_flood_keeps_the_host_console_log_within_its_bound() {
    // One and a half times the bound: past it (the old console file grew past it, and on), and
    // through three turns of the pair's newer half. The serial takes it at about 47 KB/s under
    // TCG here, far slower in the nested lane: more would only take longer.
    const FLOOD: u64 = 3 << 19;
    let bound = shim::vm::CONSOLE_LOG_BYTES;
    assert!(
        FLOOD >= bound + bound / 2,
        "the flood must outgrow the bound"
    );
    let _serial = SERIAL.lock().await;
    let (_dir, ctrd, cri) = start_hostile().await;
    let pod = run_pod(&ctrd, &cri, "hostile-console").await;
    let id = create_and_start(
        &ctrd,
        &cri,
        &pod,
        sleeper("flooder", Some(&format!("console-flood:{FLOOD}"))),
    )
    .await;
    let console = Path::new(STATE_ROOT).join(&pod.id).join("vm/console.log");
    let started = Instant::now();
    let deadline = started + Duration::from_secs(1500);
    let mut largest = 0;
    let mut answered = false;
    let mut reported = Instant::now();
    let done = loop {
        largest = largest.max(console_bytes(&pod));
        if reported.elapsed() >= Duration::from_secs(30) {
            // Progress, for slow runs (the nested lane).
            eprintln!(
                "console flood: {:?} in, the host's console log holds {} bytes, the last line \
                 {:?}",
                started.elapsed(),
                console_bytes(&pod),
                shim::vm::console_tail(&console, 1)
            );
            reported = Instant::now();
        }
        assert!(
            largest <= bound,
            "the console log holds {largest} bytes on the host (bound {bound}) after {:?}",
            started.elapsed()
        );
        let tail = shim::vm::console_tail(&console, 5);
        if let Some(line) = tail.lines().find(|l| l.contains("hostile-flood done")) {
            break line.to_string();
        }
        if !answered && started.elapsed() > Duration::from_secs(5) {
            // The shim answers during the flood (the flooding guest itself may be slow to: its
            // vCPU is busy with the flood, which is the guest's own business).
            assert_shim_answers(&ctrd, &id, Duration::from_secs(60));
            answered = true;
        }
        assert!(
            Instant::now() < deadline,
            "the flood did not end in time; console ends with:\n{tail}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    // "hostile-flood done <lines> <bytes>": the guest did write past the bound.
    let fields: Vec<&str> = done.split_whitespace().collect();
    let lines: u64 = fields[fields.len() - 2].parse().unwrap();
    let written: u64 = fields[fields.len() - 1].parse().unwrap();
    assert!(written >= FLOOD, "{done}");
    largest = largest.max(console_bytes(&pod));
    assert!(largest <= bound, "{largest} > {bound}");
    // The newest lines are kept: the last numbered line is in the tail.
    let tail = shim::vm::console_tail(&console, 20);
    let last = format!("hostile-flood {:08}", lines - 1);
    assert!(tail.contains(&last), "no {last:?} in the tail:\n{tail}");
    eprintln!(
        "console flood: the guest wrote {written} bytes in {:?}; the host kept at most {largest} \
         (bound {bound})",
        started.elapsed()
    );
    remove_pod(&ctrd, &cri, &pod).await;
}
