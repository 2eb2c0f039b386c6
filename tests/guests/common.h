/* Freestanding support for microvm's test guests.
 *
 * A test guest is a small ELF that our VMM boots through the same loader path as a Linux vmlinux.
 * It runs in ring 0 with no libc. On this project's CI host (kvm-pvm) every kernel-mode
 * instruction goes through an emulator at about a million instructions a second, and some
 * instructions cannot be emulated at all: see docs/test-guests.md. Keep loops short and avoid
 * cmpxchg16b, xsave/xrstor, int3, popcnt and fwait (build with -mno-sse -mno-popcnt ...).
 *
 * Reporting: a guest prints progress lines on COM1 and ends with exactly one line
 * `RESULT: PASS <details>` or `RESULT: FAIL <reason>`, then resets the VM through the i8042.
 */
#ifndef MICROVM_GUEST_COMMON_H
#define MICROVM_GUEST_COMMON_H

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned long usize;

#define NORETURN __attribute__((noreturn))

/* Entry: start.S sets up a stack and calls guest_main on the boot vCPU. */
void guest_main(void);

/* Port and MMIO access. */
static inline void outb(u16 port, u8 v) { __asm__ volatile("outb %0, %1" : : "a"(v), "Nd"(port)); }
static inline u8 inb(u16 port) { u8 v; __asm__ volatile("inb %1, %0" : "=a"(v) : "Nd"(port)); return v; }
static inline u32 mmio_read32(u64 addr) { return *(volatile u32 *)(usize)addr; }
static inline void mmio_write32(u64 addr, u32 v) { *(volatile u32 *)(usize)addr = v; }
static inline void barrier(void) { __asm__ volatile("" ::: "memory"); }
static inline void mfence(void) { __asm__ volatile("mfence" ::: "memory"); }
static inline void cpu_relax(void) { __asm__ volatile("pause"); }

/* Serial console (COM1, 0x3f8). */
void serial_putc(char c);
void serial_puts(const char *s);
void serial_put_dec(u64 v);
void serial_put_hex(u64 v);

/* The kernel command line the VMM passed, whichever boot entry was used (never NULL). */
const char *boot_cmdline(void);
/* Which entry the VMM used: "linux64" or "pvh". */
const char *boot_entry(void);

/* Small freestanding helpers. */
usize str_len(const char *s);
int str_starts_with(const char *s, const char *prefix);
/* Finds `key` (e.g. "virtio_mmio.device=") in the command line; returns a pointer just past it or 0. */
const char *cmdline_find(const char *cmdline, const char *key);
/* Parses an unsigned number (decimal, or hex with 0x) and advances *s; returns 0 on no digits. */
int parse_u64(const char **s, u64 *out);
void *mem_set(void *dst, int c, usize n);
void *mem_copy(void *dst, const void *src, usize n);

/* Ends the VM through the i8042 reset line (0xFE to port 0x64). */
NORETURN void reset_vm(void);
/* Prints the RESULT line and resets. */
NORETURN void result_pass(const char *details);
NORETURN void result_fail(const char *reason);

#endif
