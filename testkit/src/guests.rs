//! The C test guests (`make -C tests/guests` builds them into build/guests).

use std::path::PathBuf;

/// The path of built test guest `name` (build/guests/<name>.elf); panics with the command that
/// builds it when missing.
pub fn guest(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../build/guests")
        .join(format!("{name}.elf"));
    assert!(
        p.is_file(),
        "test guest {} is missing: build the guests first with `make -C tests/guests`",
        p.display()
    );
    p
}
