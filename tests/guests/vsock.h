/* virtio-vsock (virtio spec 5.10) for the test guests: the packet header, the device with its
 * rx/tx/event queues, per-connection credit accounting. Polling only. */
#ifndef MICROVM_GUEST_VSOCK_H
#define MICROVM_GUEST_VSOCK_H

#include "common.h"
#include "strbuf.h"
#include "virtio_mmio.h"

#define VIRTIO_ID_VSOCK 19
#define VSOCK_HOST_CID 2
#define VSOCK_TYPE_STREAM 1

#define VSOCK_OP_REQUEST 1
#define VSOCK_OP_RESPONSE 2
#define VSOCK_OP_RST 3
#define VSOCK_OP_SHUTDOWN 4
#define VSOCK_OP_RW 5
#define VSOCK_OP_CREDIT_UPDATE 6
#define VSOCK_OP_CREDIT_REQUEST 7

#define VSOCK_SHUTDOWN_RCV 1u
#define VSOCK_SHUTDOWN_SEND 2u

#define VSOCK_QUEUE_RX 0
#define VSOCK_QUEUE_TX 1
#define VSOCK_QUEUE_EVENT 2
#define VSOCK_CONFIG_GUEST_CID 0x100

#define VSOCK_RX_BUFS 16
#define VSOCK_RX_PAYLOAD 4096 /* payload bytes per rx buffer */
#define VSOCK_TX_SLOTS 8      /* packets in flight: 2 descriptors each (header, payload) */
#define VSOCK_MAX_TX_PAYLOAD 4096

struct vsock_hdr {
	u64 src_cid;
	u64 dst_cid;
	u32 src_port;
	u32 dst_port;
	u32 len;
	u16 type;
	u16 op;
	u32 flags;
	u32 buf_alloc;
	u32 fwd_cnt;
} __attribute__((packed));

_Static_assert(sizeof(struct vsock_hdr) == 44, "virtio_vsock_hdr is 44 bytes");

/* One stream connection. Counters are u32 and wrap, as on the wire. */
struct vsock_conn {
	u64 peer_cid;
	u32 local_port;
	u32 peer_port;
	u32 buf_alloc;      /* our receive buffer, advertised */
	u32 fwd_cnt;        /* bytes we have consumed from our receive buffer */
	u32 adv_fwd_cnt;    /* fwd_cnt as last sent to the peer */
	u32 peer_buf_alloc; /* the peer's receive buffer */
	u32 peer_fwd_cnt;   /* bytes the peer has consumed */
	u32 tx_cnt;         /* RW bytes we have sent */
};

struct vsock_tx_slot {
	int busy;
	u32 tag; /* caller's value, e.g. the stream offset of the payload */
	u32 len; /* payload length */
};

struct vsock_dev {
	struct virtio_mmio_dev dev;
	u64 guest_cid;
	struct virtq rx, tx, event;
	struct vsock_tx_slot slots[VSOCK_TX_SLOTS];
	u32 tx_slots; /* usable slots: tx queue size / 2 */
	int rx_kick;  /* buffers re-posted since the last rx notify */
};

/* One received packet; valid until vsock_rx_done(). */
struct vsock_rx_pkt {
	const struct vsock_hdr *hdr;
	const u8 *payload; /* 8-byte aligned */
	u32 len;           /* == hdr->len, checked against what the device wrote */
	u16 id;
};

/* Finds the vsock device on the command line and brings it up (queues filled, DRIVER_OK). */
int vsock_init(struct vsock_dev *v, const char *cmdline, struct strbuf *err);

/* Frees the slots of completed tx packets; returns -1 on a used entry we never posted. */
int vsock_reap_tx(struct vsock_dev *v, struct strbuf *err);
int vsock_tx_idle(const struct vsock_dev *v);
int vsock_tx_slot_free(const struct vsock_dev *v);

/* Queues one packet on connection `c` and notifies: 1 sent, 0 no free slot (reap and retry).
 * `payload` (RW only) must stay untouched until the slot completes. */
int vsock_send(struct vsock_dev *v, struct vsock_conn *c, u16 op, u32 flags, const void *payload,
	       u32 len, u32 tag);

/* Takes the next received packet: 1 got one, 0 none, -1 malformed (err says how). */
int vsock_rx_next(struct vsock_dev *v, struct vsock_rx_pkt *pkt, struct strbuf *err);
/* Gives the buffer back to the device (notified by vsock_rx_kick()). */
void vsock_rx_done(struct vsock_dev *v, u16 id);
void vsock_rx_kick(struct vsock_dev *v);

/* -1 if the device posted an event (transport reset), else 0. */
int vsock_check_events(struct vsock_dev *v, struct strbuf *err);

/* Whether `h` belongs to connection `c`. */
int vsock_conn_match(const struct vsock_conn *c, const struct vsock_dev *v,
		     const struct vsock_hdr *h);
/* Takes the peer's credit from any packet of the connection. */
void vsock_conn_update_peer(struct vsock_conn *c, const struct vsock_hdr *h);
/* Bytes we may send now without overrunning the peer's buffer. */
u32 vsock_peer_credit(const struct vsock_conn *c);

/* Answers a packet that belongs to no connection with RST (never an RST to an RST). */
void vsock_reply_rst(struct vsock_dev *v, const struct vsock_hdr *h);

const char *vsock_op_name(u16 op);

#endif
