//! One spawned kvferry process: started with its arguments and environment (behind a command
//! prefix such as `ip netns exec NS` if asked), its listening line read, its stderr logged, and
//! stopped (SIGTERM, then SIGKILL) when dropped. The kvferry it starts is this executable, or,
//! in the Python package's `kvferry` command, its interpreter with `-m kvferry` ([`run_as`]).

use std::ffi::OsStr;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

/// The command that runs kvferry when this process is not the `kvferry` binary: a program and
/// the arguments before a role's.
static RUN_AS: OnceLock<(PathBuf, Vec<String>)> = OnceLock::new();

/// Runs the kvferry processes this process starts as `program leading... ROLE ARGS` (the
/// Python package: `python -m kvferry`) instead of this executable. Set once, before any.
pub fn run_as(program: PathBuf, leading: Vec<String>) {
    let _ = RUN_AS.set((program, leading));
}

/// The program that runs kvferry: this executable unless [`run_as`] named another.
pub fn kvferry_exe() -> anyhow::Result<PathBuf> {
    match RUN_AS.get() {
        Some((program, _)) => Ok(program.clone()),
        None => std::env::current_exe().context("locating the kvferry binary"),
    }
}

/// The arguments `exe` takes before a role's ([`run_as`]'s, when `exe` is its program).
fn leading_args(exe: &Path) -> &'static [String] {
    match RUN_AS.get() {
        Some((program, leading)) if program == exe => leading,
        _ => &[],
    }
}

/// One spawned kvferry process.
#[derive(Debug)]
pub struct Process {
    /// What it is, for messages (`registry`, `prefill`, ...).
    pub name: String,
    /// Its "listening" line.
    pub listening: serde_json::Value,
    /// Its stderr log.
    pub log: PathBuf,
    child: Child,
}

impl Process {
    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Starts `exe args`, waits up to `wait` for its listening line.
    pub fn spawn(
        exe: &Path,
        name: &str,
        args: &[String],
        log_dir: &Path,
        wait: Duration,
    ) -> anyhow::Result<Self> {
        Self::spawn_with(&[], exe, name, args, &[] as &[(&str, &str)], log_dir, wait)
    }

    /// [`Process::spawn`] with extra environment variables (e.g. `UCX_TLS`), behind a command
    /// `prefix` that execs `exe` in its place if one is given (e.g. `ip netns exec NS`: the pid
    /// is still the kvferry process's).
    pub fn spawn_with(
        prefix: &[String],
        exe: &Path,
        name: &str,
        args: &[String],
        env: &[(impl AsRef<OsStr>, impl AsRef<OsStr>)],
        log_dir: &Path,
        wait: Duration,
    ) -> anyhow::Result<Self> {
        let log = log_dir.join(format!("{name}.log"));
        let stderr =
            std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut cmd = match prefix.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(exe);
                c
            }
            None => Command::new(exe),
        };
        let leading = leading_args(exe);
        if !leading.is_empty() {
            // `python -m kvferry`: the installed package, never one in the working directory;
            // and not the stdin watch of a sidecar (this child's stdin is /dev/null).
            cmd.env("PYTHONSAFEPATH", "1")
                .env_remove("KVFERRY_STOP_ON_STDIN_EOF");
        }
        let mut child = cmd
            .args(leading)
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v)))
            // A config file names the flags of the parent's subcommand, not of these.
            .env_remove(crate::env::CONFIG_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .with_context(|| format!("starting {} {name}", exe.display()))?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let _ = tx.send(lines.next());
            // Keep draining so the child never blocks on a full pipe.
            for _ in lines {}
        });
        let mut process = Process {
            name: name.to_owned(),
            listening: serde_json::Value::Null,
            log,
            child,
        };
        let line = match rx.recv_timeout(wait) {
            Ok(Some(Ok(line))) => line,
            _ => bail!(
                "{name} printed no listening line within {wait:?}; {}:\n{}",
                process.log.display(),
                std::fs::read_to_string(&process.log).unwrap_or_default()
            ),
        };
        process.listening = serde_json::from_str(&line)
            .with_context(|| format!("{name} listening line {line:?}"))?;
        Ok(process)
    }

    /// A string field of the listening line.
    pub fn field(&self, key: &str) -> anyhow::Result<String> {
        self.listening[key]
            .as_str()
            .map(str::to_owned)
            .with_context(|| {
                format!(
                    "{} listening line has no {key:?}: {}",
                    self.name, self.listening
                )
            })
    }

    /// Sends a signal (`TERM`, `KILL`, ...) by name.
    pub fn signal(&self, name: &str) -> anyhow::Result<()> {
        let status = Command::new("kill")
            .args([format!("-{name}"), self.child.id().to_string()])
            .status()
            .context("running kill")?;
        if !status.success() {
            bail!("kill -{name} {} failed", self.child.id());
        }
        Ok(())
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits up to `wait` for the process to exit; returns its exit code if it did.
    pub fn wait_exit(&mut self, wait: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + wait;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM, then SIGKILL if it has not exited within `grace`.
    pub fn stop(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Some(status);
        }
        let _ = self.signal("TERM");
        if let Some(status) = self.wait_exit(grace) {
            return Some(status);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        None
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.stop(Duration::from_secs(5));
    }
}

/// A folder for the cluster's logs, unique to this process.
pub fn log_dir(tag: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("kvferry-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
