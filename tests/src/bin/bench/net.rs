//! The network part (`BENCH_ONLY=net`): a `microvm` and a `runc` pod serving busybox httpd and
//! two `nc` servers, measured from the host through each pod's IP (see `net_bench`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient, Pod};
use microvm_tests::lifecycle::{pod_processes, vm_accel, wait_pod_gone};
use microvm_tests::pod_net::{
    download, http_get, mib_per_s, percentile, pod_ip, server_script, upload, wait_servers,
    PodNetError, PodServers, ServerSpec, POD_PORTS,
};

use crate::knobs::positive_knob;
use crate::report::{median, MIN_PODS};
use crate::setup::PodSetup;

/// Runs of the network part per handler (`BENCH_NET_RUNS`).
const NET_RUNS: usize = 10;
/// MiB per transfer and direction (`BENCH_NET_MIB`).
const NET_MIB: u64 = 32;
/// HTTP requests per run (`BENCH_NET_REQUESTS`).
const NET_REQUESTS: usize = 100;
/// Bound on a started pod's servers answering through its IP (with the first, unmeasured
/// transfers): the guest runs under TCG here, emulated twice in the lane.
const NET_REACH_TIMEOUT: Duration = Duration::from_secs(90);
/// Bound on each connect, read and write of a measurement.
const NET_IO_TIMEOUT: Duration = Duration::from_secs(60);

/// A metric of the network part.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NetMetric {
    /// One TCP transfer the pod sends and the host reads to its end.
    PodToHost,
    /// One TCP transfer the host sends, until the pod says it has read it all.
    HostToPod,
    /// Small HTTP requests from the host, one connection each.
    HttpLatency,
}

impl NetMetric {
    const ALL: [NetMetric; 3] = [
        NetMetric::PodToHost,
        NetMetric::HostToPod,
        NetMetric::HttpLatency,
    ];
}

/// What one handler's pod gave for one metric: the samples, or why it could not be measured.
type Measured = Result<Vec<Duration>, String>;

/// One handler's serving pod in the network part.
struct NetSide {
    handler: &'static str,
    /// Its name, also the page `GET /` answers.
    name: String,
    /// Once RunPodSandbox returned: the pod, removed at the end.
    pod: Option<Pod>,
    netns: Option<PathBuf>,
    /// Its servers, reached through the pod IP; or why not.
    servers: Result<PodServers, String>,
    pod_to_host: Measured,
    host_to_pod: Measured,
    latency: Measured,
}

impl NetSide {
    fn measured(&mut self, metric: NetMetric) -> &mut Measured {
        match metric {
            NetMetric::PodToHost => &mut self.pod_to_host,
            NetMetric::HostToPod => &mut self.host_to_pod,
            NetMetric::HttpLatency => &mut self.latency,
        }
    }

    /// The samples of `metric`, or why there are none (the pod's own failure first).
    fn result(&self, metric: NetMetric) -> Result<&[Duration], String> {
        let servers = self.servers.as_ref().map_err(Clone::clone)?;
        let measured = match metric {
            NetMetric::PodToHost => &self.pod_to_host,
            NetMetric::HostToPod => &self.host_to_pod,
            NetMetric::HttpLatency => &self.latency,
        };
        let samples = measured.as_ref().map_err(Clone::clone)?;
        if samples.is_empty() {
            return Err(format!("no samples from {}", servers.ip));
        }
        Ok(samples)
    }
}

/// An error as one line of at most 400 characters, for a report line.
fn one_line(e: impl std::fmt::Display) -> String {
    let text = format!("{e:#}")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" | ");
    if text.chars().count() > 400 {
        let cut: String = text.chars().take(400).collect();
        format!("{cut}…")
    } else {
        text
    }
}

