/* A minimal virtio-mmio (version 2) driver for the test guests: device discovery from the
 * kernel command line, feature negotiation and split virtqueues in static memory. The guests
 * run identity-mapped, so a pointer is its own guest-physical address. Completions are found
 * by polling the used rings; interrupts are never enabled or relied upon. */
#ifndef MICROVM_GUEST_VIRTIO_MMIO_H
#define MICROVM_GUEST_VIRTIO_MMIO_H

#include "common.h"
#include "strbuf.h"

/* Register offsets (virtio spec 1.x, 4.2.2). */
#define VIRTIO_MMIO_MAGIC_VALUE 0x000
#define VIRTIO_MMIO_VERSION 0x004
#define VIRTIO_MMIO_DEVICE_ID 0x008
#define VIRTIO_MMIO_VENDOR_ID 0x00c
#define VIRTIO_MMIO_DEVICE_FEATURES 0x010
#define VIRTIO_MMIO_DEVICE_FEATURES_SEL 0x014
#define VIRTIO_MMIO_DRIVER_FEATURES 0x020
#define VIRTIO_MMIO_DRIVER_FEATURES_SEL 0x024
#define VIRTIO_MMIO_QUEUE_SEL 0x030
#define VIRTIO_MMIO_QUEUE_NUM_MAX 0x034
#define VIRTIO_MMIO_QUEUE_NUM 0x038
#define VIRTIO_MMIO_QUEUE_READY 0x044
#define VIRTIO_MMIO_QUEUE_NOTIFY 0x050
#define VIRTIO_MMIO_INTERRUPT_STATUS 0x060
#define VIRTIO_MMIO_INTERRUPT_ACK 0x064
#define VIRTIO_MMIO_STATUS 0x070
#define VIRTIO_MMIO_QUEUE_DESC_LOW 0x080
#define VIRTIO_MMIO_QUEUE_DESC_HIGH 0x084
#define VIRTIO_MMIO_QUEUE_DRIVER_LOW 0x090
#define VIRTIO_MMIO_QUEUE_DRIVER_HIGH 0x094
#define VIRTIO_MMIO_QUEUE_DEVICE_LOW 0x0a0
#define VIRTIO_MMIO_QUEUE_DEVICE_HIGH 0x0a4
#define VIRTIO_MMIO_CONFIG_GENERATION 0x0fc
#define VIRTIO_MMIO_CONFIG 0x100

#define VIRTIO_MMIO_MAGIC 0x74726976u /* "virt" */

/* Device status bits. */
#define VIRTIO_STATUS_ACKNOWLEDGE 1u
#define VIRTIO_STATUS_DRIVER 2u
#define VIRTIO_STATUS_DRIVER_OK 4u
#define VIRTIO_STATUS_FEATURES_OK 8u
#define VIRTIO_STATUS_NEEDS_RESET 64u
#define VIRTIO_STATUS_FAILED 128u

#define VIRTIO_F_VERSION_1 32

/* Split virtqueue (virtio spec 2.7). */
#define VIRTQ_DESC_F_NEXT 1
#define VIRTQ_DESC_F_WRITE 2
#define VIRTQ_MAX_SIZE 16

struct virtq_desc {
	u64 addr;
	u32 len;
	u16 flags;
	u16 next;
};

struct virtq_used_elem {
	u32 id;
	u32 len;
};

/* The rings of one queue; sized for VIRTQ_MAX_SIZE, a smaller queue uses a prefix. */
struct virtq_rings {
	struct virtq_desc desc[VIRTQ_MAX_SIZE] __attribute__((aligned(16)));
	struct {
		u16 flags;
		u16 idx;
		u16 ring[VIRTQ_MAX_SIZE];
		u16 used_event;
	} avail __attribute__((aligned(2)));
	struct {
		u16 flags;
		u16 idx;
		struct virtq_used_elem ring[VIRTQ_MAX_SIZE];
		u16 avail_event;
	} used __attribute__((aligned(4)));
} __attribute__((aligned(4096)));

