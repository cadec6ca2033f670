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

/// One 16-byte message and the descriptor attached to it, if any.
pub fn receive(socket: &UnixStream) -> std::io::Result<([u8; 16], Option<OwnedFd>)> {
    let mut header = [0u8; 16];
    let mut iov = libc::iovec {
        iov_base: header.as_mut_ptr().cast(),
        iov_len: header.len(),
    };
    // Room for one descriptor; the kernel truncates (MSG_CTRUNC) anything more.
    let space = unsafe_cmsg_space();
    let mut control = vec![0u8; space];
    // SAFETY: `msg` points at live buffers of the stated lengths; recvmsg fills them.
    let got = unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space;
        let n = libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        let fd = if cmsg.is_null() || (*cmsg).cmsg_type != libc::SCM_RIGHTS {
            None
        } else {
            let raw: RawFd = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
            Some(OwnedFd::from_raw_fd(raw))
        };
        (n as usize, fd)
    };
    let (n, fd) = got;
    if n < header.len() {
        // A short datagram-like read on a stream: read the rest plainly.
        (&*socket).read_exact(&mut header[n..])?;
    }
    Ok((header, fd))
}

fn unsafe_cmsg_space() -> usize {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    unsafe { libc::CMSG_SPACE(size_of::<RawFd>() as u32) as usize }
}
