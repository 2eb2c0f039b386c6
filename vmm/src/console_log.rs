//! The guest's serial console on the host's disk, bounded: a guest that floods its console
//! (a kernel printing in a loop, `cat /dev/urandom > /dev/console` as guest root) must not fill
//! the host's disk, and reading the console's end for an error message must not read it all.
//!
//! [`ConsoleLog`] is a ring of two files: `<path>` holds the newest bytes, `<path>.1` the
//! half before. Once `<path>` holds `max_bytes / 2`, its bytes are copied over `<path>.1` and
//! `<path>` starts again from empty, so the pair never holds more than `max_bytes` and always
//! the last `max_bytes / 2` at least. `cat <path>.1 <path>` is the console's end, in order.
//! Both files are opened once, at the start: the rotation works on their descriptors only
//! (read, write, seek, truncate), never by path, so the vCPU thread that writes the serial
//! needs no file-system call in its seccomp filter ([`crate::jail`]). The price is one copy of
//! half the bound per rotation.
//! [`tail`] reads the last lines from the end of the pair, bounded in bytes.
//!
//! Used by the embedded VMM's serial ([`crate::SerialSink::File`]) and by the shim's QEMU
//! backend, whose console socket a thread copies into a [`ConsoleLog`].

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// The default bound of a console log pair (both files together).
pub const DEFAULT_CONSOLE_LOG_BYTES: u64 = 1 << 20;
/// The smallest bound accepted (smaller ones are raised to it).
pub const MIN_CONSOLE_LOG_BYTES: u64 = 8 << 10;

/// The older file of the pair: `<path>.1`.
pub fn previous_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".1");
    PathBuf::from(p)
}

/// A console log of bounded size on disk (module doc). Writes never fail for lack of room.
#[derive(Debug)]
pub struct ConsoleLog {
    path: PathBuf,
    file: File,
    previous: File,
    written: u64,
    half: u64,
}

/// Creates (or truncates) `path` for reading and writing, never following a symlink at its
/// last component.
fn create(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o640)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
}

impl ConsoleLog {
    /// A new, empty console log at `path` (and an empty `<path>.1`, whatever was left there)
    /// holding at most `max_bytes` in all.
    pub fn create(path: &Path, max_bytes: u64) -> io::Result<Self> {
        Ok(ConsoleLog {
            file: create(path)?,
            previous: create(&previous_path(path))?,
            path: path.to_path_buf(),
            written: 0,
            half: max_bytes.max(MIN_CONSOLE_LOG_BYTES) / 2,
        })
    }

    /// A console log on two files opened by someone else (a VMM in a process of its own gets
    /// descriptors, never paths): `current` is `<path>`, `previous` `<path>.1`; both are
    /// truncated. `path` only names the log in messages. The files must be open for reading
    /// and writing.
    pub fn from_files(
        path: &Path,
        mut current: File,
        mut previous: File,
        max_bytes: u64,
    ) -> io::Result<Self> {
        for f in [&mut current, &mut previous] {
            f.set_len(0)?;
            f.seek(SeekFrom::Start(0))?;
        }
        Ok(ConsoleLog {
            file: current,
            previous,
            path: path.to_path_buf(),
            written: 0,
            half: max_bytes.max(MIN_CONSOLE_LOG_BYTES) / 2,
        })
    }

    /// The newer file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Copies `<path>`'s bytes over `<path>.1` and empties `<path>`, by descriptor. Should
    /// the copy fail, `<path>` starts over all the same: the bound holds.
    fn rotate(&mut self) -> io::Result<()> {
        if let Err(e) = self.copy_to_previous() {
            log::debug!("console log {}: rotation: {e}", self.path.display());
        }
        self.file.set_len(0)?;
        self.file.seek(SeekFrom::Start(0))?;
        self.written = 0;
        Ok(())
    }

    fn copy_to_previous(&mut self) -> io::Result<()> {
        self.previous.set_len(0)?;
        self.previous.seek(SeekFrom::Start(0))?;
        self.file.seek(SeekFrom::Start(0))?;
        let mut buf = [0u8; 16 << 10];
        let mut left = self.written;
        while left > 0 {
            let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
            let n = self.file.read(&mut buf[..want])?;
            if n == 0 {
                break;
            }
            self.previous.write_all(&buf[..n])?;
            left -= n as u64;
        }
        Ok(())
    }
}

impl Write for ConsoleLog {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        if self.written >= self.half {
            self.rotate()?;
        }
        let room = usize::try_from(self.half - self.written).unwrap_or(usize::MAX);
        let n = self.file.write(&buf[..buf.len().min(room)])?;
        self.written += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.flush()
    }
}

