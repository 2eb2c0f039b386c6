//! `containerd-shim-microvm-v1`: the containerd shim v2 that runs each pod in its own VM.
//! containerd finds it on its PATH for `runtime_type = "io.containerd.microvm.v1"`.

use shim::task::shim::{shim_config, MicrovmShim, RUNTIME_ID};

#[tokio::main]
async fn main() {
    // The config must be given here: the crate sets up its signal handling (and its SIGCHLD
    // reaper) before the shim's `new` runs.
    containerd_shim::asynchronous::run::<MicrovmShim>(RUNTIME_ID, Some(shim_config())).await;
}
