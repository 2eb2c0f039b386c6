//! Generates the protobuf messages and the ttrpc service from `agent.proto` into `OUT_DIR`, with
//! ttrpc-codegen's pure-Rust parser (no `protoc` needed).
//!
//! With the `async` feature (only the shim enables it) a second pass generates the async ttrpc
//! client as `agent_ttrpc_async`, next to the synchronous `agent_ttrpc` that the agent (a static
//! binary without tokio) and its tests use: cargo unifies features across a workspace build, so
//! the feature adds a module instead of changing the existing one.

use std::path::Path;

use ttrpc_codegen::{Codegen, Customize, ProtobufCustomize};

fn generate(out_dir: &Path, here: &str, customize: Customize) {
    let proto = Path::new(here).join("agent.proto");
    Codegen::new()
        .out_dir(out_dir)
        .input(&proto)
        .include(here)
        .rust_protobuf()
        .rust_protobuf_customize(ProtobufCustomize::default().gen_mod_rs(true))
        .customize(customize)
        .run()
        .expect("generating code from agent.proto");
}

fn main() {
    println!("cargo:rerun-if-changed=agent.proto");
    println!("cargo:rerun-if-changed=build.rs");
    let out_dir = std::env::var("OUT_DIR").expect("cargo sets OUT_DIR for build scripts");
    let here = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let out = Path::new(&out_dir);
    generate(
        out,
        &here,
        Customize {
            gen_mod: true,
            ..Default::default()
        },
    );
    if std::env::var_os("CARGO_FEATURE_ASYNC").is_some() {
        let async_dir = out.join("async");
        std::fs::create_dir_all(&async_dir).expect("creating OUT_DIR/async");
        generate(
            &async_dir,
            &here,
            Customize {
                async_client: true,
                ..Default::default()
            },
        );
        std::fs::copy(
            async_dir.join("agent_ttrpc.rs"),
            out.join("agent_ttrpc_async.rs"),
        )
        .expect("copying the async client");
        let mod_rs = out.join("mod.rs");
        let mut text = std::fs::read_to_string(&mod_rs).expect("reading the generated mod.rs");
        text.push_str("\npub mod agent_ttrpc_async;\n");
        std::fs::write(&mod_rs, text).expect("writing mod.rs");
    }
}
