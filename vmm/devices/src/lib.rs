//! Device models for the microvm VMM.
//!
//! This crate knows nothing about KVM or about the VM that hosts the devices: a device sees
//! register accesses through [`bus::BusDevice`], guest memory through `vm-memory`, and raises
//! interrupts by writing an `EventFd` that the VMM wires to an irqfd. That keeps every model
//! testable (and fuzzable) on its own, with guest memory made up by the test.
//!
//! Everything a guest writes is hostile: descriptor chains, register values and packet headers
//! are checked, and a bad one is an error for that request, never a panic in the host.

pub mod bus;
pub mod i8042;
pub mod log_limit;
pub mod pci;
pub mod serial;
pub mod virtio;

/// The guest memory type every device model works on.
pub type GuestMemory = vm_memory::GuestMemoryMmap<()>;
