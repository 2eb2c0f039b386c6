//! The VMM process's half of the process split ([`serve`]): it takes the descriptors the
//! description names and closes every other, builds the VM from the description, jails itself
//! (namespaces, an empty root holding the work folder, the templates' folder and the share,
//! limits, capabilities, `no_new_privs`) before any thread of the VM exists, runs page sharing
//! passes on a thread of their own under their filter, and serves the channel on the main
//! thread, under the control filter, until the VM ends.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::Duration;

use super::description::{FileDescription, VmDescription};
use super::wait::wait_readable;
use crate::config::{
    BalloonConfig, BlockBacking, BlockConfig, BootFile, BootFiles, NetConfig, SerialSink,
    SharedFsConfig, VfioConfig, VmConfig, VsockConfig,
};
use crate::jail::channel::{self, Channel, ChannelError, EndKind, Message};
use crate::jail::process::{
    detached_tree, enter_namespaces, keep_capabilities, pivot_to_root_holding, set_limits,
    set_no_new_privs, Limits, FS_SERVER_CAPABILITIES,
};
use crate::jail::{JailError, Needs, Role, ThreadFilter};
use crate::page_sharing::PageSharingConfig;
use crate::{Vm, VmExit, VmHandle, VmmError};

/// The hidden first argument of the embedder's binary that runs [`serve`]:
/// `<binary> __vmm <channel descriptor> <work folder>` (the folder only names the VM in `ps`).
pub const SUBCOMMAND: &str = "__vmm";

/// The folder of the VM's work folder the VMM process mounts its empty root on (in its own
/// mount namespace only).
const ROOT_MOUNT_POINT: &str = ".vmm-root";

/// How often the control thread looks whether the VM ended by itself.
const END_POLL: Duration = Duration::from_millis(100);

