/* Minimal virtio-mmio driver: see virtio_mmio.h. */
#include "virtio_mmio.h"

static const char DEVICE_KEY[] = "virtio_mmio.device=";

#define PTE_PRESENT 0x1ull
#define PTE_WRITABLE 0x2ull
#define PTE_PCD 0x10ull /* cache disabled: device registers */
#define PTE_LARGE 0x80ull
#define PTE_ADDR_MASK 0x000ffffffffff000ull

static u64 gap_pd[512] __attribute__((aligned(4096)));

void virtio_mmio_map_gap(void)
{
	u64 cr3;
	__asm__ volatile("mov %%cr3, %0" : "=r"(cr3));
	/* The page tables live in the identity-mapped first GiB, so their physical address is
	 * usable as a pointer. */
	volatile u64 *pml4 = (volatile u64 *)(usize)(cr3 & PTE_ADDR_MASK);
	volatile u64 *pdpt = (volatile u64 *)(usize)(pml4[0] & PTE_ADDR_MASK);
	if (pdpt[3] & PTE_PRESENT)
		return;
	for (u64 i = 0; i < 512; i++)
		gap_pd[i] = (0xc0000000ull + (i << 21)) | PTE_PRESENT | PTE_WRITABLE | PTE_PCD |
			    PTE_LARGE;
	pdpt[3] = (u64)(usize)gap_pd | PTE_PRESENT | PTE_WRITABLE;
	__asm__ volatile("mov %0, %%cr3" : : "r"(cr3) : "memory"); /* flush the TLB */
}

/* Parses `<size>[KMG]@<base>:<irq>`; returns 0 on success. */
static int parse_device_spec(const char **s, u64 *size, u64 *base, u64 *irq)
{
	if (!parse_u64(s, size))
		return -1;
	switch (**s) {
	case 'K': case 'k': *size <<= 10; (*s)++; break;
	case 'M': case 'm': *size <<= 20; (*s)++; break;
	case 'G': case 'g': *size <<= 30; (*s)++; break;
	default: break;
	}
	if (**s != '@')
		return -1;
	(*s)++;
	if (!parse_u64(s, base))
		return -1;
	*irq = 0;
	if (**s == ':') {
		(*s)++;
		if (!parse_u64(s, irq))
			return -1;
	}
	return 0;
}

int virtio_mmio_find(const char *cmdline, u32 device_id, struct virtio_mmio_dev *dev,
		     struct strbuf *err)
{
	return virtio_mmio_find_nth(cmdline, device_id, 0, dev, err);
}

int virtio_mmio_find_nth(const char *cmdline, u32 device_id, u32 nth, struct virtio_mmio_dev *dev,
			 struct strbuf *err)
{
	const char *p = cmdline;
	u32 seen = 0;
	virtio_mmio_map_gap();
	sb_reset(err);
	sb_str(err, "no virtio-mmio device with id ");
	sb_dec(err, device_id);
	sb_str(err, " on the command line (seen:");
	while ((p = cmdline_find(p, DEVICE_KEY)) != 0) {
		u64 size, base, irq;
		if (parse_device_spec(&p, &size, &base, &irq) != 0) {
			sb_reset(err);
			sb_str(err, "cannot parse virtio_mmio.device= on the command line");
			return -1;
		}
		if (size < 0x200 || base < 0x100000000ull - 0x40000000ull ||
		    base >= 0x100000000ull || (base & 0x1ff)) {
			sb_reset(err);
			sb_str(err, "virtio_mmio.device= outside the 3-4 GiB MMIO gap: base ");
			sb_hex(err, base);
			sb_str(err, " size ");
			sb_hex(err, size);
			return -1;
		}
		u32 magic = mmio_read32(base + VIRTIO_MMIO_MAGIC_VALUE);
		u32 version = mmio_read32(base + VIRTIO_MMIO_VERSION);
		u32 id = mmio_read32(base + VIRTIO_MMIO_DEVICE_ID);
		sb_str(err, " ");
		sb_hex(err, base);
		sb_str(err, " magic=");
		sb_hex(err, magic);
		sb_str(err, " version=");
		sb_dec(err, version);
		sb_str(err, " id=");
		sb_dec(err, id);
		seen++;
		if (magic != VIRTIO_MMIO_MAGIC || id != device_id)
			continue;
		if (nth > 0) {
			nth--;
			continue;
		}
		if (version != 2) {
			sb_str(err, "; only virtio-mmio version 2 is supported)");
			return -1;
		}
		dev->base = base;
		dev->irq = (u32)irq;
		dev->device_id = id;
		return 0;
	}
	if (!seen)
		sb_str(err, " none");
	sb_str(err, ")");
	return -1;
}

static void status_fail(const struct virtio_mmio_dev *dev, struct strbuf *err, const char *what)
{
	u32 status = virtio_mmio_read(dev, VIRTIO_MMIO_STATUS);
	sb_reset(err);
	sb_str(err, what);
	sb_str(err, " (device status ");
	sb_hex(err, status);
	sb_str(err, ")");
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, status | VIRTIO_STATUS_FAILED);
}

