//! `containerd-shim-microvm-v1`: the containerd shim v2 that runs each pod in its own VM.
//! containerd finds it on its PATH for `runtime_type = "io.containerd.microvm.v1"`.

use shim::task::service::{MicrovmShim, RUNTIME_ID};

#[tokio::main]
async fn main() {
    containerd_shim::asynchronous::run::<MicrovmShim>(RUNTIME_ID, None).await;
}
