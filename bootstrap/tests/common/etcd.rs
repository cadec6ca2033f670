//! A real etcd cluster for tests: three members on 127.0.0.1 (the `etcd` and `etcdctl`
//! binaries; Debian packages etcd-server and etcd-client), started by the test and killed when
//! dropped. Shared by the registry's etcd tests and the agents' (tests/processes/e2e_registry_etcd.rs
//! includes this file by path).

#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::io::{BufRead as _, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use uuid::Uuid;

/// Generous bound on every outcome; measured times are printed.
pub const BOUND: Duration = Duration::from_secs(30);

/// True when the etcd binaries are present; otherwise skips (prints why) or, under CI=true,
/// fails.
pub fn etcd_installed() -> bool {
    let found = [("etcd", "--version"), ("etcdctl", "version")]
        .iter()
        .all(|(bin, arg)| {
            Command::new(bin)
                .arg(arg)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        });
    if !found {
        assert!(
            std::env::var("CI").as_deref() != Ok("true"),
            "etcd and etcdctl must be installed when CI=true (Debian: apt-get install etcd-server etcd-client)"
        );
        println!("SKIPPED: etcd or etcdctl not found on PATH (Debian: etcd-server, etcd-client)");
    }
    found
}

/// `n` distinct ports that were free a moment ago (all bound at once, then released).
pub fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<_> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().unwrap().port())
        .collect()
}

/// A three-member etcd cluster on 127.0.0.1, its data in a fresh directory; members are
/// killed and the directory removed on drop.
pub struct EtcdCluster {
    dir: PathBuf,
    members: Vec<Option<Child>>,
    /// `127.0.0.1:PORT` client address per member.
    pub clients: Vec<String>,
}

impl EtcdCluster {
    /// Starts a cluster on ports that were free a moment ago; if one was taken meanwhile (a
    /// member exits at start: "address already in use"), starts again on other ports, up to
    /// three times.
    pub fn start() -> Self {
        for attempt in 1..=3 {
            match Self::try_start() {
                Ok(cluster) => return cluster,
                Err(why) => {
                    println!("etcd cluster, attempt {attempt}: {why}; again on other ports")
                }
            }
        }
        panic!("no etcd cluster after three attempts (see the lines above)");
    }

    fn try_start() -> Result<Self, String> {
        let dir = std::env::temp_dir().join(format!("kvferry-etcd-{}", Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let ports = free_ports(6);
        let clients: Vec<String> = ports[..3]
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let peers: Vec<String> = ports[3..]
            .iter()
            .map(|p| format!("http://127.0.0.1:{p}"))
            .collect();
        let initial: Vec<String> = peers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("m{i}={p}"))
            .collect();
        let token = format!("kvferry-test-{}", Uuid::new_v4());
        let mut members = Vec::new();
        for i in 0..3 {
            let log = File::create(dir.join(format!("m{i}.log"))).unwrap();
            let client_url = format!("http://{}", clients[i]);
            let child = Command::new("etcd")
                .args(["--name", &format!("m{i}")])
                .arg("--data-dir")
                .arg(dir.join(format!("m{i}")))
                .args(["--listen-client-urls", &client_url])
                .args(["--advertise-client-urls", &client_url])
                .args(["--listen-peer-urls", &peers[i]])
                .args(["--initial-advertise-peer-urls", &peers[i]])
                .args(["--initial-cluster", &initial.join(",")])
                .args(["--initial-cluster-state", "new"])
                .args(["--initial-cluster-token", &token])
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("starting etcd");
            members.push(Some(child));
        }
        let mut cluster = Self {
            dir,
            members,
            clients,
        };
        let start = Instant::now();
        loop {
            let healthy = cluster
                .etcdctl(&["endpoint", "health"])
                .is_some_and(|(ok, _)| ok);
            if healthy {
                println!("etcd cluster healthy after {:?}", start.elapsed());
                return Ok(cluster);
            }
            let exited = cluster
                .members
                .iter_mut()
                .flatten()
                .any(|m| matches!(m.try_wait(), Ok(Some(_))));
            if exited {
                // Dropped: the other members are killed and the directory removed.
                return Err(format!(
                    "a member exited at start (logs were in {})",
                    cluster.dir.display()
                ));
            }
            assert!(
                start.elapsed() < BOUND,
                "etcd cluster not healthy within {BOUND:?} (logs in {})",
                cluster.dir.display()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `etcdctl --endpoints=<members> ARGS`: (success, stdout).
    pub fn etcdctl(&self, args: &[&str]) -> Option<(bool, String)> {
        let out = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", self.clients.join(",")))
            .args(["--dial-timeout=2s", "--command-timeout=3s"])
            .args(args)
            .stdin(Stdio::null())
            .output()
            .ok()?;
        Some((
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        ))
    }

    /// The `--store` flag for this cluster: `etcd://H:P,H:P,H:P`.
    pub fn store(&self) -> String {
        format!("etcd://{}", self.clients.join(","))
    }

    /// The index of the member that is the raft leader now.
    pub fn leader(&self) -> usize {
        let (ok, out) = self
            .etcdctl(&["endpoint", "status", "-w", "json"])
            .expect("etcdctl endpoint status");
        assert!(ok, "etcdctl endpoint status failed: {out}");
        let statuses: serde_json::Value = serde_json::from_str(&out).unwrap();
        let statuses = statuses.as_array().unwrap();
        let member = |s: &serde_json::Value| s["Status"]["header"]["member_id"].as_u64();
        let leader = statuses[0]["Status"]["leader"].as_u64().unwrap();
        let endpoint = statuses
            .iter()
            .find(|s| member(s) == Some(leader))
            .and_then(|s| s["Endpoint"].as_str())
            .expect("the leader among the endpoints");
        self.clients
            .iter()
            .position(|c| endpoint.ends_with(c.as_str()))
            .unwrap()
    }

    /// SIGKILL to member `i`.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].take() {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            if let Some(mut child) = self.members[i].take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        if std::thread::panicking() {
            for i in 0..self.members.len() {
                let Ok(log) = File::open(self.dir.join(format!("m{i}.log"))) else {
                    continue;
                };
                let lines: Vec<String> =
                    BufReader::new(log).lines().map_while(Result::ok).collect();
                println!("--- etcd m{i}, last lines:");
                for line in &lines[lines.len().saturating_sub(15)..] {
                    println!("{line}");
                }
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