int virtio_mmio_negotiate_features(const struct virtio_mmio_dev *dev, u64 want, u64 *accepted,
				   struct strbuf *err)
{
	u32 status;
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, 0);
	if (virtio_mmio_read(dev, VIRTIO_MMIO_STATUS) != 0) {
		status_fail(dev, err, "device did not reset: status not 0 after writing 0");
		return -1;
	}
	status = VIRTIO_STATUS_ACKNOWLEDGE;
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, status);
	status |= VIRTIO_STATUS_DRIVER;
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, status);

	virtio_mmio_write(dev, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 0);
	u32 features_lo = virtio_mmio_read(dev, VIRTIO_MMIO_DEVICE_FEATURES);
	virtio_mmio_write(dev, VIRTIO_MMIO_DEVICE_FEATURES_SEL, 1);
	u32 features_hi = virtio_mmio_read(dev, VIRTIO_MMIO_DEVICE_FEATURES);
	u64 offered = ((u64)features_hi << 32) | features_lo;
	if (!(offered & (1ull << VIRTIO_F_VERSION_1))) {
		sb_reset(err);
		sb_str(err, "device does not offer VIRTIO_F_VERSION_1 (features ");
		sb_hex(err, offered);
		sb_str(err, ")");
		return -1;
	}
	u64 take = (1ull << VIRTIO_F_VERSION_1) | (want & offered);
	virtio_mmio_write(dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 0);
	virtio_mmio_write(dev, VIRTIO_MMIO_DRIVER_FEATURES, (u32)take);
	virtio_mmio_write(dev, VIRTIO_MMIO_DRIVER_FEATURES_SEL, 1);
	virtio_mmio_write(dev, VIRTIO_MMIO_DRIVER_FEATURES, (u32)(take >> 32));

	status |= VIRTIO_STATUS_FEATURES_OK;
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, status);
	if (!(virtio_mmio_read(dev, VIRTIO_MMIO_STATUS) & VIRTIO_STATUS_FEATURES_OK)) {
		status_fail(dev, err, "device rejected our features (FEATURES_OK did not stick)");
		return -1;
	}
	if (accepted)
		*accepted = take;
	return 0;
}

int virtio_mmio_negotiate(const struct virtio_mmio_dev *dev, struct strbuf *err)
{
	return virtio_mmio_negotiate_features(dev, 0, 0, err);
}

int virtio_mmio_setup_queue(const struct virtio_mmio_dev *dev, u16 index, u16 want_size,
			    struct virtq_rings *rings, struct virtq *vq, struct strbuf *err)
{
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_SEL, index);
	if (virtio_mmio_read(dev, VIRTIO_MMIO_QUEUE_READY) != 0) {
		status_fail(dev, err, "queue already ready before set-up");
		return -1;
	}
	u32 max = virtio_mmio_read(dev, VIRTIO_MMIO_QUEUE_NUM_MAX);
	if (max == 0) {
		sb_reset(err);
		sb_str(err, "queue ");
		sb_dec(err, index);
		sb_str(err, " not available (QueueNumMax 0)");
		return -1;
	}
	u16 size = 1;
	while ((u32)size * 2 <= max && size * 2 <= want_size && size * 2 <= VIRTQ_MAX_SIZE)
		size *= 2;

	mem_set(rings, 0, sizeof(*rings));
	vq->base = dev->base;
	vq->index = index;
	vq->size = size;
	vq->next_avail = 0;
	vq->last_used = 0;
	vq->rings = rings;

	u64 desc = (u64)(usize)&rings->desc[0];
	u64 avail = (u64)(usize)&rings->avail;
	u64 used = (u64)(usize)&rings->used;
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_NUM, size);
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DESC_LOW, (u32)desc);
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DESC_HIGH, (u32)(desc >> 32));
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DRIVER_LOW, (u32)avail);
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DRIVER_HIGH, (u32)(avail >> 32));
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DEVICE_LOW, (u32)used);
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_DEVICE_HIGH, (u32)(used >> 32));
	virtio_mmio_write(dev, VIRTIO_MMIO_QUEUE_READY, 1);
	if (virtio_mmio_read(dev, VIRTIO_MMIO_QUEUE_READY) != 1) {
		status_fail(dev, err, "QueueReady did not stick");
		return -1;
	}
	return 0;
}

int virtio_mmio_driver_ok(const struct virtio_mmio_dev *dev, struct strbuf *err)
{
	u32 status = virtio_mmio_read(dev, VIRTIO_MMIO_STATUS);
	virtio_mmio_write(dev, VIRTIO_MMIO_STATUS, status | VIRTIO_STATUS_DRIVER_OK);
	status = virtio_mmio_read(dev, VIRTIO_MMIO_STATUS);
	if (status & (VIRTIO_STATUS_NEEDS_RESET | VIRTIO_STATUS_FAILED) ||
	    !(status & VIRTIO_STATUS_DRIVER_OK)) {
		status_fail(dev, err, "device not live after DRIVER_OK");
		return -1;
	}
	return 0;
}
