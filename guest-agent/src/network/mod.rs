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
//!
//! The folder: [`configure`] (here) applies what `plan.rs` checked and typed (`types.rs`) through
//! `netlink.rs`'s socket; `error.rs` holds [`NetworkError`].

mod error;
mod netlink;
mod plan;
mod types;

use std::io;

use agent_protocol::agent::ConfigureNetworkRequest;

pub use error::NetworkError;
use netlink::Netlink;
use plan::plan;
use types::Interface;

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
