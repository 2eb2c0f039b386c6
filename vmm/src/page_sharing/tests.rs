//! Unit tests of the lifecycle (mod.rs): templates prepared once per domain and checked
//! before use, the directories' checks, domains that map files of their own, and the kernel
//! text captured only by a VM that saw no pod input.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use rustix::fs::Mode;
use vm_memory::{Bytes, GuestAddress};

use super::test_fixtures::{newc, sample_files, temp_dir};
use super::*;
use crate::memory::create_guest_memory;

/// A VM's sharing state for tests: root `root`, domain `domain`, an initrd holding two
/// files, and (when `text_pages` > 0) a kernel whose text is the first `text_pages` pages
/// of guest memory (the kernel file is the initrd: only its sum counts).
fn test_sharing(
    root: &Path,
    domain: &str,
    capture: bool,
    initrd_path: &Path,
    text_pages: u64,
) -> VmSharing {
    VmSharing {
        config: PageSharingConfig {
            template_dir: root.to_path_buf(),
            domain: domain.to_string(),
            capture_kernel_text: capture,
        },
        kernel: File::open(initrd_path).unwrap(),
        initrd: Some(File::open(initrd_path).unwrap()),
        text: (text_pages > 0).then(|| 0..text_pages * PAGE as u64),
        cmdline: String::new(),
        vcpus: 1,
        cpuid: Vec::new(),
        index: None,
    }
}

/// A newc initrd of two files, written beside `d`; its bytes.
fn test_initrd(d: &Path) -> (PathBuf, Vec<u8>) {
    let (a, b) = sample_files();
    let cpio = newc(&[
        ("init", 0o100755, &a),
        ("b", 0o100644, &b),
        ("TRAILER!!!", 0, b""),
    ]);
    let initrd_path = d.with_extension("cpio");
    std::fs::write(&initrd_path, &cpio).unwrap();
    (initrd_path, cpio)
}

fn inode(f: &File) -> u64 {
    f.metadata().unwrap().ino()
}

#[test]
fn prepare_streams_the_initrd_template_once() {
    let d_tmp = temp_dir("prepare");
    let d = d_tmp.path().to_path_buf();
    let (initrd_path, cpio) = test_initrd(&d);
    let mut sharing = test_sharing(&d, NODE_DOMAIN, false, &initrd_path, 0);
    assert_eq!(
        sharing.prepare().unwrap(),
        (None, false),
        "no kernel text to capture"
    );
    let index = sharing.index.take().unwrap();
    assert_eq!(index.views().len(), 1);
    let name = index.views()[0].name().to_string();
    assert!(name.starts_with("initrd-files-"), "{name}");
    let in_domain = d.join(NODE_DOMAIN).join(&name);
    assert_eq!(
        std::fs::read(&in_domain).unwrap(),
        initrd_template(&cpio).unwrap()
    );
    assert_eq!(
        std::fs::metadata(&in_domain).unwrap().len(),
        initrd_template_len(&parse_newc(&cpio).unwrap())
    );
    // The sum is remembered beside the captures, not in the domain.
    assert_eq!(std::fs::read_dir(d.join(CAPTURED_DIR)).unwrap().count(), 1);
    // A second VM finds it (and the remembered sum): same name, nothing new written.
    let before = std::fs::read_dir(d.join(NODE_DOMAIN)).unwrap().count();
    sharing.prepare().unwrap();
    assert_eq!(sharing.index.as_ref().unwrap().views()[0].name(), name);
    assert_eq!(
        std::fs::read_dir(d.join(NODE_DOMAIN)).unwrap().count(),
        before
    );
    std::fs::remove_file(&initrd_path).unwrap();
}

