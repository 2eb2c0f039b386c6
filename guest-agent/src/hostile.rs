//! HOSTILE TEST HOOKS: an agent that attacks the host, for tests only.
//!
//! Compiled in only with the `hostile-test-hooks` feature, which the product initrd never has:
//! `guest-agent/build-initrd.sh --hostile-test-hooks` builds this variant to
//! `build/initrd-hostile.cpio`, and a product build refuses a binary that holds these hooks. It
//! plays what a container that owns the guest kernel can make of the agent, so the tests of
//! tests/tests/cri_microvm_hostile_agent.rs can show the host holds.
//!
//! A container whose OCI spec has `MICROVM_HOSTILE_TEST=<actions>` in its environment turns
//! them on, comma-separated:
//! - `oom-flood:<id>:<id>...`: GetOomEvent answers at once, forever, in turn: an OOM kill of
//!   each given id (another pod's containers), of made-up ids, of the container itself, and a
//!   DEADLINE_EXCEEDED (an empty long poll that ended at once);
//! - `wait-spin`: WaitProcess of the container's init answers DEADLINE_EXCEEDED at once,
//!   forever;
//! - `big-error-start`: StartContainer fails with an error message of almost 4 MiB (ttrpc's
//!   message limit) full of forged log lines and terminal escapes;
//! - `big-error-wait`: WaitProcess of the container's init fails with that message;
//! - `console-flood:<bytes>`: once started, a thread writes that many bytes of numbered lines to
//!   /dev/console as fast as it can, then `hostile-flood done <lines> <bytes>`.

use std::collections::HashMap;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};

use agent_protocol::agent::{GetOomEventResponse, WaitProcessResponse};
use ttrpc::Code;

/// The environment variable of a container's spec that turns the hooks on.
pub const ENV: &str = "MICROVM_HOSTILE_TEST";

/// A forged containerd log line, as the shim's log would carry it if it passed on newlines.
pub const FORGED_LINE: &str =
    "time=\"1999-12-31T23:59:59.000000000Z\" level=error msg=\"FORGED-BY-GUEST\"";

/// What one container asked for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Plan {
    oom_targets: Vec<String>,
    oom_flood: bool,
    wait_spin: bool,
    big_error_start: bool,
    big_error_wait: bool,
    console_flood: Option<u64>,
}

fn plans() -> std::sync::MutexGuard<'static, HashMap<String, Plan>> {
    static PLANS: LazyLock<Mutex<HashMap<String, Plan>>> = LazyLock::new(Default::default);
    // A poisoned lock is still a map: the hooks keep going.
    PLANS.lock().unwrap_or_else(|e| e.into_inner())
}

fn parse(value: &str) -> Plan {
    let mut plan = Plan::default();
    for action in value.split(',').map(str::trim) {
        let mut parts = action.split(':');
        match parts.next().unwrap_or_default() {
            "oom-flood" => {
                plan.oom_flood = true;
                plan.oom_targets.extend(parts.map(str::to_owned));
            }
            "wait-spin" => plan.wait_spin = true,
            "big-error-start" => plan.big_error_start = true,
            "big-error-wait" => plan.big_error_wait = true,
            "console-flood" => {
                plan.console_flood =
                    Some(parts.next().and_then(|b| b.parse().ok()).unwrap_or(4 << 20))
            }
            _ => {}
        }
    }
    plan
}

/// CreateContainer: records what the container's spec asks for.
pub fn on_create(id: &str, spec_json: &[u8]) {
    let Ok(spec) = serde_json::from_slice::<serde_json::Value>(spec_json) else {
        return;
    };
    let prefix = format!("{ENV}=");
    let Some(value) = spec
        .pointer("/process/env")
        .and_then(|e| e.as_array())
        .into_iter()
        .flatten()
        .filter_map(|v| v.as_str())
        .find_map(|v| v.strip_prefix(&prefix))
    else {
        return;
    };
    let plan = parse(value);
    log::warn!("HOSTILE TEST HOOKS for container {id}: {plan:?}");
    plans().insert(id.to_owned(), plan);
}

