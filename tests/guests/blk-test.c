/* blk-test: drives the VMM's virtio-blk devices from a freestanding guest.
 *
 * Expects three disks in this order: vda read-write (its bytes follow pattern 0), vdb
 * read-only (pattern 1), vdc an empty slot. Disk byte at offset o of pattern k is
 * (o % 251 + k) & 0xff. For each disk it negotiates SIZE_MAX, SEG_MAX, RO, BLK_SIZE, FLUSH,
 * DISCARD and WRITE_ZEROES (whatever is offered) and prints
 * `blk-test: disk N capacity C blk_size B seg_max S size_max M ro R serial SERIAL`.
 *
 * vda: reads sectors 0..15 and checks them, writes sectors 8..15 with pattern 3 and reads them
 * back, flushes, discards 16..23 and write-zeroes 24..31 (both then read as zeroes), reads one
 * sector past the end (IOERR) and sends an unknown type (UNSUPP). vdb: a write is refused
 * (IOERR), a read works. vdc: a read fails (IOERR, capacity 0), then it prints `blk-test: waiting
 * for attach` and polls the capacity (through ConfigGeneration) until the host fills the slot;
 * the config interrupt status must be set; it reads the new serial and sector 0 (pattern 2),
 * prints `blk-test: attached capacity C serial S` and `blk-test: waiting for detach`, waits
 * for capacity 0 and checks a read fails again. Polling only: interrupts stay off.
 * RESULT: PASS errors=5 (the five refused requests).
 */
#include "common.h"
#include "deadline.h"
#include "strbuf.h"
#include "virtio_mmio.h"

#define VIRTIO_ID_BLOCK 2
#define BLK_F_SIZE_MAX 1
#define BLK_F_SEG_MAX 2
#define BLK_F_RO 5
#define BLK_F_BLK_SIZE 6
#define BLK_F_FLUSH 9
#define BLK_F_DISCARD 13
#define BLK_F_WRITE_ZEROES 14

#define T_IN 0
#define T_OUT 1
#define T_FLUSH 4
#define T_GET_ID 8
#define T_DISCARD 11
#define T_WRITE_ZEROES 13

#define S_OK 0
#define S_IOERR 1
#define S_UNSUPP 2

#define CFG_CAPACITY 0x100
#define CFG_SIZE_MAX 0x108
#define CFG_SEG_MAX 0x10c
#define CFG_BLK_SIZE 0x114
#define INT_CONFIG 2

#define NDISKS 3
#define BUF_LEN 8192
#define WAIT_MS 60000

struct blk {
	struct virtio_mmio_dev dev;
	struct virtq vq;
	u64 features;
};

struct req_hdr {
	u32 type;
	u32 reserved;
	u64 sector;
};

static struct blk disks[NDISKS];
static struct virtq_rings rings[NDISKS];
static struct req_hdr hdr __attribute__((aligned(16)));
static volatile u8 status_byte;
static u8 buf[BUF_LEN] __attribute__((aligned(4096)));
static struct strbuf err;
static struct strbuf msg;
static u64 refused;

static void say(const char *s)
{
	serial_puts("blk-test: ");
	serial_puts(s);
	serial_puts("\n");
}

static NORETURN void fail(const char *what, int disk, u64 v)
{
	sb_reset(&msg);
	sb_str(&msg, "disk ");
	sb_dec(&msg, (u64)disk);
	sb_str(&msg, ": ");
	sb_str(&msg, what);
	sb_str(&msg, " (");
	sb_dec(&msg, v);
	sb_str(&msg, ")");
	result_fail(msg.buf);
}

static u8 pat(u64 off, u32 k)
{
	return (u8)(off % 251 + k);
}

static u32 cfg32(const struct blk *b, u32 off)
{
	return mmio_read32(b->dev.base + off);
}

/* The capacity, read consistently (ConfigGeneration unchanged across both halves). */
static u64 capacity(const struct blk *b)
{
	for (;;) {
		u32 gen = virtio_mmio_read(&b->dev, VIRTIO_MMIO_CONFIG_GENERATION);
		u64 lo = cfg32(b, CFG_CAPACITY), hi = cfg32(b, CFG_CAPACITY + 4);
		if (virtio_mmio_read(&b->dev, VIRTIO_MMIO_CONFIG_GENERATION) == gen)
			return (hi << 32) | lo;
	}
}

/* One request: header, `len` bytes of `data` (device-writable when `to_guest`), status.
 * Returns the status byte; *used gets the used length. */
