//! The pod network's host side (design.md 4c, Kata's "tcfilter" model).
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

use std::fs::File;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use futures_util::stream::{StreamExt, TryStreamExt};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
use rtnetlink::packet_route::link::{
    InfoKind, LinkAttribute, LinkInfo, LinkLayerType, LinkMessage,
};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol,
    RouteScope as NlRouteScope, RouteType,
};
use rtnetlink::packet_route::tc::{TcAttribute, TcHandle, TcMessage};
use rtnetlink::packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};
use serde::{Deserialize, Serialize};

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

/// tc's `protocol all`: ETH_P_ALL in network byte order, as tcm_info's low half carries it.
const PROTOCOL_ALL: u16 = (libc::ETH_P_ALL as u16).to_be();
/// The ingress hook's parent, valid for an `ingress` and a `clsact` qdisc alike (`tc filter add
/// dev X ingress`).
const INGRESS_PARENT: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_INGRESS,
};
const IFNAMSIZ: usize = 16;

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

/// Whether setup added the CNI interface's ingress qdisc (teardown deletes it, and our filter
/// with it) or found one there (an `ingress` or `clsact` of someone else's: teardown deletes
/// only our filter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum IngressQdisc {
    Added,
    Existing,
}

/// What setup creates for one CNI interface.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndoLink {
    pub cni_interface: String,
    pub tap: String,
    pub cni_ingress: IngressQdisc,
}

/// Written (JSON) before setup creates anything; enough for [`teardown`] in a fresh process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UndoRecord {
    pub netns: PathBuf,
    pub links: Vec<UndoLink>,
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
    #[error("{action} undo record {path}: {source}")]
    RecordIo {
        action: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    #[error("undo record {path}: {source}")]
    RecordParse {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("{cause}; undoing the partial setup failed too: {undo}")]
    UndoFailed {
        cause: Box<NetworkError>,
        undo: Box<NetworkError>,
    },
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

/// Reads an undo record; `None` when there is none.
pub fn read_record(path: &Path) -> Result<Option<UndoRecord>, NetworkError> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(source) => {
            return Err(NetworkError::RecordIo {
                action: "reading",
                path: path.to_path_buf(),
                source,
            })
        }
    };
    serde_json::from_slice(&bytes)
        .map(Some)
        .map_err(|source| NetworkError::RecordParse {
            path: path.to_path_buf(),
            source,
        })
}

fn write_record(path: &Path, undo: &UndoRecord) -> Result<(), NetworkError> {
    let io_err = |source| NetworkError::RecordIo {
        action: "writing",
        path: path.to_path_buf(),
        source,
    };
    let json = serde_json::to_vec_pretty(undo).map_err(|source| NetworkError::RecordParse {
        path: path.to_path_buf(),
        source,
    })?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    {
        use std::io::Write;
        let mut f = File::create(&tmp).map_err(io_err)?;
        f.write_all(&json).map_err(io_err)?;
        f.sync_all().map_err(io_err)?;
    }
    std::fs::rename(&tmp, path).map_err(io_err)
}

fn remove_record(path: &Path) -> Result<(), NetworkError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(NetworkError::RecordIo {
            action: "removing",
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// What a missing netns means to the caller.
#[derive(Clone, Copy, PartialEq, Eq)]
enum NetnsMissing {
    Error,
    /// Answer `None` (teardown: the netns, and everything in it, is gone).
    Gone,
}

/// The netns thread's view: the path and a netlink handle inside the netns.
struct NetnsCtx {
    path: PathBuf,
    handle: Handle,
}

/// Runs `work` on a new OS thread that has entered `netns`, with a current-thread tokio runtime
/// and a netlink connection opened there. `Ok(None)`: the netns is missing and `missing` is
/// [`NetnsMissing::Gone`].
async fn in_netns<T, F, Fut>(
    netns: &Path,
    missing: NetnsMissing,
    work: F,
) -> Result<Option<T>, NetworkError>
where
    T: Send + 'static,
    F: FnOnce(NetnsCtx) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<T, NetworkError>>,
{
    let path = netns.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel();
    let thread_path = path.clone();
    std::thread::Builder::new()
        .name("pod-netns".into())
        .spawn(move || {
            let _ = tx.send(run_in_netns(thread_path, missing, work));
        })
        .map_err(|source| NetworkError::Thread {
            path: path.clone(),
            source,
        })?;
    rx.await.map_err(|_| NetworkError::ThreadLost(path))?
}

fn run_in_netns<T, F, Fut>(
    path: PathBuf,
    missing: NetnsMissing,
    work: F,
) -> Result<Option<T>, NetworkError>
where
    F: FnOnce(NetnsCtx) -> Fut,
    Fut: std::future::Future<Output = Result<T, NetworkError>>,
{
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return match missing {
                NetnsMissing::Gone => Ok(None),
                NetnsMissing::Error => Err(NetworkError::NetnsMissing(path)),
            }
        }
        Err(source) => return Err(NetworkError::NetnsOpen { path, source }),
    };
    // SAFETY: `file` is an open fd for the call's duration; setns only changes this thread's
    // network namespace, and this thread is ours alone and ends after `work`.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        let source = io::Error::last_os_error();
        // EINVAL: not a network namespace (e.g. the file left after containerd unmounted it).
        if missing == NetnsMissing::Gone && source.raw_os_error() == Some(libc::EINVAL) {
            return Ok(None);
        }
        return Err(NetworkError::NetnsEnter { path, source });
    }
    drop(file);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .enable_time()
        .build()
        .map_err(|source| NetworkError::Connection {
            path: path.clone(),
            source,
        })?;
    runtime.block_on(async move {
        // The socket is opened here, after setns: it belongs to the pod netns.
        let (connection, handle, _) =
            rtnetlink::new_connection().map_err(|source| NetworkError::Connection {
                path: path.clone(),
                source,
            })?;
        let conn = tokio::spawn(connection);
        let result = work(NetnsCtx { path, handle }).await;
        conn.abort();
        result.map(Some)
    })
}

