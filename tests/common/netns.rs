//! Hosts apart on one machine: network namespaces, each with its own address on one switched
//! network, created by a test and removed when dropped (even on a panic).
//!
//! Every host is a namespace whose `eth0` is one end of a veth pair; the other end is a port of
//! a bridge in a separate *switch* namespace, which also holds an address of its own (`.254`)
//! so that the test's HTTP client, run on a thread moved into the switch ([`Hosts::enter`]),
//! reaches every host the way another machine on the network would. Addresses are in
//! `10.203.N.0/24`, N from the test's pid; nothing of this exists outside the namespaces.

use std::os::fd::AsRawFd as _;

/// Runs `ip ARGS`; its stderr on failure.
pub fn ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| format!("running ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// One host: its namespace and address; its interface is `eth0`.
#[derive(Debug)]
pub struct Host {
    pub name: String,
    pub ns: String,
    pub ip: String,
}

impl Host {
    /// The command prefix that runs a program on this host (`ip netns exec` execs it in place:
    /// the pid is the program's).
    pub fn exec(&self) -> Vec<String> {
        ["ip", "netns", "exec", &self.ns]
            .iter()
            .map(|s| (*s).to_owned())
            .collect()
    }
}

/// The hosts and their switch.
#[derive(Debug)]
pub struct Hosts {
    pub hosts: Vec<Host>,
    switch: String,
}

/// The interface of every host.
pub const DEVICE: &str = "eth0";

impl Hosts {
    /// One host per name, switched together. `Err` says why namespaces cannot be made here
    /// (they need root and iproute2).
    pub fn create(names: &[&str]) -> Result<Hosts, String> {
        let pid = std::process::id();
        let subnet = pid % 250;
        let mut hosts = Hosts {
            hosts: Vec::new(),
            switch: format!("kvferry-{pid}-switch"),
        };
        // From here on, Drop removes whatever was made.
        ip(&["netns", "add", &hosts.switch])?;
        let sw = hosts.switch.clone();
        ip(&["-n", &sw, "link", "add", "br0", "type", "bridge"])?;
        ip(&[
            "-n",
            &sw,
            "addr",
            "add",
            &format!("10.203.{subnet}.254/24"),
            "dev",
            "br0",
        ])?;
        ip(&["-n", &sw, "link", "set", "br0", "up"])?;
        ip(&["-n", &sw, "link", "set", "lo", "up"])?;
        for (i, name) in names.iter().enumerate() {
            let host = Host {
                name: (*name).to_owned(),
                ns: format!("kvferry-{pid}-{name}"),
                ip: format!("10.203.{subnet}.{}", i + 1),
            };
            ip(&["netns", "add", &host.ns])?;
            hosts.hosts.push(host);
            let host = &hosts.hosts[i];
            let port = format!("p{i}");
            ip(&[
                "link", "add", DEVICE, "netns", &host.ns, "type", "veth", "peer", "name", &port,
                "netns", &sw,
            ])?;
            ip(&["-n", &sw, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &sw, "link", "set", &port, "up"])?;
            ip(&[
                "-n",
                &host.ns,
                "addr",
                "add",
                &format!("{}/24", host.ip),
                "dev",
                DEVICE,
            ])?;
            ip(&["-n", &host.ns, "link", "set", DEVICE, "up"])?;
            ip(&["-n", &host.ns, "link", "set", "lo", "up"])?;
        }
        Ok(hosts)
    }

    /// [`Hosts::create`], or `None` after printing why not; with `CI=true` a machine without
    /// namespaces fails the test instead.
    pub fn create_or_skip(tag: &str, names: &[&str]) -> Option<Hosts> {
        match Hosts::create(names) {
            Ok(h) => Some(h),
            Err(why) => {
                let ci = std::env::var("CI").is_ok_and(|v| v == "true");
                assert!(
                    !ci,
                    "CI=true and no network namespaces: {why} (needs root and iproute2)"
                );
                println!("[{tag}] skipped: cannot create network namespaces: {why}");
                None
            }
        }
    }

    /// The host named `name`.
    pub fn host(&self, name: &str) -> &Host {
        self.hosts
            .iter()
            .find(|h| h.name == name)
            .unwrap_or_else(|| panic!("no host {name}"))
    }

    /// Brings `name`'s link up or down, from its own side.
    pub fn set_link(&self, name: &str, up: bool) {
        let host = self.host(name);
        ip(&[
            "-n",
            &host.ns,
            "link",
            "set",
            DEVICE,
            if up { "up" } else { "down" },
        ])
        .expect("setting the link");
    }

    /// Moves the calling thread into the switch: the sockets it creates from then on reach
    /// every host over the network.
    #[allow(unsafe_code)]
    pub fn enter(&self) {
        let path = format!("/var/run/netns/{}", self.switch);
        let f = std::fs::File::open(&path).unwrap_or_else(|e| panic!("opening {path}: {e}"));
        // SAFETY: setns(2) on a valid, open namespace fd; it affects only the calling thread's
        // network namespace, which only sockets created later on this thread depend on.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns({path}): {}", std::io::Error::last_os_error());
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and so the pair.
        for host in &self.hosts {
            let _ = ip(&["netns", "del", &host.ns]);
        }
        let _ = ip(&["netns", "del", &self.switch]);
    }
}