/// Up to `max` bytes from the end of `path` (nothing if it cannot be read).
fn file_end(path: &Path, max: u64) -> Vec<u8> {
    let Ok(mut f) = File::open(path) else {
        return Vec::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let start = len.saturating_sub(max);
    if f.seek(SeekFrom::Start(start)).is_err() {
        return Vec::new();
    }
    let mut out = Vec::new();
    let _ = f.take(max).read_to_end(&mut out);
    out
}

/// The last `lines` lines of the console log at `path` (with `<path>.1` before it), reading at
/// most `max_bytes` from their end; control characters other than newline and tab are shown
/// escaped (`\x1b`), so a guest cannot drive the terminal of whoever reads an error. Empty if
/// nothing can be read.
pub fn tail(path: &Path, max_bytes: usize, lines: usize) -> String {
    let max = max_bytes as u64;
    let newest = file_end(path, max);
    let mut bytes = if (newest.len() as u64) < max {
        file_end(&previous_path(path), max - newest.len() as u64)
    } else {
        Vec::new()
    };
    bytes.extend_from_slice(&newest);
    let text = String::from_utf8_lossy(&bytes);
    let all: Vec<&str> = text.lines().collect();
    let mut out = String::new();
    for (i, line) in all[all.len().saturating_sub(lines)..].iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        escape_controls_into(line.trim_end_matches('\r'), &mut out);
    }
    out
}

/// Appends `text` to `out` with every control character except tab written as an escape.
fn escape_controls_into(text: &str, out: &mut String) {
    for c in text.chars() {
        if c.is_control() && c != '\t' {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn size(path: &Path) -> u64 {
        std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
    }

    #[test]
    fn a_flood_keeps_the_pair_within_its_bound_and_the_newest_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let bound = 64 << 10;
        let mut log = ConsoleLog::create(&path, bound).unwrap();
        let mut last = 0;
        // Byte by byte (the serial) and in big chunks (the QEMU copy), far past the bound.
        for i in 0..20_000u32 {
            log.write_all(format!("line {i}\n").as_bytes()).unwrap();
            last = i;
            assert!(size(&path) + size(&previous_path(&path)) <= bound);
        }
        let chunk = vec![b'x'; 300 << 10];
        log.write_all(&chunk).unwrap();
        log.write_all(b"\nthe end\n").unwrap();
        assert!(size(&path) + size(&previous_path(&path)) <= bound);
        assert_eq!(tail(&path, 4096, 1), "the end");
        assert!(last > 0);
    }

    #[test]
    fn the_tail_reads_across_the_pair_and_escapes_controls() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        let mut log = ConsoleLog::create(&path, MIN_CONSOLE_LOG_BYTES).unwrap();
        let half = MIN_CONSOLE_LOG_BYTES as usize / 2;
        log.write_all(&vec![b'a'; half - 6]).unwrap();
        log.write_all(b"\nfirst\nsecond \x1b[2J\r\n").unwrap();
        assert!(size(&previous_path(&path)) > 0, "rotated");
        assert_eq!(tail(&path, 4096, 2), "first\nsecond \\u{1b}[2J");
        // Bounded in bytes: a line longer than the bound is cut to its end.
        let t = tail(&path, 10, 5);
        assert!(t.len() <= 20, "{t:?}");
        assert_eq!(tail(&dir.path().join("none"), 4096, 5), "");
    }

    #[test]
    fn rotation_works_on_descriptors_only() {
        // Opened, then their names removed: a rotation that renamed or reopened by path would
        // fail or lose the bound; this one keeps both files and the newest bytes.
        let dir = tempfile::tempdir().unwrap();
        let open = |name: &str| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(dir.path().join(name))
                .unwrap()
        };
        let (current, previous) = (open("c"), open("p"));
        let (mut c, mut p) = (current.try_clone().unwrap(), previous.try_clone().unwrap());
        std::fs::remove_file(dir.path().join("c")).unwrap();
        std::fs::remove_file(dir.path().join("p")).unwrap();
        let bound = MIN_CONSOLE_LOG_BYTES;
        let mut log =
            ConsoleLog::from_files(Path::new("console"), current, previous, bound).unwrap();
        let mut all = String::new();
        for i in 0..2000u32 {
            let line = format!("line {i}\n");
            log.write_all(line.as_bytes()).unwrap();
            all.push_str(&line);
        }
        let read = |f: &mut File| {
            let mut s = String::new();
            f.seek(SeekFrom::Start(0)).unwrap();
            f.read_to_string(&mut s).unwrap();
            s
        };
        let (newer, older) = (read(&mut c), read(&mut p));
        assert!((newer.len() + older.len()) as u64 <= bound);
        assert!(older.len() as u64 == bound / 2, "rotated: {}", older.len());
        // The pair, older then newer, is the end of what was written, in order.
        assert!(all.ends_with(&format!("{older}{newer}")));
    }

    #[test]
    fn create_starts_empty_and_refuses_a_symlink() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("console.log");
        std::fs::write(&path, "old").unwrap();
        std::fs::write(previous_path(&path), "older").unwrap();
        let log = ConsoleLog::create(&path, 1 << 20).unwrap();
        assert_eq!(size(&path), 0);
        assert_eq!(size(&previous_path(&path)), 0);
        drop(log);
        let target = dir.path().join("target");
        std::fs::write(&target, "keep").unwrap();
        let link = dir.path().join("link.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(ConsoleLog::create(&link, 1 << 20).is_err());
        assert_eq!(std::fs::read_to_string(&target).unwrap(), "keep");
    }
}
