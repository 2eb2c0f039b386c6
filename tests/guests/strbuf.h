/* A fixed-size string builder for progress and RESULT lines (no libc, no 64-bit division:
 * the guests may be built for 32-bit PVH entry, where u64 division would need libgcc). */
#ifndef MICROVM_GUEST_STRBUF_H
#define MICROVM_GUEST_STRBUF_H

#include "common.h"

struct strbuf {
	char buf[192];
	usize len;
};

static inline void sb_reset(struct strbuf *sb)
{
	sb->len = 0;
	sb->buf[0] = 0;
}

static inline void sb_char(struct strbuf *sb, char c)
{
	if (sb->len + 1 < sizeof(sb->buf)) {
		sb->buf[sb->len++] = c;
		sb->buf[sb->len] = 0;
	}
}

static inline void sb_str(struct strbuf *sb, const char *s)
{
	while (*s)
		sb_char(sb, *s++);
}

static inline void sb_dec(struct strbuf *sb, u64 v)
{
	/* Repeated subtraction by powers of ten: at most 9 * 20 steps, no division. */
	static const u64 pow10[20] = {
		10000000000000000000ull, 1000000000000000000ull, 100000000000000000ull,
		10000000000000000ull, 1000000000000000ull, 100000000000000ull, 10000000000000ull,
		1000000000000ull, 100000000000ull, 10000000000ull, 1000000000ull, 100000000ull,
		10000000ull, 1000000ull, 100000ull, 10000ull, 1000ull, 100ull, 10ull, 1ull,
	};
	int started = 0;
	for (int i = 0; i < 20; i++) {
		char d = '0';
		while (v >= pow10[i]) {
			v -= pow10[i];
			d++;
		}
		if (d != '0' || started || i == 19) {
			sb_char(sb, d);
			started = 1;
		}
	}
}

static inline void sb_hex(struct strbuf *sb, u64 v)
{
	static const char digits[] = "0123456789abcdef";
	int started = 0;
	sb_str(sb, "0x");
	for (int shift = 60; shift >= 0; shift -= 4) {
		u32 nibble = (u32)(v >> shift) & 0xf;
		if (nibble || started || shift == 0) {
			sb_char(sb, digits[nibble]);
			started = 1;
		}
	}
}

#endif
