//! Reading the pod netns: the CNI interfaces (links), their addresses and routes, and whether
//! their ingress hook has a qdisc already.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures_util::stream::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{
    InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol,
    RouteScope as NlRouteScope, RouteType,
};
use rtnetlink::packet_route::tc::{TcAttribute, TcHandle, TcMessage};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::RouteMessageBuilder;

use super::netns::NetnsCtx;
use super::record::IngressQdisc;
use super::{
    nl, GuestInterface, IpFamily, IpNet, MacAddr, NetworkError, Route, RouteScope, MAX_ADDRESSES,
    MAX_INTERFACES, MAX_ROUTES,
};

/// A CNI interface as found: its index and the guest's copy of it.
pub(super) struct CniLink {
    pub(super) index: u32,
    pub(super) guest: GuestInterface,
    pub(super) ingress: IngressQdisc,
}

/// Reads the CNI interfaces with their addresses, routes and ingress qdisc state.
pub(super) async fn discover(ctx: &NetnsCtx) -> Result<Vec<CniLink>, NetworkError> {
    let handle = &ctx.handle;
    let all: Vec<LinkMessage> = handle
        .link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("listing links in {}", ctx.path.display())))?;
    let mut found = Vec::new();
    for msg in &all {
        if let Some((name, mac, mtu)) = cni_link(msg)? {
            found.push((msg.header.index, name, mac, mtu));
        }
    }
    if found.is_empty() {
        return Err(NetworkError::NoInterface(ctx.path.clone()));
    }
    if found.len() > MAX_INTERFACES {
        return Err(NetworkError::TooManyInterfaces {
            path: ctx.path.clone(),
            count: found.len(),
        });
    }
    let addresses: Vec<AddressMessage> = handle
        .address()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("listing addresses in {}", ctx.path.display())))?;
    let mut routes: Vec<RouteMessage> = Vec::new();
    for dump in [
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
        RouteMessageBuilder::<Ipv6Addr>::new().build(),
    ] {
        let part: Vec<RouteMessage> = handle
            .route()
            .get(dump)
            .execute()
            .try_collect()
            .await
            .map_err(nl(format!("listing routes in {}", ctx.path.display())))?;
        routes.extend(part);
    }
    let qdiscs: Vec<TcMessage> = handle
        .qdisc()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(nl(format!("listing qdiscs in {}", ctx.path.display())))?;

    let mut links = Vec::with_capacity(found.len());
    for (index, name, mac, mtu) in found {
        let addrs = interface_addresses(index, &addresses);
        let rts = interface_routes(index, &routes);
        if addrs.len() > MAX_ADDRESSES || rts.len() > MAX_ROUTES {
            return Err(NetworkError::Interface {
                interface: name,
                problem: "more addresses or routes than a guest NIC is given",
            });
        }
        let ingress = if has_ingress_qdisc(index, &qdiscs) {
            IngressQdisc::Existing
        } else {
            IngressQdisc::Added
        };
        links.push(CniLink {
            index,
            guest: GuestInterface {
                name,
                mac,
                mtu,
                addresses: addrs,
                routes: rts,
            },
            ingress,
        });
    }
    Ok(links)
}

fn link_name(msg: &LinkMessage) -> Option<&str> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::IfName(n) => Some(n.as_str()),
        _ => None,
    })
}

pub(super) fn link_kind(msg: &LinkMessage) -> Option<&InfoKind> {
    msg.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(k),
            _ => None,
        }),
        _ => None,
    })
}

