/* hello: proves the boot path. Prints the entry the VMM used and the command line. */
#include "common.h"

void guest_main(void) {
    serial_puts("hello from the guest\n");
    serial_puts("entry: ");
    serial_puts(boot_entry());
    serial_puts("\ncmdline: ");
    serial_puts(boot_cmdline());
    serial_puts("\n");
    result_pass(boot_entry());
}
