//! The CPUs an agent embedded in an engine runs its own threads on.
//!
//! Engines pin their compute threads to cores (vLLM's CPU worker binds its process to the cores
//! of `VLLM_CPU_OMP_THREADS_BIND`), and a thread inherits the affinity of the thread that
//! starts it. An agent started from an engine's pinned thread would run its control, transport
//! and heartbeat threads on the engine's busy cores only, and where engines share cores those
//! threads wait seconds to run: peers declare it dead, handshakes time out. vLLM reserves cores
//! for its KV connector outside the OMP binding; an unpinned agent thread may run there, or on
//! whichever allowed core is free. A standalone agent process is never unpinned: pinning it
//! (`taskset`) stays the operator's choice.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

static UNPINNED: AtomicBool = AtomicBool::new(false);

/// From now on, every thread the agents of this process start runs on every CPU the process's
/// cpuset allows (called by an engine embedding).
pub fn unpin_agent_threads() {
    UNPINNED.store(true, Ordering::Relaxed);
}

/// Called first by every thread an agent starts: unpins it when the embedding asked for it.
/// A CPU set the kernel refuses leaves the thread as it is (never fatal).
pub fn on_agent_thread() {
    if !UNPINNED.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET stays within its CPU_SETSIZE bits;
    // sched_setaffinity(0, ..) changes only the calling thread. The kernel keeps only the CPUs
    // the cpuset allows and refuses an empty result.
    let refused = unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        for cpu in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut all);
        }
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all) != 0
    };
    if refused {
        tracing::debug!(error = %std::io::Error::last_os_error(), "agent thread left pinned");
    }
}
