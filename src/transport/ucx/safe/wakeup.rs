//! [`Wakeup`]: the eventfd through which a worker's handles wake its progress thread, and the
//! thread's sleep on it together with the UCP worker's event fd.
//!
//! Unlike the UCP handles, a `Wakeup` is `Send` and `Sync`: every handle of a worker holds it.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::transport::ucx::result::UcxError;

/// A non-blocking eventfd: [`Wakeup::wake`] makes it readable, [`Wakeup::sleep`] waits for that
/// and resets it.
pub struct Wakeup(OwnedFd);

impl Wakeup {
    /// A fresh eventfd (non-blocking, close-on-exec).
    pub fn new() -> Result<Wakeup, UcxError> {
        // SAFETY: eventfd has no memory preconditions; the result is checked below.
        let raw = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if raw < 0 {
            return Err(UcxError::Os {
                op: "eventfd",
                message: std::io::Error::last_os_error().to_string(),
            });
        }
        // SAFETY: `raw` is a fresh descriptor nobody else owns.
        Ok(Wakeup(unsafe { OwnedFd::from_raw_fd(raw) }))
    }

    /// Makes the eventfd readable, waking a thread in [`Wakeup::sleep`].
    pub fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to an eventfd we own. A full counter (EAGAIN)
        // already means "awake", so the result needs no handling.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&raw const one).cast(), 8) };
    }

    /// Sleeps until this eventfd or the worker's event fd `efd` is readable, or `timeout_ms`;
    /// resets this eventfd when it woke the sleep.
    pub fn sleep(&self, efd: Option<i32>, timeout_ms: i32) {
        let mut fds = [
            libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: efd.unwrap_or(-1),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: `fds` is a valid array of two pollfd (a negative fd is ignored by poll).
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout_ms) };
        if n > 0 && fds[0].revents != 0 {
            let mut counter = 0u64;
            // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd (resets it).
            let _ = unsafe { libc::read(self.0.as_raw_fd(), (&raw mut counter).cast(), 8) };
        }
    }
}
