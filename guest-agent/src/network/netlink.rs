//! A NETLINK_ROUTE socket spoken synchronously with netlink-packet-route and netlink-sys
//! ([`Netlink`]): list the links, set a link's name, MTU and state, add an address, add or
//! replace a route. One request at a time, each answer bounded.

use std::io;
use std::net::{IpAddr, Ipv4Addr};
use std::os::fd::AsRawFd;
use std::time::Duration;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP,
    NLM_F_REPLACE, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use netlink_packet_route::link::{LinkAttribute, LinkFlags, LinkLayerType, LinkMessage};
use netlink_packet_route::route::{
    RouteAttribute, RouteHeader, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket, SocketAddr};

use super::types::{IpNet, Mac, Route, Scope};

/// One netlink datagram (the kernel's dump chunks are at most 32 KiB).
const RECV_BUFFER: usize = 64 * 1024;
/// Most messages one request may answer with (a dump of links, addresses or routes).
const MAX_REPLIES: usize = 16 * 1024;
/// The kernel answers at once; this only keeps a broken socket from hanging the agent.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// A link as listed.
pub(super) struct Link {
    pub(super) index: u32,
    pub(super) name: String,
    pub(super) mac: Option<Mac>,
    pub(super) loopback: bool,
}

/// A NETLINK_ROUTE socket, one request at a time.
pub(super) struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Netlink {
    pub(super) fn open() -> io::Result<Netlink> {
        let mut socket = Socket::new(NETLINK_ROUTE)?;
        socket.bind_auto()?;
        socket.connect(&SocketAddr::new(0, 0))?;
        let tv = libc::timeval {
            tv_sec: RECV_TIMEOUT.as_secs() as libc::time_t,
            tv_usec: 0,
        };
        // SAFETY: SO_RCVTIMEO reads one timeval, which `tv` is, for the call's duration; the
        // socket's fd is open.
        let rc = unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Netlink {
            socket,
            seq: 0,
            buf: Vec::with_capacity(RECV_BUFFER),
        })
    }

    /// Sends one request and collects the answer: the messages of a dump up to its end, or
    /// nothing but the acknowledgement. A kernel error comes back as its errno.
    fn request(
        &mut self,
        msg: RouteNetlinkMessage,
        flags: u16,
    ) -> io::Result<Vec<RouteNetlinkMessage>> {
        self.seq = self.seq.wrapping_add(1);
        let mut header = NetlinkHeader::default();
        header.flags = NLM_F_REQUEST | flags;
        header.sequence_number = self.seq;
        let mut packet = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        packet.finalize();
        let mut out = vec![0u8; packet.buffer_len()];
        packet.serialize(&mut out);
        self.socket.send(&out, 0)?;

        let mut replies = Vec::new();
        loop {
            self.buf.clear();
            let n = self.socket.recv(&mut self.buf, libc::MSG_TRUNC)?;
            if n > self.buf.len() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("netlink reply of {n} bytes truncated"),
                ));
            }
            let mut offset = 0;
            while offset < n {
                let reply =
                    NetlinkMessage::<RouteNetlinkMessage>::deserialize(&self.buf[offset..n])
                        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
                let len = reply.header.length as usize;
                if len == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "netlink message of length 0",
                    ));
                }
                offset = offset.saturating_add((len + 3) & !3);
                if reply.header.sequence_number != self.seq {
                    continue;
                }
                match reply.payload {
                    NetlinkPayload::Done(_) => return Ok(replies),
                    NetlinkPayload::Error(e) => match e.code {
                        None => return Ok(replies),
                        Some(_) => return Err(e.to_io()),
                    },
                    NetlinkPayload::InnerMessage(m) => {
                        if replies.len() >= MAX_REPLIES {
                            return Err(io::Error::new(
                                io::ErrorKind::InvalidData,
                                format!("more than {MAX_REPLIES} netlink replies"),
                            ));
                        }
                        replies.push(m);
                    }
                    _ => {}
                }
            }
        }
    }

    pub(super) fn links(&mut self) -> io::Result<Vec<Link>> {
        let replies = self.request(
            RouteNetlinkMessage::GetLink(LinkMessage::default()),
            NLM_F_DUMP,
        )?;
        Ok(replies
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(l),
                _ => None,
            })
            .map(|l| Link {
                index: l.header.index,
                loopback: l.header.link_layer_type == LinkLayerType::Loopback,
                name: l
                    .attributes
                    .iter()
                    .find_map(|a| match a {
                        LinkAttribute::IfName(n) => Some(n.clone()),
                        _ => None,
                    })
                    .unwrap_or_default(),
                mac: l.attributes.iter().find_map(|a| match a {
                    LinkAttribute::Address(m) => <[u8; 6]>::try_from(m.as_slice()).ok().map(Mac),
                    _ => None,
                }),
            })
            .collect())
    }

    pub(super) fn set_link(
        &mut self,
        index: u32,
        name: Option<&str>,
        mtu: Option<u32>,
        up: Option<bool>,
    ) -> io::Result<()> {
        let mut msg = LinkMessage::default();
        msg.header.index = index;
        if let Some(up) = up {
            msg.header.change_mask = LinkFlags::Up;
            msg.header.flags = if up {
                LinkFlags::Up
            } else {
                LinkFlags::empty()
            };
        }
        if let Some(name) = name {
            msg.attributes.push(LinkAttribute::IfName(name.to_owned()));
        }
        if let Some(mtu) = mtu {
            msg.attributes.push(LinkAttribute::Mtu(mtu));
        }
        self.request(RouteNetlinkMessage::SetLink(msg), NLM_F_ACK)
            .map(drop)
    }

    pub(super) fn add_address(&mut self, index: u32, net: &IpNet) -> io::Result<()> {
        let mut msg = AddressMessage::default();
        msg.header.index = index;
        msg.header.prefix_len = net.prefix_len;
        match net.addr {
            IpAddr::V4(a) => {
                msg.header.family = AddressFamily::Inet;
                msg.attributes.push(AddressAttribute::Local(net.addr));
                msg.attributes.push(AddressAttribute::Address(net.addr));
                if let Some(brd) = broadcast(a, net.prefix_len) {
                    msg.attributes.push(AddressAttribute::Broadcast(brd));
                }
            }
            IpAddr::V6(_) => {
                msg.header.family = AddressFamily::Inet6;
                msg.attributes.push(AddressAttribute::Address(net.addr));
                msg.attributes
                    .push(AddressAttribute::Flags(AddressFlags::Nodad));
            }
        }
        match self.request(
            RouteNetlinkMessage::NewAddress(msg),
            NLM_F_ACK | NLM_F_CREATE | netlink_packet_core::NLM_F_EXCL,
        ) {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            other => other.map(drop),
        }
    }

    pub(super) fn add_route(&mut self, index: u32, route: &Route) -> io::Result<()> {
        let mut msg = RouteMessage::default();
        msg.header.address_family = match route.destination.addr {
            IpAddr::V4(_) => AddressFamily::Inet,
            IpAddr::V6(_) => AddressFamily::Inet6,
        };
        msg.header.destination_prefix_length = route.destination.prefix_len;
        msg.header.table = RouteHeader::RT_TABLE_MAIN;
        msg.header.protocol = RouteProtocol::Boot;
        msg.header.kind = RouteType::Unicast;
        msg.header.scope = match route.scope {
            Scope::Universe => RouteScope::Universe,
            Scope::Site => RouteScope::Site,
            Scope::Link => RouteScope::Link,
            Scope::Host => RouteScope::Host,
        };
        if route.destination.prefix_len > 0 {
            msg.attributes
                .push(RouteAttribute::Destination(route.destination.addr.into()));
        }
        if let Some(gw) = route.gateway {
            msg.attributes.push(RouteAttribute::Gateway(gw.into()));
        }
        msg.attributes.push(RouteAttribute::Oif(index));
        self.request(
            RouteNetlinkMessage::NewRoute(msg),
            NLM_F_ACK | NLM_F_CREATE | NLM_F_REPLACE,
        )
        .map(drop)
    }
}

/// The IPv4 broadcast address of a subnet (none for /31 and /32).
fn broadcast(addr: Ipv4Addr, prefix_len: u8) -> Option<Ipv4Addr> {
    if prefix_len >= 31 {
        return None;
    }
    let host_bits = u32::MAX.checked_shr(u32::from(prefix_len)).unwrap_or(0);
    Some(Ipv4Addr::from(u32::from(addr) | host_bits))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv4_broadcast() {
        let a = Ipv4Addr::new(10, 1, 2, 3);
        assert_eq!(broadcast(a, 24), Some(Ipv4Addr::new(10, 1, 2, 255)));
        assert_eq!(broadcast(a, 0), Some(Ipv4Addr::BROADCAST));
        assert_eq!(broadcast(a, 16), Some(Ipv4Addr::new(10, 1, 255, 255)));
        assert_eq!(broadcast(a, 31), None);
        assert_eq!(broadcast(a, 32), None);
    }
}
