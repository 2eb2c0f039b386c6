//! The initrd's newc cpio archive as page sharing reads it (`vmm::page_sharing::parse_newc`,
//! `initrd_template`): the files and their data ranges, and the page-aligned template built
//! from them. Checked: every file's range lies inside the archive, and the template holds each
//! file's bytes from a page boundary, zero-padded.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vmm::page_sharing::{initrd_template, parse_newc};

const PAGE: usize = 4096;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::initrd_cpio);
    },
    |data: &[u8]| {
        let Ok(files) = parse_newc(data) else {
            return;
        };
        for f in &files {
            assert!(f.data.start < f.data.end && f.data.end <= data.len());
        }
        let template = initrd_template(data).expect("the archive parsed once already");
        let mut at = 0usize;
        for f in &files {
            let bytes = &data[f.data.clone()];
            assert_eq!(&template[at..at + bytes.len()], bytes, "{} in the template", f.name);
            let padded = bytes.len().div_ceil(PAGE) * PAGE;
            assert!(template[at + bytes.len()..at + padded].iter().all(|b| *b == 0));
            at += padded;
        }
        assert_eq!(at, template.len());
    }
);