static u8 request(int d, u32 type, u64 sector, void *data, u32 len, int to_guest, u32 *used)
{
	struct blk *b = &disks[d];
	u16 n = 0;
	hdr.type = type;
	hdr.reserved = 0;
	hdr.sector = sector;
	status_byte = 0xff;
	virtq_set_desc(&b->vq, n, &hdr, sizeof(hdr), VIRTQ_DESC_F_NEXT, (u16)(n + 1));
	n++;
	if (len) {
		virtq_set_desc(&b->vq, n, data, len,
			       VIRTQ_DESC_F_NEXT | (to_guest ? VIRTQ_DESC_F_WRITE : 0), (u16)(n + 1));
		n++;
	}
	virtq_set_desc(&b->vq, n, (const void *)&status_byte, 1, VIRTQ_DESC_F_WRITE, 0);
	virtq_push(&b->vq, 0);
	virtq_notify(&b->vq);
	struct deadline dl;
	deadline_start_ms(&dl, WAIT_MS);
	u32 id, l;
	while (!virtq_pop_used(&b->vq, &id, &l)) {
		if (deadline_expired(&dl))
			fail("no completion for request type", d, type);
		cpu_relax();
	}
	if (id != 0)
		fail("completion for a chain we did not send", d, id);
	barrier();
	if (used)
		*used = l;
	return status_byte;
}

static void expect_status(int d, u32 type, u64 sector, void *data, u32 len, int to_guest,
			  u8 want)
{
	u8 st = request(d, type, sector, data, len, to_guest, 0);
	if (st != want) {
		sb_reset(&msg);
		sb_str(&msg, "disk ");
		sb_dec(&msg, (u64)d);
		sb_str(&msg, ": request type ");
		sb_dec(&msg, type);
		sb_str(&msg, " sector ");
		sb_dec(&msg, sector);
		sb_str(&msg, ": status ");
		sb_dec(&msg, st);
		sb_str(&msg, ", want ");
		sb_dec(&msg, want);
		result_fail(msg.buf);
	}
	if (want != S_OK)
		refused++;
}

static void check_bytes(int d, u64 sector, u32 len, u32 k, int zero)
{
	for (u32 i = 0; i < len; i++) {
		u8 want = zero ? 0 : pat(sector * 512 + i, k);
		if (buf[i] != want)
			fail("unexpected byte at disk offset", d, sector * 512 + i);
	}
}

static void read_serial(int d, struct strbuf *sb)
{
	mem_set(buf, 0, 32);
	expect_status(d, T_GET_ID, 0, buf, 20, 1, S_OK);
	for (int i = 0; i < 20 && buf[i]; i++)
		sb_char(sb, (char)buf[i]);
}

static void setup(int d)
{
	struct blk *b = &disks[d];
	u64 want = (1ull << BLK_F_SIZE_MAX) | (1ull << BLK_F_SEG_MAX) | (1ull << BLK_F_RO) |
		   (1ull << BLK_F_BLK_SIZE) | (1ull << BLK_F_FLUSH) | (1ull << BLK_F_DISCARD) |
		   (1ull << BLK_F_WRITE_ZEROES);
	if (virtio_mmio_find_nth(boot_cmdline(), VIRTIO_ID_BLOCK, (u32)d, &b->dev, &err) != 0)
		result_fail(err.buf);
	if (virtio_mmio_negotiate_features(&b->dev, want, &b->features, &err) != 0)
		result_fail(err.buf);
	if (virtio_mmio_setup_queue(&b->dev, 0, 4, &rings[d], &b->vq, &err) != 0)
		result_fail(err.buf);
	if (virtio_mmio_driver_ok(&b->dev, &err) != 0)
		result_fail(err.buf);
	sb_reset(&msg);
	sb_str(&msg, "disk ");
	sb_dec(&msg, (u64)d);
	sb_str(&msg, " capacity ");
	sb_dec(&msg, capacity(b));
	sb_str(&msg, " blk_size ");
	sb_dec(&msg, (b->features & (1ull << BLK_F_BLK_SIZE)) ? cfg32(b, CFG_BLK_SIZE) : 0);
	sb_str(&msg, " seg_max ");
	sb_dec(&msg, (b->features & (1ull << BLK_F_SEG_MAX)) ? cfg32(b, CFG_SEG_MAX) : 0);
	sb_str(&msg, " size_max ");
	sb_dec(&msg, (b->features & (1ull << BLK_F_SIZE_MAX)) ? cfg32(b, CFG_SIZE_MAX) : 0);
	sb_str(&msg, " ro ");
	sb_dec(&msg, (b->features >> BLK_F_RO) & 1);
	sb_str(&msg, " flush ");
	sb_dec(&msg, (b->features >> BLK_F_FLUSH) & 1);
	sb_str(&msg, " discard ");
	sb_dec(&msg, (b->features >> BLK_F_DISCARD) & 1);
	sb_str(&msg, " write_zeroes ");
	sb_dec(&msg, (b->features >> BLK_F_WRITE_ZEROES) & 1);
	sb_str(&msg, " serial ");
	read_serial(d, &msg);
	say(msg.buf);
}

