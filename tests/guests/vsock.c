/* virtio-vsock driver for the test guests: see vsock.h. */
#include "vsock.h"

/* Each rx buffer: 4 bytes of padding, then the 44-byte header, so the payload is 8-aligned. */
#define RX_HDR_OFFSET 4
#define RX_PAYLOAD_OFFSET (RX_HDR_OFFSET + 44)
#define RX_STRIDE (RX_PAYLOAD_OFFSET + VSOCK_RX_PAYLOAD)
#define EVENT_BUFS 4

static struct virtq_rings rx_rings, tx_rings, event_rings;
static u8 rx_mem[VSOCK_RX_BUFS][RX_STRIDE] __attribute__((aligned(64)));
static struct vsock_hdr tx_hdrs[VSOCK_TX_SLOTS] __attribute__((aligned(64)));
static u32 event_mem[EVENT_BUFS][2] __attribute__((aligned(8)));

static void rx_post(struct vsock_dev *v, u16 id)
{
	virtq_set_desc(&v->rx, id, &rx_mem[id][RX_HDR_OFFSET], 44 + VSOCK_RX_PAYLOAD,
		       VIRTQ_DESC_F_WRITE, 0);
	virtq_push(&v->rx, id);
}

int vsock_init(struct vsock_dev *v, const char *cmdline, struct strbuf *err)
{
	mem_set(v, 0, sizeof(*v));
	if (virtio_mmio_find(cmdline, VIRTIO_ID_VSOCK, &v->dev, err) != 0)
		return -1;
	if (virtio_mmio_negotiate(&v->dev, err) != 0)
		return -1;
	if (virtio_mmio_setup_queue(&v->dev, VSOCK_QUEUE_RX, VSOCK_RX_BUFS, &rx_rings, &v->rx, err) ||
	    virtio_mmio_setup_queue(&v->dev, VSOCK_QUEUE_TX, 2 * VSOCK_TX_SLOTS, &tx_rings, &v->tx,
				    err) ||
	    virtio_mmio_setup_queue(&v->dev, VSOCK_QUEUE_EVENT, EVENT_BUFS, &event_rings, &v->event,
				    err))
		return -1;
	if (v->tx.size < 2) {
		sb_reset(err);
		sb_str(err, "tx queue too small for header+payload chains");
		return -1;
	}
	v->tx_slots = v->tx.size / 2;

	u32 gen, lo, hi;
	do {
		gen = virtio_mmio_read(&v->dev, VIRTIO_MMIO_CONFIG_GENERATION);
		lo = virtio_mmio_read(&v->dev, VIRTIO_MMIO_CONFIG + 0);
		hi = virtio_mmio_read(&v->dev, VIRTIO_MMIO_CONFIG + 4);
	} while (gen != virtio_mmio_read(&v->dev, VIRTIO_MMIO_CONFIG_GENERATION));
	v->guest_cid = ((u64)hi << 32) | lo;
	if (v->guest_cid <= VSOCK_HOST_CID || v->guest_cid >= 0xffffffffull) {
		sb_reset(err);
		sb_str(err, "invalid guest_cid in config space: ");
		sb_dec(err, v->guest_cid);
		return -1;
	}

	for (u16 i = 0; i < v->rx.size; i++)
		rx_post(v, i);
	for (u16 i = 0; i < v->event.size && i < EVENT_BUFS; i++) {
		virtq_set_desc(&v->event, i, event_mem[i], sizeof(event_mem[i]), VIRTQ_DESC_F_WRITE, 0);
		virtq_push(&v->event, i);
	}
	if (virtio_mmio_driver_ok(&v->dev, err) != 0)
		return -1;
	virtq_notify(&v->rx);
	virtq_notify(&v->event);
	return 0;
}

int vsock_reap_tx(struct vsock_dev *v, struct strbuf *err)
{
	u32 id, len;
	while (virtq_pop_used(&v->tx, &id, &len)) {
		u32 slot = id / 2;
		if ((id & 1) || slot >= v->tx_slots || !v->slots[slot].busy) {
			sb_reset(err);
			sb_str(err, "device returned tx descriptor ");
			sb_dec(err, id);
			sb_str(err, " that is not in flight");
			return -1;
		}
		v->slots[slot].busy = 0;
	}
	return 0;
}

int vsock_tx_idle(const struct vsock_dev *v)
{
	for (u32 i = 0; i < v->tx_slots; i++)
		if (v->slots[i].busy)
			return 0;
	return 1;
}

int vsock_tx_slot_free(const struct vsock_dev *v)
{
	for (u32 i = 0; i < v->tx_slots; i++)
		if (!v->slots[i].busy)
			return 1;
	return 0;
}

static int send_raw(struct vsock_dev *v, const struct vsock_hdr *h, const void *payload, u32 len,
		    u32 tag)
{
	u32 slot;
	for (slot = 0; slot < v->tx_slots; slot++)
		if (!v->slots[slot].busy)
			break;
	if (slot == v->tx_slots)
		return 0;
	tx_hdrs[slot] = *h;
	u16 head = (u16)(slot * 2);
	if (len) {
		virtq_set_desc(&v->tx, head, &tx_hdrs[slot], sizeof(struct vsock_hdr),
			       VIRTQ_DESC_F_NEXT, head + 1);
		virtq_set_desc(&v->tx, head + 1, payload, len, 0, 0);
	} else {
		virtq_set_desc(&v->tx, head, &tx_hdrs[slot], sizeof(struct vsock_hdr), 0, 0);
	}
	v->slots[slot].busy = 1;
	v->slots[slot].tag = tag;
	v->slots[slot].len = len;
	virtq_push(&v->tx, head);
	virtq_notify(&v->tx);
	return 1;
}

