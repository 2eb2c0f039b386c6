//! A template file mapped read-only into this process ([`TemplateView`]), to compare guest
//! pages with and to map from: the pass maps its pages over guest memory from the file it
//! holds. Template files are never written in place (the store creates each whole, under a
//! temporary name, and links it into place), so the mapped bytes never change under a
//! reference to them.

use std::fs::File;
use std::os::fd::AsRawFd;

use super::error::{io, PageSharingError};
use super::page::PAGE;

/// A template file mapped read-only into this process, to compare guest pages with.
pub struct TemplateView {
    name: String,
    file: File,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the view is a read-only mapping of a file nobody changes (templates are never
// written in place), owned by the view; reading it from any thread is sound.
unsafe impl Send for TemplateView {}

impl TemplateView {
    /// Maps `file` (whole pages only: a partial last page is left out).
    pub fn new(name: &str, file: File) -> Result<Self, PageSharingError> {
        Self::map(name, file, true)
    }

    /// Maps `file` whole, to read it ([`TemplateView::bytes`]).
    pub(super) fn map(name: &str, file: File, whole_pages: bool) -> Result<Self, PageSharingError> {
        let size = file.metadata().map_err(io(format!("stat {name}")))?.len();
        let mut len = usize::try_from(size)
            .map_err(|_| io(name.to_string())(std::io::ErrorKind::InvalidData.into()))?;
        if whole_pages {
            len &= !(PAGE - 1);
        }
        let ptr = if len == 0 {
            std::ptr::null()
        } else {
            // SAFETY: a new shared read-only mapping of `len` bytes of an open file, at an
            // address the kernel picks; nothing else is affected.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io(format!("map template {name}"))(
                    std::io::Error::last_os_error(),
                ));
            }
            p as *const u8
        };
        Ok(Self {
            name: name.to_string(),
            file,
            ptr,
            len,
        })
    }

    /// The number of whole pages.
    pub fn pages(&self) -> usize {
        self.len / PAGE
    }

    /// Page `i`'s bytes.
    pub fn page(&self, i: usize) -> &[u8] {
        assert!(i < self.pages());
        // SAFETY: `i < pages()`, so the page lies inside the mapping, which lives as long as
        // `self`; the file is never written (see the module doc), so the bytes do not change
        // under the shared reference.
        unsafe { std::slice::from_raw_parts(self.ptr.add(i * PAGE), PAGE) }
    }

    /// All the mapped bytes.
    pub(super) fn bytes(&self) -> &[u8] {
        if self.ptr.is_null() {
            return &[];
        }
        // SAFETY: the whole mapping, which lives as long as `self`; the file is not written
        // while mapped (templates never; the initrd is replaced by renaming, docs/density.md).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The template's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The template file (to map its pages from).
    pub(super) fn file(&self) -> &File {
        &self.file
    }
}

impl Drop for TemplateView {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: the mapping made in `new`, unmapped once.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
        }
    }
}
