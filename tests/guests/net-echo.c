/* net-echo: drives the VMM's virtio-net device from a freestanding guest.
 *
 * Brings the device up (VERSION_1 + MAC + STATUS + MTU when offered), checks the config space
 * (a unicast MAC, the link up, an MTU its buffers can hold), posts NET_BUFS receive buffers and
 * prints `net-echo: ready`. Then, for every frame of ethertype 0x88b5 addressed to its MAC, it
 * sends the frame back with source and destination MAC swapped. Zero copy: the receive buffer
 * itself goes on the transmit queue (vnet header zeroed: no offloads) and returns to the
 * receive queue when its transmission completes, so buffer i is descriptor i of either queue.
 *
 * Payload byte 0 (after the Ethernet header) says what to do: 1 echo, 2 echo and stop. Frames
 * of other ethertypes or for other MACs (IPv6 neighbour discovery of the host, ...) are counted
 * and ignored. It stops after the stop frame, or once net_echo.max_frames= frames were echoed,
 * and fails if nothing happens for net_echo.idle_ms= (default 60000). With
 * net_echo.post_delay_ms=N it sets DRIVER_OK and says ready with no receive buffer posted, and
 * posts them only N ms later (the device must wait for them, not spin). The result line:
 * `RESULT: PASS frames=N bytes=B ignored=I end=stop|bound`. Polling only: interrupts stay off.
 */
#include "common.h"
#include "deadline.h"
#include "strbuf.h"
#include "virtio_mmio.h"

#define VIRTIO_ID_NET 1
#define NET_F_MTU 3
#define NET_F_MAC 5
#define NET_F_STATUS 16
#define NET_S_LINK_UP 1
#define NET_QUEUE_RX 0
#define NET_QUEUE_TX 1
#define NET_CFG_MAC 0x100
#define NET_CFG_STATUS 0x106
#define NET_CFG_MTU 0x10a

#define NET_HDR_LEN 12  /* virtio_net_hdr_v1: flags, gso_type, hdr_len, gso_size, csum x2, num_buffers */
#define ETH_HLEN 14
#define NET_HDR_F_NEEDS_CSUM 1
#define NET_BUFS VIRTQ_MAX_SIZE
#define BUF_SIZE 10240 /* holds a vnet header, an Ethernet header and an MTU of up to 10214 */
#define ETHERTYPE_ECHO 0x88b5
#define KIND_ECHO 1
#define KIND_STOP 2

enum buf_state { IN_RX, IN_TX };

static struct virtio_mmio_dev dev;
static struct virtq rxq, txq;
static struct virtq_rings rx_rings, tx_rings;
static u8 bufs[NET_BUFS][BUF_SIZE] __attribute__((aligned(64)));
static enum buf_state state[NET_BUFS];
static u8 mac[6];
static struct strbuf err;
static struct strbuf msg;

static void say(const char *s)
{
	serial_puts("net-echo: ");
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
		result_fail(msg.buf);
	}
	return v;
}

static void sb_mac(struct strbuf *sb, const u8 *m)
{
	static const char digits[] = "0123456789abcdef";
	for (int i = 0; i < 6; i++) {
		if (i)
			sb_char(sb, ':');
		sb_char(sb, digits[m[i] >> 4]);
		sb_char(sb, digits[m[i] & 0xf]);
	}
}

static u16 le16(const u8 *p)
{
	return (u16)(p[0] | (p[1] << 8));
}

static void post_rx(u16 i)
{
	virtq_set_desc(&rxq, i, bufs[i], BUF_SIZE, VIRTQ_DESC_F_WRITE, 0);
	state[i] = IN_RX;
	virtq_push(&rxq, i);
}

static NORETURN void fail_frame(const char *what, u32 id, u32 len, u64 frames)
{
	sb_reset(&msg);
	sb_str(&msg, what);
	sb_str(&msg, " (buffer ");
	sb_dec(&msg, id);
	sb_str(&msg, ", length ");
	sb_dec(&msg, len);
	sb_str(&msg, ", after ");
	sb_dec(&msg, frames);
	sb_str(&msg, " frames)");
	result_fail(msg.buf);
}

