//! `containerd-shim-microvm-v1`: the containerd shim v2 that runs each pod in its own VM.
//! containerd finds it on its PATH for `runtime_type = "io.containerd.microvm.v1"`.

#[tokio::main]
async fn main() {
    // The bootstrap takes its signals before anything else runs (task::serve).
    shim::task::serve::run().await;
}
