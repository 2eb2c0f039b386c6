/* vsock-echo: drives the VMM's virtio-vsock device from a freestanding guest.
 *
 * Phase A (host-initiated): listen on port 1234 (vsock_echo.listen_port=), accept a REQUEST
 * from the host (cid 2), echo every byte back until the host shuts down its send side (or
 * vsock_echo.host_bytes= bytes arrived), then shut down and reset the connection.
 * Phase B (guest-initiated): connect to cid 2 port 5678 (vsock_echo.connect_port=), send
 * vsock_echo.bytes= bytes (default 262144) of a fixed pattern, verify the host's echo.
 * vsock_echo.mode=host|guest runs one phase only (default both).
 *
 * Credit: received bytes are copied into a 64 KiB receive ring that we advertise as buf_alloc,
 * so every rx buffer goes back to the device at once and control packets (credit updates,
 * shutdown) always find room; echoes go out from the ring without a second copy, within the
 * host's credit. Phase B sends straight from the pattern buffer and verifies 8 bytes at a time.
 * Every wait is bounded (deadline.h); the result is one RESULT line on COM1.
 */
#include "common.h"
#include "deadline.h"
#include "strbuf.h"
#include "virtio_mmio.h"
#include "vsock.h"

#define ECHO_RING_SIZE 65536u /* power of two */
#define PATTERN_PERIOD 60000u /* bytes; deliberately not a power of two nor a page multiple */
#define CONNECT_WAIT_MS 60000u
#define IDLE_WAIT_MS 30000u
#define CLOSE_WAIT_MS 2000u
#define GUEST_PORT_BASE 49152u

typedef u64 u64_unaligned __attribute__((aligned(1), may_alias));

struct config {
	u32 listen_port;
	u32 connect_port;
	u64 guest_bytes;
	u64 host_bytes; /* 0: until the host shuts down */
	int run_host;
	int run_guest;
};

static struct vsock_dev vsock;
static struct strbuf err;
static struct strbuf msg;
static u8 echo_ring[ECHO_RING_SIZE] __attribute__((aligned(64)));
static u8 pattern[PATTERN_PERIOD + VSOCK_MAX_TX_PAYLOAD + 8] __attribute__((aligned(64)));

/* Copies 8 bytes at a time (x86 allows unaligned loads and stores). */
__attribute__((optimize("no-tree-loop-distribute-patterns")))
static void copy8(u8 *dst, const u8 *src, u32 n)
{
	while (n >= 8) {
		*(u64_unaligned *)dst = *(const u64_unaligned *)src;
		dst += 8;
		src += 8;
		n -= 8;
	}
	while (n--)
		*dst++ = *src++;
}

static NORETURN void fail(const char *phase, const char *what)
{
	struct strbuf line;
	sb_reset(&line);
	sb_str(&line, phase);
	sb_str(&line, ": ");
	sb_str(&line, what);
	result_fail(line.buf);
}

static void say(const char *s)
{
	serial_puts("vsock-echo: ");
	serial_puts(s);
	serial_puts("\n");
}

static u64 cmdline_u64(const char *key, u64 dflt)
{
	const char *p = cmdline_find(boot_cmdline(), key);
	u64 v;
	if (!p)
		return dflt;
	if (!parse_u64(&p, &v) || (*p != 0 && *p != ' ')) {
		sb_reset(&msg);
		sb_str(&msg, "bad value for ");
		sb_str(&msg, key);
		fail("cmdline", msg.buf);
	}
	return v;
}

static void read_config(struct config *cfg)
{
	cfg->listen_port = (u32)cmdline_u64("vsock_echo.listen_port=", 1234);
	cfg->connect_port = (u32)cmdline_u64("vsock_echo.connect_port=", 5678);
	cfg->guest_bytes = cmdline_u64("vsock_echo.bytes=", 262144);
	cfg->host_bytes = cmdline_u64("vsock_echo.host_bytes=", 0);
	if (cfg->guest_bytes > 0xffffffffull || cfg->host_bytes > 0xffffffffull)
		fail("cmdline", "byte counts must be below 4 GiB");
	cfg->run_host = 1;
	cfg->run_guest = 1;
	const char *mode = cmdline_find(boot_cmdline(), "vsock_echo.mode=");
	if (mode) {
		if (str_starts_with(mode, "host"))
			cfg->run_guest = 0;
		else if (str_starts_with(mode, "guest"))
			cfg->run_host = 0;
		else if (!str_starts_with(mode, "both"))
			fail("cmdline", "vsock_echo.mode= must be host, guest or both");
	}
}