void guest_main(void)
{
	u64 max_frames = cmdline_u64("net_echo.max_frames=", 1000000);
	u32 idle_ms = (u32)cmdline_u64("net_echo.idle_ms=", 60000);
	u32 post_delay_ms = (u32)cmdline_u64("net_echo.post_delay_ms=", 0);
	u64 features = 0;
	u32 mtu = 1500;

	if (virtio_mmio_find(boot_cmdline(), VIRTIO_ID_NET, &dev, &err) != 0)
		result_fail(err.buf);
	if (virtio_mmio_negotiate_features(&dev,
					   (1ull << NET_F_MAC) | (1ull << NET_F_STATUS) |
						   (1ull << NET_F_MTU),
					   &features, &err) != 0)
		result_fail(err.buf);
	if (!(features & (1ull << NET_F_MAC)) || !(features & (1ull << NET_F_STATUS))) {
		sb_reset(&msg);
		sb_str(&msg, "device does not offer MAC and STATUS (accepted features ");
		sb_hex(&msg, features);
		sb_str(&msg, ")");
		result_fail(msg.buf);
	}
	for (int i = 0; i < 6; i++)
		mac[i] = *(volatile u8 *)(usize)(dev.base + NET_CFG_MAC + (u64)i);
	u16 status = *(volatile u16 *)(usize)(dev.base + NET_CFG_STATUS);
	if (features & (1ull << NET_F_MTU))
		mtu = *(volatile u16 *)(usize)(dev.base + NET_CFG_MTU);
	if ((mac[0] & 1) || !(mac[0] | mac[1] | mac[2] | mac[3] | mac[4] | mac[5]))
		result_fail("config space MAC is not a unicast address");
	if (!(status & NET_S_LINK_UP))
		result_fail("config space status: link down");
	if (mtu < 68 || mtu + NET_HDR_LEN + ETH_HLEN > BUF_SIZE) {
		sb_reset(&msg);
		sb_str(&msg, "MTU ");
		sb_dec(&msg, mtu);
		sb_str(&msg, " does not fit our buffers of ");
		sb_dec(&msg, BUF_SIZE);
		result_fail(msg.buf);
	}
	if (virtio_mmio_setup_queue(&dev, NET_QUEUE_RX, NET_BUFS, &rx_rings, &rxq, &err) != 0 ||
	    virtio_mmio_setup_queue(&dev, NET_QUEUE_TX, NET_BUFS, &tx_rings, &txq, &err) != 0)
		result_fail(err.buf);
	if (rxq.size != NET_BUFS || txq.size != NET_BUFS)
		result_fail("the device's queues are smaller than our 16 buffers");
	if (!post_delay_ms)
		for (u16 i = 0; i < NET_BUFS; i++)
			post_rx(i);
	if (virtio_mmio_driver_ok(&dev, &err) != 0)
		result_fail(err.buf);
	virtq_notify(&rxq);

	sb_reset(&msg);
	sb_str(&msg, "device at ");
	sb_hex(&msg, dev.base);
	sb_str(&msg, " irq ");
	sb_dec(&msg, dev.irq);
	sb_str(&msg, " mac ");
	sb_mac(&msg, mac);
	sb_str(&msg, " mtu ");
	sb_dec(&msg, mtu);
	sb_str(&msg, " link up, ");
	sb_dec(&msg, NET_BUFS);
	sb_str(&msg, " rx buffers of ");
	sb_dec(&msg, BUF_SIZE);
	say(msg.buf);
	say("ready");
	if (post_delay_ms) {
		delay_ms(post_delay_ms);
		for (u16 i = 0; i < NET_BUFS; i++)
			post_rx(i);
		virtq_notify(&rxq);
		say("receive buffers posted");
	}

	u64 frames = 0, bytes = 0, ignored = 0;
	u32 in_tx = 0;
	int stopping = 0;
	struct deadline dl;
	deadline_start_ms(&dl, idle_ms);
	for (;;) {
		int progress = 0, rx_pushed = 0, tx_pushed = 0;
		u32 id, len;
		while (virtq_pop_used(&rxq, &id, &len)) {
			progress = 1;
			if (id >= NET_BUFS || state[id] != IN_RX)
				fail_frame("receive completion for a buffer not on the receive queue", id,
					   len, frames);
			if (len < NET_HDR_LEN + ETH_HLEN || len > NET_HDR_LEN + ETH_HLEN + mtu)
				fail_frame("received length outside header size .. MTU", id, len, frames);
			u8 *b = bufs[id];
			if (le16(b + 10) != 1)
				fail_frame("vnet header num_buffers is not 1", id, len, frames);
			if (b[1] != 0 || (b[0] & NET_HDR_F_NEEDS_CSUM))
				fail_frame("vnet header asks for an offload we did not negotiate", id, len,
					   frames);
			u8 *eth = b + NET_HDR_LEN;
			u16 type = (u16)((eth[12] << 8) | eth[13]);
			int for_us = 1;
			for (int i = 0; i < 6; i++)
				if (eth[i] != mac[i])
					for_us = 0;
			if (type != ETHERTYPE_ECHO || !for_us || stopping || frames >= max_frames ||
			    len < NET_HDR_LEN + ETH_HLEN + 1) {
				ignored++;
				post_rx((u16)id);
				rx_pushed = 1;
				continue;
			}
			if (eth[ETH_HLEN] == KIND_STOP)
				stopping = 1;
			/* Swap: the sender becomes the destination, we the source. */
			for (int i = 0; i < 6; i++) {
				u8 t = eth[i];
				eth[i] = eth[6 + i];
				eth[6 + i] = t;
			}
			for (int i = 0; i < NET_HDR_LEN; i++)
				b[i] = 0;
			virtq_set_desc(&txq, (u16)id, b, len, 0, 0);
			state[id] = IN_TX;
			virtq_push(&txq, (u16)id);
			tx_pushed = 1;
			in_tx++;
			frames++;
			bytes += len - NET_HDR_LEN;
		}
		if (tx_pushed)
			virtq_notify(&txq);
		while (virtq_pop_used(&txq, &id, &len)) {
			progress = 1;
			if (id >= NET_BUFS || state[id] != IN_TX)
				fail_frame("transmit completion for a buffer not on the transmit queue",
					   id, len, frames);
			in_tx--;
			post_rx((u16)id);
			rx_pushed = 1;
		}
		if (rx_pushed)
			virtq_notify(&rxq);
		if ((stopping || frames >= max_frames) && in_tx == 0)
			break;
		if (progress) {
			deadline_start_ms(&dl, idle_ms);
		} else if (deadline_expired(&dl)) {
			sb_reset(&msg);
			sb_str(&msg, "nothing happened for ");
			sb_dec(&msg, idle_ms);
			sb_str(&msg, " ms: echoed ");
			sb_dec(&msg, frames);
			sb_str(&msg, " frames, ignored ");
			sb_dec(&msg, ignored);
			sb_str(&msg, ", ");
			sb_dec(&msg, in_tx);
			sb_str(&msg, " transmissions not completed, device status ");
			sb_hex(&msg, virtio_mmio_read(&dev, VIRTIO_MMIO_STATUS));
			result_fail(msg.buf);
		} else {
			cpu_relax();
		}
	}
	sb_reset(&msg);
	sb_str(&msg, "frames=");
	sb_dec(&msg, frames);
	sb_str(&msg, " bytes=");
	sb_dec(&msg, bytes);
	sb_str(&msg, " ignored=");
	sb_dec(&msg, ignored);
	sb_str(&msg, stopping ? " end=stop" : " end=bound");
	result_pass(msg.buf);
}
