//! `make demo` (scripts/demo.sh): a busybox pod in a microVM, through containerd's CRI.
//!
//! 1. `microvm check-host` picks the VM backend: the embedded VMM where this host can boot our
//!    guest kernel, QEMU otherwise (and says why);
//! 2. a private containerd (own root, state, socket, CNI bridge; tests/src/containerd.rs) with
//!    the `microvm` runtime handler configured, and the locally built busybox and pause images
//!    imported (no registry);
//! 3. RunPodSandbox with the `microvm` handler boots the pod's VM;
//! 4. a busybox container prints the kernel it runs on (the guest's, next to the host's) and a
//!    line, then exits with a chosen code; its CRI log lines and exit code are printed;
//! 5. the pod's network: a second container serves a page with busybox httpd, and the demo
//!    fetches it on the host from the pod's IP (the address CNI gave the pod, from its CRI
//!    status); the page names the guest's kernel, so it can only have come from the VM;
//! 6. the pod is removed and nothing of it may remain (processes, mounts, state directory, shim
//!    socket, network namespace, cgroups);
//! 7. containerd is stopped and its directory, processes and bridge must be gone.
//!
//! Any failure ends the demo with a message and exit status 1, after the same cleanup (dropping
//! the private containerd removes its pods and everything it made). A page that cannot be
//! fetched is said as such at step 5; the demo still removes the pod and checks the cleanup
//! (steps 6 and 7), then fails.
//!
//! Environment: `MICROVM_KERNEL`, `MICROVM_INITRD` (default: build/vmlinux, build/initrd.cpio),
//! `MICROVM_DEMO_LOG_LEVEL` (the shim's and agent's, default `info`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use microvm_tests::containerd::{mounts_under, ContainerdOptions, PrivateContainerd};
use microvm_tests::cri::{container_config, read_cri_log, CriClient};
use microvm_tests::host_cgroup::HostCgroup;
use microvm_tests::images::{BUSYBOX_IMAGE, PAUSE_IMAGE};
use microvm_tests::lifecycle::{
    choose_vm_backend, pod_processes, vm_accel, wait_pod_gone, write_shim_config,
    MICROVM_STATE_ROOT,
};
use microvm_tests::pod_net::{pod_ip, wait_get};

const SHIM: &str = "containerd-shim-microvm-v1";
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// The exit code the demo container ends with.
const EXIT_CODE: i32 = 7;
const STEPS: usize = 7;
/// The port the demo pod's httpd serves on (in the pod's network namespace).
const HTTP_PORT: u16 = 8080;
/// Bound on fetching the page from the pod's IP (the guest runs under TCG here).
const FETCH_TIMEOUT: Duration = Duration::from_secs(60);

fn step(n: usize, title: &str) {
    println!("\n== Step {n}/{STEPS}: {title}");
}

/// The pod's host cgroup (docs/overhead.md): every host process of the pod is in it, sized to the
/// VM plus the overhead; its limits and what it holds now.
fn print_host_cgroup(ctrd: &PrivateContainerd, pod_id: &str, when: &str) -> Result<()> {
    let cg = HostCgroup::of_pod(ctrd.cgroup_parent(), pod_id).with_context(|| {
        format!(
            "the pod has no host cgroup under {} (docs/overhead.md)",
            ctrd.cgroup_parent()
        )
    })?;
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / (1 << 20) as f64);
    println!(
        "   the pod's host cgroup ({when}): {} ({})",
        cg.path, cg.version
    );
    println!(
        "     memory: limit {}, in use {}, peak {}",
        cg.memory_limit.map_or("none".into(), mib),
        mib(cg.memory_usage),
        cg.memory_peak.map_or("n/a".into(), mib)
    );
    println!(
        "     cpu:    limit {}, used {:.2} s",
        cg.cpu_limit_millis
            .map_or("none".into(), |m| format!("{m}m")),
        cg.cpu_usage_us as f64 / 1e6
    );
    Ok(())
}

/// An error of a step, followed by the last lines of containerd's log (where the shim logs).
fn with_log(ctrd: &PrivateContainerd, what: &str, e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!(
        "{what}: {e}\n--- the last lines of containerd's log ---\n{}",
        ctrd.log_tail()
    )
}

fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn host_kernel_release() -> Result<String> {
    let out = std::process::Command::new("uname")
        .arg("-r")
        .output()
        .context("running uname -r")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// The shortened command line of a process, for display.
fn short(cmdline: &str) -> String {
    const MAX: usize = 110;
    if cmdline.chars().count() <= MAX {
        cmdline.to_string()
    } else {
        let cut: String = cmdline.chars().take(MAX).collect();
        format!("{cut}…")
    }
}

async fn run() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the demo starts containerd and VMs: run it as root");
    }
    let root = repo_root();
    // microvm-demo is built next to the shim and the microvm tool (`make build`).
    let exe = std::env::current_exe().context("locating the demo binary")?;
    let bin_dir = exe
        .parent()
        .context("the demo binary has no directory")?
        .to_path_buf();
    let microvm = bin_dir.join("microvm");
    let kernel = std::env::var_os("MICROVM_KERNEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("build/vmlinux"));
    let initrd = std::env::var_os("MICROVM_INITRD")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("build/initrd.cpio"));
    for (path, how) in [
        (&microvm, "make build"),
        (&bin_dir.join(SHIM), "make build"),
        (&kernel, "make kernel"),
        (&initrd, "make initrd"),
    ] {
        if !path.exists() {
            bail!("{} is missing: run `{how}`", path.display());
        }
    }
    let log_level = std::env::var("MICROVM_DEMO_LOG_LEVEL").unwrap_or_else(|_| "info".into());
    println!("microvm demo: a busybox pod in its own VM, through containerd's CRI");

    step(1, "which VM backend? (`microvm check-host`)");
    let backend = choose_vm_backend(&microvm, &kernel)?;
    for line in backend.report.lines() {
        println!("   | {line}");
    }
    match backend.hypervisor {
        "kvm" => println!(
            "-> backend: the embedded VMM on /dev/kvm (hypervisor = \"kvm\"), because: {}",
            backend.reason
        ),
        _ => println!(
            "-> backend: QEMU `-M microvm` (hypervisor = \"qemu\"; TCG unless /dev/kvm is hardware \
             virtualization, so the demo's config sets allow_software_emulation = true: software \
             emulation is no security boundary, and the shim runs on it only when allowed), \
             because check-host says: {}",
            backend.reason
        ),
    }

    step(2, "a private containerd with the `microvm` runtime handler");
    let config_dir = tempfile::Builder::new()
        .prefix("microvm-demo-")
        .tempdir()
        .context("creating a temp dir for the shim config")?;
    let shim_config = write_shim_config(
        config_dir.path(),
        backend.hypervisor,
        &kernel,
        &initrd,
        &log_level,
    )?;
    let ctrd = PrivateContainerd::start(ContainerdOptions {
        extra_path: vec![bin_dir.clone()],
        microvm_config: Some(shim_config.clone()),
        ..ContainerdOptions::default()
    })
    .context("starting the private containerd")?;
    let cri = CriClient::connect(ctrd.socket(), CALL_TIMEOUT)
        .await
        .map_err(|e| with_log(&ctrd, "connecting to CRI", e))?;
    cri.wait_ready(&[PAUSE_IMAGE, BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .map_err(|e| with_log(&ctrd, "CRI not ready", e))?;
    println!("   containerd:  {}", ctrd.socket().display());
    println!(
        "   directory:   {} (root, state, config.toml, CNI bridge {} on {})",
        ctrd.dir().display(),
        ctrd.bridge_name(),
        ctrd.subnet()
    );
    println!(
        "   handlers:    runc (io.containerd.runc.v2), microvm (io.containerd.microvm.v1 -> {})",
        bin_dir.join(SHIM).display()
    );
    println!("   shim config: {} (ConfigPath)", shim_config.display());
    for line in std::fs::read_to_string(&shim_config)
        .unwrap_or_default()
        .lines()
    {
        println!("   | {line}");
    }
    println!("   images:      {BUSYBOX_IMAGE}, {PAUSE_IMAGE} (built locally, imported)");
    println!("   ready in {}", secs(ctrd.started_in()));

    step(
        3,
        "RunPodSandbox with the `microvm` handler: the pod's VM boots",
    );
    let t = Instant::now();
    let pod = cri
        .run_pod_sandbox(ctrd.pod_config("demo", HashMap::new())?, "microvm")
        .await
        .map_err(|e| with_log(&ctrd, "the pod did not start", e))?;
    println!("   pod {} ready in {}", pod.id, secs(t.elapsed()));
    let netns = cri.pod_netns_path(&pod.id).await?;
    let processes = pod_processes(&ctrd, &pod.id);
    println!("   the pod on the host:");
    for p in &processes {
        println!("     {:>7} {:<16} {}", p.pid, p.name, short(&p.cmdline));
    }
    if backend.hypervisor == "qemu" {
        let accel = vm_accel(&processes)
            .context("the pod has no QEMU process although the backend is qemu")?;
        println!("   the VM runs under QEMU with accel={accel}");
    }
    print_host_cgroup(&ctrd, &pod.id, "just booted")?;

    step(4, "a busybox container in the pod's VM");
    let host_kernel = host_kernel_release()?;
    let script = format!(
        "echo \"uname -r: $(uname -r)\"; echo \"hello from busybox in a microVM, exiting with {EXIT_CODE}\"; exit {EXIT_CODE}"
    );
    println!("   command: sh -c '{script}'");
    let t = Instant::now();
    let id = cri
        .create_container(
            &pod,
            container_config("hello", BUSYBOX_IMAGE, &["sh", "-c", &script]),
        )
        .await
        .map_err(|e| with_log(&ctrd, "the container was not created", e))?;
    cri.start_container(&id)
        .await
        .map_err(|e| with_log(&ctrd, "the container did not start", e))?;
    let status = cri
        .wait_container_exited(&id, Duration::from_secs(120))
        .await
        .map_err(|e| with_log(&ctrd, "waiting for the container", e))?;
    println!("   container {id} ran in {}", secs(t.elapsed()));
    let log_path = PathBuf::from(&status.log_path);
    let log = read_cri_log(&log_path)?;
    println!("   its CRI log ({}):", log_path.display());
    for line in &log {
        println!("     {} | {}", line.stream, line.text);
    }
    println!("   exit code: {}", status.exit_code);
    let guest_kernel = log
        .iter()
        .find_map(|l| l.text.strip_prefix("uname -r: "))
        .context("the container's log has no `uname -r:` line")?
        .trim()
        .to_string();
    println!("   kernel inside the pod: {guest_kernel} (the guest's); on the host: {host_kernel}");
    if guest_kernel == host_kernel {
        bail!("the container saw the host's kernel {host_kernel}: it did not run in a VM");
    }
    if status.exit_code != EXIT_CODE {
        bail!(
            "the container exited {} instead of {EXIT_CODE}",
            status.exit_code
        );
    }
    if !log.iter().any(|l| l.text.starts_with("hello from busybox")) {
        bail!("the container's output line is missing from its CRI log");
    }

    step(
        5,
        "the pod's network: a page served in the VM, fetched on the host from the pod's IP",
    );
    let page_script = format!(
        "mkdir -p /www && echo \"hello from busybox httpd in pod demo, kernel $(uname -r)\" > \
         /www/index.html && exec httpd -f -p {HTTP_PORT} -h /www"
    );
    println!("   command: sh -c '{page_script}'");
    let httpd = cri
        .create_container(
            &pod,
            container_config("httpd", BUSYBOX_IMAGE, &["sh", "-c", &page_script]),
        )
        .await
        .map_err(|e| with_log(&ctrd, "the httpd container was not created", e))?;
    cri.start_container(&httpd)
        .await
        .map_err(|e| with_log(&ctrd, "the httpd container did not start", e))?;
    let ip = pod_ip(&cri, &pod.id).await?;
    println!("   pod IP: {ip} (from CNI, in the pod's CRI status)");
    let url = format!("http://{ip}:{HTTP_PORT}/");
    println!(
        "   GET {url} from the host (retried for up to {}s)",
        FETCH_TIMEOUT.as_secs()
    );
    let addr = std::net::SocketAddr::new(ip, HTTP_PORT);
    let fetched = tokio::task::spawn_blocking(move || wait_get(addr, "/", FETCH_TIMEOUT))
        .await
        .context("the fetch thread panicked")?;
    let network_failure = match fetched {
        Ok((after, body)) => {
            let page = String::from_utf8_lossy(&body).trim().to_string();
            println!("   the page, after {}:", secs(after));
            for line in page.lines() {
                println!("     | {line}");
            }
            if !page.contains(&format!("kernel {guest_kernel}")) {
                Some(format!(
                    "the page fetched from {url} does not name the guest's kernel \
                     {guest_kernel}: {page:?}"
                ))
            } else {
                println!(
                    "   served by the VM (it names the guest's kernel {guest_kernel}), reached \
                     through the pod's IP"
                );
                None
            }
        }
        Err(e) => {
            let why = format!("the page could not be fetched from the pod's IP: {e}");
            println!("   FAILED: {why}");
            println!(
                "   (the pod IP is CNI's address in the pod's network namespace; the page is \
                 served inside the VM, so the VM must be connected to that namespace)"
            );
            Some(why)
        }
    };

    print_host_cgroup(&ctrd, &pod.id, "serving its page")?;

    step(6, "remove the pod; nothing of it may remain");
    let t = Instant::now();
    cri.remove_container(&httpd).await?;
    cri.remove_container(&id).await?;
    let removed_container = t.elapsed();
    let t = Instant::now();
    cri.stop_pod_sandbox(&pod.id).await?;
    let stopped = t.elapsed();
    let t = Instant::now();
    cri.remove_pod_sandbox(&pod.id).await?;
    println!(
        "   RemoveContainer (both) {}, StopPodSandbox {}, RemovePodSandbox {}",
        secs(removed_container),
        secs(stopped),
        secs(t.elapsed())
    );
    let left = wait_pod_gone(&ctrd, &pod.id, netns.as_deref(), Duration::from_secs(30));
    if !left.is_empty() {
        bail!(
            "left behind by pod {}:\n  {}\ncontainerd log:\n{}",
            pod.id,
            left.join("\n  "),
            ctrd.log_tail()
        );
    }
    let state = Path::new(MICROVM_STATE_ROOT).join(&pod.id);
    println!(
        "   nothing left: no shim, VM, virtiofsd or vhost-device-vsock process; no mount; no {}; \
         no shim socket; no network namespace; no pod cgroup",
        state.display()
    );

    step(7, "stop containerd");
    let dir = ctrd.dir().to_path_buf();
    let socket = ctrd.socket().to_path_buf();
    let bridge = ctrd.bridge_name();
    drop(cri);
    drop(ctrd);
    let mut left = Vec::new();
    if dir.exists() {
        left.push(format!("directory {}", dir.display()));
    }
    for m in mounts_under(&dir) {
        left.push(format!("mount {}", m.display()));
    }
    if Path::new("/sys/class/net").join(&bridge).exists() {
        left.push(format!("bridge {bridge}"));
    }
    let needle = socket.to_string_lossy().into_owned();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(&needle) || cmdline.contains(&dir.to_string_lossy().into_owned()) {
            left.push(format!("process {pid}: {cmdline}"));
        }
    }
    if !left.is_empty() {
        bail!("left behind by containerd:\n  {}", left.join("\n  "));
    }
    println!("   containerd stopped; its directory, bridge {bridge} and processes are gone");
    if let Some(why) = network_failure {
        bail!(
            "step 5, the pod's network: {why}\n(steps 1-4, 6 and 7 passed: the pod ran in a VM \
             and left nothing behind)"
        );
    }
    println!(
        "\nDemo OK: a busybox pod ran in a {} VM through containerd's CRI; guest kernel {guest_kernel} \
         (host {host_kernel}); exit code {EXIT_CODE}; its page fetched from the pod IP; nothing left \
         behind.",
        if backend.hypervisor == "kvm" {
            "embedded-VMM"
        } else {
            "QEMU"
        }
    );
    Ok(())
}

fn main() -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("demo FAILED: starting the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // Everything the demo started is dropped (and so cleaned up) before the result is printed.
    match runtime.block_on(run()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("\ndemo FAILED: {e:#}");
            ExitCode::FAILURE
        }
    }
}
