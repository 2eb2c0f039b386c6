//! The pod network's host side (Kata's "tcfilter" model).
//!
//! containerd runs CNI in the pod's network namespace before the sandbox task exists and passes
//! the netns path in the sandbox spec. [`setup`] enters that netns on a dedicated thread (never a
//! thread of the shim's tokio runtime: `setns` changes the calling thread), and there:
//!
//! 1. reads every CNI interface (each Ethernet link but `lo` and tun devices; usually `eth0`, a
//!    veth): name, MAC, MTU, addresses (not IPv6 link-local) and the main table's routes through
//!    it, except those the kernel made for an address (the guest kernel makes them again);
//! 2. writes the [`UndoRecord`] to the path the caller gives (the sandbox's state dir) before it
//!    creates anything;
//! 3. per interface opens a tap `mvtap<N>` through `/dev/net/tun` (`IFF_TAP | IFF_NO_PI |
//!    IFF_VNET_HDR`; the fd is what the VM gets), gives it the interface's MTU, brings it up, puts
//!    an ingress qdisc on both, and a match-all u32 filter with a mirred egress redirect on each
//!    ingress: CNI interface -> tap, tap -> CNI interface.
//!
//! Nothing else in the netns changes: the addresses stay on the CNI interface (so portmap and
//! bandwidth keep working on the host side); the guest gets the same MAC, addresses, routes and
//! MTU through the agent's ConfigureNetwork ([`configure_network_request`]).
//!
//! [`teardown`] reads the record (in the same process or a fresh one after a crash), removes the
//! taps and the qdiscs/filters setup added, and nothing else. It is idempotent, and a netns that
//! is already gone (containerd removes it) is success.
//!
//! Why rtnetlink here: the shim is async (tokio) already, and rtnetlink brings typed builders for
//! links, addresses, routes and tc (qdiscs, u32 filters, mirred actions) on top of the same
//! netlink-packet-route messages the agent uses; no `ip`/`tc` binaries are run.

mod discover;
pub mod loopback;
mod netns;
mod record;
pub mod sk_lookup;
mod tap;
// The page sharing capture VM opens an inert tap of its own (shim/src/vm/thread.rs).
pub(crate) use tap::open_tap;

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use discover::discover;
use netns::{in_netns, NetnsCtx, NetnsMissing};
pub use record::{read_record, IngressQdisc, UndoLink, UndoRecord};
use record::{remove_record, write_record};
use tap::{connect, undo_links};

/// Taps are named `mvtap<N>`, N the CNI interface's position.
pub const TAP_PREFIX: &str = "mvtap";
/// At most this many CNI interfaces per pod (each one is a virtio-net device).
pub const MAX_INTERFACES: usize = 8;
/// At most this many addresses, and routes, taken from one interface.
pub const MAX_ADDRESSES: usize = 64;
pub const MAX_ROUTES: usize = 256;
/// The tc priority (`pref`) of our redirect filters: teardown deletes the filters of exactly
/// this priority, so filters others put on the same ingress stay.
pub const FILTER_PRIORITY: u16 = 0xc0de;

/// An Ethernet MAC address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MacAddr(pub [u8; 6]);

impl std::fmt::Display for MacAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let m = self.0;
        write!(
            f,
            "{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}",
            m[0], m[1], m[2], m[3], m[4], m[5]
        )
    }
}

/// An address with its prefix length (`10.88.0.5/16`), or a route's destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNet {
    pub addr: IpAddr,
    pub prefix_len: u8,
}

impl IpNet {
    /// The default destination of a family (`0.0.0.0/0`, `::/0`).
    pub fn default_route(family: IpFamily) -> IpNet {
        let addr = match family {
            IpFamily::V4 => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpFamily::V6 => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        IpNet {
            addr,
            prefix_len: 0,
        }
    }

    pub fn family(&self) -> IpFamily {
        match self.addr {
            IpAddr::V4(_) => IpFamily::V4,
            IpAddr::V6(_) => IpFamily::V6,
        }
    }
}

impl std::fmt::Display for IpNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

/// A route's scope (`ip route ... scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RouteScope {
    /// Through a gateway or anywhere (`global`).
    Universe,
    Site,
    /// Directly on the link.
    Link,
    Host,
}

