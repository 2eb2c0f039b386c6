//! Generates kubelet's PodResources v1 API (client for the shim's cold-plug, server for the
//! tests' stand-in kubelet) from `proto/podresources/v1/api.proto` with tonic-prost-build
//! (needs `protoc`, Debian's protobuf-compiler).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/podresources/v1/api.proto");
    println!("cargo:rerun-if-changed=build.rs");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/podresources/v1/api.proto"], &["proto"])
        .map_err(|e| {
            format!("generating the PodResources client from proto/podresources/v1/api.proto: {e}")
        })?;
    Ok(())
}
