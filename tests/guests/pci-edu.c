/* pci-edu: drives a passed-through QEMU edu device (1234:11e8) on the VMM's PCI root.
 *
 * Configuration mechanism #1 (0xCF8/0xCFC): finds the host bridge at 00:00.0 and the edu device
 * on bus 0, sizes its BAR 0 (1 MiB), enables memory decoding, and then talks to the real device
 * through the BAR: the identification register (0x00) reads 0x010000ed and the liveness register
 * (0x04) returns the complement of what was written. Then it moves BAR 0 by 1 MiB and checks the
 * device answers at the new address and no longer at the old one (the VMM moves its memory slot).
 * Device accesses through BAR 0 go to the device itself: the value read back is computed by it.
 */
#include "common.h"

static inline void outl(u16 port, u32 v) { __asm__ volatile("outl %0, %1" : : "a"(v), "Nd"(port)); }
static inline u32 inl(u16 port) { u32 v; __asm__ volatile("inl %1, %0" : "=a"(v) : "Nd"(port)); return v; }

static u32 cfg_addr(u32 slot, u32 reg) { return 0x80000000u | (slot << 11) | (reg & 0xfc); }
static u32 cfg_read(u32 slot, u32 reg) { outl(0xcf8, cfg_addr(slot, reg)); return inl(0xcfc); }
static void cfg_write(u32 slot, u32 reg, u32 v) { outl(0xcf8, cfg_addr(slot, reg)); outl(0xcfc, v); }

static void check_liveness(u64 bar, u32 value) {
    mmio_write32(bar + 4, value);
    u32 back = mmio_read32(bar + 4);
    if (back != ~value) {
        serial_puts("liveness: wrote ");
        serial_put_hex(value);
        serial_puts(", read ");
        serial_put_hex(back);
        serial_puts("\n");
        result_fail("the edu liveness register did not return the complement");
    }
}

void guest_main(void) {
    if ((cfg_read(0, 0x08) >> 16) != 0x0600)
        result_fail("00:00.0 is not a host bridge");
    u32 slot = 32;
    for (u32 s = 1; s < 32; s++) {
        if (cfg_read(s, 0) == 0x11e81234) { slot = s; break; }
    }
    if (slot == 32)
        result_fail("no edu device (1234:11e8) on bus 0");
    serial_puts("edu at 00:");
    serial_put_hex(slot);
    serial_puts(".0\n");

    u32 bar = cfg_read(slot, 0x10);
    cfg_write(slot, 0x10, 0xffffffffu);
    u32 sized = cfg_read(slot, 0x10);
    cfg_write(slot, 0x10, bar);
    u32 size = ~(sized & ~0xfu) + 1;
    serial_puts("BAR 0 at ");
    serial_put_hex(bar & ~0xfu);
    serial_puts(", size ");
    serial_put_hex(size);
    serial_puts("\n");
    if (bar & 1) result_fail("BAR 0 is an I/O BAR");
    if (size != 0x100000) result_fail("BAR 0 does not size as 1 MiB");
    u64 base = bar & ~0xfu;
    if (base < 0xc0000000ull) result_fail("BAR 0 is not in the MMIO gap");

    u32 cmd = cfg_read(slot, 0x04);
    cfg_write(slot, 0x04, (cmd & 0xffff) | 0x2);  /* memory decode on */
    u32 id = mmio_read32(base);
    serial_puts("edu id register: ");
    serial_put_hex(id);
    serial_puts("\n");
    if (id != 0x010000ed) result_fail("the edu identification register is not 0x010000ed");
    check_liveness(base, 0x12345678);
    check_liveness(base, 0xa5a55a5a);

    /* Move BAR 0 up by its size (the guest may place BARs anywhere in the window). */
    u64 moved = base + size;
    cfg_write(slot, 0x10, (u32)moved);
    if ((cfg_read(slot, 0x10) & ~0xfu) != (u32)moved) result_fail("BAR 0 did not move");
    if (mmio_read32(moved) != 0x010000ed) result_fail("no edu at the moved BAR 0");
    check_liveness(moved, 0x0badf00d);
    if (mmio_read32(base) == 0x010000ed) result_fail("the old BAR 0 address still decodes");

    /* Decode off: the BAR no longer answers. */
    cfg_write(slot, 0x04, cmd & 0xffff & ~0x2u);
    if (mmio_read32(moved) == 0x010000ed) result_fail("BAR 0 decodes with memory decoding off");
    result_pass("edu id 0x010000ed, liveness through BAR 0, BAR moved and decode off");
}
