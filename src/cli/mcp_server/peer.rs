//! Which local user a loopback TCP connection comes from: the uid that owns the
//! client's end, asked of the kernel over `NETLINK_SOCK_DIAG` (as `ss -e` does).
//! `--http` keeps the connections of other users apart from its own user's, so
//! that no other user can take the slots its own clients need.

use nix::sys::socket::{
    recv, sendto, setsockopt, socket, sockopt, AddressFamily, MsgFlags, NetlinkAddr, SockFlag,
    SockProtocol, SockType,
};
use nix::sys::time::TimeVal;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::AsRawFd;

/// `SOCK_DIAG_BY_FAMILY`, the request and its answer's type.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_ERROR: u16 = 2;
/// `struct nlmsghdr`, then `struct inet_diag_req_v2`.
const REQUEST_LEN: usize = 16 + 56;
/// Where `idiag_uid` is in the answer: `nlmsghdr` (16), then `inet_diag_msg`'s
/// family, state, timer, retrans (4), its socket id (48), expires, rqueue and
/// wqueue (12).
const UID_AT: usize = 16 + 4 + 48 + 12;

/// The uid owning the client end of the TCP connection that `ours` (this
/// server's address) accepted from `peer`: the other end is a socket of this
/// host, whose local address is `peer` and whose remote one is `ours`.
pub(super) fn uid_of_peer(ours: SocketAddr, peer: SocketAddr) -> io::Result<u32> {
    let (family, src, dst) = match (peer.ip(), ours.ip()) {
        (IpAddr::V4(p), IpAddr::V4(o)) => (libc::AF_INET, v4(p.octets()), v4(o.octets())),
        (IpAddr::V6(p), IpAddr::V6(o)) => (libc::AF_INET6, p.octets(), o.octets()),
        _ => return Err(io::Error::other("mixed address families")),
    };
    let mut req = Vec::with_capacity(REQUEST_LEN);
    // nlmsghdr: length, type, flags, sequence, port id (the kernel's: 0).
    req.extend_from_slice(&(REQUEST_LEN as u32).to_ne_bytes());
    req.extend_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend_from_slice(&NLM_F_REQUEST.to_ne_bytes());
    req.extend_from_slice(&1u32.to_ne_bytes());
    req.extend_from_slice(&0u32.to_ne_bytes());
    // inet_diag_req_v2: family, protocol, extensions, pad, states (all).
    req.push(family as u8);
    req.push(libc::IPPROTO_TCP as u8);
    req.extend_from_slice(&[0, 0]);
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    // inet_diag_sockid of the client's socket: its ports and addresses in
    // network order, any interface, no cookie.
    req.extend_from_slice(&peer.port().to_be_bytes());
    req.extend_from_slice(&ours.port().to_be_bytes());
    req.extend_from_slice(&src);
    req.extend_from_slice(&dst);
    req.extend_from_slice(&0u32.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    req.extend_from_slice(&u32::MAX.to_ne_bytes());
    debug_assert_eq!(req.len(), REQUEST_LEN);
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkSockDiag,
    )?;
    // The kernel answers at once; never wait long for it.
    setsockopt(&fd, sockopt::ReceiveTimeout, &TimeVal::new(0, 200_000))?;
    sendto(
        fd.as_raw_fd(),
        &req,
        &NetlinkAddr::new(0, 0),
        MsgFlags::empty(),
    )?;
    let mut buf = [0u8; 512];
    let n = recv(fd.as_raw_fd(), &mut buf, MsgFlags::empty())?;
    let answer = &buf[..n];
    let kind = answer
        .get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or_else(|| io::Error::other("short sock_diag answer"))?;
    match kind {
        NLMSG_ERROR => {
            let errno = answer
                .get(16..20)
                .map_or(0, |b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]));
            Err(io::Error::from_raw_os_error(-errno))
        }
        SOCK_DIAG_BY_FAMILY => answer
            .get(UID_AT..UID_AT + 4)
            .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(|| io::Error::other("short sock_diag answer")),
        other => Err(io::Error::other(format!(
            "unexpected sock_diag answer type {other}"
        ))),
    }
}

/// An IPv4 address as `inet_diag_sockid` holds it: the first of four words.
fn v4(o: [u8; 4]) -> [u8; 16] {
    let mut a = [0u8; 16];
    a[..4].copy_from_slice(&o);
    a
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_loopback_peer_is_this_user() {
        let me = nix::unistd::geteuid().as_raw();
        for ip in ["127.0.0.1", "::1"] {
            let Ok(l) = std::net::TcpListener::bind((ip, 0)) else {
                continue; // no IPv6 here
            };
            let ours = l.local_addr().unwrap();
            let c = std::net::TcpStream::connect(ours).unwrap();
            let (_s, peer) = l.accept().unwrap();
            assert_eq!(peer, c.local_addr().unwrap());
            assert_eq!(uid_of_peer(ours, peer).unwrap(), me, "{ip}");
            // A connection that does not exist is not found.
            let gone = SocketAddr::new(peer.ip(), 1);
            assert!(uid_of_peer(ours, gone).is_err(), "{ip}");
        }
    }
}