/// A CNI interface as found: its index and the guest's copy of it.
struct CniLink {
    index: u32,
    guest: GuestInterface,
    ingress: IngressQdisc,
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

/// Reads the CNI interfaces with their addresses, routes and ingress qdisc state.
async fn discover(ctx: &NetnsCtx) -> Result<Vec<CniLink>, NetworkError> {
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

fn link_kind(msg: &LinkMessage) -> Option<&InfoKind> {
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
fn has_ingress_qdisc(index: u32, qdiscs: &[TcMessage]) -> bool {
    qdiscs.iter().any(|q| {
        q.header.index == index as i32
            && q.header.parent == TcHandle::INGRESS
            && q.attributes
                .iter()
                .any(|a| matches!(a, TcAttribute::Kind(k) if k == "ingress" || k == "clsact"))
    })
}

/// Opens a tap named `name` in the calling thread's netns.
fn open_tap(name: &str) -> Result<OwnedFd, NetworkError> {
    let err = |source| NetworkError::TapCreate {
        name: name.to_owned(),
        source,
    };
    if name.is_empty() || name.len() >= IFNAMSIZ {
        return Err(err(io::Error::from(io::ErrorKind::InvalidInput)));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
        .map_err(err)?;
    let fd = OwnedFd::from(file);
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in ifr.ifr_name.iter_mut().zip(name.bytes()) {
        *dst = src as libc::c_char;
    }
    ifr.ifr_ifru.ifru_flags =
        (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes one ifreq, which `ifr` is, for the call's duration;
    // the fd is open.
    if unsafe { libc::ioctl(fd.as_raw_fd(), libc::TUNSETIFF, &mut ifr) } != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(fd)
}

/// Creates the tap of one CNI interface and the redirects both ways.
async fn connect(handle: &Handle, link: &CniLink, undo: &UndoLink) -> Result<TapFd, NetworkError> {
    let tap_name = &undo.tap;
    let fd = open_tap(tap_name)?;
    let tap_index = link_index(handle, tap_name)
        .await?
        .ok_or_else(|| NetworkError::TapVanished(tap_name.clone()))?;
    handle
        .link()
        .set(
            LinkUnspec::new_with_index(tap_index)
                .mtu(link.guest.mtu)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(nl(format!(
            "tap {tap_name}: setting MTU {} and up",
            link.guest.mtu
        )))?;
    handle
        .qdisc()
        .add(tap_index as i32)
        .ingress()
        .execute()
        .await
        .map_err(nl(format!("tap {tap_name}: adding the ingress qdisc")))?;
    if link.ingress == IngressQdisc::Added {
        handle
            .qdisc()
            .add(link.index as i32)
            .ingress()
            .execute()
            .await
            .map_err(nl(format!("{}: adding the ingress qdisc", link.guest.name)))?;
    }
    redirect(handle, link.index, tap_index)
        .await
        .map_err(nl(format!(
            "{}: redirecting its ingress to {tap_name}",
            link.guest.name
        )))?;
    redirect(handle, tap_index, link.index)
        .await
        .map_err(nl(format!(
            "{tap_name}: redirecting its ingress to {}",
            link.guest.name
        )))?;
    Ok(TapFd {
        name: tap_name.clone(),
        ifindex: tap_index,
        fd,
    })
}

/// `tc filter add dev <from> ingress pref FILTER_PRIORITY protocol all u32 match u8 0 0 action
/// mirred egress redirect dev <to>`.
async fn redirect(handle: &Handle, from: u32, to: u32) -> Result<(), rtnetlink::Error> {
    handle
        .traffic_filter(from as i32)
        .add()
        .parent(INGRESS_PARENT.into())
        .priority(FILTER_PRIORITY)
        .protocol(PROTOCOL_ALL)
        .redirect(to)?
        .execute()
        .await
}

async fn link_by_name(handle: &Handle, name: &str) -> Result<Option<LinkMessage>, NetworkError> {
    let mut links = handle.link().get().match_name(name.to_owned()).execute();
    match links.try_next().await {
        Ok(link) => Ok(link),
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(source) => Err(NetworkError::Netlink {
            action: format!("looking up link {name}"),
            source,
        }),
    }
}

async fn link_index(handle: &Handle, name: &str) -> Result<Option<u32>, NetworkError> {
    Ok(link_by_name(handle, name).await?.map(|l| l.header.index))
}

/// Sends one request and waits for its acknowledgement.
async fn acked(handle: &Handle, msg: RouteNetlinkMessage) -> Result<(), rtnetlink::Error> {
    let mut req = NetlinkMessage::from(msg);
    req.header.flags = NLM_F_REQUEST | NLM_F_ACK;
    let mut response = handle.clone().request(req)?;
    while let Some(reply) = response.next().await {
        if let NetlinkPayload::Error(e) = reply.payload {
            if e.code.is_some() {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
        }
    }
    Ok(())
}

/// Removes what the record says was added, skipping what is gone already.
async fn undo_links(handle: &Handle, links: &[UndoLink]) -> Result<(), NetworkError> {
    for link in links {
        // Our tap: only a tun device of that name (deleting it takes its qdisc and filter).
        if let Some(tap) = link_by_name(handle, &link.tap).await? {
            if matches!(link_kind(&tap), Some(InfoKind::Tun)) {
                match handle.link().del(tap.header.index).execute().await {
                    Ok(()) => {}
                    Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {}
                    Err(source) => {
                        return Err(NetworkError::Netlink {
                            action: format!("deleting tap {}", link.tap),
                            source,
                        })
                    }
                }
            } else {
                log::warn!("{} is not a tap device any more: left in place", link.tap);
            }
        }
        let Some(index) = link_index(handle, &link.cni_interface).await? else {
            continue;
        };
        match link.cni_ingress {
            IngressQdisc::Added => {
                let qdiscs: Vec<TcMessage> = handle
                    .qdisc()
                    .get()
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nl("listing qdiscs"))?;
                if has_ingress_qdisc(index, &qdiscs) {
                    let mut msg = TcMessage::with_index(index as i32);
                    msg.header.parent = TcHandle::INGRESS;
                    msg.header.handle = TcHandle {
                        major: 0xffff,
                        minor: 0,
                    };
                    acked(handle, RouteNetlinkMessage::DelQueueDiscipline(msg))
                        .await
                        .map_err(nl(format!(
                            "{}: deleting the ingress qdisc",
                            link.cni_interface
                        )))?;
                }
            }
            IngressQdisc::Existing => {
                let filters: Vec<TcMessage> = handle
                    .traffic_filter(index as i32)
                    .get()
                    .ingress()
                    .execute()
                    .try_collect()
                    .await
                    .map_err(nl(format!(
                        "{}: listing ingress filters",
                        link.cni_interface
                    )))?;
                if filters
                    .iter()
                    .any(|f| (f.header.info >> 16) as u16 == FILTER_PRIORITY)
                {
                    let mut msg = TcMessage::with_index(index as i32);
                    msg.header.parent = INGRESS_PARENT;
                    msg.header.info = (u32::from(FILTER_PRIORITY) << 16) | u32::from(PROTOCOL_ALL);
                    acked(handle, RouteNetlinkMessage::DelTrafficFilter(msg))
                        .await
                        .map_err(nl(format!(
                            "{}: deleting our ingress filter",
                            link.cni_interface
                        )))?;
                }
            }
        }
    }
    Ok(())
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
    fn protocol_all_is_eth_p_all_in_network_order() {
        assert_eq!(PROTOCOL_ALL.to_ne_bytes(), [0x00, 0x03]);
    }

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
    fn link_local_v6_is_recognised() {
        assert!(is_ipv6_link_local(&"fe80::1".parse().unwrap()));
        assert!(is_ipv6_link_local(&"febf::1".parse().unwrap()));
        assert!(!is_ipv6_link_local(&"fec0::1".parse().unwrap()));
        assert!(!is_ipv6_link_local(&"fd00::1".parse().unwrap()));
    }

    #[test]
    fn undo_record_round_trips_and_a_missing_one_is_none() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("network.json");
        assert!(read_record(&path).unwrap().is_none());
        let undo = UndoRecord {
            netns: "/var/run/netns/cni-1".into(),
            links: vec![UndoLink {
                cni_interface: "eth0".into(),
                tap: tap_name(0),
                cni_ingress: IngressQdisc::Existing,
            }],
        };
        write_record(&path, &undo).unwrap();
        assert_eq!(read_record(&path).unwrap(), Some(undo));
        let json = std::fs::read_to_string(&path).unwrap();
        assert!(json.contains("\"cni_ingress\": \"existing\""), "{json}");
        remove_record(&path).unwrap();
        remove_record(&path).unwrap();
        std::fs::write(&path, b"{not json").unwrap();
        let err = read_record(&path).unwrap_err().to_string();
        assert!(err.contains("network.json"), "{err}");
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