struct virtq {
	u64 base;      /* the device's MMIO base */
	u16 index;     /* queue number */
	u16 size;      /* a power of two, <= VIRTQ_MAX_SIZE */
	u16 next_avail; /* shadow of avail.idx */
	u16 last_used; /* used entries consumed so far */
	struct virtq_rings *rings;
};

struct virtio_mmio_dev {
	u64 base;
	u32 irq;
	u32 device_id;
};

/* Maps the 3-4 GiB MMIO gap (uncached, 2 MiB pages) into the current identity map, which
 * covers only the first GiB on either boot entry. Idempotent. */
void virtio_mmio_map_gap(void);

/* Finds the first `virtio_mmio.device=<size>@<base>:<irq>` on the command line whose device
 * reports `device_id`. Returns 0 on success; otherwise writes what it saw into `err`. */
int virtio_mmio_find(const char *cmdline, u32 device_id, struct virtio_mmio_dev *dev,
		     struct strbuf *err);

/* The same for the `nth` (from 0) device with `device_id`, in command-line order. */
int virtio_mmio_find_nth(const char *cmdline, u32 device_id, u32 nth, struct virtio_mmio_dev *dev,
			 struct strbuf *err);

/* Reset, ACKNOWLEDGE, DRIVER, accept exactly VIRTIO_F_VERSION_1, FEATURES_OK (checked). */
int virtio_mmio_negotiate(const struct virtio_mmio_dev *dev, struct strbuf *err);

/* The same, also accepting the bits of `want` the device offers; *accepted (if not NULL) gets
 * what was accepted, VERSION_1 included. */
int virtio_mmio_negotiate_features(const struct virtio_mmio_dev *dev, u64 want, u64 *accepted,
				   struct strbuf *err);

/* Sets up queue `index` on `rings` with at most `want_size` entries. */
int virtio_mmio_setup_queue(const struct virtio_mmio_dev *dev, u16 index, u16 want_size,
			    struct virtq_rings *rings, struct virtq *vq, struct strbuf *err);

/* Sets DRIVER_OK; fails if the device reports NEEDS_RESET or FAILED. */
int virtio_mmio_driver_ok(const struct virtio_mmio_dev *dev, struct strbuf *err);

static inline u32 virtio_mmio_read(const struct virtio_mmio_dev *dev, u32 reg)
{
	return mmio_read32(dev->base + reg);
}

static inline void virtio_mmio_write(const struct virtio_mmio_dev *dev, u32 reg, u32 v)
{
	mmio_write32(dev->base + reg, v);
}

/* Publishes descriptor chain `head` in the avail ring (no notification). */
static inline void virtq_push(struct virtq *vq, u16 head)
{
	volatile struct virtq_rings *r = vq->rings;
	r->avail.ring[vq->next_avail & (vq->size - 1)] = head;
	barrier(); /* the ring entry is visible before the index (x86 keeps store order) */
	vq->next_avail++;
	r->avail.idx = vq->next_avail;
	barrier();
}

static inline void virtq_notify(struct virtq *vq)
{
	mfence(); /* avail.idx reaches memory before the device is told to look */
	mmio_write32(vq->base + VIRTIO_MMIO_QUEUE_NOTIFY, vq->index);
}

/* Takes the next used element, if any: returns 1 and fills *id and *len. */
static inline int virtq_pop_used(struct virtq *vq, u32 *id, u32 *len)
{
	volatile struct virtq_rings *r = vq->rings;
	if (r->used.idx == vq->last_used)
		return 0;
	barrier(); /* read the element only after seeing the index (x86 keeps load order) */
	u16 slot = vq->last_used & (vq->size - 1);
	*id = r->used.ring[slot].id;
	*len = r->used.ring[slot].len;
	vq->last_used++;
	return 1;
}

static inline int virtq_has_used(const struct virtq *vq)
{
	volatile const struct virtq_rings *r = vq->rings;
	return r->used.idx != vq->last_used;
}

static inline void virtq_set_desc(struct virtq *vq, u16 i, const void *addr, u32 len, u16 flags,
				  u16 next)
{
	volatile struct virtq_desc *d = &vq->rings->desc[i];
	d->addr = (u64)(usize)addr;
	d->len = len;
	d->flags = flags;
	d->next = next;
}

#endif
