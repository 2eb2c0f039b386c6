//! The guest's network (ConfigureNetwork): the shim reads the pod's CNI interfaces in the pod
//! netns and gives the VM one virtio-net NIC per interface, with the interface's MAC. Here each
//! NIC, found by that MAC, gets the interface's name, MTU, addresses and routes, and `lo` comes
//! up; the pod's containers share this network namespace.
//!
//! The request is validated whole before anything changes (bounded counts, lengths and
//! families). Netlink is spoken synchronously with netlink-packet-route and netlink-sys (the
//! versions libcontainer links already; no async runtime in the agent, whose size matters).
//!
//! Order: lo up; every NIC found; per interface rename (while down; through a temporary name
//! when two NICs' names are swapped), MTU, addresses (IPv6 without duplicate
//! address detection: the pod's interface on the host holds them already), up; then every
//! route without a gateway, then those through one (a gateway must be reachable first).
//! Applying twice is harmless: an address already there is fine, routes are replaced.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::AsRawFd;
use std::time::Duration;

use agent_protocol::agent::{
    ConfigureNetworkRequest, IpFamily as PbFamily, IpNet as PbIpNet, RouteScope as PbScope,
};
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

pub const MAX_INTERFACES: usize = 8;
pub const MAX_ADDRESSES: usize = 64;
pub const MAX_ROUTES: usize = 256;
const MIN_MTU: u32 = 68;
const MAX_MTU: u32 = 65535;
/// IFNAMSIZ less the NUL.
const MAX_NAME: usize = 15;
/// One netlink datagram (the kernel's dump chunks are at most 32 KiB).
const RECV_BUFFER: usize = 64 * 1024;
/// Most messages one request may answer with (a dump of links, addresses or routes).
const MAX_REPLIES: usize = 16 * 1024;
/// The kernel answers at once; this only keeps a broken socket from hanging the agent.
const RECV_TIMEOUT: Duration = Duration::from_secs(10);

/// A MAC address, printed the usual way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mac(pub [u8; 6]);

impl std::fmt::Display for Mac {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    Universe,
    Site,
    Link,
    Host,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub destination: IpNet,
    pub gateway: Option<IpAddr>,
    pub scope: Scope,
}

impl std::fmt::Display for Route {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.destination.prefix_len == 0 {
            write!(f, "default")?;
        } else {
            write!(f, "{}", self.destination)?;
        }
        if let Some(gw) = self.gateway {
            write!(f, " via {gw}")?;
        }
        Ok(())
    }
}