/* Fails the phase on a device event (transport reset) or a bogus tx completion. */
static void check_device(const char *phase)
{
	if (vsock_check_events(&vsock, &err) || vsock_reap_tx(&vsock, &err))
		fail(phase, err.buf);
}

static void describe_conn(struct strbuf *sb, const struct vsock_conn *c)
{
	sb_str(sb, " (peer credit ");
	sb_dec(sb, vsock_peer_credit(c));
	sb_str(sb, ", peer buf_alloc ");
	sb_dec(sb, c->peer_buf_alloc);
	sb_str(sb, ", our fwd_cnt ");
	sb_dec(sb, c->fwd_cnt);
	sb_str(sb, ", device status ");
	sb_hex(sb, virtio_mmio_read(&vsock.dev, VIRTIO_MMIO_STATUS));
	sb_str(sb, ")");
}

/* Sends a packet, waiting (bounded) for a free tx slot. */
static void send_or_fail(const char *phase, struct vsock_conn *c, u16 op, u32 flags)
{
	struct deadline dl;
	deadline_start_ms(&dl, IDLE_WAIT_MS);
	while (!vsock_send(&vsock, c, op, flags, 0, 0, 0)) {
		check_device(phase);
		if (deadline_expired(&dl)) {
			sb_reset(&msg);
			sb_str(&msg, "no tx slot to send ");
			sb_str(&msg, vsock_op_name(op));
			sb_str(&msg, ": the device does not complete tx packets");
			fail(phase, msg.buf);
		}
		cpu_relax();
	}
}

/* SHUTDOWN both ways, then wait briefly for the peer's RST; reset ourselves if none came. */
static void close_conn(const char *phase, struct vsock_conn *c)
{
	struct deadline dl;
	struct vsock_rx_pkt p;
	int r, reset = 0;
	send_or_fail(phase, c, VSOCK_OP_SHUTDOWN, VSOCK_SHUTDOWN_RCV | VSOCK_SHUTDOWN_SEND);
	deadline_start_ms(&dl, CLOSE_WAIT_MS);
	while (!reset && !deadline_expired(&dl)) {
		check_device(phase);
		while ((r = vsock_rx_next(&vsock, &p, &err)) == 1) {
			if (vsock_conn_match(c, &vsock, p.hdr)) {
				if (p.hdr->op == VSOCK_OP_RST)
					reset = 1;
			} else {
				vsock_reply_rst(&vsock, p.hdr);
			}
			vsock_rx_done(&vsock, p.id);
		}
		if (r < 0)
			fail(phase, err.buf);
		vsock_rx_kick(&vsock);
		cpu_relax();
	}
	if (!reset)
		send_or_fail(phase, c, VSOCK_OP_RST, 0);
}

/* ---- Phase A: the host connects to us and we echo. ---- */

struct echo {
	struct vsock_conn c;
	int connected;
	int peer_done;        /* SHUTDOWN(SEND) or RST from the host */
	int peer_reset;
	int credit_requested; /* we asked the host for credit */
	int credit_asked;     /* the host asked us for a CREDIT_UPDATE */
	u32 head;             /* bytes received = ring head (stream offset) */
	u32 sent;             /* bytes handed to tx */
	u32 tail;             /* bytes whose tx completed: ring tail, our fwd_cnt */
};

