/* pci-edu: drives a passed-through QEMU edu device (1234:11e8) on the VMM's PCI root.
 *
 * Configuration mechanism #1 (0xCF8/0xCFC): finds the host bridge at 00:00.0 and the edu device
 * on bus 0, sizes its BAR 0 (1 MiB), enables memory decoding, and then talks to the real device
 * through the BAR: the identification register (0x00) reads 0x010000ed and the liveness register
 * (0x04) returns the complement of what was written. Then it moves BAR 0 by 1 MiB and checks the
 * device answers at the new address and no longer at the old one (the VMM moves its memory slot).
 * Device accesses through BAR 0 go to the device itself: the value read back is computed by it.
 *
 * INTx: the device's Interrupt Pin reads INTA and its Interrupt Line the IOAPIC pin the VMM
 * routed it to; the MP table has the PCI bus and a level-triggered, active-low entry for
 * slot/INTA on that pin (and no other entry for the pin). A guest write to the line/pin
 * register changes the line byte only. With the IOAPIC entry programmed from the MP table, edu's
 * interrupt raise register (0x60) brings an interrupt; the handler acks it in the device (0x64)
 * and EOIs, and a second raise brings a second interrupt (so the EOI unmasked INTx again). With
 * the command register's Interrupt Disable bit set a raise brings none (the status register
 * shows it pending); clearing the bit delivers it. Every wait is bounded (deadline.h).
 */
#include "common.h"
#include "deadline.h"

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

/* ---------------- INTx ---------------- */

#define IOAPIC_BASE 0xfec00000ull
#define LAPIC_BASE 0xfee00000ull
#define LAPIC_ID 0x20
#define LAPIC_TPR 0x80
#define LAPIC_EOI 0xb0
#define LAPIC_SVR 0xf0
#define LAPIC_IRR 0x200
#define LAPIC_LINT0 0x350
#define INTX_VECTOR 0x40
#define SPURIOUS_VECTOR 0xff
#define EDU_IRQ_STATUS 0x24
#define EDU_IRQ_RAISE 0x60
#define EDU_IRQ_ACK 0x64
#define PCI_COMMAND_INTX_DISABLE 0x400
#define PCI_STATUS_INTERRUPT 0x8
#define WAIT_MS 10000

struct idt_gate {
    u16 off0;
    u16 sel;
    u8 ist;
    u8 type;
    u16 off1;
    u32 off2;
    u32 zero;
} __attribute__((packed));

static struct idt_gate idt[256] __attribute__((aligned(16)));
static volatile u32 intx_count;
static volatile u32 intx_status;
static volatile u64 intx_bar;

extern char intx_stub[], spurious_stub[], unexpected_stub[];

/* Interrupt entry stubs: save the registers C may clobber, call the C handler, iretq. */
__asm__(
    ".text\n"
    ".globl intx_stub\n"
    "intx_stub:\n"
    "  push %rax; push %rcx; push %rdx; push %rsi; push %rdi\n"
    "  push %r8; push %r9; push %r10; push %r11\n"
    "  cld\n"
    "  call intx_handler\n"
    "  pop %r11; pop %r10; pop %r9; pop %r8\n"
    "  pop %rdi; pop %rsi; pop %rdx; pop %rcx; pop %rax\n"
    "  iretq\n"
    ".globl spurious_stub\n"
    "spurious_stub:\n"
    "  iretq\n"
    ".globl unexpected_stub\n"
    "unexpected_stub:\n"
    "  cld\n"
    "  call unexpected_handler\n");

static u32 lapic_read(u32 reg) { return mmio_read32(LAPIC_BASE + reg); }
static void lapic_write(u32 reg, u32 v) { mmio_write32(LAPIC_BASE + reg, v); }
static u32 ioapic_read(u32 reg) { mmio_write32(IOAPIC_BASE, reg); return mmio_read32(IOAPIC_BASE + 0x10); }
static void ioapic_write(u32 reg, u32 v) { mmio_write32(IOAPIC_BASE, reg); mmio_write32(IOAPIC_BASE + 0x10, v); }

__attribute__((used)) void intx_handler(void) {
    u64 bar = intx_bar;
    u32 st = mmio_read32(bar + EDU_IRQ_STATUS);
    mmio_write32(bar + EDU_IRQ_ACK, st); /* the device lowers INTx */
    intx_status |= st;
    intx_count++;
    lapic_write(LAPIC_EOI, 0);
}

__attribute__((used, noreturn)) void unexpected_handler(void) {
    result_fail("an unexpected exception or interrupt vector arrived");
}