/// Starts `side`'s pod with one busybox container running [`server_script`], and waits until
/// its servers answer through the pod IP.
async fn start_serving_pod(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    side: &mut NetSide,
    download_bytes: u64,
) -> Result<PodServers, String> {
    let handler = side.handler;
    let config = ctrd
        .pod_config(&side.name, HashMap::new())
        .map_err(|e| format!("the pod config: {e}"))?;
    let pod = cri
        .run_pod_sandbox(config, handler)
        .await
        .map_err(|e| format!("RunPodSandbox: {}", one_line(e)))?;
    side.pod = Some(pod.clone());
    side.netns = cri
        .pod_netns_path(&pod.id)
        .await
        .map_err(|e| format!("the pod's netns: {}", one_line(e)))?;
    let spec = ServerSpec {
        page: side.name.clone(),
        www: "/www".into(),
        ports: POD_PORTS,
        download_bytes,
    };
    let script = server_script(&spec).map_err(|e| e.to_string())?;
    let id = cri
        .create_container(
            &pod,
            container_config("servers", ctrd.busybox_image(), &["sh", "-c", &script]),
        )
        .await
        .map_err(|e| format!("CreateContainer: {}", one_line(e)))?;
    cri.start_container(&id)
        .await
        .map_err(|e| format!("StartContainer: {}", one_line(e)))?;
    let ip = pod_ip(cri, &pod.id)
        .await
        .map_err(|e| format!("the pod IP: {}", one_line(e)))?;
    let servers = PodServers {
        ip,
        ports: POD_PORTS,
    };
    let page = side.name.clone();
    let reached = tokio::task::spawn_blocking(move || {
        wait_servers(&servers, &page, download_bytes, NET_REACH_TIMEOUT)
    })
    .await
    .map_err(|e| format!("the reachability check panicked: {e}"))?;
    match reached {
        Ok(after) => {
            eprintln!(
                "bench: net: the {handler} pod's servers answered at {ip} (ports {} http, {} \
                 upload, {} download) after {:.2}s",
                POD_PORTS.http,
                POD_PORTS.upload,
                POD_PORTS.download,
                after.as_secs_f64()
            );
            Ok(servers)
        }
        Err(e) => Err(format!(
            "its IP {ip} (from CRI) did not serve the host: {}",
            one_line(e)
        )),
    }
}

/// One run of `metric` on `side`; a failure ends that metric for the side, with the reason.
async fn measure_net(
    side: &mut NetSide,
    metric: NetMetric,
    run: usize,
    bytes: u64,
    requests: usize,
) {
    let Ok(servers) = side.servers.clone() else {
        return;
    };
    if side.measured(metric).is_err() {
        return;
    }
    let page = side.name.clone();
    let result = tokio::task::spawn_blocking(move || -> Result<Vec<Duration>, PodNetError> {
        match metric {
            NetMetric::PodToHost => Ok(vec![download(servers.download(), bytes, NET_IO_TIMEOUT)?]),
            NetMetric::HostToPod => Ok(vec![upload(servers.upload(), bytes, NET_IO_TIMEOUT)?]),
            NetMetric::HttpLatency => {
                let mut times = Vec::with_capacity(requests);
                for _ in 0..requests {
                    let (t, body) = http_get(servers.http(), "/", NET_IO_TIMEOUT)?;
                    if String::from_utf8_lossy(&body).trim() != page {
                        return Err(PodNetError::Protocol {
                            addr: servers.http(),
                            detail: format!(
                                "GET / answered {:?}, expected {page:?}",
                                String::from_utf8_lossy(&body[..body.len().min(80)])
                            ),
                        });
                    }
                    times.push(t);
                }
                Ok(times)
            }
        }
    })
    .await;
    let entry = side.measured(metric);
    match result {
        Ok(Ok(samples)) => {
            if let Ok(all) = entry {
                all.extend(samples);
            }
        }
        Ok(Err(e)) => *entry = Err(format!("run {run}: {}", one_line(e))),
        Err(e) => *entry = Err(format!("run {run}: the measuring thread panicked: {e}")),
    }
}