/// Every way a template file can be unfit: each is refused with an error naming the
/// template and why, before anything is mapped (the VM then runs its pass with no sharing
/// at all: the shim logs the error).
#[test]
fn a_template_failing_a_check_is_refused_with_its_reason() {
    let d_tmp = temp_dir("checks");
    let d = d_tmp.path().to_path_buf();
    let (initrd_path, cpio) = test_initrd(&d);
    // A first VM makes the good template; keep its bytes and name.
    let mut sharing = test_sharing(&d, "ns-x", false, &initrd_path, 0);
    sharing.prepare().unwrap();
    let name = sharing.index.take().unwrap().views()[0].name().to_string();
    let path = d.join("ns-x").join(&name);
    let good = std::fs::read(&path).unwrap();
    let elsewhere = d.join("elsewhere");
    std::fs::write(&elsewhere, &good).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o444)).unwrap();

    let replace = |how: &dyn Fn(&Path)| {
        let _ = std::fs::remove_file(&path);
        let _ = std::fs::remove_dir(&path);
        how(&path);
    };
    let good_file = |p: &Path| {
        std::fs::write(p, &good).unwrap();
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
    };
    type Case<'a> = (&'a str, Box<dyn Fn(&Path) + 'a>, &'a str);
    let cases: Vec<Case> = vec![
        (
            "another owner",
            Box::new(|p: &Path| {
                good_file(p);
                std::os::unix::fs::chown(p, Some(1000), Some(1000)).unwrap();
            }),
            "owned by uid 1000",
        ),
        (
            "writable by others",
            Box::new(|p: &Path| {
                good_file(p);
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o646)).unwrap();
            }),
            "group or others may write it",
        ),
        (
            "writable by the group",
            Box::new(|p: &Path| {
                good_file(p);
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o464)).unwrap();
            }),
            "group or others may write it",
        ),
        (
            "cut short",
            Box::new(|p: &Path| {
                std::fs::write(p, &good[..good.len() - PAGE]).unwrap();
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o444)).unwrap();
            }),
            "expected",
        ),
        (
            "a symbolic link to a good copy",
            Box::new(|p: &Path| std::os::unix::fs::symlink(&elsewhere, p).unwrap()),
            "symbolic link",
        ),
        (
            "a FIFO",
            Box::new(|p: &Path| {
                rustix::fs::mknodat(
                    rustix::fs::CWD,
                    p,
                    rustix::fs::FileType::Fifo,
                    Mode::from_raw_mode(0o444),
                    0,
                )
                .unwrap()
            }),
            "not a regular file",
        ),
        (
            "a directory",
            Box::new(|p: &Path| std::fs::create_dir(p).unwrap()),
            "not a regular file",
        ),
    ];
    for (what, how, reason) in &cases {
        replace(how.as_ref());
        let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
        match vm.prepare() {
            Err(e @ PageSharingError::Template { .. }) => {
                let msg = e.to_string();
                assert!(
                    msg.contains(&name) && msg.contains(reason) && msg.contains("refused"),
                    "{what}: {msg}"
                );
            }
            other => panic!("{what}: {other:?}"),
        }
        assert!(vm.index.is_none(), "{what}: nothing prepared");
    }
    // The good file again: accepted (the checks refuse only what is unfit).
    replace(&good_file);
    let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
    vm.prepare().unwrap();
    assert_eq!(
        good,
        initrd_template(&cpio).unwrap(),
        "the template is the initrd's files"
    );
    // A remembered sum that is not 64 bytes is refused too.
    let sums: Vec<_> = std::fs::read_dir(d.join(CAPTURED_DIR))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(sums.len(), 1);
    std::fs::remove_file(&sums[0]).unwrap();
    std::fs::write(&sums[0], b"00").unwrap();
    std::fs::set_permissions(&sums[0], std::fs::Permissions::from_mode(0o444)).unwrap();
    let mut vm = test_sharing(&d, "ns-x", false, &initrd_path, 0);
    let e = vm.prepare().unwrap_err().to_string();
    assert!(e.contains("2 bytes, expected 64"), "{e}");
    std::fs::remove_file(&initrd_path).unwrap();
}

