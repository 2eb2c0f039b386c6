//! Public page templates and the sharing pass (docs/page-sharing.md).
//!
//! Some guest pages hold the same bytes in every pod by construction: the kernel's text as the
//! guest patched it at boot, the files of the initrd once the guest unpacked them into its page
//! cache, and pages the guest zeroed. Each VM holds a private copy of them on the host. The
//! sharing pass replaces such copies:
//! - an all-zero private page is dropped (`MADV_DONTNEED`; in a range mapped from a boot file,
//!   anonymous zero memory is mapped over it instead, since dropping would show the file again);
//! - a private page equal, byte for byte, to a page of a *template file* gets that file page
//!   mapped over it (`MAP_PRIVATE | MAP_FIXED`, read-write): the host's page cache then holds
//!   one copy for every VM, and a guest write copies it again (copy-on-write).
//!
//! Only public content becomes a template, never what another tenant's guest holds: the
//! initrd's regular files (each laid out from a page boundary, as a page cache holds it),
//! computed from the file, and the kernel text captured from a VM that has seen no pod input
//! (started with [`PageSharingConfig::capture_kernel_text`]; a pod's VM never captures).
//! Learning that a page was shared tells a guest nothing about another pod. Still, a shared
//! physical page lets guests time each other's use of it (Flush+Reload), so templates are kept
//! per trust domain ([`PageSharingConfig::domain`]): VMs of different domains map different
//! files, hence share no page.
//!
//! Correctness never depends on a template: a page is replaced only when it is equal to the
//! template page, while every vCPU and the device thread are paused, so a wrong or hostile
//! template means no sharing, never different guest memory.
//!
//! Template files live in directories only root can enter (0700, owned by the VMM's user),
//! reached from a checked directory descriptor without following links, created 0444 through a
//! temporary file and a link, never changed in place (a private mapping of a file still sees
//! later writes to the pages it has not copied), and checked each time they are opened: a
//! regular file of ours, writable by nobody else, of the size expected ([`TemplateDir::get`]).
//!
//! The folder, from the bottom up (each file imports only files above it in this list, and
//! none imports this one):
//! - `error.rs`: [`PageSharingError`], the errors of every part;
//! - `page.rs`: the page size, a page's hash and whether it is all zero;
//! - `cpio.rs`: the initrd read as a newc cpio archive, and the initrd template of its files;
//! - `store.rs`: the template store, a checked directory of checked template files
//!   ([`TemplateDir`]);
//! - `names.rs`: template names, and file sums remembered in the store;
//! - `view.rs`: a template file mapped read-only ([`TemplateView`]);
//! - `index.rs`: the templates' pages by hash ([`TemplateIndex`]);
//! - `report.rs`: what a pass did ([`SharingReport`]);
//! - `proc_self.rs`: what the pass reads of /proc/self (its mappings, its page map);
//! - `pass.rs`: the pass with the VM paused: drop zero pages, map template pages;
//! - this file: the configuration and the trust domains, and the lifecycle of a VM's sharing
//!   (`VmSharing`: the directories opened, the templates prepared while the VM runs, the
//!   kernel text captured and the pass run while it is paused).

use std::fs::File;
use std::ops::Range;
use std::path::PathBuf;
use std::time::Instant;

use vm_memory::{GuestAddress, GuestMemory as _};

use crate::memory::GuestMemory;

mod cpio;
mod error;
mod index;
mod names;
mod page;
mod pass;
mod proc_self;
mod report;
mod store;
mod view;

pub use cpio::{
    initrd_template, initrd_template_len, parse_newc, write_initrd_template, CpioError, CpioFile,
};
pub use error::PageSharingError;
pub use index::TemplateIndex;
pub use names::{cached_file_sha256, file_sha256, initrd_template_name, kernel_template_name};
pub use page::{is_zero, page_hash, PAGE};
pub use report::SharingReport;
pub use store::TemplateDir;
pub use view::TemplateView;