/// A CNI interface's name, MAC and MTU; `None` for links that are not one (lo, tunnels a
/// module creates in every netns, tun/tap devices).
fn cni_link(msg: &LinkMessage) -> Result<Option<(String, MacAddr, u32)>, NetworkError> {
    if msg.header.link_layer_type != LinkLayerType::Ether {
        return Ok(None);
    }
    if matches!(link_kind(msg), Some(InfoKind::Tun)) {
        return Ok(None);
    }
    let Some(name) = link_name(msg) else {
        return Ok(None);
    };
    let bad = |problem| NetworkError::Interface {
        interface: name.to_owned(),
        problem,
    };
    let mac = msg
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Address(m) => Some(m.as_slice()),
            _ => None,
        })
        .ok_or_else(|| bad("no MAC address"))?;
    let mac: [u8; 6] = mac
        .try_into()
        .map_err(|_| bad("MAC address is not 6 bytes"))?;
    let mtu = msg
        .attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::Mtu(m) => Some(*m),
            _ => None,
        })
        .ok_or_else(|| bad("no MTU"))?;
    Ok(Some((name.to_owned(), MacAddr(mac), mtu)))
}

fn is_ipv6_link_local(a: &Ipv6Addr) -> bool {
    (a.segments()[0] & 0xffc0) == 0xfe80
}

/// The interface's addresses, in the kernel's order; IPv6 link-local ones left out (the guest
/// kernel makes its own).
fn interface_addresses(index: u32, all: &[AddressMessage]) -> Vec<IpNet> {
    let mut out = Vec::new();
    for msg in all.iter().filter(|m| m.header.index == index) {
        let find = |want_local: bool| {
            msg.attributes.iter().find_map(|a| match a {
                AddressAttribute::Local(ip) if want_local => Some(*ip),
                AddressAttribute::Address(ip) if !want_local => Some(*ip),
                _ => None,
            })
        };
        // IPv4: IFA_LOCAL is the interface's address (IFA_ADDRESS is the peer's on a
        // point-to-point link); IPv6 has IFA_ADDRESS only.
        let ip = match msg.header.family {
            AddressFamily::Inet => find(true).or_else(|| find(false)),
            AddressFamily::Inet6 => find(false),
            _ => None,
        };
        match ip {
            Some(IpAddr::V6(v6)) if is_ipv6_link_local(&v6) => {}
            Some(addr) => out.push(IpNet {
                addr,
                prefix_len: msg.header.prefix_len,
            }),
            None => {}
        }
    }
    out
}

fn route_ip(addr: &RouteAddress) -> Option<IpAddr> {
    match addr {
        RouteAddress::Inet(a) => Some(IpAddr::V4(*a)),
        RouteAddress::Inet6(a) => Some(IpAddr::V6(*a)),
        _ => None,
    }
}

/// The main table's unicast routes out of the interface, except the kernel's own (the prefix
/// routes of addresses and IPv6 link-local ones: the guest kernel makes them when it gets the
/// addresses).
fn interface_routes(index: u32, all: &[RouteMessage]) -> Vec<Route> {
    let mut out = Vec::new();
    for msg in all {
        let attr =
            |f: fn(&RouteAttribute) -> Option<&RouteAddress>| msg.attributes.iter().find_map(f);
        let table = msg
            .attributes
            .iter()
            .find_map(|a| match a {
                RouteAttribute::Table(t) => Some(*t),
                _ => None,
            })
            .unwrap_or(u32::from(msg.header.table));
        let oif = msg.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        });
        if table != u32::from(RouteHeader::RT_TABLE_MAIN)
            || msg.header.kind != RouteType::Unicast
            || msg.header.protocol == RouteProtocol::Kernel
            || oif != Some(index)
        {
            continue;
        }
        let family = match msg.header.address_family {
            AddressFamily::Inet => IpFamily::V4,
            AddressFamily::Inet6 => IpFamily::V6,
            _ => continue,
        };
        let destination = match attr(|a| match a {
            RouteAttribute::Destination(d) => Some(d),
            _ => None,
        }) {
            Some(d) => match route_ip(d) {
                Some(addr) => IpNet {
                    addr,
                    prefix_len: msg.header.destination_prefix_length,
                },
                None => continue,
            },
            None => IpNet::default_route(family),
        };
        let gateway = match attr(|a| match a {
            RouteAttribute::Gateway(g) => Some(g),
            _ => None,
        }) {
            Some(g) => match route_ip(g) {
                Some(ip) => Some(ip),
                None => continue,
            },
            None => None,
        };
        if msg
            .attributes
            .iter()
            .any(|a| matches!(a, RouteAttribute::Via(_)))
        {
            log::warn!("route to {destination} via another family: not given to the guest");
            continue;
        }
        let scope = match msg.header.scope {
            NlRouteScope::Universe => RouteScope::Universe,
            NlRouteScope::Site => RouteScope::Site,
            NlRouteScope::Link => RouteScope::Link,
            NlRouteScope::Host => RouteScope::Host,
            other => {
                log::warn!("route to {destination} with scope {other:?}: not given to the guest");
                continue;
            }
        };
        out.push(Route {
            destination,
            gateway,
            scope,
        });
    }
    out
}

