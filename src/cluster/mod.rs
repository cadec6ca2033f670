//! A local cluster of real kvferry processes (registry, prefill and decode agents) on loopback,
//! started from this binary, and the engine stand-in that drives rooms through it: what
//! `kvferry demo` and `kvferry bench` run, and what the multi-process tests use.
//!
//! Each process is started with port 0; its "listening" line tells its addresses
//! ([`Process`]). Its stderr goes to a log file beside the others, named in errors. Processes
//! get SIGTERM (then SIGKILL after a grace period) when dropped, so nothing outlives its
//! cluster. [`drive_rooms`] plays both engines over the agents' HTTP APIs.

mod drive;
mod process;

pub use drive::{
    Apis, RoomResult, STAGES, drive_rooms, drive_rooms_counted, memcpy_gbps, percentile,
    pool_pages, summary,
};
pub use process::{Process, kvferry_exe, log_dir, run_as};

use std::path::PathBuf;
use std::time::Duration;

/// How many ranks of one role, by parallelism.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    /// DP size.
    pub dp: u32,
    /// TP size.
    pub tp: u32,
    /// PP size.
    pub pp: u32,
}

impl Shape {
    /// One rank.
    pub const ONE: Shape = Shape {
        dp: 1,
        tp: 1,
        pp: 1,
    };

    /// TP ranks only.
    pub fn tp(tp: u32) -> Self {
        Shape { tp, ..Shape::ONE }
    }
}

/// A registry and prefill and decode agents, running as processes of this binary.
#[derive(Debug)]
pub struct LocalCluster {
    /// Decode agents by DP group, then (PP, TP) (fields drop in order: agents stop before
    /// the registry).
    pub decodes: Vec<Vec<Process>>,
    /// Prefill agents by DP group, then (PP, TP).
    pub prefills: Vec<Vec<Process>>,
    /// The registry.
    pub registry: Process,
    /// Where the logs are.
    pub logs: PathBuf,
}

impl LocalCluster {
    /// A registry, one prefill and one decode agent; `agent_args` go to both agents.
    pub fn start(exe: &std::path::Path, tag: &str, agent_args: &[String]) -> anyhow::Result<Self> {
        Self::start_shaped(exe, tag, agent_args, Shape::ONE, Shape::ONE)
    }

    /// A registry and `prefill` x `decode` shaped agents, each given its rank flags.
    pub fn start_shaped(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
    ) -> anyhow::Result<Self> {
        Self::start_shaped_env(exe, tag, agent_args, prefill, decode, &[])
    }

    /// [`LocalCluster::start_shaped`], the agents with extra environment variables (e.g.
    /// `UCX_TLS` for `--transport ucx`).
    pub fn start_shaped_env(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
        env: &[(String, String)],
    ) -> anyhow::Result<Self> {
        Self::spawn(exe, tag, agent_args, prefill, decode, env, &|_| Vec::new())
    }

    /// A registry, one prefill and one decode agent; `agent_args` go to both, then
    /// `role_args(role)` to each.
    pub fn start_per_role(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        role_args: &dyn Fn(&str) -> Vec<String>,
    ) -> anyhow::Result<Self> {
        Self::spawn(exe, tag, agent_args, Shape::ONE, Shape::ONE, &[], role_args)
    }

    fn spawn(
        exe: &std::path::Path,
        tag: &str,
        agent_args: &[String],
        prefill: Shape,
        decode: Shape,
        env: &[(String, String)],
        role_args: &dyn Fn(&str) -> Vec<String>,
    ) -> anyhow::Result<Self> {
        let logs = log_dir(tag)?;
        let wait = Duration::from_secs(30);
        let owned = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        let bootstrap = owned(&["bootstrap", "--host", "127.0.0.1", "--port", "0"]);
        let registry = Process::spawn(exe, "registry", &bootstrap, &logs, wait)?;
        let url = registry.field("url")?;
        let spawn = |role: &str, shape: Shape| -> anyhow::Result<Vec<Vec<Process>>> {
            let mut groups = Vec::new();
            for dp in 0..shape.dp {
                let mut ranks = Vec::new();
                for pp in 0..shape.pp {
                    for tp in 0..shape.tp {
                        let mut args = owned(&[role, "--bootstrap", &url]);
                        for (flag, v) in [
                            ("--dp-rank", dp),
                            ("--dp-size", shape.dp),
                            ("--tp-rank", tp),
                            ("--tp-size", shape.tp),
                            ("--pp-rank", pp),
                            ("--pp-size", shape.pp),
                        ] {
                            args.extend([flag.to_owned(), v.to_string()]);
                        }
                        args.extend_from_slice(agent_args);
                        args.extend(role_args(role));
                        let name = format!("{role}-dp{dp}-pp{pp}-tp{tp}");
                        ranks.push(Process::spawn_with(
                            &[],
                            exe,
                            &name,
                            &args,
                            env,
                            &logs,
                            wait,
                        )?);
                    }
                }
                groups.push(ranks);
            }
            Ok(groups)
        };
        let prefills = spawn("prefill", prefill)?;
        let decodes = spawn("decode", decode)?;
        Ok(LocalCluster {
            decodes,
            prefills,
            registry,
            logs,
        })
    }

    /// The first prefill agent.
    pub fn prefill(&self) -> &Process {
        &self.prefills[0][0]
    }

    /// The first decode agent.
    pub fn decode(&self) -> &Process {
        &self.decodes[0][0]
    }

    /// The first prefill agent, mutably (to signal or stop it).
    pub fn prefill_mut(&mut self) -> &mut Process {
        &mut self.prefills[0][0]
    }

    /// Every agent's API, grouped for [`drive_rooms`].
    pub fn apis(&self) -> anyhow::Result<Apis> {
        let api = |groups: &[Vec<Process>]| -> anyhow::Result<Vec<Vec<String>>> {
            groups
                .iter()
                .map(|g| g.iter().map(|p| p.field("api")).collect())
                .collect()
        };
        Ok(Apis {
            prefill: api(&self.prefills)?,
            decode: api(&self.decodes)?,
            token: None,
        })
    }
}
