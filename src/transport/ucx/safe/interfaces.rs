//! [`interfaces`]: the host's network interface addresses, read from the list `getifaddrs`
//! returns, which is freed before the function returns.

use std::net::IpAddr;

/// Every interface address of this host, with its interface's name (`getifaddrs`).
pub fn interfaces() -> std::io::Result<Vec<(String, IpAddr)>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut out = Vec::new();
    let mut next = list;
    while !next.is_null() {
        // SAFETY: a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*next };
        next = ifa.ifa_next;
        if ifa.ifa_addr.is_null() || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: a NUL-terminated name; the address's family says which struct it is.
        let name = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: as above.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        let ip = match family {
            libc::AF_INET => {
                // SAFETY: an AF_INET address is a sockaddr_in.
                let a = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                IpAddr::from(u32::from_be(a.sin_addr.s_addr).to_be_bytes())
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 address is a sockaddr_in6.
                let a = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                IpAddr::from(a.sin6_addr.s6_addr)
            }
            _ => continue,
        };
        out.push((name, ip));
    }
    // SAFETY: the list getifaddrs returned, freed once; no reference into it is kept.
    unsafe { libc::freeifaddrs(list) };
    Ok(out)
}