static void echo_rx(const struct config *cfg, struct echo *e, const struct vsock_rx_pkt *p)
{
	const struct vsock_hdr *h = p->hdr;
	if (!e->connected) {
		if (h->op == VSOCK_OP_REQUEST && h->dst_port == cfg->listen_port &&
		    h->dst_cid == vsock.guest_cid && h->src_cid == VSOCK_HOST_CID &&
		    h->type == VSOCK_TYPE_STREAM) {
			e->c.peer_cid = h->src_cid;
			e->c.peer_port = h->src_port;
			vsock_conn_update_peer(&e->c, h);
			send_or_fail("host-initiated", &e->c, VSOCK_OP_RESPONSE, 0);
			e->connected = 1;
			sb_reset(&msg);
			sb_str(&msg, "host connected from cid 2 port ");
			sb_dec(&msg, h->src_port);
			sb_str(&msg, ", its buf_alloc ");
			sb_dec(&msg, h->buf_alloc);
			say(msg.buf);
		} else {
			vsock_reply_rst(&vsock, h);
		}
		return;
	}
	if (!vsock_conn_match(&e->c, &vsock, h)) {
		vsock_reply_rst(&vsock, h);
		return;
	}
	vsock_conn_update_peer(&e->c, h);
	switch (h->op) {
	case VSOCK_OP_RW: {
		u32 space = ECHO_RING_SIZE - (e->head - e->tail);
		if (e->peer_done) {
			fail("host-initiated", "host sent data after shutting down its send side");
		}
		if (p->len > space) {
			sb_reset(&msg);
			sb_str(&msg, "host overran our credit: ");
			sb_dec(&msg, p->len);
			sb_str(&msg, " bytes with ");
			sb_dec(&msg, space);
			sb_str(&msg, " free after ");
			sb_dec(&msg, e->head);
			fail("host-initiated", msg.buf);
		}
		u32 off = e->head & (ECHO_RING_SIZE - 1);
		u32 first = ECHO_RING_SIZE - off;
		if (first > p->len)
			first = p->len;
		copy8(echo_ring + off, p->payload, first);
		copy8(echo_ring, p->payload + first, p->len - first);
		e->head += p->len;
		if (cfg->host_bytes && e->head > cfg->host_bytes)
			fail("host-initiated", "host sent more than vsock_echo.host_bytes");
		break;
	}
	case VSOCK_OP_CREDIT_REQUEST:
		e->credit_asked = 1;
		break;
	case VSOCK_OP_SHUTDOWN:
		if (h->flags & VSOCK_SHUTDOWN_SEND)
			e->peer_done = 1;
		break;
	case VSOCK_OP_RST:
		e->peer_done = 1;
		e->peer_reset = 1;
		break;
	default: /* CREDIT_UPDATE: credit already taken; stray REQUEST/RESPONSE: ignore */
		break;
	}
}

/* Moves the ring tail to the oldest echo still in flight. */
static void echo_advance_tail(struct echo *e)
{
	u32 new_tail = e->sent;
	for (u32 i = 0; i < vsock.tx_slots; i++) {
		const struct vsock_tx_slot *s = &vsock.slots[i];
		if (s->busy && s->len && s->tag - e->tail < new_tail - e->tail)
			new_tail = s->tag;
	}
	e->c.fwd_cnt += new_tail - e->tail;
	e->tail = new_tail;
}

static int echo_tx(struct echo *e)
{
	int progress = 0;
	while (e->sent != e->head) {
		u32 credit = vsock_peer_credit(&e->c);
		u32 off = e->sent & (ECHO_RING_SIZE - 1);
		u32 n = e->head - e->sent;
		if (n > ECHO_RING_SIZE - off)
			n = ECHO_RING_SIZE - off;
		if (n > VSOCK_MAX_TX_PAYLOAD)
			n = VSOCK_MAX_TX_PAYLOAD;
		if (n > credit)
			n = credit;
		if (n == 0) {
			if (!e->credit_requested &&
			    vsock_send(&vsock, &e->c, VSOCK_OP_CREDIT_REQUEST, 0, 0, 0, 0))
				e->credit_requested = 1;
			break;
		}
		e->credit_requested = 0;
		if (!vsock_send(&vsock, &e->c, VSOCK_OP_RW, 0, echo_ring + off, n, e->sent))
			break;
		e->sent += n;
		progress = 1;
	}
	/* Tell the host about freed space it has not heard of: when a quarter of the ring is
	 * free again, or when everything is echoed (no echo packet will carry the news). */
	u32 unadvertised = e->c.fwd_cnt - e->c.adv_fwd_cnt;
	if (e->credit_asked ||
	    (unadvertised && (unadvertised >= ECHO_RING_SIZE / 4 || e->tail == e->head))) {
		if (vsock_send(&vsock, &e->c, VSOCK_OP_CREDIT_UPDATE, 0, 0, 0, 0))
			e->credit_asked = 0;
	}
	return progress;
}