/// One interface of a validated request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub mac: Mac,
    pub mtu: u32,
    pub addresses: Vec<IpNet>,
    pub routes: Vec<Route>,
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("opening a netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("listing the guest's links: {0}")]
    ListLinks(#[source] io::Error),
    #[error("bringing lo up: {0}")]
    Loopback(#[source] io::Error),
    #[error("interface {name}: no guest NIC has MAC {mac}")]
    NicNotFound { name: String, mac: Mac },
    #[error("interface {name}: {action}: {source}")]
    Link {
        name: String,
        action: String,
        source: io::Error,
    },
    #[error("interface {name}: adding address {addr}: {source}")]
    Address {
        name: String,
        addr: IpNet,
        source: io::Error,
    },
    #[error("interface {name}: adding route {route}: {source}")]
    Route {
        name: String,
        route: Route,
        source: io::Error,
    },
}

impl NetworkError {
    /// Whether the request itself was wrong (nothing was changed).
    pub fn is_invalid_request(&self) -> bool {
        matches!(self, NetworkError::Invalid(_))
    }
}

fn invalid(msg: impl Into<String>) -> NetworkError {
    NetworkError::Invalid(msg.into())
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

fn ip_of(bytes: &[u8], family: Option<PbFamily>) -> Option<IpAddr> {
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => return None,
    };
    match (family, ip) {
        (None, _)
        | (Some(PbFamily::IP_FAMILY_V4), IpAddr::V4(_))
        | (Some(PbFamily::IP_FAMILY_V6), IpAddr::V6(_)) => Some(ip),
        _ => None,
    }
}

fn net_of(n: &PbIpNet, family: Option<PbFamily>) -> Option<IpNet> {
    let addr = ip_of(&n.addr, family)?;
    let max = if addr.is_ipv4() { 32 } else { 128 };
    let prefix_len = u8::try_from(n.prefix_len).ok().filter(|p| *p <= max)?;
    Some(IpNet { addr, prefix_len })
}

/// Checks the whole request and turns it into typed interfaces; nothing is changed yet.
pub fn plan(req: &ConfigureNetworkRequest) -> Result<Vec<Interface>, NetworkError> {
    if req.interfaces.len() > MAX_INTERFACES {
        return Err(invalid(format!(
            "{} interfaces (at most {MAX_INTERFACES})",
            req.interfaces.len()
        )));
    }
    let mut out: Vec<Interface> = Vec::with_capacity(req.interfaces.len());
    for (i, iface) in req.interfaces.iter().enumerate() {
        if !valid_name(&iface.name) || iface.name == "lo" {
            return Err(invalid(format!(
                "interface {i}: name {:?} is not 1-{MAX_NAME} bytes of [A-Za-z0-9_.-] (nor lo)",
                iface.name
            )));
        }
        let name = iface.name.clone();
        let bad = |what: String| invalid(format!("interface {name}: {what}"));
        let mac: [u8; 6] = iface
            .mac
            .as_slice()
            .try_into()
            .map_err(|_| bad(format!("MAC of {} bytes (not 6)", iface.mac.len())))?;
        if mac[0] & 1 != 0 || mac == [0; 6] {
            return Err(bad(format!("MAC {} is not a unicast address", Mac(mac))));
        }
        if !(MIN_MTU..=MAX_MTU).contains(&iface.mtu) {
            return Err(bad(format!("MTU {} (not {MIN_MTU}-{MAX_MTU})", iface.mtu)));
        }
        if iface.addresses.len() > MAX_ADDRESSES || iface.routes.len() > MAX_ROUTES {
            return Err(bad(format!(
                "{} addresses and {} routes (at most {MAX_ADDRESSES} and {MAX_ROUTES})",
                iface.addresses.len(),
                iface.routes.len()
            )));
        }
        let mut addresses = Vec::with_capacity(iface.addresses.len());
        for (j, a) in iface.addresses.iter().enumerate() {
            let net = net_of(a, None).ok_or_else(|| {
                bad(format!(
                    "address {j}: {} bytes with prefix {} is not an IPv4 or IPv6 address",
                    a.addr.len(),
                    a.prefix_len
                ))
            })?;
            addresses.push(net);
        }
        let mut routes = Vec::with_capacity(iface.routes.len());
        for (j, r) in iface.routes.iter().enumerate() {
            let family = match r.family.enum_value() {
                Ok(f @ (PbFamily::IP_FAMILY_V4 | PbFamily::IP_FAMILY_V6)) => f,
                _ => return Err(bad(format!("route {j}: no address family"))),
            };
            let destination = r
                .destination
                .as_ref()
                .and_then(|d| net_of(d, Some(family)))
                .ok_or_else(|| bad(format!("route {j}: destination missing or not {family:?}")))?;
            let gateway = if r.gateway.is_empty() {
                None
            } else {
                Some(
                    ip_of(&r.gateway, Some(family))
                        .ok_or_else(|| bad(format!("route {j}: gateway is not {family:?}")))?,
                )
            };
            let scope = match r.scope.enum_value() {
                Ok(PbScope::ROUTE_SCOPE_UNIVERSE) => Scope::Universe,
                Ok(PbScope::ROUTE_SCOPE_SITE) => Scope::Site,
                Ok(PbScope::ROUTE_SCOPE_LINK) => Scope::Link,
                Ok(PbScope::ROUTE_SCOPE_HOST) => Scope::Host,
                _ => return Err(bad(format!("route {j}: no scope"))),
            };
            routes.push(Route {
                destination,
                gateway,
                scope,
            });
        }
        if out.iter().any(|o| o.name == name || o.mac.0 == mac) {
            return Err(bad("name or MAC given twice".to_owned()));
        }
        out.push(Interface {
            name,
            mac: Mac(mac),
            mtu: iface.mtu,
            addresses,
            routes,
        });
    }
    Ok(out)
}

/// Validates the request, then configures the guest's network (see the module doc).
pub fn configure(req: &ConfigureNetworkRequest) -> Result<(), NetworkError> {
    let interfaces = plan(req)?;
    let mut nl = Netlink::open().map_err(NetworkError::Socket)?;
    let links = nl.links().map_err(NetworkError::ListLinks)?;

    let lo = links
        .iter()
        .find(|l| l.loopback)
        .ok_or_else(|| NetworkError::Loopback(io::Error::from(io::ErrorKind::NotFound)))?;
    nl.set_link(lo.index, None, None, Some(true))
        .map_err(NetworkError::Loopback)?;

    // Find every NIC first, so a missing one fails before anything is renamed.
    let mut found = Vec::with_capacity(interfaces.len());
    for iface in &interfaces {
        let link = links
            .iter()
            .find(|l| !l.loopback && l.mac == Some(iface.mac))
            .ok_or_else(|| NetworkError::NicNotFound {
                name: iface.name.clone(),
                mac: iface.mac,
            })?;
        found.push(link);
    }
    let link_err = |iface: &Interface, action: String| {
        let name = iface.name.clone();
        move |source| NetworkError::Link {
            name,
            action,
            source,
        }
    };
    // Renames go through a temporary name when the wanted one is another of these NICs' current
    // name (two NICs whose names are swapped); a link is renamed only while it is down.
    let renamed: Vec<bool> = interfaces
        .iter()
        .zip(&found)
        .map(|(iface, link)| link.name != iface.name)
        .collect();
    let clash = interfaces
        .iter()
        .zip(&renamed)
        .any(|(iface, r)| *r && found.iter().any(|l| l.name == iface.name));
    for (i, (iface, link)) in interfaces.iter().zip(&found).enumerate() {
        if !renamed[i] {
            continue;
        }
        nl.set_link(link.index, None, None, Some(false))
            .map_err(link_err(iface, format!("taking {} down", link.name)))?;
        if clash {
            let temporary = format!("mvnic{i}");
            nl.set_link(link.index, Some(&temporary), None, None)
                .map_err(link_err(
                    iface,
                    format!("renaming {} (MAC {}) to {temporary}", link.name, iface.mac),
                ))?;
        }
    }
    let mut indexes = Vec::with_capacity(interfaces.len());
    for (i, (iface, link)) in interfaces.iter().zip(&found).enumerate() {
        if renamed[i] {
            nl.set_link(link.index, Some(&iface.name), None, None)
                .map_err(link_err(
                    iface,
                    format!("renaming {} (MAC {})", link.name, iface.mac),
                ))?;
        }
        nl.set_link(link.index, None, Some(iface.mtu), None)
            .map_err(link_err(iface, format!("setting MTU {}", iface.mtu)))?;
        for addr in &iface.addresses {
            nl.add_address(link.index, addr)
                .map_err(|source| NetworkError::Address {
                    name: iface.name.clone(),
                    addr: *addr,
                    source,
                })?;
        }
        nl.set_link(link.index, None, None, Some(true))
            .map_err(link_err(iface, "bringing it up".to_owned()))?;
        log::info!(
            "network: {} (MAC {}, MTU {}) {}",
            iface.name,
            iface.mac,
            iface.mtu,
            iface
                .addresses
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        );
        indexes.push(link.index);
    }
    for through_gateway in [false, true] {
        for (iface, &index) in interfaces.iter().zip(&indexes) {
            for route in iface
                .routes
                .iter()
                .filter(|r| r.gateway.is_some() == through_gateway)
            {
                nl.add_route(index, route)
                    .map_err(|source| NetworkError::Route {
                        name: iface.name.clone(),
                        route: route.clone(),
                        source,
                    })?;
                log::info!("network: route {route} dev {}", iface.name);
            }
        }
    }
    Ok(())
}

/// A link as listed.
struct Link {
    index: u32,
    name: String,
    mac: Option<Mac>,
    loopback: bool,
}

/// A NETLINK_ROUTE socket, one request at a time.
struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl Netlink {
    fn open() -> io::Result<Netlink> {
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

    fn links(&mut self) -> io::Result<Vec<Link>> {
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

    fn set_link(
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

    fn add_address(&mut self, index: u32, net: &IpNet) -> io::Result<()> {
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

    fn add_route(&mut self, index: u32, route: &Route) -> io::Result<()> {
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
    use agent_protocol::agent::{NetworkInterface, Route as PbRoute};

    fn pbnet(addr: &[u8], prefix_len: u32) -> PbIpNet {
        PbIpNet {
            addr: addr.to_vec(),
            prefix_len,
            ..Default::default()
        }
    }

    fn good() -> NetworkInterface {
        NetworkInterface {
            name: "eth0".into(),
            mac: vec![2, 0, 0, 0, 0, 1],
            mtu: 1400,
            addresses: vec![pbnet(&[10, 1, 0, 5], 24), pbnet(&[0xfd; 16], 64)],
            routes: vec![PbRoute {
                family: PbFamily::IP_FAMILY_V4.into(),
                destination: protobuf::MessageField::some(pbnet(&[0; 4], 0)),
                gateway: vec![10, 1, 0, 1],
                scope: PbScope::ROUTE_SCOPE_UNIVERSE.into(),
                ..Default::default()
            }],
            ..Default::default()
        }
    }

    fn req(ifaces: Vec<NetworkInterface>) -> ConfigureNetworkRequest {
        ConfigureNetworkRequest {
            interfaces: ifaces,
            ..Default::default()
        }
    }

    #[test]
    fn a_good_request_becomes_typed_interfaces() {
        let plan = plan(&req(vec![good()])).unwrap();
        assert_eq!(plan.len(), 1);
        let i = &plan[0];
        assert_eq!(
            (i.name.as_str(), i.mac.to_string().as_str(), i.mtu),
            ("eth0", "02:00:00:00:00:01", 1400)
        );
        assert_eq!(i.addresses[0].to_string(), "10.1.0.5/24");
        assert_eq!(
            i.addresses[1].to_string(),
            "fdfd:fdfd:fdfd:fdfd:fdfd:fdfd:fdfd:fdfd/64"
        );
        assert_eq!(i.routes[0].to_string(), "default via 10.1.0.1");
        assert_eq!(i.routes[0].scope, Scope::Universe);
    }

    #[test]
    fn malformed_requests_are_refused_naming_the_problem() {
        type Mutation = Box<dyn Fn(&mut NetworkInterface)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|i| i.name = "".into()), "name"),
            (Box::new(|i| i.name = "a/b".into()), "name"),
            (Box::new(|i| i.name = "x".repeat(16)), "name"),
            (Box::new(|i| i.name = "lo".into()), "name"),
            (Box::new(|i| i.mac = vec![2, 0, 0]), "MAC of 3 bytes"),
            (
                Box::new(|i| i.mac = vec![1, 0, 0, 0, 0, 1]),
                "not a unicast",
            ),
            (Box::new(|i| i.mtu = 10), "MTU 10"),
            (Box::new(|i| i.mtu = 70000), "MTU 70000"),
            (
                Box::new(|i| i.addresses[0] = pbnet(&[10, 0, 0], 8)),
                "address 0",
            ),
            (
                Box::new(|i| i.addresses[0] = pbnet(&[10, 0, 0, 1], 33)),
                "address 0",
            ),
            (
                Box::new(|i| i.addresses[1] = pbnet(&[0xfd; 16], 129)),
                "address 1",
            ),
            (
                Box::new(|i| i.addresses = vec![pbnet(&[10, 0, 0, 1], 8); 65]),
                "65 addresses",
            ),
            (
                Box::new(|i| i.routes[0].family = PbFamily::IP_FAMILY_UNSPECIFIED.into()),
                "no address family",
            ),
            (
                Box::new(|i| i.routes[0].family = PbFamily::IP_FAMILY_V6.into()),
                "destination",
            ),
            (
                Box::new(|i| i.routes[0].destination = protobuf::MessageField::none()),
                "destination",
            ),
            (
                Box::new(|i| i.routes[0].gateway = vec![0xfd; 16]),
                "gateway",
            ),
            (
                Box::new(|i| i.routes[0].scope = PbScope::ROUTE_SCOPE_UNSPECIFIED.into()),
                "no scope",
            ),
        ];
        for (mutate, want) in cases {
            let mut iface = good();
            mutate(&mut iface);
            let err = plan(&req(vec![iface])).unwrap_err();
            assert!(err.is_invalid_request());
            assert!(err.to_string().contains(want), "{err} lacks {want:?}");
        }
        let err = plan(&req(vec![good(); 9])).unwrap_err();
        assert!(err.to_string().contains("9 interfaces"), "{err}");
        let mut second = good();
        second.name = "eth1".into();
        let err = plan(&req(vec![good(), second])).unwrap_err();
        assert!(err.to_string().contains("given twice"), "{err}");
    }

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
