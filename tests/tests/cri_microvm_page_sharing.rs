//! Page sharing stays inside a trust domain (docs/page-sharing.md), through CRI on a private
//! containerd (tests/src/containerd.rs) on the embedded VMM: only it shares pages, and its Linux
//! guests boot only where `microvm check-host` says so (the nested lane here,
//! docs/nested-lane.md), hence `#[ignore]` where make test runs the pod suites on QEMU. Needs
//! root, containerd, and `make kernel initrd`.
//!
//! With the default `page_sharing = "namespace"`, two pods of one Kubernetes namespace map the
//! same template files and hold the same physical template pages; a pod of another namespace
//! maps files of its own and holds none of those pages (read from the shims' /proc/<pid>/maps
//! and /proc/<pid>/pagemap). The kernel text template is captured once, by a VM that saw no pod
//! input, and no pod maps the captured file itself. A pod's first app container brings one more
//! pass (the late pass), and later containers none.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use microvm_tests::containerd::PrivateContainerd;
use microvm_tests::cri::{container_config, CriClient};
use microvm_tests::images::BUSYBOX_IMAGE;
use microvm_tests::microvm_pods::*;
use std::collections::{BTreeSet, HashMap};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// A template file mapped into a shim: its path, inode, and the physical pages of it present.
#[derive(Debug)]
struct Mapped {
    path: PathBuf,
    inode: u64,
    pfns: BTreeSet<u64>,
}

/// The template files (under `root`) shim `pid` maps, with the page frames of each mapping
/// that are present (pagemap bit 63; PFN in bits 0-54, read as root).
fn mapped_templates(pid: i32, root: &Path) -> Vec<Mapped> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("the shim's maps");
    let mut pagemap =
        std::fs::File::open(format!("/proc/{pid}/pagemap")).expect("the shim's pagemap");
    let mut out: Vec<Mapped> = Vec::new();
    for line in maps.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 6 || !f[5].starts_with(&*root.to_string_lossy()) {
            continue;
        }
        let (a, b) = f[0].split_once('-').expect("a range");
        let (start, end) = (
            u64::from_str_radix(a, 16).unwrap(),
            u64::from_str_radix(b, 16).unwrap(),
        );
        let inode: u64 = f[4].parse().unwrap();
        let mut entries = vec![0u8; ((end - start) / 4096 * 8) as usize];
        pagemap.seek(SeekFrom::Start(start / 4096 * 8)).unwrap();
        pagemap.read_exact(&mut entries).unwrap();
        let pfns = entries
            .chunks_exact(8)
            .map(|e| u64::from_le_bytes(e.try_into().unwrap()))
            .filter(|e| e & (1 << 63) != 0 && e & (1 << 61) != 0)
            .map(|e| e & ((1 << 55) - 1))
            .filter(|&pfn| pfn != 0)
            .collect::<BTreeSet<_>>();
        let path = PathBuf::from(f[5]);
        match out.iter_mut().find(|m| m.inode == inode && m.path == path) {
            Some(m) => m.pfns.extend(pfns),
            None => out.push(Mapped { path, inode, pfns }),
        }
    }
    out
}

async fn run_pod_in(
    ctrd: &PrivateContainerd,
    cri: &CriClient,
    name: &str,
    namespace: &str,
) -> microvm_tests::cri::Pod {
    let mut config = ctrd.pod_config(name, HashMap::new()).unwrap();
    config.metadata.as_mut().expect("metadata").namespace = namespace.to_string();
    cri.run_pod_sandbox(config, "microvm")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "RunPodSandbox {namespace}/{name}: {e}\ncontainerd log:\n{}",
                ctrd.log_tail()
            )
        })
}

/// The shims' page sharing lines: `(initrd-files, kernel-text)` pages shared per pass.
fn sharing_lines(ctrd: &PrivateContainerd) -> (Vec<(u64, u64)>, Vec<String>) {
    let log = std::fs::read_to_string(ctrd.dir().join("containerd.log")).unwrap_or_default();
    let lines: Vec<String> = log
        .lines()
        .filter(|l| l.contains("page sharing"))
        .map(str::to_owned)
        .collect();
    let count = |l: &str, kind: &str| -> u64 {
        l.split_once(&format!("{kind} "))
            .and_then(|(_, rest)| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()
                    .and_then(|n| n.parse().ok())
            })
            .unwrap_or(0)
    };
    let passes = lines
        .iter()
        .filter(|l| l.contains("private pages scanned"))
        .map(|l| (count(l, "initrd-files"), count(l, "kernel-text")))
        .collect();
    (passes, lines)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "page sharing runs on the embedded VMM only: the nested lane runs this (docs/nested-lane.md)"]