static u32 phase_host_initiated(const struct config *cfg)
{
	static const char phase[] = "host-initiated";
	struct echo e;
	struct deadline dl;
	struct vsock_rx_pkt p;
	int r;
	mem_set(&e, 0, sizeof(e));
	e.c.local_port = cfg->listen_port;
	e.c.buf_alloc = ECHO_RING_SIZE;

	sb_reset(&msg);
	sb_str(&msg, "listening on port ");
	sb_dec(&msg, cfg->listen_port);
	say(msg.buf);
	deadline_start_ms(&dl, CONNECT_WAIT_MS);
	for (;;) {
		int progress = 0;
		check_device(phase);
		while ((r = vsock_rx_next(&vsock, &p, &err)) == 1) {
			echo_rx(cfg, &e, &p);
			vsock_rx_done(&vsock, p.id);
			progress = 1;
		}
		if (r < 0)
			fail(phase, err.buf);
		vsock_rx_kick(&vsock);
		if (e.connected) {
			u32 old_tail = e.tail;
			echo_advance_tail(&e);
			if (!e.peer_reset)
				progress |= echo_tx(&e);
			progress |= e.tail != old_tail;
			if (e.peer_reset && e.sent != e.head) {
				sb_reset(&msg);
				sb_str(&msg, "host reset the connection with ");
				sb_dec(&msg, e.head - e.sent);
				sb_str(&msg, " bytes not yet echoed");
				fail(phase, msg.buf);
			}
			int input_done = e.peer_done ||
					 (cfg->host_bytes && e.head == cfg->host_bytes);
			if (input_done && e.sent == e.head && vsock_tx_idle(&vsock))
				break;
		}
		if (progress) {
			deadline_start_ms(&dl, IDLE_WAIT_MS);
		} else if (deadline_expired(&dl)) {
			sb_reset(&msg);
			if (!e.connected) {
				sb_str(&msg, "timed out waiting for the host's REQUEST to port ");
				sb_dec(&msg, cfg->listen_port);
			} else {
				sb_str(&msg, "no progress for 30 s: received ");
				sb_dec(&msg, e.head);
				sb_str(&msg, ", echoed ");
				sb_dec(&msg, e.sent);
				sb_str(&msg, ", completed ");
				sb_dec(&msg, e.tail);
			}
			describe_conn(&msg, &e.c);
			fail(phase, msg.buf);
		} else {
			cpu_relax();
		}
	}
	if (cfg->host_bytes && e.head != cfg->host_bytes) {
		sb_reset(&msg);
		sb_str(&msg, "host closed after ");
		sb_dec(&msg, e.head);
		sb_str(&msg, " of vsock_echo.host_bytes=");
		sb_dec(&msg, cfg->host_bytes);
		fail(phase, msg.buf);
	}
	if (e.head == 0)
		fail(phase, "host closed the connection without sending data");
	if (!e.peer_reset)
		close_conn(phase, &e.c);
	sb_reset(&msg);
	sb_str(&msg, "host-initiated echo done: ");
	sb_dec(&msg, e.head);
	sb_str(&msg, e.peer_reset ? " bytes (host reset)" : " bytes");
	say(msg.buf);
	return e.head;
}

/* ---- Phase B: we connect to the host, send a pattern and verify its echo. ---- */

static void pattern_init(void)
{
	u64 x = 0x9e3779b97f4a7c15ull;
	for (u32 i = 0; i + 8 <= PATTERN_PERIOD; i += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		*(u64 *)(pattern + i) = x;
	}
	copy8(pattern + PATTERN_PERIOD, pattern, sizeof(pattern) - PATTERN_PERIOD);
}

