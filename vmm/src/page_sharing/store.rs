//! The template store: a template directory held open ([`TemplateDir`]), whose files are
//! reached from its descriptor without following links, created 0444 through a temporary file
//! and a link, never changed in place, and checked each time they are opened (a regular file
//! of ours, writable by nobody else, of the size expected). The directories themselves are
//! checked as they are opened: ours, 0700, never a symbolic link.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use super::error::{io, PageSharingError};

/// A template directory, held open: every file in it is reached from this descriptor, never
/// by a path again, and never through a symbolic link.
#[derive(Debug)]
pub struct TemplateDir {
    path: PathBuf,
    fd: OwnedFd,
}

/// This process's effective user (root for the shim).
fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// Why a directory's status makes it unfit to hold templates (`None`: fit): a directory owned
/// by this process's user that nobody else may enter, list or write.
fn unfit_dir(st: &rustix::fs::Stat) -> Option<String> {
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::Directory {
        return Some(format!("not a directory ({kind:?})"));
    }
    let me = euid();
    if st.st_uid != me {
        return Some(format!("owned by uid {}, not {me}", st.st_uid));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o077 != 0 {
        return Some(format!(
            "mode {mode:o}: others may enter or write it (want 0700)"
        ));
    }
    None
}

/// Why a template file's status makes it unfit to be mapped (`None`: fit): a regular file owned
/// by this process's user, writable by nobody else, of the size expected (when known).
fn unfit_file(st: &rustix::fs::Stat, expected: Option<u64>) -> Option<String> {
    let kind = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if kind != rustix::fs::FileType::RegularFile {
        return Some(format!("not a regular file ({kind:?})"));
    }
    let me = euid();
    if st.st_uid != me {
        return Some(format!("owned by uid {}, not {me}", st.st_uid));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o022 != 0 {
        return Some(format!(
            "mode {mode:o}: group or others may write it (templates are 0444)"
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(u64::MAX);
    match expected {
        Some(want) if size != want => Some(format!("{size} bytes, expected {want}")),
        _ => None,
    }
}

impl TemplateDir {
    /// Opens `path`, creating it (0700) if missing. Refused unless it is a directory (not a
    /// symbolic link) owned by this process's user that nobody else may enter or write.
    pub fn open(path: &Path) -> Result<Self, PageSharingError> {
        let bad = |reason: String| PageSharingError::TemplateDir {
            dir: path.to_path_buf(),
            reason,
        };
        if std::fs::symlink_metadata(path).is_err() {
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(|e| bad(e.to_string()))?;
            }
            match std::fs::DirBuilder::new().mode(0o700).create(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(bad(e.to_string())),
            }
        }
        // openat, not open: rustix's `open` is the `open` system call on x86_64, which the
        // page sharing thread's seccomp filter does not allow.
        let fd = rustix::fs::openat(rustix::fs::CWD, path, Self::dir_flags(), Mode::empty())
            .map_err(|e| bad(Self::open_reason(e)))?;
        Self::checked(path.to_path_buf(), fd)
    }

    /// The subdirectory `name` (one component), created 0700 if missing, with the checks of
    /// [`TemplateDir::open`]. Reached from this directory's descriptor without following links.
    pub fn subdir(&self, name: &str) -> Result<Self, PageSharingError> {
        let path = self.path.join(name);
        let bad = |reason: String| PageSharingError::TemplateDir {
            dir: path.clone(),
            reason,
        };
        if name.is_empty() || name.contains('/') || name == "." || name == ".." {
            return Err(bad("not one path component".into()));
        }
        match rustix::fs::mkdirat(&self.fd, name, Mode::from_raw_mode(0o700)) {
            Ok(()) | Err(rustix::io::Errno::EXIST) => {}
            Err(e) => return Err(bad(std::io::Error::from(e).to_string())),
        }
        let fd = rustix::fs::openat(&self.fd, name, Self::dir_flags(), Mode::empty())
            .map_err(|e| bad(Self::open_reason(e)))?;
        Self::checked(path.clone(), fd)
    }

    fn dir_flags() -> OFlags {
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
    }

    fn open_reason(e: rustix::io::Errno) -> String {
        match e {
            rustix::io::Errno::LOOP | rustix::io::Errno::NOTDIR => {
                "a symbolic link or not a directory (links are never followed)".into()
            }
            e => std::io::Error::from(e).to_string(),
        }
    }

    fn checked(path: PathBuf, fd: OwnedFd) -> Result<Self, PageSharingError> {
        let st = rustix::fs::fstat(&fd).map_err(|e| PageSharingError::TemplateDir {
            dir: path.clone(),
            reason: std::io::Error::from(e).to_string(),
        })?;
        if let Some(reason) = unfit_dir(&st) {
            return Err(PageSharingError::TemplateDir { dir: path, reason });
        }
        Ok(Self { path, fd })
    }

    /// The directory's path (for messages).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The template `name`, if it exists, checked before it is used: opened without following
    /// a symbolic link, a regular file owned by this process's user that nobody else may write,
    /// of `expected` bytes (when given). A file that fails a check is an error naming why,
    /// never a template.
    pub fn get(&self, name: &str, expected: Option<u64>) -> Result<Option<File>, PageSharingError> {
        let refuse = |reason: String| PageSharingError::Template {
            dir: self.path.clone(),
            name: name.to_string(),
            reason,
        };
        // Non-blocking: a FIFO planted under the name must not hang the open (it is refused
        // below as not a regular file).
        let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
        let fd = match rustix::fs::openat(&self.fd, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(rustix::io::Errno::NOENT) => return Ok(None),
            Err(rustix::io::Errno::LOOP) => {
                return Err(refuse(
                    "a symbolic link (template files are never reached through one)".into(),
                ))
            }
            Err(e) => return Err(refuse(std::io::Error::from(e).to_string())),
        };
        let st = rustix::fs::fstat(&fd).map_err(|e| refuse(std::io::Error::from(e).to_string()))?;
        if let Some(reason) = unfit_file(&st, expected) {
            return Err(refuse(reason));
        }
        Ok(Some(File::from(fd)))
    }

    /// Creates the template `name` holding `bytes` (0444, through a temporary file linked into
    /// place), unless it exists already; returns the file now under that name, checked.
    pub fn put(&self, name: &str, bytes: &[u8]) -> Result<File, PageSharingError> {
        self.put_with(name, Some(bytes.len() as u64), |f| f.write_all(bytes))
    }

    /// [`TemplateDir::put`] with the content written by `write` (streamed: no copy of a large
    /// template on the heap, where the allocator would keep it after it is freed), of
    /// `expected` bytes when known.
    pub fn put_with(
        &self,
        name: &str,
        expected: Option<u64>,
        write: impl FnOnce(&mut File) -> std::io::Result<()>,
    ) -> Result<File, PageSharingError> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let temp = format!(".{name}.{}.{nanos}.tmp", std::process::id());
        let what = format!("create {}", self.path.join(&temp).display());
        let fd = rustix::fs::openat(
            &self.fd,
            temp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o444),
        )
        .map_err(|e| io(what)(e.into()))?;
        let mut f = File::from(fd);
        let written = write(&mut f).and_then(|()| f.sync_data());
        drop(f);
        let linked = written.and_then(|()| {
            match rustix::fs::linkat(
                &self.fd,
                temp.as_str(),
                &self.fd,
                name,
                rustix::fs::AtFlags::empty(),
            ) {
                // Another VM put the same template first: keep that one.
                Ok(()) | Err(rustix::io::Errno::EXIST) => Ok(()),
                Err(e) => Err(e.into()),
            }
        });
        let _ = rustix::fs::unlinkat(&self.fd, temp.as_str(), rustix::fs::AtFlags::empty());
        linked.map_err(io(format!("write template {name}")))?;
        self.get(name, expected)?
            .ok_or_else(|| io(format!("template {name}"))(std::io::ErrorKind::NotFound.into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::page_sharing::test_fixtures::temp_dir;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn template_dir_is_private_and_templates_are_read_only() {
        let d_tmp = temp_dir("dir");
        let d = d_tmp.path().to_path_buf();
        let dir = TemplateDir::open(&d.join("t")).unwrap();
        let mode = std::fs::metadata(d.join("t")).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(dir.get("x", None).unwrap().is_none());
        let f = dir.put("x", b"first").unwrap();
        assert_eq!(f.metadata().unwrap().permissions().mode() & 0o777, 0o444);
        // A second put keeps the first file (and checks it: the size is the first one's).
        dir.put("x", b"first").unwrap();
        assert!(matches!(
            dir.put("x", b"second!"),
            Err(PageSharingError::Template { .. })
        ));
        assert_eq!(std::fs::read(d.join("t/x")).unwrap(), b"first");
        // No temporary file left.
        assert_eq!(std::fs::read_dir(d.join("t")).unwrap().count(), 1);
        // A directory others may enter is refused.
        std::fs::set_permissions(d.join("t"), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert!(matches!(
            TemplateDir::open(&d.join("t")),
            Err(PageSharingError::TemplateDir { .. })
        ));
    }
}