/// One route through an interface, from the main table.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Route {
    pub destination: IpNet,
    /// `None`: directly reachable on the link.
    pub gateway: Option<IpAddr>,
    pub scope: RouteScope,
}

impl Route {
    pub fn family(&self) -> IpFamily {
        self.destination.family()
    }
}

/// What the guest NIC of one CNI interface must look like: same name, MAC, MTU, addresses and
/// routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestInterface {
    pub name: String,
    pub mac: MacAddr,
    pub mtu: u32,
    pub addresses: Vec<IpNet>,
    pub routes: Vec<Route>,
}

/// An open tap device in the pod netns: `IFF_TAP | IFF_NO_PI | IFF_VNET_HDR`. The device lives as
/// long as an fd on it is open (it is not persistent). The VM backend sets the vnet header size
/// and offloads itself (QEMU: `-netdev tap,fd=`). The fd is close-on-exec: a backend that hands it
/// to a child (QEMU) clears that flag on the child's copy only. Dropping every copy removes the
/// tap (the redirect filter on the CNI interface then drops the pod's traffic until teardown).
#[derive(Debug)]
pub struct TapFd {
    pub name: String,
    pub ifindex: u32,
    fd: OwnedFd,
}

impl TapFd {
    pub fn into_owned_fd(self) -> OwnedFd {
        self.fd
    }
}

impl AsFd for TapFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

/// One CNI interface's guest description and the tap that carries its traffic.
#[derive(Debug)]
pub struct PodNic {
    pub guest: GuestInterface,
    pub tap: TapFd,
}

/// The pod network as [`setup`] left it: one NIC per CNI interface, in the netns's link order.
#[derive(Debug)]
pub struct PodNetwork {
    pub nics: Vec<PodNic>,
}

impl PodNetwork {
    pub fn guest_interfaces(&self) -> impl Iterator<Item = &GuestInterface> {
        self.nics.iter().map(|n| &n.guest)
    }
}

/// What [`teardown`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TeardownOutcome {
    /// No undo record: setup never got to create anything, or teardown ran already.
    NothingRecorded,
    /// The netns is gone (and with it everything setup made); the record is removed.
    NetnsGone,
    /// Taps, filters and qdiscs setup added are removed; the record is removed.
    Removed,
}

/// Errors of the pod network; each names what it was doing and keeps the cause.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error("pod netns {0} does not exist")]
    NetnsMissing(PathBuf),
    #[error("opening pod netns {path}: {source}")]
    NetnsOpen { path: PathBuf, source: io::Error },
    #[error("entering pod netns {path}: {source}")]
    NetnsEnter { path: PathBuf, source: io::Error },
    #[error("starting the thread for pod netns {path}: {source}")]
    Thread { path: PathBuf, source: io::Error },
    #[error("the thread for pod netns {0} ended without an answer")]
    ThreadLost(PathBuf),
    #[error("netlink in pod netns {path}: {source}")]
    Connection { path: PathBuf, source: io::Error },
    #[error("pod netns {0} has no CNI interface (no Ethernet link but lo)")]
    NoInterface(PathBuf),
    #[error("pod netns {path} has {count} CNI interfaces (at most {MAX_INTERFACES})")]
    TooManyInterfaces { path: PathBuf, count: usize },
    #[error("interface {interface}: {problem}")]
    Interface {
        interface: String,
        problem: &'static str,
    },
    #[error("{action}: {source}")]
    Netlink {
        action: String,
        source: rtnetlink::Error,
    },
    #[error("creating tap {name} through /dev/net/tun: {source}")]
    TapCreate { name: String, source: io::Error },
    #[error("tap {0} was created but is not in the netns's link list")]
    TapVanished(String),
    #[error("undo record {path} exists: tear the pod network down first")]
    RecordExists { path: PathBuf },
    #[error(transparent)]
    Record(#[from] crate::state::RecordError),
    #[error("{}", several(.0))]
    Several(Vec<NetworkError>),
    #[error("{cause}; undoing the partial setup failed too: {undo}")]
    UndoFailed {
        cause: Box<NetworkError>,
        undo: Box<NetworkError>,
    },
}