static void set_gate(u32 vector, void *handler, u16 cs) {
    u64 a = (u64)(usize)handler;
    idt[vector].off0 = (u16)a;
    idt[vector].sel = cs;
    idt[vector].ist = 0;
    idt[vector].type = 0x8e; /* present, DPL 0, 64-bit interrupt gate */
    idt[vector].off1 = (u16)(a >> 16);
    idt[vector].off2 = (u32)(a >> 32);
    idt[vector].zero = 0;
}

static void install_idt(void) {
    u16 cs;
    __asm__ volatile("mov %%cs, %0" : "=r"(cs));
    for (u32 v = 0; v < 256; v++)
        set_gate(v, unexpected_stub, cs);
    set_gate(INTX_VECTOR, intx_stub, cs);
    set_gate(SPURIOUS_VECTOR, spurious_stub, cs);
    struct {
        u16 limit;
        u64 base;
    } __attribute__((packed)) desc = {sizeof(idt) - 1, (u64)(usize)idt};
    __asm__ volatile("lidt %0" : : "m"(desc));
}

static u8 mp_checksum(const u8 *p, usize n) {
    u8 s = 0;
    for (usize i = 0; i < n; i++)
        s = (u8)(s + p[i]);
    return s;
}

/* The MP configuration table the VMM wrote (floating pointer in the EBDA), or 0. */
static const u8 *mp_table(void) {
    for (u64 a = 0x9fc00; a + 16 <= 0xa0000; a += 16) {
        const u8 *p = (const u8 *)(usize)a;
        if (p[0] == '_' && p[1] == 'M' && p[2] == 'P' && p[3] == '_' && mp_checksum(p, 16) == 0) {
            u32 table = *(const u32 *)(p + 4);
            if (table == 0 || table >= 0x100000)
                return 0;
            const u8 *t = (const u8 *)(usize)table;
            u16 len = *(const u16 *)(t + 4);
            if (!(t[0] == 'P' && t[1] == 'C' && t[2] == 'M' && t[3] == 'P') || len < 44 ||
                mp_checksum(t, len) != 0)
                return 0;
            return t;
        }
    }
    return 0;
}

/* Checks the MP table routes slot/pin to IOAPIC pin `line`, level-triggered and active low, and
 * that no other entry names that pin. Returns the entry's flags. */
static u8 check_mp_route(u32 slot, u32 pin, u32 line) {
    const u8 *t = mp_table();
    if (!t)
        result_fail("no valid MP table in the EBDA");
    u16 len = *(const u16 *)(t + 4), count = *(const u16 *)(t + 34);
    const u8 *e = t + 44, *end = t + len;
    int pci_bus = -1, found = 0, others = 0;
    u8 flags = 0;
    /* Buses come before the interrupt entries. */
    for (u16 i = 0; i < count && e < end; i++) {
        if (e[0] == 0) {
            e += 20;
            continue;
        }
        if (e[0] == 1 && e[2] == 'P' && e[3] == 'C' && e[4] == 'I')
            pci_bus = e[1];
        if (e[0] == 3 && e[7] == line) {
            if (pci_bus >= 0 && e[4] == (u8)pci_bus && e[5] == (u8)((slot << 2) | (pin - 1))) {
                found++;
                flags = e[2];
            } else {
                others++;
            }
        }
        e += 8;
    }
    if (pci_bus < 0)
        result_fail("the MP table has no PCI bus");
    if (found != 1)
        result_fail("the MP table has no single entry for edu's slot/INTA on its interrupt line");
    if (others)
        result_fail("another MP table entry also names edu's IOAPIC pin");
    if (flags != 0x0f)
        result_fail("edu's MP table entry is not level-triggered, active low (flags 0x0f)");
    serial_puts("MP table: PCI bus ");
    serial_put_dec((u64)pci_bus);
    serial_puts(", slot ");
    serial_put_dec(slot);
    serial_puts(" INTA -> IOAPIC pin ");
    serial_put_dec(line);
    serial_puts(", level, active low\n");
    return flags;
}

static void intx_diagnose(u32 slot, u32 pin) {
    serial_puts("count ");
    serial_put_dec(intx_count);
    serial_puts(", edu status ");
    serial_put_hex(mmio_read32(intx_bar + EDU_IRQ_STATUS));
    serial_puts(", command/status ");
    serial_put_hex(cfg_read(slot, 0x04));
    serial_puts(", IOAPIC entry ");
    serial_put_hex(ioapic_read(0x10 + 2 * pin));
    serial_puts(", LAPIC IRR[2] ");
    serial_put_hex(lapic_read(LAPIC_IRR + 0x10 * (INTX_VECTOR / 32)));
    serial_puts("\n");
}

