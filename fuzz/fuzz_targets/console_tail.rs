//! The guest console's tail as the shim quotes it in errors (`shim::vm::console_tail`): the
//! console log holds whatever the guest wrote to its serial port. Checked: at most the lines
//! asked for come back.
#![no_main]

use libfuzzer_sys::fuzz_target;
use microvm_fuzz::scratch::{self, Scratch};
use microvm_fuzz::tape::Tape;

fuzz_target!(
    init: {
        microvm_fuzz::seeds::write_if_asked(microvm_fuzz::seeds::console_tail);
        scratch::init();
    },
    |data: &[u8]| {
        let dir = Scratch::new("console");
        let mut t = Tape::new(data);
        let lines = usize::from(t.u8() % 32);
        let path = dir.path().join("console.log");
        std::fs::write(&path, t.rest()).expect("console log");
        let tail = shim::vm::console_tail(&path, lines);
        assert!(tail.lines().count() <= lines.max(1));
    }
);