/// The directories: a domain or the root that is a symbolic link, or that others may enter,
/// is refused; a domain name that is not one safe component is refused.
#[test]
fn template_directories_are_checked_and_domains_are_safe_names() {
    let d_tmp = temp_dir("dirs");
    let d = d_tmp.path().to_path_buf();
    let (initrd_path, _) = test_initrd(&d);
    std::fs::create_dir_all(d.join("real")).unwrap();
    std::fs::set_permissions(d.join("real"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(d.join("real"), d.join("link")).unwrap();
    let mut vm = test_sharing(&d.join("link"), "ns-x", false, &initrd_path, 0);
    let e = vm.prepare().unwrap_err().to_string();
    assert!(e.contains("symbolic link"), "{e}");
    std::fs::create_dir_all(d.join("root")).unwrap();
    std::fs::set_permissions(d.join("root"), std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(d.join("real"), d.join("root/ns-x")).unwrap();
    let mut vm = test_sharing(&d.join("root"), "ns-x", false, &initrd_path, 0);
    let e = vm.prepare().unwrap_err().to_string();
    assert!(e.contains("symbolic link"), "{e}");
    std::fs::create_dir(d.join("root/ns-y")).unwrap();
    std::fs::set_permissions(d.join("root/ns-y"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut vm = test_sharing(&d.join("root"), "ns-y", false, &initrd_path, 0);
    let e = vm.prepare().unwrap_err().to_string();
    assert!(e.contains("others may enter"), "{e}");
    for bad in ["", "..", "a/b", "captured", "ns x", &"a".repeat(65)] {
        assert!(!valid_domain(bad), "{bad:?}");
        let mut vm = test_sharing(&d.join("root"), bad, false, &initrd_path, 0);
        assert!(
            matches!(vm.prepare(), Err(PageSharingError::Domain { .. })),
            "{bad:?}"
        );
    }
    let shop = namespace_domain("shop");
    assert!(valid_domain(&shop) && valid_domain(NODE_DOMAIN), "{shop}");
    assert_eq!(shop, namespace_domain("shop"));
    assert_ne!(shop, namespace_domain("shop2"));
    assert_eq!(namespace_domain("../../etc").len(), 3 + 32);
    assert!(valid_domain(&namespace_domain("../../etc")));
    std::fs::remove_file(&initrd_path).unwrap();
}

/// Domains map different files (so their guests share no template page), VMs of one domain
/// the same; a pod's VM never captures the kernel text, a capturing VM's capture is copied
/// into each domain.
#[test]
fn domains_map_files_of_their_own_and_only_a_capturing_vm_captures() {
    let d_tmp = temp_dir("domains");
    let d = d_tmp.path().to_path_buf();
    let (initrd_path, _) = test_initrd(&d);
    let mem = create_guest_memory(2 << 20).unwrap();
    let text: Vec<u8> = (0..2 * PAGE).map(|i| (i % 251) as u8 + 1).collect();
    mem.write_slice(&text, GuestAddress(0)).unwrap();
    let (a, b) = (namespace_domain("team-a"), namespace_domain("team-b"));

    // A pod's VM before any capture: the kernel text is missing, and it captures nothing.
    let mut pod = test_sharing(&d, &a, false, &initrd_path, 2);
    assert!(pod.kernel_text_missing().unwrap());
    assert_eq!(pod.prepare().unwrap(), (None, true));
    assert!(matches!(
        pod.capture_kernel_text(&mem, "kernel-text-x"),
        Err(PageSharingError::NoCapture)
    ));
    assert!(matches!(
        pod.capture_name(),
        Err(PageSharingError::NoCapture)
    ));
    let report = pod.paused_pass(&mem, None, true).unwrap();
    assert!(report.kernel_text_missing && !report.captured_kernel_text);
    assert!(
        report.to_string().contains("no kernel text template"),
        "{report}"
    );
    pod.index = None;

    // A VM that saw no pod input captures it, into the captures only.
    let mut throwaway = test_sharing(&d, NODE_DOMAIN, true, &initrd_path, 2);
    let name = throwaway.capture_name().unwrap().expect("to capture");
    assert!(throwaway.capture_kernel_text(&mem, &name).unwrap());
    assert_eq!(
        std::fs::read(d.join(CAPTURED_DIR).join(&name)).unwrap(),
        text
    );
    assert_eq!(throwaway.capture_name().unwrap(), None, "captured once");
    assert!(!pod.kernel_text_missing().unwrap());

    // Pods of two domains, and a second pod of the first.
    let views = |domain: &str| {
        let mut vm = test_sharing(&d, domain, false, &initrd_path, 2);
        assert_eq!(vm.prepare().unwrap(), (None, false));
        let index = vm.index.take().unwrap();
        assert_eq!(index.views().len(), 2);
        index
            .views()
            .iter()
            .map(|v| (v.name().to_string(), inode(v.file()), v.bytes().to_vec()))
            .collect::<Vec<_>>()
    };
    let (a1, a2, b1) = (views(&a), views(&a), views(&b));
    assert_eq!(a1[1].0, name);
    assert_eq!(a1[1].2, text, "the domain's copy holds the capture");
    for i in 0..2 {
        assert_eq!(a1[i].1, a2[i].1, "one domain maps one file");
        assert_ne!(a1[i].1, b1[i].1, "two domains map different files");
        assert_eq!(a1[i].2, b1[i].2, "of the same bytes");
    }
    std::fs::remove_file(&initrd_path).unwrap();
}