static void connect_host(const struct config *cfg, struct vsock_conn *c)
{
	static const char phase[] = "guest-initiated connect";
	struct deadline dl;
	struct vsock_rx_pkt p;
	int r, attempt = 0;
	deadline_start_ms(&dl, CONNECT_WAIT_MS);
	for (;;) {
		int answered = 0, connected = 0;
		mem_set(c, 0, sizeof(*c));
		c->peer_cid = VSOCK_HOST_CID;
		c->peer_port = cfg->connect_port;
		c->local_port = GUEST_PORT_BASE + (u32)attempt;
		c->buf_alloc = ECHO_RING_SIZE;
		sb_reset(&msg);
		sb_str(&msg, "connecting to cid 2 port ");
		sb_dec(&msg, cfg->connect_port);
		sb_str(&msg, " from port ");
		sb_dec(&msg, c->local_port);
		say(msg.buf);
		send_or_fail(phase, c, VSOCK_OP_REQUEST, 0);
		while (!answered) {
			check_device(phase);
			while ((r = vsock_rx_next(&vsock, &p, &err)) == 1) {
				const struct vsock_hdr *h = p.hdr;
				if (vsock_conn_match(c, &vsock, h) && !answered) {
					answered = 1;
					vsock_conn_update_peer(c, h);
					if (h->op == VSOCK_OP_RESPONSE)
						connected = 1;
					else if (h->op != VSOCK_OP_RST)
						vsock_reply_rst(&vsock, h);
				} else {
					vsock_reply_rst(&vsock, h);
				}
				vsock_rx_done(&vsock, p.id);
			}
			if (r < 0)
				fail(phase, err.buf);
			vsock_rx_kick(&vsock);
			if (!answered && deadline_expired(&dl)) {
				sb_reset(&msg);
				sb_str(&msg, "no answer to REQUEST for port ");
				sb_dec(&msg, cfg->connect_port);
				describe_conn(&msg, c);
				fail(phase, msg.buf);
			}
			cpu_relax();
		}
		if (connected)
			return;
		/* Refused: the host listener may not be up yet. */
		attempt++;
		if (attempt >= 40 || deadline_expired(&dl)) {
			sb_reset(&msg);
			sb_str(&msg, "host refused port ");
			sb_dec(&msg, cfg->connect_port);
			sb_str(&msg, " (RST) ");
			sb_dec(&msg, attempt);
			sb_str(&msg, " times; is anything listening on <uds_path>_");
			sb_dec(&msg, cfg->connect_port);
			sb_str(&msg, "?");
			fail(phase, msg.buf);
		}
		delay_ms(250);
	}
}

/* Compares a received chunk with the pattern at pattern offset `pos`; returns the index of
 * the first differing byte, or `len` if all match. */
static u32 verify_chunk(const u8 *got, u32 len, u32 pos)
{
	const u8 *want = pattern + pos;
	u32 i = 0;
	while (i + 8 <= len && *(const u64_unaligned *)(got + i) ==
				       *(const u64_unaligned *)(want + i))
		i += 8;
	while (i < len && got[i] == want[i])
		i++;
	return i;
}