async fn pods_share_template_pages_within_a_namespace_and_never_across() {
    require_root();
    assert_eq!(
        test_hypervisor(),
        "kvm",
        "page sharing is the embedded VMM's: run with MICROVM_TEST_HYPERVISOR=kvm"
    );
    let dir = tempfile::tempdir().unwrap();
    let config = write_config(dir.path(), None);
    let templates = dir.path().join("page-templates");
    let mut text = std::fs::read_to_string(&config).unwrap();
    // The default page_sharing ("namespace"), in a template root of this test's own: empty, so
    // the first pod has the kernel text captured.
    text.push_str(&format!(
        "page_templates_dir = \"{}\"\n",
        templates.display()
    ));
    std::fs::write(&config, text).unwrap();
    let before = state_entries();
    let (ctrd, cri) = start(&config).await;

    let a1 = run_pod_in(&ctrd, &cri, "share-a1", "team-a").await;
    let a2 = run_pod_in(&ctrd, &cri, "share-a2", "team-a").await;
    let b1 = run_pod_in(&ctrd, &cri, "share-b1", "team-b").await;
    let (passes, lines) = sharing_lines(&ctrd);
    let all = lines.join("\n");
    eprintln!("{all}");
    // One pass per pod, each sharing pages of both templates.
    assert_eq!(passes.len(), 3, "{all}");
    for (initrd, kernel) in &passes {
        assert!(*initrd > 0 && *kernel > 0, "{all}");
    }
    // The kernel text was captured once, by the VM that saw no pod input, before the first
    // pod's pass; no pod captured it itself.
    assert_eq!(
        lines
            .iter()
            .filter(|l| l.contains("captured from a VM that saw no pod input"))
            .count(),
        1,
        "{all}"
    );
    assert!(
        !lines
            .iter()
            .any(|l| l.contains("captured the kernel text template;")),
        "{all}"
    );

    let maps: Vec<Vec<Mapped>> = [&a1, &a2, &b1]
        .iter()
        .map(|pod| {
            let pids = shim_pids(&ctrd, &pod.id);
            assert_eq!(pids.len(), 1, "one shim for {}", pod.id);
            // The guest memory is the shim's, or its VMM process's (vmm_process = true).
            vm_memory_pids(pids[0])
                .into_iter()
                .flat_map(|pid| mapped_templates(pid, &templates))
                .collect()
        })
        .collect();
    eprintln!("{maps:#?}");
    let dir_of = |m: &Mapped| m.path.parent().unwrap().to_path_buf();
    let domain_a = templates.join(vmm::page_sharing::namespace_domain("team-a"));
    let domain_b = templates.join(vmm::page_sharing::namespace_domain("team-b"));
    for (i, (m, domain)) in maps
        .iter()
        .zip([&domain_a, &domain_a, &domain_b])
        .enumerate()
    {
        assert!(!m.is_empty(), "pod {i} maps no template");
        for t in m {
            assert_eq!(&dir_of(t), domain, "pod {i} maps {}", t.path.display());
        }
        // Both kinds of template.
        for kind in ["initrd-files-", "kernel-text-"] {
            assert!(
                m.iter().any(|t| t
                    .path
                    .file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with(kind)),
                "pod {i} maps no {kind} template: {m:?}"
            );
        }
    }
    let inodes = |m: &[Mapped]| m.iter().map(|t| t.inode).collect::<BTreeSet<_>>();
    let pfns = |m: &[Mapped]| {
        m.iter()
            .flat_map(|t| t.pfns.iter().copied())
            .collect::<BTreeSet<_>>()
    };
    let (a1_pfns, a2_pfns, b1_pfns) = (pfns(&maps[0]), pfns(&maps[1]), pfns(&maps[2]));
    // One namespace: the same files, and physical pages in common.
    assert!(!inodes(&maps[0]).is_disjoint(&inodes(&maps[1])));
    let within = a1_pfns.intersection(&a2_pfns).count();
    // Two namespaces: no file and no physical page in common.
    assert!(inodes(&maps[0]).is_disjoint(&inodes(&maps[2])));
    let across = a1_pfns.intersection(&b1_pfns).count() + a2_pfns.intersection(&b1_pfns).count();
    eprintln!(
        "template pages present: a1 {}, a2 {}, b1 {}; shared within team-a {within}, across \
         namespaces {across}",
        a1_pfns.len(),
        a2_pfns.len(),
        b1_pfns.len()
    );
    assert!(
        within > 0,
        "two pods of one namespace share no template page"
    );
    assert_eq!(across, 0, "pods of two namespaces share template pages");

    // The late pass: the first app container's start brings one more pass, and only the first.
    cri.wait_ready(&[BUSYBOX_IMAGE], Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e}\ncontainerd log:\n{}", ctrd.log_tail()));
    for name in ["first", "second"] {
        let config = container_config(name, BUSYBOX_IMAGE, &["true"]);
        let exited =
            run_container_to_exit(&ctrd, &cri, &b1, config, Duration::from_secs(120)).await;
        assert_eq!(exited.status.exit_code, 0, "{name}: {:?}", exited.lines());
        // The late pass runs on the VM's thread after StartContainer answered: wait for it.
        let waited = std::time::Instant::now();
        while sharing_lines(&ctrd).0.len() < 4 && waited.elapsed() < Duration::from_secs(60) {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    // A pass the second container brought would have been logged while it ran; give it a moment.
    std::thread::sleep(Duration::from_secs(2));
    let (passes, lines) = sharing_lines(&ctrd);
    let all = lines.join("\n");
    eprintln!("{all}");
    assert_eq!(
        passes.len(),
        4,
        "one late pass, for the first container only:\n{all}"
    );
    assert_eq!(
        lines.iter().filter(|l| l.contains("the late pass")).count(),
        1,
        "{all}"
    );
    assert!(
        !lines.iter().any(|l| l.contains("late pass failed")),
        "{all}"
    );

    for pod in [&a1, &a2] {
        cri.stop_pod_sandbox(&pod.id).await.unwrap();
        cri.remove_pod_sandbox(&pod.id).await.unwrap();
        assert_pod_gone_while_others_run(&ctrd, &pod.id, Duration::from_secs(20));
    }
    remove_pod(&ctrd, &cri, &b1).await;
    // Nothing of the capture VM is left either (its work folder and empty share were beside
    // the first pod's VM folder, gone with its state directory).
    assert_nothing_new(&ctrd, &before);
}
