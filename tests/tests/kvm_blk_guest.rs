//! The `blk-test` guest under our VMM on the real /dev/kvm: the guest's own virtio-blk driver
//! against our virtio-blk device and real temporary files. Three slots: vda read-write, vdb
//! read-only (opened O_RDONLY), vdc empty; the test fills vdc with `attach_block` once the guest
//! waits for it and empties it with `detach_block`. Afterwards the host files must hold what the
//! guest wrote, discarded and zeroed, the read-only file must be untouched, and the device's
//! error counters must match the requests the guest expected to be refused. The same run on
//! loop devices over the files (block-device backings: BLKDISCARD, BLKZEROOUT) needs root.
//!
//! Needs /dev/kvm and the guest built (`make -C tests/guests OUT=$PWD/build/guests`;
//! `MICROVM_GUEST_DIR` overrides where it is looked for).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "test harness: a failed step is the test's failure"
)]

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use microvm_tests::guest_console::{test_guest_elf, Console};
use vmm::{BlockBacking, BlockConfig, SerialSink, Vm, VmConfig, VmExit, VmHandle};

/// Bound for each wait (kvm-pvm emulates the guest's kernel-mode code).
const TIMEOUT: Duration = Duration::from_secs(60);

/// Waits for `line` on the console; fails with the console if the guest ended first.
fn wait_for_line(console: &Console, line: &str) {
    console.wait_until(
        &format!("{line:?}"),
        TIMEOUT,
        |t| t.lines().any(|l| l == line),
        |t| t.contains("RESULT: "),
    );
}
const VDA_SECTORS: u64 = 2048;
const VDB_SECTORS: u64 = 64;
const VDC_SECTORS: u64 = 4096;

/// The guest's pattern `k`: byte at disk offset `o` is `o % 251 + k`.
fn pattern(sectors: u64, k: u8) -> Vec<u8> {
    (0..sectors * 512)
        .map(|o| ((o % 251) as u8).wrapping_add(k))
        .collect()
}

/// A temporary disk file with pattern `k`, closed: only its path is kept (the file is removed on
/// drop), so every descriptor open on it afterwards is the VMM's.
fn disk(sectors: u64, k: u8) -> tempfile::TempPath {
    let mut f = tempfile::NamedTempFile::new().expect("temp file");
    f.write_all(&pattern(sectors, k)).expect("fill the disk");
    f.into_temp_path()
}

fn read_at(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    let mut b = vec![0u8; len];
    File::open(path)
        .expect("reopen the disk")
        .read_exact_at(&mut b, offset)
        .expect("read the disk");
    b
}

/// This process's descriptors open on `path`.
fn open_fds_of(path: &Path) -> Vec<String> {
    let want = std::fs::canonicalize(path).expect("canonical path");
    std::fs::read_dir("/proc/self/fd")
        .expect("read /proc/self/fd")
        .flatten()
        .filter(|e| std::fs::read_link(e.path()).is_ok_and(|t| t == want))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect()
}

fn finish(handle: VmHandle, console: &Console) -> String {
    let exit = match handle.wait_timeout(TIMEOUT) {
        Some(r) => r.expect("the VM ends without a VMM error"),
        None => panic!("the guest did not end; console:\n{}", console.text()),
    };
    let text = console.text();
    assert_eq!(exit, VmExit::Reset, "console:\n{text}");
    text
}

fn rw(p: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .expect("open the disk")
}

/// What the host saw of one guest run.
struct Run {
    stats: Vec<vmm::BlockStats>,
}

