/* smp: counts the CPUs in the VMM's MP table, starts every application processor with
 * INIT-SIPI-SIPI through the local APIC, and waits (bounded) for each to check in.
 * An AP runs the real-mode trampoline of start.S (copied below 1 MiB), switches to long mode with
 * the boot CPU's page tables and increments `cpus_online`. */
#include "common.h"

#define AP_TRAMPOLINE 0x10000u
#define LAPIC_BASE 0xfee00000ull
#define LAPIC_ID 0x20
#define LAPIC_SVR 0xf0
#define LAPIC_ICR_LO 0x300
#define LAPIC_ICR_HI 0x310
#define ICR_INIT 0x00004500u
#define ICR_STARTUP 0x00004600u
#define ICR_BUSY (1u << 12)
#define MAX_CPUS 64
/* Each poll is a handful of emulated instructions: on kvm-pvm this is several seconds. */
#define WAIT_POLLS 3000000ull

extern u64 ap_cr3, ap_started_flag;
extern char ap_start16[], ap_start16_end[];

static volatile u64 cpus_online;
static volatile u32 ap_apic_ids[MAX_CPUS];

struct mp_cpu {
    u8 apic_id;
    u8 is_bsp;
};

static u8 checksum(const u8 *p, usize n) {
    u8 s = 0;
    for (usize i = 0; i < n; i++)
        s = (u8)(s + p[i]);
    return s;
}

static const u8 *find_mp_floating(u64 start, u64 len) {
    for (u64 a = start; a + 16 <= start + len; a += 16) {
        const u8 *p = (const u8 *)(usize)a;
        if (p[0] == '_' && p[1] == 'M' && p[2] == 'P' && p[3] == '_' && checksum(p, 16) == 0)
            return p;
    }
    return 0;
}

/* Reads the processor entries of the MP configuration table. Returns the count, or -1. */
static int read_mp_cpus(struct mp_cpu *cpus, int max) {
    const u8 *mpf = find_mp_floating(0x9fc00, 0x400);
    if (!mpf)
        mpf = find_mp_floating(0xf0000, 0x10000);
    if (!mpf)
        return -1;
    u32 table = *(const u32 *)(mpf + 4);
    if (table == 0 || table >= 0x100000)
        return -1;
    const u8 *t = (const u8 *)(usize)table;
    if (!(t[0] == 'P' && t[1] == 'C' && t[2] == 'M' && t[3] == 'P'))
        return -1;
    u16 len = *(const u16 *)(t + 4);
    u16 count = *(const u16 *)(t + 34);
    if (len < 44 || checksum(t, len) != 0)
        return -1;
    const u8 *e = t + 44, *end = t + len;
    int n = 0;
    for (u16 i = 0; i < count && e < end; i++) {
        if (e[0] == 0) { /* processor */
            if ((e[3] & 1) && n < max) {
                cpus[n].apic_id = e[1];
                cpus[n].is_bsp = (e[3] & 2) != 0;
                n++;
            }
            e += 20;
        } else {
            e += 8;
        }
    }
    return n;
}

static u32 lapic_read(u32 reg) { return mmio_read32(LAPIC_BASE + reg); }
static void lapic_write(u32 reg, u32 v) { mmio_write32(LAPIC_BASE + reg, v); }

static int send_ipi(u8 apic_id, u32 icr) {
    lapic_write(LAPIC_ICR_HI, (u32)apic_id << 24);
    lapic_write(LAPIC_ICR_LO, icr);
    for (int i = 0; i < 10000; i++)
        if (!(lapic_read(LAPIC_ICR_LO) & ICR_BUSY))
            return 1;
    return 0;
}

static void short_delay(void) {
    for (int i = 0; i < 200; i++)
        cpu_relax();
}

void ap_main(u64 index);
void ap_main(u64 index) {
    if (index < MAX_CPUS)
        ap_apic_ids[index] = lapic_read(LAPIC_ID) >> 24;
    __atomic_fetch_add(&cpus_online, 1, __ATOMIC_SEQ_CST);
    for (;;)
        __asm__ volatile("cli; hlt");
}

void guest_main(void) {
    struct mp_cpu cpus[MAX_CPUS];
    int n = read_mp_cpus(cpus, MAX_CPUS);
    if (n <= 0)
        result_fail("no valid MP table");
    serial_puts("smp: MP table lists ");
    serial_put_dec((u64)n);
    serial_puts(" cpus, boot cpu apic id ");
    serial_put_dec(lapic_read(LAPIC_ID) >> 24);
    serial_puts("\n");

    u64 cr3;
    __asm__ volatile("mov %%cr3, %0" : "=r"(cr3));
    ap_cr3 = cr3;
    ap_started_flag = 1;
    mem_copy((void *)(usize)AP_TRAMPOLINE, ap_start16, (usize)(ap_start16_end - ap_start16));
    mfence();

    lapic_write(LAPIC_SVR, 0x1ff); /* software enable, spurious vector 0xff */
    int aps = 0;
    for (int i = 0; i < n; i++) {
        if (cpus[i].is_bsp)
            continue;
        aps++;
        if (!send_ipi(cpus[i].apic_id, ICR_INIT))
            result_fail("INIT IPI stuck");
        short_delay();
        for (int k = 0; k < 2; k++) {
            if (!send_ipi(cpus[i].apic_id, ICR_STARTUP | (AP_TRAMPOLINE >> 12)))
                result_fail("SIPI stuck");
            short_delay();
        }
    }

    u64 polls = 0;
    while (cpus_online < (u64)aps && polls < WAIT_POLLS) {
        cpu_relax();
        polls++;
    }
    u64 online = cpus_online;
    serial_puts("smp: application processors online: ");
    serial_put_dec(online);
    serial_puts(" of ");
    serial_put_dec((u64)aps);
    serial_puts(", apic ids:");
    for (u64 i = 0; i < online && i < MAX_CPUS; i++) {
        serial_puts(" ");
        serial_put_dec(ap_apic_ids[i]);
    }
    serial_puts("\n");
    if (online != (u64)aps) {
        serial_puts("RESULT: FAIL only ");
        serial_put_dec(online + 1);
        serial_puts(" of ");
        serial_put_dec((u64)n);
        serial_puts(" cpus came online\n");
        reset_vm();
    }
    serial_puts("RESULT: PASS cpus=");
    serial_put_dec(online + 1);
    serial_puts("\n");
    reset_vm();
}
