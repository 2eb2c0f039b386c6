//! What can go wrong configuring the guest's network ([`NetworkError`]): a refused request, or
//! the netlink step that failed.

use std::io;

use super::types::{IpNet, Mac, Route};

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