/// Why the VMM process could not run its VM.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("the channel descriptor {0:?}")]
    ChannelFd(String),
    #[error(transparent)]
    Channel(#[from] ChannelError),
    #[error("the first message was not Start")]
    NoStart,
    #[error("the VM description: {0}")]
    Description(String),
    #[error(transparent)]
    Vmm(#[from] VmmError),
    #[error(transparent)]
    Jail(#[from] JailError),
}

/// Takes descriptor `fd` (named by the description) as ours: open, not standard I/O, not the
/// channel, close-on-exec from now on.
fn take_fd(fd: RawFd, channel: RawFd, taken: &mut Vec<RawFd>) -> Result<OwnedFd, ServeError> {
    let cloexec = |fd: RawFd| {
        // SAFETY: F_SETFD on a descriptor number touches no memory; a number that is not open
        // gives EBADF.
        unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) }
    };
    if fd < 3 || fd == channel || taken.contains(&fd) || cloexec(fd) != 0 {
        return Err(ServeError::Description(format!(
            "descriptor {fd} is not one the VMM process was given"
        )));
    }
    taken.push(fd);
    // SAFETY: an open descriptor named once by the embedder, owned by nothing else here.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Closes every descriptor above 2 but `keep`. It allocates nothing (a forked child of a
/// process with threads may call it: the unit tests do).
fn close_others(keep: &[RawFd]) {
    let mut from: u32 = 3;
    // The kept descriptors in rising order: the smallest one at or above `from`, each round.
    while let Some(fd) = keep
        .iter()
        .filter_map(|&f| u32::try_from(f).ok())
        .filter(|&f| f >= from)
        .min()
    {
        if fd > from {
            // SAFETY: close_range on descriptor numbers we do not use.
            unsafe { libc::syscall(libc::SYS_close_range, from, fd - 1, 0u32) };
        }
        from = fd.saturating_add(1);
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
}

enum ShareRequest {
    Pass,
    TextMissing,
}

/// Runs the VMM process's half: `channel_fd` from the command line. Returns the exit code;
/// when the VM ran, it never returns (the process exits without dropping the VM: a confined
/// thread may not remove its socket file, and the embedder removes the work folder).
pub fn serve(channel_fd: &str) -> i32 {
    serve_with(channel_fd, None)
}

/// Code an embedder runs in its VMM process on a thread of its own ([`serve_with`]).
pub type ExtraThread = Box<dyn FnOnce() + Send + 'static>;

/// [`serve`], with `extra` run on a thread of its own once the VM runs, in the jail (the
/// process's namespaces, root, limits, capabilities and `no_new_privs`), started before the
/// control thread installs its filter (which forbids starting threads); the thread has no
/// filter but what `extra` installs. The product binary passes none: the jail's tests play a
/// hijacked thread of the VM there, under that thread's filter
/// (shim/tests/kvm_vmm_process_climb.rs).
pub fn serve_with(channel_fd: &str, extra: Option<ExtraThread>) -> i32 {
    let Ok(fd) = channel_fd.parse::<RawFd>() else {
        eprintln!("vmm: {}", ServeError::ChannelFd(channel_fd.into()));
        return 2;
    };
    // SAFETY: F_SETFD on a descriptor number; no memory.
    if fd < 3 || unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } != 0 {
        eprintln!("vmm: {}", ServeError::ChannelFd(channel_fd.into()));
        return 2;
    }
    // SAFETY: the embedder handed this descriptor (its end of the channel) to us alone.
    let channel = Channel::from_fd(unsafe { OwnedFd::from_raw_fd(fd) });
    match run(&channel, fd, extra) {
        Ok(never) => match never {},
        Err(e) => {
            log::error!("vmm: {e}");
            let _ = channel.send(
                &Message::Failed {
                    reason: e.to_string(),
                },
                &[],
            );
            1
        }
    }
}

enum Never {}

fn run(
    channel: &Channel,
    channel_fd: RawFd,
    extra: Option<ExtraThread>,
) -> Result<Never, ServeError> {
    let description = match channel.recv()? {
        (Message::Start { description }, _) => description,
        _ => return Err(ServeError::NoStart),
    };
    let desc: VmDescription =
        serde_json::from_str(&description).map_err(|e| ServeError::Description(e.to_string()))?;
    // Only what the description names stays open.
    let mut keep = desc.fds();
    keep.push(channel_fd);
    close_others(&keep);
    let mut taken = Vec::new();
    // The kernel, the initrd and KVM are the embedder's open files: nothing here opens their
    // paths, which only name them in messages.
    let mut boot_file = |f: &FileDescription| -> Result<BootFile, ServeError> {
        Ok(BootFile::Open {
            file: take_fd(f.fd, channel_fd, &mut taken)?.into(),
            name: f.name.clone(),
        })
    };
    let mut cfg = VmConfig::new(boot_file(&desc.kernel)?);
    cfg.initrd = desc.initrd.as_ref().map(&mut boot_file).transpose()?;
    cfg.kvm = Some(take_fd(desc.kvm_fd, channel_fd, &mut taken)?);
    cfg.vcpus = desc.vcpus;
    cfg.memory_mib = desc.memory_mib;
    cfg.boot_files = if desc.copy_boot_files {
        BootFiles::Copy
    } else {
        BootFiles::Map
    };
    cfg.cmdline = desc.cmdline.clone();
    cfg.serial = SerialSink::File {
        path: desc.console_log.clone(),
        max_bytes: desc.console_log_bytes,
    };
    cfg.vsock = desc.vsock.as_ref().map(|v| VsockConfig {
        guest_cid: v.guest_cid,
        uds_path: v.uds_path.clone(),
    });
    // The share is served by its path, which the jail's root holds: the process's own copy
    // of the host's share mount (a slave of it, so the containers' files the shim mounts
    // there later appear), mounted at the same path. The file server opens its root and
    // /proc/self/fd after the jail (`VirtioFs::open_backend`), so `..` from either stops at
    // the jail's root (docs/security.md, "The share in the VMM process").
    cfg.shared_fs = desc.shared_fs.as_ref().map(|s| SharedFsConfig {
        tag: s.tag.clone(),
        host_dir: s.host_dir.clone(),
    });
    for n in &desc.nets {
        cfg.nets.push(NetConfig {
            tap: take_fd(n.fd, channel_fd, &mut taken)?,
            mac: n.mac,
            mtu: n.mtu,
        });
    }
    for b in &desc.blocks {
        let backing = match b.fd {
            None => BlockBacking::Empty {
                read_only: b.read_only,
            },
            Some(fd) => BlockBacking::File {
                file: take_fd(fd, channel_fd, &mut taken)?.into(),
                read_only: b.read_only,
            },
        };
        cfg.blocks.push(BlockConfig {
            serial: b.serial.clone(),
            backing,
        });
    }
    cfg.vfio = desc
        .vfio
        .iter()
        .map(|p| VfioConfig {
            sysfs_path: p.clone(),
        })
        .collect();
    cfg.balloon = desc.balloon.map(|free_page_reporting| BalloonConfig {
        free_page_reporting,
    });
    cfg.page_sharing = desc.page_sharing.as_ref().map(|p| PageSharingConfig {
        template_dir: p.template_dir.clone(),
        domain: p.domain.clone(),
        capture_kernel_text: p.capture_kernel_text,
    });
    cfg.jail = true;

    // The folders the jail keeps, cloned while this process still sees the host's mounts.
    let io = |what: &'static str| move |e: std::io::Error| VmmError::io(what)(e);
    let mount_point = desc.work_dir.join(ROOT_MOUNT_POINT);
    match std::fs::create_dir(&mount_point) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(io("make the empty root's mount point")(e).into()),
    }
    let mut trees: Vec<(PathBuf, OwnedFd)> = vec![(
        desc.work_dir.clone(),
        detached_tree(&desc.work_dir).map_err(VmmError::from)?,
    )];
    if let Some(p) = &desc.page_sharing {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&p.template_dir)
            .map_err(io("make the page templates' folder"))?;
        trees.push((
            p.template_dir.clone(),
            detached_tree(&p.template_dir).map_err(VmmError::from)?,
        ));
    }
    let serves_fs = desc.shared_fs.is_some();
    let mut limits = Limits::for_vm(desc.vcpus, serves_fs);
    if desc.page_sharing.is_some() {
        // Template files are as large as the initrd's files and the kernel text.
        limits.file_size = None;
    }
    let share_dir = desc.shared_fs.as_ref().map(|s| s.host_dir.clone());
    // The process's own procfs: the file server's `/proc/self/fd`, and page sharing's
    // `/proc/self/maps` and `/proc/self/pagemap`.
    let with_proc = serves_fs || desc.page_sharing.is_some();
    let jail = || -> Result<(), VmmError> {
        enter_namespaces()?;
        // The share is cloned from this namespace's copy of it, a slave of the host's mount
        // since `enter_namespaces`: the clone is a slave too (the host's later mounts under it
        // reach it, nothing goes back), never a peer of the host's.
        if let Some(dir) = &share_dir {
            trees.push((dir.clone(), detached_tree(dir)?));
        }
        let mounts: Vec<(&Path, &OwnedFd)> = trees.iter().map(|(p, t)| (p.as_path(), t)).collect();
        pivot_to_root_holding(&mount_point, &mounts, with_proc)?;
        set_limits(&limits)?;
        keep_capabilities(if serves_fs {
            &FS_SERVER_CAPABILITIES
        } else {
            &[]
        })?;
        set_no_new_privs()?;
        Ok(())
    };
    let handle = Vm::start_then(cfg, jail)?;
    handle.keep_devices_after_end();
    let control = ThreadFilter::new(Role::Control, Needs::default())?;
    std::thread::scope(|scope| -> Result<Never, ServeError> {
        // The page sharing passes run on a thread of their own under their filter: the control
        // thread, filtered, cannot start threads.
        let (share_tx, share_rx) = mpsc::channel::<(ShareRequest, mpsc::Sender<Message>)>();
        let handle = &handle;
        if handle.sharing_filter().is_some() {
            std::thread::Builder::new()
                .name("vmm-sharing".into())
                .spawn_scoped(scope, move || share_thread(handle, share_rx))
                .map_err(io("spawn the page sharing thread"))?;
        } else {
            drop(share_rx);
        }
        let detail = format!(
            "embedded vmm on /dev/kvm in its own process, {} entry",
            handle.boot_entry()
        );
        if let Some(extra) = extra {
            std::thread::Builder::new()
                .name("vmm-extra".into())
                .spawn(extra)
                .map_err(io("spawn the embedder's extra thread"))?;
        }
        control.install()?;
        channel.send(&Message::Started { detail }, &[])?;
        serve_requests(channel, handle, &share_tx);
        // The VM has ended and the embedder knows: exit without dropping anything.
        // SAFETY: _exit ends the process; nothing of it is used after.
        unsafe { libc::_exit(0) }
    })
}