/* Waits (bounded) until the handler has run `count` times. */
static int wait_intx(u32 count) {
    struct deadline dl;
    deadline_start_ms(&dl, WAIT_MS);
    while (intx_count < count && !deadline_expired(&dl))
        cpu_relax();
    return intx_count >= count;
}

static void raise_and_expect(u32 slot, u32 ioapic_pin, u32 value, u32 count, const char *what) {
    mmio_write32(intx_bar + EDU_IRQ_RAISE, value);
    if (!wait_intx(count)) {
        intx_diagnose(slot, ioapic_pin);
        result_fail(what);
    }
    if (!(intx_status & value))
        result_fail("the interrupt handler did not see edu's status bit");
    serial_puts("interrupt ");
    serial_put_dec(count);
    serial_puts(": edu status ");
    serial_put_hex(value);
    serial_puts("\n");
}

static void check_intx(u32 slot, u64 bar) {
    u32 v = cfg_read(slot, 0x3c);
    u32 line = v & 0xff, pin = (v >> 8) & 0xff;
    serial_puts("interrupt line ");
    serial_put_dec(line);
    serial_puts(", pin ");
    serial_put_dec(pin);
    serial_puts("\n");
    if (pin != 1)
        result_fail("edu's Interrupt Pin does not read 1 (INTA)");
    if (line < 16 || line > 23)
        result_fail("edu's Interrupt Line is not an IOAPIC pin above the ISA IRQs");
    check_mp_route(slot, pin, line);

    /* Hostile writes: the line byte is scratch, the pin is read-only, the routing stays. */
    cfg_write(slot, 0x3c, 0x0000030au);
    v = cfg_read(slot, 0x3c);
    if ((v & 0xff) != 0x0a)
        result_fail("the Interrupt Line byte is not writable scratch");
    if (((v >> 8) & 0xff) != 1)
        result_fail("a guest write changed the Interrupt Pin");

    outb(0x21, 0xff); /* mask both PICs */
    outb(0xa1, 0xff);
    install_idt();
    lapic_write(LAPIC_LINT0, 0x10000); /* masked: no ExtINT from the PIC */
    lapic_write(LAPIC_TPR, 0);
    lapic_write(LAPIC_SVR, 0x100 | SPURIOUS_VECTOR);
    u32 apic_id = lapic_read(LAPIC_ID) >> 24;
    /* Redirection entry from the MP table: level (bit 15), active low (bit 13), fixed,
     * physical destination = this CPU, unmasked. */
    ioapic_write(0x11 + 2 * line, apic_id << 24);
    ioapic_write(0x10 + 2 * line, INTX_VECTOR | (1u << 13) | (1u << 15));
    intx_bar = bar;
    __asm__ volatile("sti" ::: "memory");

    raise_and_expect(slot, line, 1, 1, "no interrupt arrived after edu's interrupt raise");
    raise_and_expect(slot, line, 2, 2,
                     "no second interrupt arrived (INTx was not unmasked after the EOI)");

    /* Interrupt Disable: a raise is held back, and delivered once the bit is cleared. */
    u32 cmd = cfg_read(slot, 0x04) & 0xffff;
    cfg_write(slot, 0x04, cmd | PCI_COMMAND_INTX_DISABLE);
    mmio_write32(bar + EDU_IRQ_RAISE, 4);
    delay_ms(500);
    if (intx_count != 2) {
        intx_diagnose(slot, line);
        result_fail("an interrupt arrived with Interrupt Disable set");
    }
    if (!((cfg_read(slot, 0x04) >> 16) & PCI_STATUS_INTERRUPT))
        result_fail("the status register does not show the held-back interrupt");
    cfg_write(slot, 0x04, cmd & ~PCI_COMMAND_INTX_DISABLE);
    if (!wait_intx(3)) {
        intx_diagnose(slot, line);
        result_fail("the held-back interrupt did not arrive once Interrupt Disable was cleared");
    }
    if (!(intx_status & 4))
        result_fail("the interrupt handler did not see edu's status bit 4");
    __asm__ volatile("cli" ::: "memory");
    ioapic_write(0x10 + 2 * line, 1u << 16);
    serial_puts("INTx: 3 interrupts on IOAPIC pin ");
    serial_put_dec(line);
    serial_puts(", one held back by Interrupt Disable\n");
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

    check_intx(slot, moved);

    /* Decode off: the BAR no longer answers. */
    cfg_write(slot, 0x04, cmd & 0xffff & ~0x2u);
    if (mmio_read32(moved) == 0x010000ed) result_fail("BAR 0 decodes with memory decoding off");
    result_pass("edu id 0x010000ed, liveness through BAR 0, BAR moved, INTx delivered, decode off");
}
