/* console-flood: a guest flooding its serial console. Writes numbered lines to COM1 until it has
 * written the number of bytes `flood=N` on the command line names (default 256 KiB), then
 * `flood done <lines> <bytes>` and the RESULT line. The host's console log must stay within its
 * bound and keep the newest lines (vmm/tests/kvm_console.rs). */
#include "common.h"

#define PAD "xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"

void guest_main(void) {
    u64 want = 256 << 10;
    const char *arg = cmdline_find(boot_cmdline(), "flood=");
    if (arg)
        parse_u64(&arg, &want);
    u64 written = 0, lines = 0;
    while (written < want) {
        serial_puts("flood ");
        serial_put_dec(lines);
        serial_puts(" " PAD "\n");
        /* "flood " + the number + " " + PAD + "\n" */
        u64 digits = 1;
        for (u64 n = lines; n >= 10; n /= 10)
            digits++;
        written += 6 + digits + 1 + (sizeof(PAD) - 1) + 1;
        lines++;
    }
    serial_puts("flood done ");
    serial_put_dec(lines);
    serial_puts(" ");
    serial_put_dec(written);
    serial_puts("\n");
    result_pass("flooded");
}