static void range(u64 sector, u32 num)
{
	mem_set(buf, 0, 16);
	for (int i = 0; i < 8; i++)
		buf[i] = (u8)(sector >> (8 * i));
	for (int i = 0; i < 4; i++)
		buf[8 + i] = (u8)(num >> (8 * i));
}

static void wait_capacity(const struct blk *b, int nonzero)
{
	struct deadline dl;
	deadline_start_ms(&dl, WAIT_MS);
	while ((capacity(b) != 0) != nonzero) {
		if (deadline_expired(&dl))
			fail(nonzero ? "no attach seen" : "no detach seen", 2, capacity(b));
		delay_ms(1);
	}
	u32 isr = virtio_mmio_read(&b->dev, VIRTIO_MMIO_INTERRUPT_STATUS);
	if (!(isr & INT_CONFIG))
		fail("capacity changed without the config interrupt status", 2, isr);
	virtio_mmio_write(&b->dev, VIRTIO_MMIO_INTERRUPT_ACK, INT_CONFIG);
}

void guest_main(void)
{
	for (int d = 0; d < NDISKS; d++)
		setup(d);

	/* vda: read, write, flush, discard, write-zeroes, out of range, unknown type. */
	u64 cap0 = capacity(&disks[0]);
	expect_status(0, T_IN, 0, buf, BUF_LEN, 1, S_OK);
	check_bytes(0, 0, BUF_LEN, 0, 0);
	for (u32 i = 0; i < 4096; i++)
		buf[i] = pat(8 * 512 + i, 3);
	expect_status(0, T_OUT, 8, buf, 4096, 0, S_OK);
	mem_set(buf, 0, BUF_LEN);
	expect_status(0, T_IN, 8, buf, 4096, 1, S_OK);
	check_bytes(0, 8, 4096, 3, 0);
	expect_status(0, T_FLUSH, 0, 0, 0, 0, S_OK);
	range(16, 8);
	expect_status(0, T_DISCARD, 0, buf, 16, 0, S_OK);
	range(24, 8);
	expect_status(0, T_WRITE_ZEROES, 0, buf, 16, 0, S_OK);
	expect_status(0, T_IN, 16, buf, 8192, 1, S_OK);
	check_bytes(0, 16, 8192, 0, 1);
	expect_status(0, T_IN, cap0, buf, 512, 1, S_IOERR);
	expect_status(0, 99, 0, 0, 0, 0, S_UNSUPP);
	say("vda read write flush discard write-zeroes ok");

	/* vdb: read-only. */
	for (u32 i = 0; i < 512; i++)
		buf[i] = 0x5a;
	expect_status(1, T_OUT, 0, buf, 512, 0, S_IOERR);
	expect_status(1, T_IN, 0, buf, 512, 1, S_OK);
	check_bytes(1, 0, 512, 1, 0);
	say("vdb write refused, read ok");

	/* vdc: empty, attached, detached. */
	expect_status(2, T_IN, 0, buf, 512, 1, S_IOERR);
	say("waiting for attach");
	wait_capacity(&disks[2], 1);
	expect_status(2, T_IN, 0, buf, 4096, 1, S_OK);
	check_bytes(2, 0, 4096, 2, 0);
	sb_reset(&msg);
	sb_str(&msg, "attached capacity ");
	sb_dec(&msg, capacity(&disks[2]));
	sb_str(&msg, " serial ");
	read_serial(2, &msg);
	say(msg.buf);
	say("waiting for detach");
	wait_capacity(&disks[2], 0);
	expect_status(2, T_IN, 0, buf, 512, 1, S_IOERR);
	say("detached");

	sb_reset(&msg);
	sb_str(&msg, "errors=");
	sb_dec(&msg, refused);
	result_pass(msg.buf);
}
