/* Freestanding support shared by the test guests (see common.h). */
#include "common.h"

#define COM1 0x3f8
#define XEN_HVM_START_MAGIC 0x336ec578u

/* Set by start.S: 1 = Linux 64-bit entry (boot_info_ptr = boot_params), 2 = PVH (hvm_start_info). */
extern u64 boot_entry_kind;
extern u64 boot_info_ptr;

/* Page directory mapping 3..4 GiB (MMIO: virtio-mmio, IOAPIC, LAPIC) uncached with 2 MiB pages. */
static u64 mmio_pd[512] __attribute__((aligned(4096)));

static const char empty_cmdline[] = "";

static void serial_init(void) {
    outb(COM1 + 1, 0x00); /* no interrupts */
    outb(COM1 + 3, 0x80); /* DLAB */
    outb(COM1 + 0, 0x01); /* 115200 baud */
    outb(COM1 + 1, 0x00);
    outb(COM1 + 3, 0x03); /* 8N1 */
}

void serial_putc(char c) {
    /* Wait (bounded) for the transmitter holding register to be empty. */
    for (int i = 0; i < 1000 && !(inb(COM1 + 5) & 0x20); i++)
        cpu_relax();
    outb(COM1, (u8)c);
}

void serial_puts(const char *s) {
    for (; *s; s++) {
        if (*s == '\n')
            serial_putc('\r');
        serial_putc(*s);
    }
}

void serial_put_dec(u64 v) {
    char buf[21];
    int i = 20;
    buf[i] = 0;
    do {
        buf[--i] = (char)('0' + v % 10);
        v /= 10;
    } while (v && i > 0);
    serial_puts(&buf[i]);
}

void serial_put_hex(u64 v) {
    static const char digits[] = "0123456789abcdef";
    char buf[19];
    int i = 18;
    buf[i] = 0;
    do {
        buf[--i] = digits[v & 0xf];
        v >>= 4;
    } while (v && i > 2);
    buf[--i] = 'x';
    buf[--i] = '0';
    serial_puts(&buf[i]);
}

const char *boot_cmdline(void) {
    u64 p = 0;
    if (boot_entry_kind == 1 && boot_info_ptr) {
        p = *(volatile u32 *)(usize)(boot_info_ptr + 0x228); /* hdr.cmd_line_ptr */
    } else if (boot_entry_kind == 2 && boot_info_ptr) {
        if (*(volatile u32 *)(usize)boot_info_ptr == XEN_HVM_START_MAGIC)
            p = *(volatile u64 *)(usize)(boot_info_ptr + 0x18); /* cmdline_paddr */
    }
    /* The identity map covers the first GiB only. */
    if (p == 0 || p >= (1ull << 30))
        return empty_cmdline;
    return (const char *)(usize)p;
}

const char *boot_entry(void) {
    return boot_entry_kind == 2 ? "pvh" : "linux64";
}

usize str_len(const char *s) {
    usize n = 0;
    while (s[n])
        n++;
    return n;
}

int str_starts_with(const char *s, const char *prefix) {
    for (; *prefix; s++, prefix++)
        if (*s != *prefix)
            return 0;
    return 1;
}

const char *cmdline_find(const char *cmdline, const char *key) {
    const char *p = cmdline;
    while (*p) {
        /* Only match at the start of a word. */
        if ((p == cmdline || p[-1] == ' ') && str_starts_with(p, key))
            return p + str_len(key);
        p++;
    }
    return 0;
}

int parse_u64(const char **s, u64 *out) {
    const char *p = *s;
    u64 v = 0;
    int any = 0;
    if (p[0] == '0' && (p[1] == 'x' || p[1] == 'X')) {
        p += 2;
        for (;; p++) {
            u64 d;
            if (*p >= '0' && *p <= '9')
                d = (u64)(*p - '0');
            else if (*p >= 'a' && *p <= 'f')
                d = (u64)(*p - 'a' + 10);
            else if (*p >= 'A' && *p <= 'F')
                d = (u64)(*p - 'A' + 10);
            else
                break;
            v = (v << 4) | d;
            any = 1;
        }
    } else {
        for (; *p >= '0' && *p <= '9'; p++) {
            v = v * 10 + (u64)(*p - '0');
            any = 1;
        }
    }
    if (!any)
        return 0;
    *out = v;
    *s = p;
    return 1;
}

void *mem_set(void *dst, int c, usize n) {
    volatile u8 *d = dst;
    for (usize i = 0; i < n; i++)
        d[i] = (u8)c;
    return dst;
}

void *mem_copy(void *dst, const void *src, usize n) {
    volatile u8 *d = dst;
    const u8 *s = src;
    for (usize i = 0; i < n; i++)
        d[i] = s[i];
    return dst;
}

/* gcc may emit calls to these for struct copies and zeroing. */
void *memset(void *dst, int c, usize n) { return mem_set(dst, c, n); }
void *memcpy(void *dst, const void *src, usize n) { return mem_copy(dst, src, n); }

NORETURN void reset_vm(void) {
    outb(0x64, 0xfe);
    for (;;)
        __asm__ volatile("cli; hlt");
}

NORETURN void result_pass(const char *details) {
    serial_puts("RESULT: PASS");
    if (details && *details) {
        serial_putc(' ');
        serial_puts(details);
    }
    serial_puts("\n");
    reset_vm();
}

NORETURN void result_fail(const char *reason) {
    serial_puts("RESULT: FAIL ");
    serial_puts(reason);
    serial_puts("\n");
    reset_vm();
}

/* Maps 3..4 GiB (the MMIO gap) uncached into the current page tables: PML4[0] -> PDPT[3]. */
static void map_mmio_gap(void) {
    u64 cr3;
    __asm__ volatile("mov %%cr3, %0" : "=r"(cr3));
    u64 *pml4 = (u64 *)(usize)(cr3 & ~0xfffull);
    u64 *pdpt = (u64 *)(usize)(pml4[0] & 0x000ffffffffff000ull);
    for (u64 i = 0; i < 512; i++)
        mmio_pd[i] = ((3ull << 30) + (i << 21)) | 0x9b; /* present, rw, PWT, PCD, 2 MiB */
    pdpt[3] = (u64)(usize)mmio_pd | 3;
    __asm__ volatile("mov %0, %%cr3" : : "r"(cr3) : "memory");
}

void guest_start(void);
void guest_start(void) {
    serial_init();
    map_mmio_gap();
    guest_main();
    result_fail("guest_main returned");
}

/* Application processors land here (start.S); smp.c provides the real one. */
__attribute__((weak)) void ap_main(u64 index);
__attribute__((weak)) void ap_main(u64 index) {
    (void)index;
    for (;;)
        __asm__ volatile("cli; hlt");
}