/// Boots blk-test with `vda` (read-write), `vdb` (read-only, opened O_RDONLY) and an empty
/// third slot that gets `vdc` once the guest waits for it; checks the guest's report.
fn run_guest(vda: &Path, vdb: &Path, vdc: &Path) -> Run {
    let console = Console::default();
    let mut cfg = VmConfig::new(test_guest_elf("blk-test.elf"));
    cfg.memory_mib = 64;
    cfg.serial = SerialSink::Writer(Box::new(console.clone()));
    cfg.blocks = vec![
        BlockConfig {
            serial: "vda-serial".into(),
            backing: BlockBacking::File {
                file: rw(vda),
                read_only: false,
            },
        },
        BlockConfig {
            serial: "ro-disk".into(),
            backing: BlockBacking::File {
                file: File::open(vdb).expect("open vdb"),
                read_only: true,
            },
        },
        BlockConfig {
            serial: String::new(),
            backing: BlockBacking::Empty { read_only: false },
        },
    ];
    let handle = Vm::start(cfg).expect("the VM starts");
    assert_eq!(handle.block_capacity(2).expect("slot 2"), 0);
    assert!(matches!(
        handle.block_capacity(3),
        Err(vmm::VmmError::NoBlockSlot { index: 3, count: 3 })
    ));

    wait_for_line(&console, "blk-test: waiting for attach");
    // A slot that has a disk refuses another one.
    assert!(handle.attach_block(0, "x".into(), rw(vdc)).is_err());
    handle
        .attach_block(2, "hot-disk".into(), rw(vdc))
        .expect("attach vdc");
    assert_eq!(handle.block_capacity(2).expect("slot 2"), VDC_SECTORS);
    wait_for_line(&console, "blk-test: waiting for detach");
    handle.detach_block(2).expect("detach vdc");
    assert!(handle.detach_block(2).is_err(), "vdc is already empty");
    wait_for_line(&console, "blk-test: detached");
    let stats: Vec<_> = (0..3)
        .map(|i| handle.block_stats(i).expect("stats"))
        .collect();
    let text = finish(handle, &console);
    // The VMM closed every disk it was given (the detached one, and the others at the end).
    for disk in [vda, vdb, vdc] {
        let open = open_fds_of(disk);
        assert!(open.is_empty(), "{} still open: {open:?}", disk.display());
    }

    for want in [
        "blk-test: disk 0 capacity 2048 blk_size 512 seg_max 254 size_max 1048576 ro 0 flush 1 discard 1 write_zeroes 1 serial vda-serial",
        "blk-test: disk 1 capacity 64 blk_size 512 seg_max 254 size_max 1048576 ro 1 flush 1 discard 0 write_zeroes 0 serial ro-disk",
        "blk-test: disk 2 capacity 0 blk_size 512 seg_max 254 size_max 1048576 ro 0 flush 1 discard 1 write_zeroes 1 serial ",
        "blk-test: vda read write flush discard write-zeroes ok",
        "blk-test: vdb write refused, read ok",
        "blk-test: attached capacity 4096 serial hot-disk",
        "RESULT: PASS errors=5",
    ] {
        assert!(
            text.lines().any(|l| l.trim_end() == want.trim_end()),
            "no {want:?}; console:\n{text}"
        );
    }
    // The refused requests, per disk: vda out of range + unknown type, vdb the write, vdc a
    // read while empty, before and after.
    let errors: Vec<u64> = stats.iter().map(|s| s.errors).collect();
    assert_eq!(errors, vec![2, 1, 2], "{stats:?}");
    assert_eq!(stats[0].write_bytes, 4096);
    assert_eq!(stats[2].read_bytes, 4096);
    Run { stats }
}

