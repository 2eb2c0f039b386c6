/* Bounded waiting for the test guests. Every wait loop calls deadline_expired() once per
 * iteration. Time comes from the TSC (frequency from CPUID leaf 0x16 or KVM's leaf 0x40000010,
 * else assumed 3 GHz, so a wait lasts between about 0.3x and 3x of what was asked on any real
 * CPU). As a backstop against a TSC that does not advance, the iteration count is bounded too,
 * generously: kvm-pvm emulates kernel-mode code at ~1M instructions/s, real KVM ~1000x faster. */
#ifndef MICROVM_GUEST_DEADLINE_H
#define MICROVM_GUEST_DEADLINE_H

#include "common.h"

struct deadline {
	u64 end_tsc;
	u64 iters_left;
	u32 tick;
	int expired;
};

static inline u64 rdtsc(void)
{
	u32 lo, hi;
	__asm__ volatile("rdtsc" : "=a"(lo), "=d"(hi));
	return ((u64)hi << 32) | lo;
}

static inline void cpuid(u32 leaf, u32 *a, u32 *b, u32 *c, u32 *d)
{
	__asm__ volatile("cpuid" : "=a"(*a), "=b"(*b), "=c"(*c), "=d"(*d) : "a"(leaf), "c"(0));
}

/* TSC ticks per millisecond. */
static inline u64 tsc_khz(void)
{
	static u64 khz;
	u32 a, b, c, d;
	if (khz)
		return khz;
	khz = 3000000;
	cpuid(0x40000000, &a, &b, &c, &d);
	/* "KVMKVMKVM\0\0\0" */
	if (b == 0x4b4d564b && c == 0x564b4d56 && d == 0x4d && a >= 0x40000010) {
		cpuid(0x40000010, &a, &b, &c, &d);
		if (a >= 100000 && a < 100000000) {
			khz = a;
			return khz;
		}
	}
	cpuid(0, &a, &b, &c, &d);
	if (a >= 0x16) {
		cpuid(0x16, &a, &b, &c, &d);
		if ((a & 0xffff) >= 100)
			khz = (u64)(a & 0xffff) * 1000;
	}
	return khz;
}

static inline void deadline_start_ms(struct deadline *dl, u32 ms)
{
	dl->end_tsc = rdtsc() + (u64)ms * tsc_khz();
	dl->iters_left = (u64)ms * 4096 + 4096;
	dl->tick = 0;
	dl->expired = 0;
}

/* Counts one loop iteration; reads the TSC every 32 iterations. */
static inline int deadline_expired(struct deadline *dl)
{
	if (dl->expired)
		return 1;
	if (dl->iters_left-- == 0)
		dl->expired = 1;
	else if ((++dl->tick & 31) == 0 && (long long)(rdtsc() - dl->end_tsc) >= 0)
		dl->expired = 1;
	return dl->expired;
}

static inline void delay_ms(u32 ms)
{
	struct deadline dl;
	deadline_start_ms(&dl, ms);
	while (!deadline_expired(&dl))
		cpu_relax();
}

#endif