/// The pod network, `microvm` and `runc` pods side by side on one private containerd (the
/// default CNI bridge): each pod runs one busybox container serving [`server_script`] (httpd, an
/// upload and a download `nc` server), and the bench on the host measures through each pod's
/// IP, interleaved run by run (alternating which handler goes first), `BENCH_NET_RUNS` runs:
/// - `net_tcp_pod_to_host`, `net_tcp_host_to_pod`: one TCP transfer of `BENCH_NET_MIB` MiB per
///   run and direction (MiB/s, the median run);
/// - `net_http_latency_median`, `net_http_latency_p99`: `BENCH_NET_REQUESTS` HTTP/1.0 `GET /`
///   per run, a connection each, over all runs' requests.
///
/// A metric that cannot be measured on one side (the pod does not start, its IP does not serve,
/// a transfer fails or comes short) prints `FAILED` there with the reason, and fails the
/// benchmark once everything is printed; the other side's number is still printed.
pub(crate) async fn net_bench() -> Result<()> {
    // SAFETY: geteuid(2) has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the network benchmark starts containerd and VMs: run it as root");
    }
    let runs: usize = positive_knob("BENCH_NET_RUNS", NET_RUNS)?;
    let mib: u64 = positive_knob("BENCH_NET_MIB", NET_MIB)?;
    let requests: usize = positive_knob("BENCH_NET_REQUESTS", NET_REQUESTS)?;
    let bytes = mib
        .checked_mul(1 << 20)
        .context("BENCH_NET_MIB is too large")?;
    let PodSetup {
        backend,
        embedded_accel,
        vm_size,
        cri,
        ctrd,
        config_dir: _config_dir,
        ..
    } = PodSetup::start().await?;
    eprintln!(
        "bench: net: backend {} ({}), a serving pod of each handler, then {runs} runs each, \
         interleaved",
        backend.label(),
        backend.why
    );
    let new_side = |handler: &'static str| NetSide {
        handler,
        name: format!("bench-net-{handler}"),
        pod: None,
        netns: None,
        servers: Err("not started".into()),
        pod_to_host: Ok(Vec::new()),
        host_to_pod: Ok(Vec::new()),
        latency: Ok(Vec::new()),
    };
    let mut sides = [new_side("microvm"), new_side("runc")];
    for side in sides.iter_mut() {
        side.servers = start_serving_pod(&ctrd, &cri, side, bytes).await;
        if let Err(e) = &side.servers {
            eprintln!(
                "bench: net: the {} pod cannot be measured: {e}\n--- the last lines of \
                 containerd's log ---\n{}",
                side.handler,
                ctrd.log_tail()
            );
        }
    }
    for run in 0..runs {
        let order = if run % 2 == 0 { [0, 1] } else { [1, 0] };
        for metric in NetMetric::ALL {
            for k in order {
                measure_net(&mut sides[k], metric, run, bytes, requests).await;
            }
        }
        eprintln!("bench: net: run {} of {runs} done", run + 1);
    }

    let mut failures: Vec<String> = Vec::new();
    // The accelerator of our pods' VMs, while the pod still runs.
    let accel = match (&embedded_accel, &sides[0].pod) {
        (Some(accel), _) => accel.clone(),
        (None, Some(pod)) => match vm_accel(&pod_processes(&ctrd, &pod.id)) {
            Some(accel) => accel,
            None => {
                failures.push("the QEMU process of our pod was not found".into());
                "unknown".into()
            }
        },
        (None, None) => "unknown (our pod did not start)".into(),
    };
    // Remove both pods, then check what each left (the check sees the whole instance).
    let mut removed = Vec::new();
    for side in &mut sides {
        let Some(pod) = side.pod.take() else {
            continue;
        };
        let result = async {
            cri.stop_pod_sandbox(&pod.id).await?;
            cri.remove_pod_sandbox(&pod.id).await
        }
        .await;
        match result {
            Ok(()) => removed.push((side.handler, pod.id, side.netns.clone())),
            Err(e) => failures.push(format!(
                "removing the {} pod: {}",
                side.handler,
                one_line(e)
            )),
        }
    }
    for (handler, id, netns) in removed {
        let left = wait_pod_gone(&ctrd, &id, netns.as_deref(), Duration::from_secs(30));
        if !left.is_empty() {
            failures.push(format!("the {handler} pod left: {}", left.join("; ")));
        }
    }
    drop(cri);
    drop(ctrd);

    let tag = format!("(backend={} accel={accel})", backend.label());
    println!(
        "# the pod network through CRI on a private containerd (the default CNI bridge), from the \
         host through each pod's IP: {runs} runs per handler, interleaved; throughput: one TCP \
         transfer of {mib} MiB per run and direction (busybox nc in the pod, MiB/s of the median \
         run); latency: {requests} HTTP/1.0 GET / per run, a connection each (busybox httpd), \
         over all {} requests; ours = the microvm handler: backend {} accel {accel} ({}), guest {} \
         vCPU {} MiB",
        runs * requests,
        backend.label(),
        backend.why,
        vm_size.vcpus,
        vm_size.memory_mib
    );
    if runs < MIN_PODS {
        println!(
            "# only {runs} runs per handler (BENCH_NET_RUNS): too few for trustworthy medians \
             (>= {MIN_PODS})"
        );
    }
    let [ours, runc] = &sides;
    let mibs = |v: &[Duration]| -> Vec<f64> { v.iter().map(|d| mib_per_s(bytes, *d)).collect() };
    let range = |v: &[f64], unit: &str| {
        let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.1}-{hi:.1}{unit}")
    };
    let mut report =
        |name: &str, metric: NetMetric, value: &dyn Fn(&[Duration]) -> (f64, String)| {
            let (o, r) = (ours.result(metric), runc.result(metric));
            let show = |side: &Result<&[Duration], String>| match side {
                Ok(v) => value(v).1,
                Err(_) => "FAILED".to_string(),
            };
            let ratio = match (&o, &r) {
                (Ok(o), Ok(r)) => format!("{:.2}", value(o).0 / value(r).0),
                _ => "FAILED".to_string(),
            };
            let mut why = Vec::new();
            for (who, side) in [("ours", &o), ("runc", &r)] {
                if let Err(e) = side {
                    why.push(format!("{who} not measured: {e}"));
                    failures.push(format!("{name}: {who} not measured"));
                }
            }
            let why = if why.is_empty() {
                String::new()
            } else {
                format!(" ({})", why.join("; "))
            };
            println!(
                "{name} ours={} runc={} ratio={ratio} {tag}{why}",
                show(&o),
                show(&r)
            );
        };
    for (name, metric) in [
        ("net_tcp_pod_to_host", NetMetric::PodToHost),
        ("net_tcp_host_to_pod", NetMetric::HostToPod),
    ] {
        report(name, metric, &|v| {
            let per_run = mibs(v);
            let m = median(per_run.clone());
            (
                m,
                format!("{m:.1}MiB/s (runs {})", range(&per_run, "MiB/s")),
            )
        });
    }
    for (name, p) in [
        ("net_http_latency_median", 50.0),
        ("net_http_latency_p99", 99.0),
    ] {
        report(name, NetMetric::HttpLatency, &|v| {
            let ms = percentile(v, p).map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0);
            (ms, format!("{ms:.2}ms"))
        });
    }
    if !failures.is_empty() {
        bail!("{}", failures.join("; "));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_becomes_one_bounded_line() {
        assert_eq!(one_line("a\n\n  b \nc"), "a | b | c");
        let long = "x".repeat(1000);
        assert_eq!(one_line(&long).chars().count(), 401);
    }
}