/// After the run: vda's sectors 8..15 hold pattern 3, 16..31 zeroes, the rest is untouched; vdb
/// and vdc are untouched.
fn check_files(vda: &Path, vdb: &Path, vdc: &Path) {
    let whole = read_at(vda, 0, (VDA_SECTORS * 512) as usize);
    let mut want = pattern(VDA_SECTORS, 0);
    let p3 = pattern(16, 3);
    want[8 * 512..16 * 512].copy_from_slice(&p3[8 * 512..16 * 512]);
    want[16 * 512..32 * 512].fill(0);
    if let Some(at) = whole.iter().zip(&want).position(|(a, b)| a != b) {
        panic!(
            "{}: first difference from what the guest did at byte {at}",
            vda.display()
        );
    }
    let meta = std::fs::metadata(vda).expect("vda");
    if meta.is_file() {
        assert_eq!(
            meta.len(),
            VDA_SECTORS * 512,
            "discard changed the file's size"
        );
    }
    assert!(read_at(vdb, 0, (VDB_SECTORS * 512) as usize) == pattern(VDB_SECTORS, 1));
    assert!(read_at(vdc, 0, (VDC_SECTORS * 512) as usize) == pattern(VDC_SECTORS, 2));
}

#[test]
fn guest_reads_writes_discards_and_sees_hot_attach_and_detach() {
    let vda = disk(VDA_SECTORS, 0);
    let vdb = disk(VDB_SECTORS, 1);
    let vdc = disk(VDC_SECTORS, 2);
    let run = run_guest(&vda, &vdb, &vdc);
    assert_eq!(run.stats.len(), 3);
    check_files(&vda, &vdb, &vdc);
}

/// A loop device over a file, detached on drop.
struct Loop {
    dev: PathBuf,
}

impl Loop {
    fn new(file: &Path, read_only: bool) -> Self {
        let mut cmd = std::process::Command::new("losetup");
        if read_only {
            cmd.arg("--read-only");
        }
        let out = cmd
            .args(["--find", "--show"])
            .arg(file)
            .output()
            .expect("run losetup");
        assert!(
            out.status.success(),
            "losetup {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let dev = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        Self { dev }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        match std::process::Command::new("losetup")
            .arg("-d")
            .arg(&self.dev)
            .status()
        {
            Ok(s) if s.success() => {}
            other => eprintln!("cleanup: losetup -d {}: {other:?}", self.dev.display()),
        }
    }
}

/// The same guest on loop devices (block-device backings: BLKDISCARD, BLKZEROOUT); the data
/// must be in the loop devices' backing files afterwards. Needs root (losetup).
#[test]
fn loop_devices_as_disks_carry_the_guests_data_to_their_files() {
    // SAFETY: geteuid has no preconditions and touches no memory.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "loop devices need root");
    let vda = disk(VDA_SECTORS, 0);
    let vdb = disk(VDB_SECTORS, 1);
    let vdc = disk(VDC_SECTORS, 2);
    {
        let (la, lb, lc) = (
            Loop::new(&vda, false),
            Loop::new(&vdb, true),
            Loop::new(&vdc, false),
        );
        run_guest(&la.dev, &lb.dev, &lc.dev);
        // Through the loop devices too (their own page cache, flushed by the guest's FLUSH).
        check_files(&la.dev, &lb.dev, &lc.dev);
    }
    check_files(&vda, &vdb, &vdc);
}

#[test]
fn a_too_long_serial_or_a_directory_is_refused_at_start() {
    let mut cfg = VmConfig::new(test_guest_elf("blk-test.elf"));
    cfg.serial = SerialSink::Null;
    cfg.blocks.push(BlockConfig {
        serial: "s".repeat(21),
        backing: BlockBacking::Empty { read_only: true },
    });
    let e = Vm::start(cfg).err().expect("refused").to_string();
    assert!(e.contains("disk 0") && e.contains("longer than 20"), "{e}");

    let mut cfg = VmConfig::new(test_guest_elf("blk-test.elf"));
    cfg.serial = SerialSink::Null;
    cfg.blocks.push(BlockConfig {
        serial: "dir".into(),
        backing: BlockBacking::File {
            file: File::open(std::env::temp_dir()).expect("open a directory"),
            read_only: true,
        },
    });
    let e = Vm::start(cfg).err().expect("refused").to_string();
    assert!(
        e.contains("virtio-blk 0") && e.contains("not a regular file"),
        "{e}"
    );
}