fn share_thread(
    handle: &VmHandle,
    requests: mpsc::Receiver<(ShareRequest, mpsc::Sender<Message>)>,
) {
    if let Some(filter) = handle.sharing_filter() {
        if let Err(e) = filter.install() {
            log::error!("vmm: the page sharing thread's filter: {e}");
            return;
        }
    }
    for (request, reply) in requests {
        let answer = match request {
            ShareRequest::Pass => match handle.share_pages_on_this_thread() {
                Ok(_) => Message::Done,
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
            ShareRequest::TextMissing => match handle.kernel_text_template_missing() {
                Ok(value) => Message::Flag { value },
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
        };
        let _ = reply.send(answer);
    }
}

fn ended(result: Result<VmExit, VmmError>) -> Message {
    let (how, detail) = match result {
        Ok(VmExit::Reset) => (EndKind::Reset, String::new()),
        Ok(VmExit::Stopped) | Err(VmmError::AlreadyWaited) => (EndKind::Stopped, String::new()),
        Err(e) => (EndKind::Error, e.to_string()),
    };
    let mut detail = detail;
    detail.truncate(channel::MAX_STRING);
    while !detail.is_char_boundary(detail.len()) {
        detail.pop();
    }
    Message::Ended { how, detail }
}

/// The control thread's loop: the embedder's requests until the VM ends.
fn serve_requests(
    channel: &Channel,
    handle: &VmHandle,
    share: &mpsc::Sender<(ShareRequest, mpsc::Sender<Message>)>,
) {
    let ask_share = |request| {
        let (tx, rx) = mpsc::channel();
        match share.send((request, tx)).ok().and_then(|()| rx.recv().ok()) {
            Some(m) => m,
            None => Message::Failed {
                reason: "this VM has no page sharing".into(),
            },
        }
    };
    loop {
        if let Some(result) = handle.wait_timeout(Duration::ZERO) {
            let _ = channel.send(&ended(result), &[]);
            return;
        }
        match wait_readable(&[channel.as_fd()], END_POLL) {
            Ok(r) if r[0] => {}
            _ => continue,
        }
        let answer = match channel.recv() {
            Ok((Message::Stop, _)) => {
                handle.stop();
                let _ = channel.send(&ended(handle.wait()), &[]);
                return;
            }
            Ok((Message::SharePages, _)) => ask_share(ShareRequest::Pass),
            Ok((Message::KernelTextMissing, _)) => ask_share(ShareRequest::TextMissing),
            Ok((Message::AttachBlock { index, serial }, mut fds)) => {
                let file = std::fs::File::from(fds.remove(0));
                match handle.attach_block(index as usize, serial, file) {
                    Ok(()) => Message::Done,
                    Err(e) => Message::Failed {
                        reason: e.to_string(),
                    },
                }
            }
            Ok((Message::DetachBlock { index }, _)) => match handle.detach_block(index as usize) {
                Ok(()) => Message::Done,
                Err(e) => Message::Failed {
                    reason: e.to_string(),
                },
            },
            Ok((other, _)) => Message::Failed {
                reason: format!("not a request: {other:?}"),
            },
            Err(ChannelError::Closed) | Err(ChannelError::Io(_)) => {
                // The embedder is gone: so is the VM.
                handle.stop();
                let _ = handle.wait();
                return;
            }
            Err(e) => Message::Failed {
                reason: e.to_string(),
            },
        };
        let _ = channel.send(&answer, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jail::split::description::{BlockDescription, NetDescription};
    use std::fs::File;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// A regular file with `bytes`, open read-only, and what names it.
    fn boot_file(bytes: &[u8]) -> (File, tempfile::TempPath) {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(bytes).unwrap();
        let path = f.into_temp_path();
        (File::open(&path).unwrap(), path)
    }

    fn file_description(file: &File, path: &Path) -> FileDescription {
        FileDescription {
            fd: file.as_raw_fd(),
            name: path.to_path_buf(),
        }
    }

    #[test]
    fn the_kernel_initrd_and_kvm_descriptors_are_named_and_close_others_keeps_them() {
        let (kernel, kernel_path) = boot_file(b"\x7fELF kernel");
        let (initrd, initrd_path) = boot_file(b"070701 initrd");
        // Stands for /dev/kvm: what is checked here is the descriptor's number and life.
        let kvm = File::open("/dev/null").unwrap();
        let tap = File::open("/dev/zero").unwrap();
        let disk = tempfile::tempfile().unwrap();
        let desc = VmDescription {
            kernel: file_description(&kernel, &kernel_path),
            initrd: Some(file_description(&initrd, &initrd_path)),
            kvm_fd: kvm.as_raw_fd(),
            nets: vec![NetDescription {
                fd: tap.as_raw_fd(),
                mac: [2, 0, 0, 0, 0, 1],
                mtu: None,
            }],
            blocks: vec![
                BlockDescription {
                    serial: "a".into(),
                    read_only: false,
                    fd: Some(disk.as_raw_fd()),
                },
                BlockDescription {
                    serial: "empty".into(),
                    read_only: false,
                    fd: None,
                },
            ],
            ..VmDescription::default()
        };
        assert_eq!(
            desc.fds(),
            [
                kernel.as_raw_fd(),
                initrd.as_raw_fd(),
                kvm.as_raw_fd(),
                tap.as_raw_fd(),
                disk.as_raw_fd()
            ]
        );
        // The description survives its trip as JSON with its numbers and names.
        let json = serde_json::to_string(&desc).unwrap();
        assert_eq!(serde_json::from_str::<VmDescription>(&json).unwrap(), desc);

        // Descriptors the description does not name, below, between and above the named ones.
        let (channel, theirs) = Channel::pair().unwrap();
        let others: Vec<File> = (0..3).map(|_| File::open("/dev/null").unwrap()).collect();
        let mut keep = desc.fds();
        keep.push(channel.as_fd().as_raw_fd());
        keep.reverse(); // any order
        let closed: Vec<RawFd> = others
            .iter()
            .map(|f| f.as_raw_fd())
            .chain(std::iter::once(theirs.as_fd().as_raw_fd()))
            .collect();
        // SAFETY: the child makes raw system calls only (close_range, fcntl, exit): the test
        // harness has other threads, so it must not allocate or take a lock.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
        if pid == 0 {
            close_others(&keep);
            let open = |fd: RawFd| {
                // SAFETY: F_GETFD reads a descriptor's flags; no memory.
                unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
            };
            let mut code = 0;
            for (i, &fd) in keep.iter().enumerate() {
                if !open(fd) {
                    code = 10 + i as i32;
                }
            }
            for (i, &fd) in closed.iter().enumerate() {
                if open(fd) {
                    code = 20 + i as i32;
                }
            }
            // SAFETY: ends this single-threaded child.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child forked above; `status` is a valid out pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(libc::WIFEXITED(status), "{status:#x}");
        let code = libc::WEXITSTATUS(status);
        assert_eq!(
            code, 0,
            "10+i: kept descriptor i ({keep:?}) closed; 20+i: descriptor i ({closed:?}) left open"
        );
    }

    #[test]
    fn a_descriptor_named_twice_or_the_channels_is_refused() {
        let (kernel, _path) = boot_file(b"\x7fELF");
        let fd = kernel.as_raw_fd();
        let mut taken = Vec::new();
        // take_fd owns what it takes: give it a copy.
        let copy_fd = std::os::fd::IntoRawFd::into_raw_fd(kernel.try_clone().unwrap());
        let first = take_fd(copy_fd, fd, &mut taken).unwrap();
        let e = take_fd(copy_fd, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains("is not one the VMM process was given"), "{e}");
        let e = take_fd(fd, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains(&format!("descriptor {fd} ")), "{e}");
        let e = take_fd(2, fd, &mut taken).unwrap_err().to_string();
        assert!(e.contains("descriptor 2 "), "{e}");
        drop(first);
    }
}