/// RemoveContainer: the container's hooks end.
pub fn on_remove(id: &str) {
    plans().remove(id);
}

/// The error message of the `big-error-*` hooks: just under ttrpc's 4 MiB message limit.
fn big_error() -> String {
    const SIZE: usize = (4 << 20) - (16 << 10);
    let chunk = format!("\n{FORGED_LINE}\r\x1b[2J\x1b]0;owned\x07 ");
    let mut s = String::with_capacity(SIZE);
    s.push_str("hostile agent: this error is almost 4 MiB long");
    while s.len() + chunk.len() < SIZE {
        s.push_str(&chunk);
    }
    while s.len() < SIZE {
        s.push('x');
    }
    s
}

fn status(code: Code, message: impl ToString) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message))
}

/// StartContainer: the big error for a `big-error-start` container; starts a console flood.
pub fn start_reply(id: &str) -> Option<ttrpc::Error> {
    let plan = plans().get(id).cloned()?;
    if let Some(bytes) = plan.console_flood {
        std::thread::spawn(move || flood_console(bytes));
    }
    plan.big_error_start
        .then(|| status(Code::FAILED_PRECONDITION, big_error()))
}

/// WaitProcess of a container's init (`exec_id` ""): an instant timeout or the big error.
pub fn wait_reply(id: &str, exec_id: &str) -> Option<ttrpc::Result<WaitProcessResponse>> {
    if !exec_id.is_empty() {
        return None;
    }
    let plan = plans().get(id).cloned()?;
    if plan.big_error_wait {
        return Some(Err(status(Code::INTERNAL, big_error())));
    }
    plan.wait_spin.then(|| {
        Err(status(
            Code::DEADLINE_EXCEEDED,
            "hostile agent: still running (at once)",
        ))
    })
}

/// GetOomEvent while a container floods: the next lie, at once.
pub fn oom_reply() -> Option<ttrpc::Result<GetOomEventResponse>> {
    static TURN: AtomicU64 = AtomicU64::new(0);
    let mut ids: Vec<String> = Vec::new();
    for (own, plan) in plans().iter().filter(|(_, p)| p.oom_flood) {
        ids.extend(plan.oom_targets.iter().cloned());
        ids.push(own.clone());
    }
    if ids.is_empty() {
        return None;
    }
    let turn = TURN.fetch_add(1, Ordering::Relaxed);
    // Every other answer: a made-up id, or an empty long poll ended at once.
    let id = match turn % 4 {
        1 => format!("hostile-bogus-{turn}"),
        3 => {
            return Some(Err(status(
                Code::DEADLINE_EXCEEDED,
                "hostile agent: no OOM event (at once)",
            )))
        }
        _ => ids[(turn / 2) as usize % ids.len()].clone(),
    };
    Some(Ok(GetOomEventResponse {
        container_id: id,
        ..Default::default()
    }))
}

/// Writes `bytes` of numbered lines to /dev/console as fast as it takes them.
fn flood_console(bytes: u64) {
    let Ok(mut console) = std::fs::OpenOptions::new().write(true).open("/dev/console") else {
        log::warn!("hostile console flood: cannot open /dev/console");
        return;
    };
    let pad = "x".repeat(80);
    let (mut written, mut lines) = (0u64, 0u64);
    while written < bytes {
        let line = format!("hostile-flood {lines:08} {pad}\n");
        if console.write_all(line.as_bytes()).is_err() {
            break;
        }
        written += line.len() as u64;
        lines += 1;
    }
    let _ = writeln!(console, "hostile-flood done {lines} {written}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn actions_parse() {
        let p = parse("oom-flood:a:b, wait-spin,big-error-start,console-flood:1000,nonsense");
        assert_eq!(
            p,
            Plan {
                oom_targets: vec!["a".into(), "b".into()],
                oom_flood: true,
                wait_spin: true,
                big_error_start: true,
                big_error_wait: false,
                console_flood: Some(1000),
            }
        );
        let e = big_error();
        assert!(e.len() < 4 << 20 && e.len() > (4 << 20) - (17 << 10));
        assert!(e.contains(FORGED_LINE));
    }
}
