/* emul-fail: executes `lock cmpxchg16b`, which kvm-pvm's instruction emulator cannot handle: the
 * VMM must end the VM with an error naming KVM_EXIT_INTERNAL_ERROR. On real KVM (hardware
 * virtualization) the instruction just runs; the guest then reports that, so a test can tell the
 * two hosts apart: `RESULT: FAIL instruction unexpectedly emulated`. */
#include "common.h"

static u64 target[2] __attribute__((aligned(16))) = {1, 2};

void guest_main(void) {
    u64 lo = 1, hi = 2, new_lo = 3, new_hi = 4;
    serial_puts("emul-fail: executing lock cmpxchg16b\n");
    __asm__ volatile("lock cmpxchg16b %0"
                     : "+m"(*(volatile u64(*)[2])target), "+a"(lo), "+d"(hi)
                     : "b"(new_lo), "c"(new_hi)
                     : "memory", "cc");
    serial_puts("cmpxchg16b ran: target = ");
    serial_put_hex(target[0]);
    serial_puts("\n");
    result_fail("instruction unexpectedly emulated (cmpxchg16b ran; this host is not kvm-pvm)");
}
