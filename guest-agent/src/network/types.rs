//! The typed form of a checked request ([`Interface`]s with their addresses and routes), as
//! `plan.rs` makes it and the netlink calls apply it.

use std::net::IpAddr;

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
