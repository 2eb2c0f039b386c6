//! The taps and tc redirects: opening a tap per CNI interface, connecting it to the interface
//! with a mirred redirect on each ingress, and removing what the undo record lists.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use futures_util::stream::{StreamExt, TryStreamExt};
use rtnetlink::packet_core::{NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST};
use rtnetlink::packet_route::link::{InfoKind, LinkMessage};
use rtnetlink::packet_route::tc::{TcHandle, TcMessage};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::{Handle, LinkUnspec};

use super::discover::{has_ingress_qdisc, link_kind, CniLink};
use super::record::{IngressQdisc, UndoLink};
use super::{nl, NetworkError, TapFd, FILTER_PRIORITY};

/// tc's `protocol all`: ETH_P_ALL in network byte order, as tcm_info's low half carries it.
const PROTOCOL_ALL: u16 = (libc::ETH_P_ALL as u16).to_be();
/// The ingress hook's parent, valid for an `ingress` and a `clsact` qdisc alike (`tc filter add
/// dev X ingress`).
const INGRESS_PARENT: TcHandle = TcHandle {
    major: 0xffff,
    minor: TcHandle::MIN_INGRESS,
};
const IFNAMSIZ: usize = 16;

/// Opens a tap named `name` in the calling thread's netns.
pub(crate) fn open_tap(name: &str) -> Result<OwnedFd, NetworkError> {
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
pub(super) async fn connect(
    handle: &Handle,
    link: &CniLink,
    undo: &UndoLink,
) -> Result<TapFd, NetworkError> {
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
        Err(e) if netlink_errno(&e) == Some(libc::ENODEV) => Ok(None),
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

/// A delete that found its object gone (the link, ENODEV, or the qdisc or filter, ENOENT) has
/// nothing left to do: the link can vanish between our lookup and the delete (its netns being
/// torn down, a CNI DEL racing a crashed shim's reclaim).
fn already_gone_is_done(result: Result<(), rtnetlink::Error>) -> Result<(), rtnetlink::Error> {
    match result {
        Err(e) if matches!(netlink_errno(&e), Some(libc::ENODEV | libc::ENOENT)) => Ok(()),
        other => other,
    }
}

/// The errno the kernel answered a netlink request with, if that is what failed.
fn netlink_errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => Some(-m.raw_code()),
        _ => None,
    }
}

/// Removes what the record says was added, skipping what is gone already. Every link is undone
/// even when one before it failed (a link that cannot be cleaned must not leave the next one's
/// tap behind); the failures are reported together.
pub(super) async fn undo_links(handle: &Handle, links: &[UndoLink]) -> Result<(), NetworkError> {
    let mut failures = Vec::new();
    for link in links {
        if let Err(e) = undo_link(handle, link).await {
            failures.push(e);
        }
    }
    match failures.len() {
        0 => Ok(()),
        1 => Err(failures.remove(0)),
        _ => Err(NetworkError::Several(failures)),
    }
}

/// One link's undo: our tap deleted, then the CNI interface's ingress qdisc (if we added it) or
/// our filter on it (if the qdisc was there before us) removed.
async fn undo_link(handle: &Handle, link: &UndoLink) -> Result<(), NetworkError> {
    // Our tap: only a tun device of that name (deleting it takes its qdisc and filter).
    if let Some(tap) = link_by_name(handle, &link.tap).await? {
        if matches!(link_kind(&tap), Some(InfoKind::Tun)) {
            match handle.link().del(tap.header.index).execute().await {
                Ok(()) => {}
                Err(e) if netlink_errno(&e) == Some(libc::ENODEV) => {}
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
        return Ok(());
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
                already_gone_is_done(
                    acked(handle, RouteNetlinkMessage::DelQueueDiscipline(msg)).await,
                )
                .map_err(nl(format!(
                    "{}: deleting the ingress qdisc",
                    link.cni_interface
                )))?;
            }
        }
        IngressQdisc::Existing => {
            let listed: Result<Vec<TcMessage>, _> = handle
                .traffic_filter(index as i32)
                .get()
                .ingress()
                .execute()
                .try_collect()
                .await;
            let filters = match listed {
                Ok(filters) => filters,
                // The interface went away since we looked it up: so did its filters.
                Err(e) if netlink_errno(&e) == Some(libc::ENODEV) => return Ok(()),
                Err(source) => {
                    return Err(NetworkError::Netlink {
                        action: format!("{}: listing ingress filters", link.cni_interface),
                        source,
                    })
                }
            };
            if filters
                .iter()
                .any(|f| (f.header.info >> 16) as u16 == FILTER_PRIORITY)
            {
                let mut msg = TcMessage::with_index(index as i32);
                msg.header.parent = INGRESS_PARENT;
                msg.header.info = (u32::from(FILTER_PRIORITY) << 16) | u32::from(PROTOCOL_ALL);
                already_gone_is_done(
                    acked(handle, RouteNetlinkMessage::DelTrafficFilter(msg)).await,
                )
                .map_err(nl(format!(
                    "{}: deleting our ingress filter",
                    link.cni_interface
                )))?;
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_all_is_eth_p_all_in_network_order() {
        assert_eq!(PROTOCOL_ALL.to_ne_bytes(), [0x00, 0x03]);
    }

    fn netlink_error(errno: i32) -> rtnetlink::Error {
        let mut e = rtnetlink::packet_core::ErrorMessage::default();
        e.code = std::num::NonZeroI32::new(-errno);
        rtnetlink::Error::NetlinkError(e)
    }

    #[test]
    fn a_delete_that_finds_its_link_or_object_gone_is_done_and_others_fail() {
        // The CI failure this guards: a crashed shim's reclaim failed on "deleting the ingress
        // qdisc: No such device" and left the pod's share, cgroup and socket behind.
        assert!(already_gone_is_done(Err(netlink_error(libc::ENODEV))).is_ok());
        assert!(already_gone_is_done(Err(netlink_error(libc::ENOENT))).is_ok());
        assert!(already_gone_is_done(Err(netlink_error(libc::EPERM))).is_err());
        assert!(already_gone_is_done(Ok(())).is_ok());
    }
}