int vsock_send(struct vsock_dev *v, struct vsock_conn *c, u16 op, u32 flags, const void *payload,
	       u32 len, u32 tag)
{
	struct vsock_hdr h;
	h.src_cid = v->guest_cid;
	h.dst_cid = c->peer_cid;
	h.src_port = c->local_port;
	h.dst_port = c->peer_port;
	h.len = op == VSOCK_OP_RW ? len : 0;
	h.type = VSOCK_TYPE_STREAM;
	h.op = op;
	h.flags = flags;
	h.buf_alloc = c->buf_alloc;
	h.fwd_cnt = c->fwd_cnt;
	if (!send_raw(v, &h, payload, h.len, tag))
		return 0;
	c->adv_fwd_cnt = c->fwd_cnt;
	if (op == VSOCK_OP_RW)
		c->tx_cnt += len;
	return 1;
}

int vsock_rx_next(struct vsock_dev *v, struct vsock_rx_pkt *pkt, struct strbuf *err)
{
	u32 id, written;
	if (!virtq_pop_used(&v->rx, &id, &written))
		return 0;
	if (id >= v->rx.size) {
		sb_reset(err);
		sb_str(err, "device returned rx descriptor ");
		sb_dec(err, id);
		sb_str(err, " out of range");
		return -1;
	}
	const struct vsock_hdr *h = (const struct vsock_hdr *)&rx_mem[id][RX_HDR_OFFSET];
	pkt->hdr = h;
	pkt->payload = &rx_mem[id][RX_PAYLOAD_OFFSET];
	pkt->id = (u16)id;
	pkt->len = h->len;
	if (written < sizeof(struct vsock_hdr) || h->len > VSOCK_RX_PAYLOAD ||
	    h->len > written - sizeof(struct vsock_hdr)) {
		sb_reset(err);
		sb_str(err, "malformed rx packet: used len ");
		sb_dec(err, written);
		sb_str(err, ", header len ");
		sb_dec(err, written >= sizeof(struct vsock_hdr) ? h->len : 0);
		sb_str(err, ", op ");
		sb_str(err, written >= sizeof(struct vsock_hdr) ? vsock_op_name(h->op) : "?");
		vsock_rx_done(v, (u16)id);
		return -1;
	}
	return 1;
}

void vsock_rx_done(struct vsock_dev *v, u16 id)
{
	rx_post(v, id);
	v->rx_kick = 1;
}

void vsock_rx_kick(struct vsock_dev *v)
{
	if (v->rx_kick) {
		v->rx_kick = 0;
		virtq_notify(&v->rx);
	}
}

int vsock_check_events(struct vsock_dev *v, struct strbuf *err)
{
	u32 id, len;
	if (!virtq_pop_used(&v->event, &id, &len))
		return 0;
	sb_reset(err);
	sb_str(err, "device posted vsock event id ");
	sb_dec(err, id < EVENT_BUFS ? event_mem[id][0] : 0xffffffffu);
	sb_str(err, " (transport reset)");
	return -1;
}

int vsock_conn_match(const struct vsock_conn *c, const struct vsock_dev *v,
		     const struct vsock_hdr *h)
{
	return h->src_cid == c->peer_cid && h->dst_cid == v->guest_cid &&
	       h->src_port == c->peer_port && h->dst_port == c->local_port &&
	       h->type == VSOCK_TYPE_STREAM;
}

void vsock_conn_update_peer(struct vsock_conn *c, const struct vsock_hdr *h)
{
	c->peer_buf_alloc = h->buf_alloc;
	c->peer_fwd_cnt = h->fwd_cnt;
}

u32 vsock_peer_credit(const struct vsock_conn *c)
{
	u32 in_flight = c->tx_cnt - c->peer_fwd_cnt;
	if (in_flight >= c->peer_buf_alloc)
		return 0;
	return c->peer_buf_alloc - in_flight;
}

void vsock_reply_rst(struct vsock_dev *v, const struct vsock_hdr *h)
{
	if (h->op == VSOCK_OP_RST)
		return;
	struct vsock_hdr r;
	mem_set(&r, 0, sizeof(r));
	r.src_cid = v->guest_cid;
	r.dst_cid = h->src_cid;
	r.src_port = h->dst_port;
	r.dst_port = h->src_port;
	r.type = VSOCK_TYPE_STREAM;
	r.op = VSOCK_OP_RST;
	send_raw(v, &r, 0, 0, 0); /* best effort: a stray packet is not worth waiting for */
}

const char *vsock_op_name(u16 op)
{
	switch (op) {
	case VSOCK_OP_REQUEST: return "REQUEST";
	case VSOCK_OP_RESPONSE: return "RESPONSE";
	case VSOCK_OP_RST: return "RST";
	case VSOCK_OP_SHUTDOWN: return "SHUTDOWN";
	case VSOCK_OP_RW: return "RW";
	case VSOCK_OP_CREDIT_UPDATE: return "CREDIT_UPDATE";
	case VSOCK_OP_CREDIT_REQUEST: return "CREDIT_REQUEST";
	default: return "unknown-op";
	}
}