use error::io;
use names::digest;
use pass::share_paused;

/// Where template files go unless configured otherwise (beside the shim's pod state root
/// /run/microvm, whose directories are pods').
pub const DEFAULT_TEMPLATE_DIR: &str = "/run/microvm-page-templates";

/// The trust domain of `page_sharing = "node"`: every VM of the node maps the same templates.
pub const NODE_DOMAIN: &str = "node";
/// The subdirectory of the template root holding kernel text captured from VMs that saw no pod
/// input, and the remembered file sums. No VM maps a file of it: each domain maps its own copy.
pub const CAPTURED_DIR: &str = "captured";

/// Page sharing of a VM (on when [`crate::VmConfig::page_sharing`] is set).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageSharingConfig {
    /// The root of the template directories (created 0700 if missing; refused unless owned by
    /// this process's user with no access for anybody else).
    pub template_dir: PathBuf,
    /// The VM's trust domain: the subdirectory of `template_dir` whose template files it maps.
    /// VMs of different domains never map the same file, so they share no template page.
    /// [`NODE_DOMAIN`], or [`namespace_domain`] of a Kubernetes namespace.
    pub domain: String,
    /// Whether this VM has seen no pod input (a throwaway boot, a test guest), so that a pass may
    /// capture its kernel text as the template every domain copies. A pod's VM never captures:
    /// a missing kernel text template means no kernel text sharing for it.
    pub capture_kernel_text: bool,
}

impl Default for PageSharingConfig {
    fn default() -> Self {
        Self {
            template_dir: PathBuf::from(DEFAULT_TEMPLATE_DIR),
            domain: NODE_DOMAIN.to_string(),
            capture_kernel_text: false,
        }
    }
}

/// The domain (template subdirectory) of the pods of Kubernetes namespace `namespace`: a hash
/// of the name, since the name is pod input (it never becomes a path itself).
pub fn namespace_domain(namespace: &str) -> String {
    let key = digest(&[b"microvm-page-sharing-namespace-v1", namespace.as_bytes()]);
    format!("ns-{}", &key[..32])
}

/// Whether `domain` can name a template subdirectory: one path component of ASCII letters,
/// digits, `-` and `_`, not the captures' directory.
pub fn valid_domain(domain: &str) -> bool {
    !domain.is_empty()
        && domain.len() <= 64
        && domain
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        && domain != CAPTURED_DIR
}

/// What a VM keeps to run sharing passes (made at start when sharing is on).
pub(crate) struct VmSharing {
    pub(crate) config: PageSharingConfig,
    /// The kernel and initrd files the VM booted from (their inodes: a file renamed over them
    /// later does not change what this VM holds).
    pub(crate) kernel: File,
    pub(crate) initrd: Option<File>,
    /// The guest-physical range of the kernel's first loadable segment (its text), whole pages.
    pub(crate) text: Option<Range<u64>>,
    pub(crate) cmdline: String,
    pub(crate) vcpus: u8,
    /// The CPUID entries vCPU 0 got, as bytes.
    pub(crate) cpuid: Vec<u8>,
    /// The templates, once the first pass found or made them.
    pub(crate) index: Option<TemplateIndex>,
}

/// The directories a VM's pass works in.
pub(crate) struct Dirs {
    /// The VM's domain: the templates it maps.
    domain: TemplateDir,
    /// The captured kernel text templates and the remembered sums (never mapped into a guest).
    captured: TemplateDir,
}

/// Where the kernel text template of a VM stands.
pub(crate) enum KernelText {
    /// The kernel has no text range to share.
    None,
    /// The domain's template (found there, or copied there from the captured one).
    Found { name: String, file: File },
    /// No template captured yet.
    Missing { name: String },
}

