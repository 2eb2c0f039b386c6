/* triple-fault: loads an empty IDT and raises an exception. With no IDT entry the #GP becomes
 * a double fault, then a triple fault: the CPU shuts down (KVM_EXIT_SHUTDOWN) and the VMM must end
 * the VM with an error naming it. Reaching the line after the fault is a failure. */
#include "common.h"

void guest_main(void) {
    struct __attribute__((packed)) {
        u16 limit;
        u64 base;
    } idtr = {0, 0};
    serial_puts("triple-fault: loading an empty IDT and faulting\n");
    __asm__ volatile("lidt %0" : : "m"(idtr));
    __asm__ volatile("ud2");
    result_fail("survived an exception with an empty IDT");
}
