//! Where each distinct template page is ([`TemplateIndex`]): the templates a VM maps, and
//! their non-zero pages by hash, to find the template page equal to a guest page.

use std::collections::HashMap;

use super::page::{is_zero, page_hash};
use super::view::TemplateView;

/// Where each distinct template page is: hash -> (template, page).
#[derive(Default)]
pub struct TemplateIndex {
    views: Vec<TemplateView>,
    by_hash: HashMap<u64, (usize, usize)>,
}

impl TemplateIndex {
    /// Adds a template's non-zero pages (the first of equal pages wins).
    pub fn add(&mut self, view: TemplateView) {
        let t = self.views.len();
        for i in 0..view.pages() {
            let p = view.page(i);
            if is_zero(p) {
                continue;
            }
            self.by_hash.entry(page_hash(p)).or_insert((t, i));
        }
        self.views.push(view);
    }

    /// The template page equal to `p`, if any.
    pub fn find(&self, p: &[u8]) -> Option<(usize, usize)> {
        let &(t, i) = self.by_hash.get(&page_hash(p))?;
        (self.views[t].page(i) == p).then_some((t, i))
    }

    /// The templates, in the order added.
    pub fn views(&self) -> &[TemplateView] {
        &self.views
    }
}