static u32 phase_guest_initiated(const struct config *cfg)
{
	static const char phase[] = "guest-initiated";
	struct vsock_conn c;
	struct deadline dl;
	struct vsock_rx_pkt p;
	u32 total = (u32)cfg->guest_bytes;
	u32 sent = 0, recv = 0, send_pos = 0, recv_pos = 0;
	int credit_requested = 0, credit_asked = 0, r;

	pattern_init();
	connect_host(cfg, &c);
	say("connected; sending the pattern");
	deadline_start_ms(&dl, IDLE_WAIT_MS);
	while (recv != total || !vsock_tx_idle(&vsock)) {
		int progress = 0;
		check_device(phase);
		while ((r = vsock_rx_next(&vsock, &p, &err)) == 1) {
			const struct vsock_hdr *h = p.hdr;
			progress = 1;
			if (!vsock_conn_match(&c, &vsock, h)) {
				vsock_reply_rst(&vsock, h);
				vsock_rx_done(&vsock, p.id);
				continue;
			}
			vsock_conn_update_peer(&c, h);
			if (h->op == VSOCK_OP_RW) {
				if (p.len > sent - recv) {
					sb_reset(&msg);
					sb_str(&msg, "host echoed more than was sent: ");
					sb_dec(&msg, recv + p.len);
					sb_str(&msg, " > ");
					sb_dec(&msg, sent);
					fail(phase, msg.buf);
				}
				u32 good = verify_chunk(p.payload, p.len, recv_pos);
				if (good != p.len) {
					sb_reset(&msg);
					sb_str(&msg, "echo mismatch at byte ");
					sb_dec(&msg, recv + good);
					sb_str(&msg, ": got ");
					sb_hex(&msg, p.payload[good]);
					sb_str(&msg, ", want ");
					sb_hex(&msg, pattern[recv_pos + good]);
					fail(phase, msg.buf);
				}
				recv += p.len;
				recv_pos += p.len;
				if (recv_pos >= PATTERN_PERIOD)
					recv_pos -= PATTERN_PERIOD;
				c.fwd_cnt += p.len;
			} else if (h->op == VSOCK_OP_CREDIT_REQUEST) {
				credit_asked = 1;
			} else if (h->op == VSOCK_OP_SHUTDOWN || h->op == VSOCK_OP_RST) {
				sb_reset(&msg);
				sb_str(&msg, "host sent ");
				sb_str(&msg, vsock_op_name(h->op));
				sb_str(&msg, " after ");
				sb_dec(&msg, recv);
				sb_str(&msg, " of ");
				sb_dec(&msg, total);
				sb_str(&msg, " bytes echoed");
				fail(phase, msg.buf);
			}
			vsock_rx_done(&vsock, p.id);
		}
		if (r < 0)
			fail(phase, err.buf);
		vsock_rx_kick(&vsock);

		while (sent != total) {
			u32 credit = vsock_peer_credit(&c);
			u32 n = total - sent;
			if (n > VSOCK_MAX_TX_PAYLOAD)
				n = VSOCK_MAX_TX_PAYLOAD;
			if (n > credit)
				n = credit;
			if (n == 0) {
				if (!credit_requested &&
				    vsock_send(&vsock, &c, VSOCK_OP_CREDIT_REQUEST, 0, 0, 0, 0))
					credit_requested = 1;
				break;
			}
			credit_requested = 0;
			if (!vsock_send(&vsock, &c, VSOCK_OP_RW, 0, pattern + send_pos, n, sent))
				break;
			sent += n;
			send_pos += n;
			if (send_pos >= PATTERN_PERIOD)
				send_pos -= PATTERN_PERIOD;
			progress = 1;
		}
		if (credit_asked || c.fwd_cnt - c.adv_fwd_cnt >= ECHO_RING_SIZE / 2) {
			if (vsock_send(&vsock, &c, VSOCK_OP_CREDIT_UPDATE, 0, 0, 0, 0))
				credit_asked = 0;
		}

		if (progress) {
			deadline_start_ms(&dl, IDLE_WAIT_MS);
		} else if (deadline_expired(&dl)) {
			sb_reset(&msg);
			sb_str(&msg, "no progress for 30 s: sent ");
			sb_dec(&msg, sent);
			sb_str(&msg, ", echoed back ");
			sb_dec(&msg, recv);
			sb_str(&msg, " of ");
			sb_dec(&msg, total);
			describe_conn(&msg, &c);
			fail(phase, msg.buf);
		} else {
			cpu_relax();
		}
	}
	close_conn(phase, &c);
	sb_reset(&msg);
	sb_str(&msg, "guest-initiated echo verified: ");
	sb_dec(&msg, recv);
	sb_str(&msg, " bytes");
	say(msg.buf);
	return recv;
}

void guest_main(void)
{
	struct config cfg;
	struct strbuf result;
	u32 host = 0, guest = 0;

	read_config(&cfg);
	if (vsock_init(&vsock, boot_cmdline(), &err) != 0)
		fail("init", err.buf);
	sb_reset(&msg);
	sb_str(&msg, "device at ");
	sb_hex(&msg, vsock.dev.base);
	sb_str(&msg, " irq ");
	sb_dec(&msg, vsock.dev.irq);
	sb_str(&msg, ", guest cid ");
	sb_dec(&msg, vsock.guest_cid);
	sb_str(&msg, ", queue sizes rx ");
	sb_dec(&msg, vsock.rx.size);
	sb_str(&msg, " tx ");
	sb_dec(&msg, vsock.tx.size);
	sb_str(&msg, " event ");
	sb_dec(&msg, vsock.event.size);
	say(msg.buf);

	if (cfg.run_host)
		host = phase_host_initiated(&cfg);
	if (cfg.run_guest)
		guest = phase_guest_initiated(&cfg);

	sb_reset(&result);
	sb_str(&result, "host-initiated=");
	if (cfg.run_host)
		sb_dec(&result, host);
	else
		sb_str(&result, "skipped");
	sb_str(&result, " guest-initiated=");
	if (cfg.run_guest)
		sb_dec(&result, guest);
	else
		sb_str(&result, "skipped");
	result_pass(result.buf);
}
