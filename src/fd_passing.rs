//! Messages of 16 bytes over a Unix stream socket, each with at most one file descriptor
//! attached (`SCM_RIGHTS`): how a process hands memory to another on the same host (an
//! engine's VMM pieces to its agent, `kernel/cuda/vmm.rs`; a decode's pool file to a prefill,
//! `transport/mapped.rs`).
#![allow(unsafe_code)]

use std::io::Read as _;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// One 16-byte message with `fd` attached.
pub fn send(socket: &UnixStream, header: &[u8; 16], fd: Option<RawFd>) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: header.as_ptr() as *mut std::ffi::c_void,
        iov_len: header.len(),
    };
    let space = unsafe_cmsg_space();
    let mut control = vec![0u8; space];
    // SAFETY: `msg` points at live buffers of the stated lengths; the control buffer is sized
    // by CMSG_SPACE for one descriptor and filled through the CMSG macros.
    let sent = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if let Some(fd) = fd {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), fd);
        }
        libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    match sent {
        16 => Ok(()),
        n if n < 0 => Err(std::io::Error::last_os_error()),
        n => Err(std::io::Error::other(format!("sent {n} of 16 bytes"))),
    }
}

/// Descriptors a received message has room for: one is expected, and room for more lets every
/// extra one a peer attaches be received, and closed, rather than dropped unseen.
const RECEIVE_ROOM: usize = 8;

/// One 16-byte message and the descriptor attached to it, if any. A message with more than one
/// descriptor attached (or more than fit in [`RECEIVE_ROOM`]) is refused, and every descriptor
/// that came with it closed.
pub fn receive(socket: &UnixStream) -> std::io::Result<([u8; 16], Option<OwnedFd>)> {
    let mut header = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    };
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let space = unsafe { libc::CMSG_SPACE((RECEIVE_ROOM * size_of::<RawFd>()) as u32) as usize };
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: `msg` points at live buffers of the stated lengths (the control buffer is u64s,
    // aligned for `cmsghdr`); recvmsg fills them, and the CMSG macros walk only the
    // `msg_controllen` bytes the kernel reports. Every descriptor read is one the kernel just
    // installed in this process for us, owned by nothing else.
    let (n, fds, truncated) = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        let n = libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let first = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..data / size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(first.add(i))));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        (n as usize, fds, msg.msg_flags & libc::MSG_CTRUNC != 0)
    };
    if fds.len() > 1 || truncated {
        // `fds` drops here: each one closed.
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}{} descriptors attached to one message; at most one was expected",
                fds.len(),
                if truncated { "+" } else { "" }
            ),
        ));
    }
    if n < header.len() {
        // A short datagram-like read on a stream: read the rest plainly.
        (&*socket).read_exact(&mut header[n..])?;
    }
    Ok((header, fds.into_iter().next()))
}

fn unsafe_cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) as usize }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open_descriptors() -> usize {
        std::fs::read_dir("/proc/self/fd").map_or(0, |d| d.count())
    }

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("fd-passing-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd")
    }

    /// Sends `fds` attached to one 16-byte message (what a rogue peer could send).
    fn send_many(socket: &UnixStream, fds: &[RawFd]) {
        let header = [7u8; 16];
        let mut iov = libc::iovec {
            iov_base: header.as_ptr() as *mut std::ffi::c_void,
            iov_len: header.len(),
        };
        let bytes = std::mem::size_of_val(fds);
        // SAFETY: CMSG_SPACE is arithmetic.
        let space = unsafe { libc::CMSG_SPACE(bytes as u32) as usize };
        let mut control = vec![0u64; space.div_ceil(8)];
        // SAFETY: live buffers of the stated lengths, filled through the CMSG macros.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = &mut iov;
            msg.msg_iovlen = 1;
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(bytes as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast(), fds.len());
            libc::sendmsg(socket.as_raw_fd(), &msg, 0)
        };
        assert_eq!(sent, 16);
    }

    #[test]
    fn one_descriptor_is_received_and_extra_ones_are_refused_and_closed() {
        let (a, b) = UnixStream::pair().expect("pair");
        // The expected shape: one descriptor.
        let file = memfd();
        send(&a, &[1u8; 16], Some(file.as_raw_fd())).expect("send");
        let (header, fd) = receive(&b).expect("one descriptor");
        assert_eq!(header, [1u8; 16]);
        assert!(fd.is_some());
        drop(fd);
        // A rogue attaches 2, then 12 (more than the room): refused, and none is left open here.
        for n in [2, 12] {
            let files: Vec<OwnedFd> = (0..n).map(|_| memfd()).collect();
            let raw: Vec<RawFd> = files.iter().map(AsRawFd::as_raw_fd).collect();
            send_many(&a, &raw);
            drop(files);
            let before = open_descriptors();
            let e = receive(&b).expect_err("more than one descriptor");
            assert_eq!(e.kind(), std::io::ErrorKind::InvalidData, "{e}");
            assert!(e.to_string().contains("at most one"), "{e}");
            assert_eq!(open_descriptors(), before, "{n} descriptors: one kept open");
        }
    }
}