/// Whether the interface has an `ingress` or `clsact` qdisc (both hold the ingress hook).
pub(super) fn has_ingress_qdisc(index: u32, qdiscs: &[TcMessage]) -> bool {
    qdiscs.iter().any(|q| {
        q.header.index == index as i32
            && q.header.parent == TcHandle::INGRESS
            && q.attributes
                .iter()
                .any(|a| matches!(a, TcAttribute::Kind(k) if k == "ingress" || k == "clsact"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn link_local_v6_is_recognised() {
        assert!(is_ipv6_link_local(&"fe80::1".parse().unwrap()));
        assert!(is_ipv6_link_local(&"febf::1".parse().unwrap()));
        assert!(!is_ipv6_link_local(&"fec0::1".parse().unwrap()));
        assert!(!is_ipv6_link_local(&"fd00::1".parse().unwrap()));
    }

    fn route_msg(
        family: AddressFamily,
        dst: Option<(IpAddr, u8)>,
        gw: Option<IpAddr>,
        oif: u32,
        protocol: RouteProtocol,
        scope: NlRouteScope,
    ) -> RouteMessage {
        let mut m = RouteMessage::default();
        m.header.address_family = family;
        m.header.table = RouteHeader::RT_TABLE_MAIN;
        m.header.kind = RouteType::Unicast;
        m.header.protocol = protocol;
        m.header.scope = scope;
        if let Some((ip, len)) = dst {
            m.header.destination_prefix_length = len;
            m.attributes.push(RouteAttribute::Destination(ip.into()));
        }
        if let Some(g) = gw {
            m.attributes.push(RouteAttribute::Gateway(g.into()));
        }
        m.attributes.push(RouteAttribute::Oif(oif));
        m
    }

    #[test]
    fn routes_of_the_interface_without_the_kernels_own() {
        let v4 = AddressFamily::Inet;
        let v6 = AddressFamily::Inet6;
        let gw4: IpAddr = "10.1.0.1".parse().unwrap();
        let gw6: IpAddr = "fd00::1".parse().unwrap();
        let all = vec![
            route_msg(
                v4,
                None,
                Some(gw4),
                2,
                RouteProtocol::Boot,
                NlRouteScope::Universe,
            ),
            route_msg(
                v4,
                Some(("10.1.0.0".parse().unwrap(), 24)),
                None,
                2,
                RouteProtocol::Kernel,
                NlRouteScope::Link,
            ),
            route_msg(
                v4,
                Some(("10.1.0.1".parse().unwrap(), 32)),
                None,
                2,
                RouteProtocol::Boot,
                NlRouteScope::Link,
            ),
            route_msg(
                v4,
                None,
                Some(gw4),
                3,
                RouteProtocol::Boot,
                NlRouteScope::Universe,
            ),
            route_msg(
                v6,
                None,
                Some(gw6),
                2,
                RouteProtocol::Static,
                NlRouteScope::Universe,
            ),
        ];
        let routes = interface_routes(2, &all);
        assert_eq!(
            routes,
            vec![
                Route {
                    destination: IpNet::default_route(IpFamily::V4),
                    gateway: Some(gw4),
                    scope: RouteScope::Universe,
                },
                Route {
                    destination: IpNet {
                        addr: "10.1.0.1".parse().unwrap(),
                        prefix_len: 32
                    },
                    gateway: None,
                    scope: RouteScope::Link,
                },
                Route {
                    destination: IpNet::default_route(IpFamily::V6),
                    gateway: Some(gw6),
                    scope: RouteScope::Universe,
                },
            ]
        );
    }

    /// Properties of the route translation (netlink dump -> guest routes -> agent request).
    mod properties {
        use super::*;
        use crate::resources::network::{configure_network_request, GuestInterface, MacAddr};
        use proptest::prelude::*;

        /// One route of a dump: family, destination, gateway (of that family), interface,
        /// protocol, scope.
        type Dumped = (bool, Option<(IpAddr, u8)>, Option<IpAddr>, u32, u8, u8);

        fn ip(v6: bool) -> BoxedStrategy<IpAddr> {
            if v6 {
                any::<u128>().prop_map(|a| IpAddr::V6(a.into())).boxed()
            } else {
                any::<u32>().prop_map(|a| IpAddr::V4(a.into())).boxed()
            }
        }

        fn dumped() -> impl Strategy<Value = Dumped> {
            any::<bool>().prop_flat_map(|v6| {
                let max: u8 = if v6 { 128 } else { 32 };
                (
                    Just(v6),
                    prop::option::of((ip(v6), 0..=max)),
                    prop::option::of(ip(v6)),
                    1u32..4,
                    0u8..3,
                    0u8..4,
                )
            })
        }

        const PROTOCOLS: [RouteProtocol; 3] = [
            RouteProtocol::Kernel,
            RouteProtocol::Boot,
            RouteProtocol::Static,
        ];
        const SCOPES: [(NlRouteScope, RouteScope); 4] = [
            (NlRouteScope::Universe, RouteScope::Universe),
            (NlRouteScope::Site, RouteScope::Site),
            (NlRouteScope::Link, RouteScope::Link),
            (NlRouteScope::Host, RouteScope::Host),
        ];

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(256))]

            /// The guest gets exactly the interface's routes that are not the kernel's own, in
            /// the dump's order, each with its destination, prefix, gateway and scope; and the
            /// agent's request carries each with its family's address length.
            #[test]
            fn routes_reach_the_guest_as_dumped(
                dump in prop::collection::vec(dumped(), 0..12),
                index in 1u32..4,
            ) {
                let msgs: Vec<RouteMessage> = dump
                    .iter()
                    .map(|&(v6, dst, gw, oif, proto, scope)| {
                        let family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
                        route_msg(family, dst, gw, oif, PROTOCOLS[proto as usize], SCOPES[scope as usize].0)
                    })
                    .collect();
                let expected: Vec<Route> = dump
                    .iter()
                    .filter(|&&(_, _, _, oif, proto, _)| oif == index && proto != 0)
                    .map(|&(v6, dst, gw, _, _, scope)| Route {
                        destination: match dst {
                            Some((addr, prefix_len)) => IpNet { addr, prefix_len },
                            None => IpNet::default_route(if v6 { IpFamily::V6 } else { IpFamily::V4 }),
                        },
                        gateway: gw,
                        scope: SCOPES[scope as usize].1,
                    })
                    .collect();
                let routes = interface_routes(index, &msgs);
                prop_assert_eq!(&routes, &expected);

                let iface = GuestInterface {
                    name: "eth0".into(),
                    mac: MacAddr([2, 0, 0, 0, 0, 1]),
                    mtu: 1500,
                    addresses: Vec::new(),
                    routes,
                };
                let req = configure_network_request([&iface]);
                let sent = &req.interfaces[0].routes;
                prop_assert_eq!(sent.len(), expected.len());
                for (r, want) in sent.iter().zip(&expected) {
                    let len = if want.family() == IpFamily::V6 { 16 } else { 4 };
                    let dst = r.destination.as_ref().map(|d| (d.addr.len(), d.prefix_len));
                    prop_assert_eq!(dst, Some((len, u32::from(want.destination.prefix_len))));
                    prop_assert_eq!(r.gateway.len(), if want.gateway.is_some() { len } else { 0 });
                }
            }
        }
    }
}