impl VmSharing {
    /// Opens (and checks) the template root, the captures' directory and the VM's domain.
    pub(crate) fn dirs(&self) -> Result<Dirs, PageSharingError> {
        if !valid_domain(&self.config.domain) {
            return Err(PageSharingError::Domain {
                domain: self.config.domain.clone(),
            });
        }
        let root = TemplateDir::open(&self.config.template_dir)?;
        Ok(Dirs {
            captured: root.subdir(CAPTURED_DIR)?,
            domain: root.subdir(&self.config.domain)?,
        })
    }

    /// The name of this VM's kernel text template and its size, if the kernel has a text range.
    fn kernel_text_key(&mut self, dirs: &Dirs) -> Result<Option<(String, u64)>, PageSharingError> {
        let Some(text) = self.text.clone() else {
            return Ok(None);
        };
        let sum = cached_file_sha256(&dirs.captured, &mut self.kernel)?;
        let name = kernel_template_name(&sum, &self.cmdline, self.vcpus, &self.cpuid);
        Ok(Some((name, text.end - text.start)))
    }

    /// The domain's kernel text template: found there, or copied there from the captured one
    /// (a copy of its own, so that domains map different files), or missing.
    pub(crate) fn kernel_text(&mut self, dirs: &Dirs) -> Result<KernelText, PageSharingError> {
        let Some((name, len)) = self.kernel_text_key(dirs)? else {
            return Ok(KernelText::None);
        };
        if let Some(file) = dirs.domain.get(&name, Some(len))? {
            return Ok(KernelText::Found { name, file });
        }
        let Some(mut captured) = dirs.captured.get(&name, Some(len))? else {
            return Ok(KernelText::Missing { name });
        };
        let file = dirs.domain.put_with(&name, Some(len), |f| {
            std::io::copy(&mut captured, f).map(drop)
        })?;
        Ok(KernelText::Found { name, file })
    }

    /// The initrd template of the domain (made from the initrd file if missing), if the initrd
    /// gives one.
    fn initrd_template(&mut self, dirs: &Dirs) -> Result<Option<TemplateView>, PageSharingError> {
        let Some(initrd) = self.initrd.as_mut() else {
            return Ok(None);
        };
        let sum = cached_file_sha256(&dirs.captured, initrd)?;
        let name = initrd_template_name(&sum);
        let clone = initrd.try_clone().map_err(io("dup the initrd"))?;
        let map = TemplateView::map("initrd", clone, false)?;
        let files = match parse_newc(map.bytes()) {
            Ok(files) if !files.is_empty() => files,
            Ok(_) => return Ok(None),
            Err(e) => {
                log::info!("page sharing: the initrd gives no template: {e}");
                return Ok(None);
            }
        };
        // The size the template must have: a file of another size is refused, never mapped.
        let len = initrd_template_len(&files);
        let file = match dirs.domain.get(&name, Some(len))? {
            Some(f) => f,
            None => dirs.domain.put_with(&name, Some(len), |f| {
                write_initrd_template(map.bytes(), &files, f)
            })?,
        };
        Ok(Some(TemplateView::new(&name, file)?))
    }

    /// Everything the pass prepares while the VM runs: the directories, the initrd template
    /// (made if missing) and the kernel text template if it exists. Returns the kernel
    /// template's name when this VM is to capture it, and whether it is missing.
    pub(crate) fn prepare(&mut self) -> Result<(Option<String>, bool), PageSharingError> {
        if self.index.is_some() {
            return Ok((None, false));
        }
        let dirs = self.dirs()?;
        let mut index = TemplateIndex::default();
        if let Some(view) = self.initrd_template(&dirs)? {
            index.add(view);
        }
        let mut capture = None;
        let mut missing = false;
        match self.kernel_text(&dirs)? {
            KernelText::None => {}
            KernelText::Found { name, file } => index.add(TemplateView::new(&name, file)?),
            KernelText::Missing { name } => {
                if self.config.capture_kernel_text {
                    capture = Some(name);
                } else {
                    missing = true;
                }
            }
        }
        self.index = Some(index);
        Ok((capture, missing))
    }

