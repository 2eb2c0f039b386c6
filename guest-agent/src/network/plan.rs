//! Checking a ConfigureNetwork request whole before anything changes ([`plan`]): bounded counts,
//! names, MACs, MTUs, address lengths and families, each refusal naming the problem.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use agent_protocol::agent::{
    ConfigureNetworkRequest, IpFamily as PbFamily, IpNet as PbIpNet, RouteScope as PbScope,
};

use super::error::NetworkError;
use super::types::{Interface, IpNet, Mac, Route, Scope};

pub const MAX_INTERFACES: usize = 8;
pub const MAX_ADDRESSES: usize = 64;
pub const MAX_ROUTES: usize = 256;
const MIN_MTU: u32 = 68;
const MAX_MTU: u32 = 65535;
/// IFNAMSIZ less the NUL.
const MAX_NAME: usize = 15;

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
pub(super) fn plan(req: &ConfigureNetworkRequest) -> Result<Vec<Interface>, NetworkError> {
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
}