/// Several failures, each in full, in the order they happened.
fn several(errors: &[NetworkError]) -> String {
    errors
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

fn nl(action: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> NetworkError {
    let action = action.into();
    move |source| NetworkError::Netlink { action, source }
}

/// Sets the pod network up in `netns` (see the module doc); the undo record goes to `record`.
/// On an error, whatever was created is removed again and so is the record.
pub async fn setup(netns: &Path, record: &Path) -> Result<PodNetwork, NetworkError> {
    let record = record.to_path_buf();
    in_netns(netns, NetnsMissing::Error, move |ctx| async move {
        setup_in_netns(&ctx, &record).await
    })
    .await?
    .ok_or_else(|| NetworkError::NetnsMissing(netns.to_path_buf()))
}

/// Removes what the undo record at `record` says setup created, then the record. Idempotent;
/// a missing record or a missing netns is success.
pub async fn teardown(record: &Path) -> Result<TeardownOutcome, NetworkError> {
    let undo = match read_record(record)? {
        Some(undo) => undo,
        None => return Ok(TeardownOutcome::NothingRecorded),
    };
    let links = undo.links.clone();
    let outcome = in_netns(&undo.netns, NetnsMissing::Gone, move |ctx| async move {
        undo_links(&ctx.handle, &links).await
    })
    .await?;
    let outcome = match outcome {
        Some(()) => TeardownOutcome::Removed,
        None => TeardownOutcome::NetnsGone,
    };
    remove_record(record)?;
    Ok(outcome)
}

async fn setup_in_netns(ctx: &NetnsCtx, record: &Path) -> Result<PodNetwork, NetworkError> {
    if record.exists() {
        return Err(NetworkError::RecordExists {
            path: record.to_path_buf(),
        });
    }
    let links = discover(ctx).await?;
    let undo = UndoRecord {
        netns: ctx.path.clone(),
        links: links
            .iter()
            .enumerate()
            .map(|(i, l)| UndoLink {
                cni_interface: l.guest.name.clone(),
                tap: tap_name(i),
                cni_ingress: l.ingress,
            })
            .collect(),
    };
    write_record(record, &undo)?;
    let mut nics = Vec::with_capacity(links.len());
    let mut failure = None;
    for (link, undo_link) in links.into_iter().zip(&undo.links) {
        match connect(&ctx.handle, &link, undo_link).await {
            Ok(tap) => nics.push(PodNic {
                guest: link.guest,
                tap,
            }),
            Err(e) => {
                failure = Some(e);
                break;
            }
        }
    }
    let Some(cause) = failure else {
        log::info!(
            "pod network in {}: {}",
            ctx.path.display(),
            undo.links
                .iter()
                .map(|l| format!("{} <-> {}", l.cni_interface, l.tap))
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(PodNetwork { nics });
    };
    // Close our taps first (the kernel removes a non-persistent tap with its last fd), then undo
    // the rest from the record, as teardown would.
    drop(nics);
    match undo_links(&ctx.handle, &undo.links).await {
        Ok(()) => {
            remove_record(record)?;
            Err(cause)
        }
        Err(undo) => Err(NetworkError::UndoFailed {
            cause: Box::new(cause),
            undo: Box::new(undo),
        }),
    }
}

fn tap_name(i: usize) -> String {
    format!("{TAP_PREFIX}{i}")
}

/// The agent's ConfigureNetwork request for these interfaces.
pub fn configure_network_request<'a>(
    interfaces: impl IntoIterator<Item = &'a GuestInterface>,
) -> agent_protocol::agent::ConfigureNetworkRequest {
    use agent_protocol::agent as pb;
    let ip_bytes = |ip: &IpAddr| match ip {
        IpAddr::V4(a) => a.octets().to_vec(),
        IpAddr::V6(a) => a.octets().to_vec(),
    };
    let family = |f: IpFamily| match f {
        IpFamily::V4 => pb::IpFamily::IP_FAMILY_V4,
        IpFamily::V6 => pb::IpFamily::IP_FAMILY_V6,
    };
    let net = |n: &IpNet| pb::IpNet {
        addr: ip_bytes(&n.addr),
        prefix_len: u32::from(n.prefix_len),
        ..Default::default()
    };
    pb::ConfigureNetworkRequest {
        interfaces: interfaces
            .into_iter()
            .map(|i| pb::NetworkInterface {
                name: i.name.clone(),
                mac: i.mac.0.to_vec(),
                mtu: i.mtu,
                addresses: i.addresses.iter().map(net).collect(),
                routes: i
                    .routes
                    .iter()
                    .map(|r| pb::Route {
                        family: family(r.family()).into(),
                        destination: protobuf::MessageField::some(net(&r.destination)),
                        gateway: r.gateway.as_ref().map(ip_bytes).unwrap_or_default(),
                        scope: match r.scope {
                            RouteScope::Universe => pb::RouteScope::ROUTE_SCOPE_UNIVERSE,
                            RouteScope::Site => pb::RouteScope::ROUTE_SCOPE_SITE,
                            RouteScope::Link => pb::RouteScope::ROUTE_SCOPE_LINK,
                            RouteScope::Host => pb::RouteScope::ROUTE_SCOPE_HOST,
                        }
                        .into(),
                        ..Default::default()
                    })
                    .collect(),
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mac_and_net_display() {
        let mac = MacAddr([0x02, 0x42, 0xac, 0x11, 0x00, 0x0a]);
        assert_eq!(mac.to_string(), "02:42:ac:11:00:0a");
        let net = IpNet {
            addr: "fd00::5".parse().unwrap(),
            prefix_len: 64,
        };
        assert_eq!(net.to_string(), "fd00::5/64");
        assert_eq!(IpNet::default_route(IpFamily::V6).to_string(), "::/0");
        assert_eq!(IpNet::default_route(IpFamily::V4).to_string(), "0.0.0.0/0");
    }

    #[test]
    fn the_agent_request_carries_every_field() {
        let iface = GuestInterface {
            name: "eth0".into(),
            mac: MacAddr([2, 0, 0, 0, 0, 1]),
            mtu: 1400,
            addresses: vec![IpNet {
                addr: "10.1.0.5".parse().unwrap(),
                prefix_len: 24,
            }],
            routes: vec![Route {
                destination: IpNet::default_route(IpFamily::V6),
                gateway: Some("fd00::1".parse().unwrap()),
                scope: RouteScope::Universe,
            }],
        };
        let req = configure_network_request([&iface]);
        let i = &req.interfaces[0];
        assert_eq!(
            (i.name.as_str(), i.mac.as_slice(), i.mtu),
            ("eth0", &[2, 0, 0, 0, 0, 1][..], 1400)
        );
        assert_eq!(i.addresses[0].addr, vec![10, 1, 0, 5]);
        assert_eq!(i.addresses[0].prefix_len, 24);
        let r = &i.routes[0];
        assert_eq!(
            r.family.enum_value(),
            Ok(agent_protocol::agent::IpFamily::IP_FAMILY_V6)
        );
        assert_eq!(r.destination.addr, vec![0u8; 16]);
        assert_eq!(r.destination.prefix_len, 0);
        assert_eq!(r.gateway.len(), 16);
        assert_eq!(
            r.scope.enum_value(),
            Ok(agent_protocol::agent::RouteScope::ROUTE_SCOPE_UNIVERSE)
        );
    }
}