    /// Whether the kernel text template of this VM is still to be captured (from a VM that has
    /// seen no pod input): neither the domain nor the captures hold it.
    pub(crate) fn kernel_text_missing(&mut self) -> Result<bool, PageSharingError> {
        let dirs = self.dirs()?;
        let Some((name, len)) = self.kernel_text_key(&dirs)? else {
            return Ok(false);
        };
        Ok(dirs.domain.get(&name, Some(len))?.is_none()
            && dirs.captured.get(&name, Some(len))?.is_none())
    }

    /// The name of the kernel text template to capture from this VM, if it is one that may
    /// capture and none was captured yet.
    pub(crate) fn capture_name(&mut self) -> Result<Option<String>, PageSharingError> {
        if !self.config.capture_kernel_text {
            return Err(PageSharingError::NoCapture);
        }
        let dirs = self.dirs()?;
        let Some((name, len)) = self.kernel_text_key(&dirs)? else {
            return Ok(None);
        };
        Ok(dirs
            .captured
            .get(&name, Some(len))?
            .is_none()
            .then_some(name))
    }

    /// With the VM paused: captures the kernel text into the captures' directory as template
    /// `name` (when it had none) and, if the VM has an index, adds the domain's copy to it.
    pub(crate) fn capture_kernel_text(
        &mut self,
        mem: &GuestMemory,
        name: &str,
    ) -> Result<bool, PageSharingError> {
        if !self.config.capture_kernel_text {
            return Err(PageSharingError::NoCapture);
        }
        let Some(range) = self.text.clone() else {
            return Ok(false);
        };
        let Ok(len) = usize::try_from(range.end - range.start) else {
            return Ok(false);
        };
        if !mem.check_range(GuestAddress(range.start), len) {
            return Ok(false);
        }
        let dirs = self.dirs()?;
        // Straight from guest memory into the file.
        dirs.captured.put_with(name, Some(len as u64), |f| {
            vm_memory::Bytes::write_all_volatile_to(mem, GuestAddress(range.start), f, len)
                .map_err(|e| std::io::Error::other(e.to_string()))
        })?;
        if self.index.is_some() {
            if let KernelText::Found { name, file } = self.kernel_text(&dirs)? {
                let view = TemplateView::new(&name, file)?;
                if let Some(index) = self.index.as_mut() {
                    index.add(view);
                }
            }
        }
        Ok(true)
    }
}

/// The guest-physical pages of a kernel's first loadable segment (its text and read-only
/// data), from the ELF headers of `kernel`: every page holding some of its file bytes.
pub(crate) fn kernel_text_range(kernel: &mut File) -> Option<Range<u64>> {
    let k = crate::boot_files::read_elf(kernel).ok()?;
    let s = k.segments.first()?;
    // Whole guest pages holding the segment's file bytes (it is guest memory that is captured:
    // a partial page's rest is whatever the guest keeps there, and shares only if equal).
    let start = s.paddr & !(PAGE as u64 - 1);
    let end = s
        .paddr
        .checked_add(s.filesz)?
        .checked_add(PAGE as u64 - 1)?
        & !(PAGE as u64 - 1);
    (start < end).then_some(start..end)
}

impl VmSharing {
    /// The part of the pass that runs with the VM paused: the kernel text capture (when
    /// `capture` names a missing template) and the sharing itself.
    pub(crate) fn paused_pass(
        &mut self,
        mem: &GuestMemory,
        capture: Option<&str>,
        missing: bool,
    ) -> Result<SharingReport, PageSharingError> {
        let paused_at = Instant::now();
        let mut report = SharingReport {
            kernel_text_missing: missing,
            ..SharingReport::default()
        };
        if let Some(name) = capture {
            report.captured_kernel_text = self.capture_kernel_text(mem, name)?;
        }
        if let Some(index) = self.index.as_ref() {
            share_paused(mem, index, &mut report)?;
        }
        report.paused_for = paused_at.elapsed();
        Ok(report)
    }
}

#[cfg(test)]
mod test_fixtures;
#[cfg(test)]
mod tests;
