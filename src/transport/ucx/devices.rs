//! Which network devices an agent's UCX workers use: the interface of the agent's `--host`, so
//! that UCX's tcp transport listens there and nowhere else, plus every RDMA device port (RDMA
//! stays the operator's choice). `UCX_NET_DEVICES` in the environment overrides it all.
//!
//! Without this, UCX's tcp transport opens an interface, and a listening socket, on every
//! network device of the host, whatever address the agent was told to serve on.

use std::net::{IpAddr, ToSocketAddrs};

use super::safe::interfaces;

/// The `NET_DEVICES` value for an agent serving on `host`: `Ok(None)` for an unspecified host
/// (`0.0.0.0`, `::`: every device, which the exposure check admits only with a token or
/// `--insecure`); the interface that holds `host`'s address and the RDMA ports otherwise. An
/// address no interface holds is an error naming it.
pub fn for_host(host: &str) -> Result<Option<String>, String> {
    let addrs: Vec<IpAddr> = match host.parse::<IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => (host, 0)
            .to_socket_addrs()
            .map_err(|e| format!("resolving {host}: {e}"))?
            .map(|a| a.ip())
            .collect(),
    };
    if addrs.iter().any(IpAddr::is_unspecified) {
        return Ok(None);
    }
    let interfaces = interfaces().map_err(|e| format!("listing network interfaces: {e}"))?;
    let Some((name, _)) = interfaces.iter().find(|(_, ip)| addrs.contains(ip)) else {
        return Err(format!(
            "no network interface holds {host} ({addrs:?}): UCX would not know where to listen; \
             serve on an address of this host, or set UCX_NET_DEVICES"
        ));
    };
    let mut devices = vec![name.clone()];
    devices.extend(rdma_ports());
    Ok(Some(devices.join(",")))
}

/// Every RDMA device port (`mlx5_0:1`), from `/sys/class/infiniband`.
fn rdma_ports() -> Vec<String> {
    let mut out = Vec::new();
    let Ok(devices) = std::fs::read_dir("/sys/class/infiniband") else {
        return out;
    };
    for device in devices.flatten() {
        let name = device.file_name().to_string_lossy().into_owned();
        if let Ok(ports) = std::fs::read_dir(device.path().join("ports")) {
            for port in ports.flatten() {
                out.push(format!("{name}:{}", port.file_name().to_string_lossy()));
            }
        }
    }
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_lo_and_unspecified_is_every_device() {
        let lo = for_host("127.0.0.1").unwrap().unwrap();
        assert!(lo == "lo" || lo.starts_with("lo,"), "{lo}");
        assert_eq!(for_host("localhost").unwrap().unwrap(), lo);
        assert_eq!(for_host("0.0.0.0").unwrap(), None);
        assert_eq!(for_host("::").unwrap(), None);
        let err = for_host("192.0.2.77").unwrap_err();
        assert!(
            err.contains("no network interface holds 192.0.2.77"),
            "{err}"
        );
    }
}
