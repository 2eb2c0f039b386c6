//! Generates the protobuf messages and the ttrpc service from `agent.proto` into `OUT_DIR`, with
//! ttrpc-codegen's pure-Rust parser (no `protoc` needed).

use ttrpc_codegen::{Codegen, Customize, ProtobufCustomize};

fn main() {
    println!("cargo:rerun-if-changed=agent.proto");
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let here = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let proto = std::path::Path::new(&here).join("agent.proto");
    Codegen::new()
        .out_dir(&out_dir)
        .input(&proto)
        .include(&here)
        .rust_protobuf()
        .rust_protobuf_customize(ProtobufCustomize::default().gen_mod_rs(true))
        .customize(Customize {
            gen_mod: true,
            ..Default::default()
        })
        .run()
        .expect("generating code from agent.proto");
}
