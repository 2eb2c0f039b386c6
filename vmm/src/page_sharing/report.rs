//! What a sharing pass did ([`SharingReport`]): pages scanned, dropped, shared per template,
//! missed and left, the kernel text capture, and how long the VM was paused. The shim logs its
//! one-line form.

use std::time::Duration;

/// What a sharing pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SharingReport {
    /// Private resident guest pages looked at.
    pub scanned: u64,
    /// All-zero pages given back.
    pub zero_dropped: u64,
    /// Pages replaced by a template page, per template (in the order of `templates`).
    pub shared: Vec<u64>,
    /// The templates used, by name.
    pub templates: Vec<String>,
    /// Non-zero pages no template had.
    pub misses: u64,
    /// Pages a template page matched but that were left alone (mapping limit reached).
    pub skipped: u64,
    /// Whether this pass captured the kernel text template.
    pub captured_kernel_text: bool,
    /// Whether the kernel text template was missing (none captured yet, and this VM may not
    /// capture one): the pass shared no kernel text.
    pub kernel_text_missing: bool,
    /// How long the VM was paused.
    pub paused_for: Duration,
    /// How long the whole pass took (with the template preparation).
    pub took: Duration,
}

impl SharingReport {
    /// Pages shared in all.
    pub fn shared_total(&self) -> u64 {
        self.shared.iter().sum()
    }
}

impl std::fmt::Display for SharingReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} private pages scanned: {} zero pages dropped, {} shared (",
            self.scanned,
            self.zero_dropped,
            self.shared_total()
        )?;
        for (i, (n, t)) in self.shared.iter().zip(&self.templates).enumerate() {
            let kind = t.split('-').take(2).collect::<Vec<_>>().join("-");
            write!(f, "{}{kind} {n}", if i > 0 { ", " } else { "" })?;
        }
        write!(
            f,
            "), {} without a template, {} left (mapping limit); paused {:?}, took {:?}{}",
            self.misses,
            self.skipped,
            self.paused_for,
            self.took,
            if self.captured_kernel_text {
                "; captured the kernel text template"
            } else if self.kernel_text_missing {
                "; no kernel text template (none captured yet)"
            } else {
                ""
            }
        )
    }
}
