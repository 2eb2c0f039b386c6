//! Puts the device models on the VM: buses, interrupt lines, event-loop subscriptions and the
//! kernel command line arguments that declare them.

use std::io::Write;
use std::sync::{Arc, Mutex};

use event_manager::{MutEventSubscriber, SubscriberOps};
use vmm_devices::bus::{Bus, SharedDevice};
use vmm_devices::i8042::{I8042, I8042_PORT_BASE, I8042_PORT_LEN};
use vmm_devices::pci::{
    BarSpace, PciBarWindow, PciConfigIo, PciRoot, PCI_CONFIG_IO_BASE, PCI_CONFIG_IO_LEN,
};
use vmm_devices::serial::{EventFdTrigger, SerialDevice, SERIAL_PORT_LEN};
use vmm_devices::virtio::mmio::MmioTransport;
use vmm_devices::virtio::VirtioDevice;
use vmm_sys_util::eventfd::EventFd;

use crate::event_loop::{DeviceEventManager, Subscriber};
use crate::kvm_vm::KvmVm;
use crate::layout::{
    PCI_IO_END, PCI_IO_START, PCI_MMIO_END, PCI_MMIO_START, SERIAL_GSI, SERIAL_PORT,
    VIRTIO_MMIO_BASE, VIRTIO_MMIO_FIRST_GSI, VIRTIO_MMIO_MAX_DEVICES, VIRTIO_MMIO_SIZE,
};
use crate::memory::GuestMemory;
use crate::VmmError;

/// The VM's devices while it is being built.
pub struct DeviceManager {
    pub(crate) pio: Bus,
    pub(crate) mmio: Bus,
    pub(crate) events: DeviceEventManager,
    /// Arguments for the kernel command line (`virtio_mmio.device=...`).
    pub(crate) cmdline_args: Vec<String>,
    virtio_devices: u32,
}

fn bus_err(e: vmm_devices::bus::BusError) -> VmmError {
    VmmError::Device(e.to_string())
}

impl DeviceManager {
    pub(crate) fn new() -> Result<Self, VmmError> {
        Ok(Self {
            pio: Bus::new(),
            mmio: Bus::new(),
            events: DeviceEventManager::new()
                .map_err(|e| VmmError::Device(format!("cannot create the event manager: {e:?}")))?,
            cmdline_args: Vec::new(),
            virtio_devices: 0,
        })
    }

    /// COM1 at 0x3f8, interrupts on GSI 4, output to `out`.
    pub(crate) fn add_serial(
        &mut self,
        vm: &KvmVm,
        out: Box<dyn Write + Send>,
    ) -> Result<(), VmmError> {
        let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(VmmError::io("create an eventfd"))?;
        vm.register_irqfd(&evt, SERIAL_GSI)?;
        let dev: SharedDevice =
            Arc::new(Mutex::new(SerialDevice::new(EventFdTrigger::new(evt), out)));
        self.pio
            .insert(dev, SERIAL_PORT, SERIAL_PORT_LEN)
            .map_err(bus_err)
    }

    /// The i8042 at 0x60..=0x64; returns the reset line's eventfd (read by the event loop).
    pub(crate) fn add_i8042(&mut self) -> Result<EventFd, VmmError> {
        let reset = EventFd::new(libc::EFD_NONBLOCK).map_err(VmmError::io("create an eventfd"))?;
        let ours = reset
            .try_clone()
            .map_err(VmmError::io("clone an eventfd"))?;
        let dev: SharedDevice = Arc::new(Mutex::new(I8042::new(reset)));
        self.pio
            .insert(dev, I8042_PORT_BASE, I8042_PORT_LEN)
            .map_err(bus_err)?;
        Ok(ours)
    }

    /// How many virtio-mmio devices hold GSIs (5, 6, ...) so far.
    pub(crate) fn virtio_device_count(&self) -> u32 {
        self.virtio_devices
    }

    /// Adds a subscriber to the device event loop.
    pub fn add_subscriber(&mut self, s: Subscriber) {
        self.events.add_subscriber(s);
    }

    /// Attaches a virtio device on the next virtio-mmio slot: its transport at
    /// 0xd000_0000 + i * 0x1000 on the MMIO bus, its interrupt eventfd as an irqfd on GSI 5 + i,
    /// its event handling on the device event loop, and `virtio_mmio.device=4K@<base>:<gsi>` on
    /// the kernel command line. Returns the slot's base address.
    pub fn attach_virtio_device<D>(
        &mut self,
        vm: &KvmVm,
        mem: &GuestMemory,
        device: Arc<Mutex<D>>,
    ) -> Result<u64, VmmError>
    where
        D: VirtioDevice + MutEventSubscriber + Send + 'static,
    {
        let index = self.virtio_devices;
        if index >= VIRTIO_MMIO_MAX_DEVICES {
            return Err(VmmError::Device(format!(
                "at most {VIRTIO_MMIO_MAX_DEVICES} virtio devices fit the interrupt lines"
            )));
        }
        let base = VIRTIO_MMIO_BASE + u64::from(index) * VIRTIO_MMIO_SIZE;
        let gsi = VIRTIO_MMIO_FIRST_GSI + index;
        let as_virtio: Arc<Mutex<dyn VirtioDevice>> = device.clone();
        let transport = MmioTransport::new(as_virtio, mem.clone())
            .map_err(|e| VmmError::Device(format!("virtio-mmio transport: {e}")))?;
        vm.register_irqfd(transport.interrupt().eventfd(), gsi)?;
        let dev: SharedDevice = Arc::new(Mutex::new(transport));
        self.mmio
            .insert(dev, base, VIRTIO_MMIO_SIZE)
            .map_err(bus_err)?;
        let as_subscriber: Subscriber = device;
        self.events.add_subscriber(as_subscriber);
        self.cmdline_args
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        self.virtio_devices += 1;
        Ok(base)
    }

    /// Puts a PCI root on the buses: config mechanism #1 at 0xCF8..=0xCFF, and the BAR windows
    /// (PCI_MMIO_START..PCI_MMIO_END on the MMIO bus, PCI_IO_START..PCI_IO_END on the port bus).
    pub(crate) fn attach_pci(&mut self, root: PciRoot) -> Result<(), VmmError> {
        let root = Arc::new(root);
        let config: SharedDevice = Arc::new(Mutex::new(PciConfigIo::new(root.clone())));
        self.pio
            .insert(config, PCI_CONFIG_IO_BASE, PCI_CONFIG_IO_LEN)
            .map_err(bus_err)?;
        let mmio: SharedDevice = Arc::new(Mutex::new(PciBarWindow::new(
            root.clone(),
            BarSpace::Memory,
            PCI_MMIO_START,
        )));
        self.mmio
            .insert(mmio, PCI_MMIO_START, PCI_MMIO_END - PCI_MMIO_START)
            .map_err(bus_err)?;
        let io: SharedDevice = Arc::new(Mutex::new(PciBarWindow::new(
            root,
            BarSpace::Io,
            PCI_IO_START,
        )));
        self.pio
            .insert(io, PCI_IO_START, PCI_IO_END - PCI_IO_START)
            .map_err(bus_err)
    }
}
