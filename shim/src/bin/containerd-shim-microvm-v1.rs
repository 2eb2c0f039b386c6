//! `containerd-shim-microvm-v1`: the containerd shim v2 that runs each pod in its own VM.
//! containerd finds it on its PATH for `runtime_type = "io.containerd.microvm.v1"`.
//!
//! `containerd-shim-microvm-v1 __vmm <fd>` (hidden) is a pod's VMM in a process of its own,
//! started by the shim (`vmm::jail::split`): it must jail itself before any other thread
//! exists, so it is dispatched before the async runtime starts.
//!
//! `containerd-shim-microvm-v1 __pod-init <work dir>` (hidden) is PID 1 of the PID namespace a
//! pod's QEMU and its helpers run in, started by the shim (`shim::vm::qemu::init`).

fn main() {
    let mut args = std::env::args().skip(1);
    let first = args.next();
    if first.as_deref() == Some(vmm::jail::split::SUBCOMMAND) {
        std::process::exit(shim::vm::process::vmm_main(args.next().unwrap_or_default()));
    }
    if first.as_deref() == Some(shim::vm::qemu::init::SUBCOMMAND) {
        std::process::exit(shim::vm::qemu::init::pod_init_main());
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("containerd-shim-microvm-v1: starting the async runtime: {e}");
            std::process::exit(1);
        }
    };
    // The bootstrap takes its signals before anything else runs (task::serve).
    runtime.block_on(shim::task::serve::run());
}
