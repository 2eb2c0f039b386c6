/* Entry points of the test guests.
 *
 * start64   Linux 64-bit boot protocol: long mode, paging on with the VMM's identity map of the
 *           first GiB, RSI = boot_params (zero page).
 * pvh_entry PVH: 32-bit protected mode, paging off, EBX = hvm_start_info. Builds its own
 *           identity map of the first GiB and switches to long mode.
 * ap_start16..ap_start16_end: the real-mode trampoline an application processor runs after
 *           INIT-SIPI-SIPI; smp copies it to AP_TRAMPOLINE (below 1 MiB) and patches nothing:
 *           it only uses link-time constants. The AP goes real -> protected -> long mode with
 *           the BSP's CR3 (ap_cr3) and calls ap_main(cpu_index) on its own stack.
 *
 * The code avoids instructions kvm-pvm cannot emulate (see docs/test-guests.md).
 */
#define AP_TRAMPOLINE 0x10000
#define STACK_SIZE 16384
#define MAX_CPUS 64
#define AP_STACK_SIZE 4096

#define SEL_CODE32 0x08
#define SEL_DATA 0x10
#define SEL_CODE64 0x18

    .section .text.entry, "ax"
    .code64
    .globl start64
start64:
    cli
    lea boot_stack_top(%rip), %rsp
    xor %ebp, %ebp
    movq $1, boot_entry_kind(%rip)
    movq %rsi, boot_info_ptr(%rip)
    call guest_start
1:  hlt
    jmp 1b

/* ---------------- PVH entry (32-bit, paging off) ---------------- */
    .code32
    .globl pvh_entry
pvh_entry:
    cli
    movl $boot_stack_top, %esp
    movl $2, boot_entry_kind
    movl %ebx, boot_info_ptr
    /* Identity map of the first GiB with 2 MiB pages: PML4[0] -> PDPT, PDPT[0] -> PD. */
    movl $pvh_pdpt, %eax
    orl $3, %eax
    movl %eax, pvh_pml4
    movl $pvh_pd, %eax
    orl $3, %eax
    movl %eax, pvh_pdpt
    xorl %ecx, %ecx
2:  movl %ecx, %eax
    shll $21, %eax
    orl $0x83, %eax              /* present, writable, 2 MiB page */
    movl %eax, pvh_pd(,%ecx,8)
    incl %ecx
    cmpl $512, %ecx
    jne 2b
    movl $pvh_pml4, %eax
    movl %eax, ap_cr3
    lgdt gdt_desc
    ljmp $SEL_CODE32, $enter_long32

/* Shared 32-bit path to long mode (PVH boot CPU and APs): CR3 from ap_cr3. */
enter_long32:
    movw $SEL_DATA, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    movl %cr4, %eax
    orl $0x20, %eax              /* PAE */
    movl %eax, %cr4
    movl ap_cr3, %eax
    movl %eax, %cr3
    movl $0xc0000080, %ecx       /* EFER */
    rdmsr
    orl $0x100, %eax             /* LME */
    wrmsr
    movl %cr0, %eax
    orl $0x80000001, %eax        /* PG | PE */
    movl %eax, %cr0
    ljmp $SEL_CODE64, $long_from32

    .code64
long_from32:
    movw $SEL_DATA, %ax
    movw %ax, %ds
    movw %ax, %es
    movw %ax, %ss
    movw %ax, %fs
    movw %ax, %gs
    cmpq $0, ap_started_flag(%rip)
    jne ap_long
    /* The PVH boot CPU. */
    lea boot_stack_top(%rip), %rsp
    xor %ebp, %ebp
    call guest_start
3:  hlt
    jmp 3b

ap_long:
    /* Pick this AP's index and stack. */
    movq $1, %rax
    lock xaddq %rax, ap_next_index(%rip)
    cmpq $MAX_CPUS, %rax
    jae 4f
    movq %rax, %rdi
    movq %rax, %rbx
    incq %rbx
    shlq $12, %rbx
    lea ap_stacks(%rip), %rsp
    addq %rbx, %rsp
    xor %ebp, %ebp
    call ap_main
4:  cli
    hlt
    jmp 4b

/* ---------------- AP real-mode trampoline (copied to AP_TRAMPOLINE) ---------------- */
    .code16
    .globl ap_start16, ap_start16_end
ap_start16:
    cli
    movw %cs, %ax
    movw %ax, %ds
    lgdtl (ap_gdt_desc16 - ap_start16)
    movl %cr0, %eax
    orl $1, %eax
    movl %eax, %cr0
    ljmpl $SEL_CODE32, $enter_long32
    .align 8
ap_gdt_desc16:
    .word gdt_end - gdt - 1
    .long gdt
ap_start16_end:

    .section .rodata
    .align 16
gdt:
    .quad 0
    .quad 0x00cf9b000000ffff     /* 0x08: 32-bit code */
    .quad 0x00cf93000000ffff     /* 0x10: data */
    .quad 0x00af9b000000ffff     /* 0x18: 64-bit code */
gdt_end:
gdt_desc:
    .word gdt_end - gdt - 1
    .quad gdt

/* PVH ELF note: XEN_ELFNOTE_PHYS32_ENTRY (18), name "Xen", 32-bit entry address. */
    .section .note.Xen, "a", @note
    .align 4
    .long 4
    .long 4
    .long 18
    .asciz "Xen"
    .long pvh_entry

    .data
    .align 8
    .globl boot_entry_kind, boot_info_ptr, ap_cr3, ap_started_flag, ap_next_index
boot_entry_kind: .quad 0
boot_info_ptr:   .quad 0
ap_cr3:          .quad 0
ap_started_flag: .quad 0
ap_next_index:   .quad 0

    .bss
    .align 4096
pvh_pml4: .skip 4096
pvh_pdpt: .skip 4096
pvh_pd:   .skip 4096
boot_stack: .skip STACK_SIZE
boot_stack_top:
    .globl ap_stacks
ap_stacks: .skip AP_STACK_SIZE * MAX_CPUS
    .section .note.GNU-stack, "", @progbits
