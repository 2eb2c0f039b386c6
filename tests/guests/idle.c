/* idle: prints one line, then halts with interrupts off forever. The VMM must still stop it
 * promptly (its vCPU is blocked inside KVM_RUN and has to be kicked out). */
#include "common.h"

void guest_main(void) {
    serial_puts("idle: halting forever\n");
    for (;;)
        __asm__ volatile("cli; hlt");
}
