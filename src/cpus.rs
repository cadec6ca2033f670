//! The CPUs an agent embedded in an engine runs its own threads on, and how they share them.
//!
//! Engines pin their compute threads to cores (vLLM's CPU worker binds its process to the cores
//! of `VLLM_CPU_OMP_THREADS_BIND`), and a thread inherits the affinity of the thread that
//! starts it. An agent started from an engine's pinned thread would run its control, transport
//! and heartbeat threads on the engine's busy cores only, and where engines share cores those
//! threads wait seconds to run: peers declare it dead, handshakes time out. vLLM reserves cores
//! for its KV connector outside the OMP binding; an unpinned agent thread may run there, or on
//! whichever allowed core is free.
//!
//! Where no core is free, an agent thread the engine's per-layer `ready` wakes would take the
//! core from the engine at once (the kernel preempts on wake-up), and the engine's forward pass
//! waits for that layer's gather and send. Embedded agent threads therefore run under
//! `SCHED_BATCH`: the same share of CPU time as any thread, given at the scheduler's tick rather
//! than on wake-up, so that a free core runs them at once and a busy one finishes the engine's
//! call first. A standalone agent process is left as it is: pinning it (`taskset`) and its
//! policy stay the operator's choice.

#![allow(unsafe_code)]

use std::sync::atomic::{AtomicBool, Ordering};

static EMBEDDED: AtomicBool = AtomicBool::new(false);

/// From now on, every thread the agents of this process start runs on every CPU the process's
/// cpuset allows, under `SCHED_BATCH` (called by an engine embedding).
pub fn embed_agent_threads() {
    EMBEDDED.store(true, Ordering::Relaxed);
}

/// Called first by every thread an agent starts: unpins it and makes it yield on wake-up when
/// the embedding asked for it. What the kernel refuses leaves the thread as it is (never fatal).
pub fn on_agent_thread() {
    if !EMBEDDED.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is the empty set; CPU_SET stays within its CPU_SETSIZE bits;
    // sched_setaffinity(0, ..) and sched_setscheduler(0, ..) change only the calling thread.
    // The kernel keeps only the CPUs the cpuset allows and refuses an empty result; SCHED_BATCH
    // takes priority 0 and needs no privilege.
    let (unpinned, batch) = unsafe {
        let mut all: libc::cpu_set_t = std::mem::zeroed();
        for cpu in 0..libc::CPU_SETSIZE as usize {
            libc::CPU_SET(cpu, &mut all);
        }
        let unpinned =
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all) == 0;
        let param = libc::sched_param { sched_priority: 0 };
        (
            unpinned,
            libc::sched_setscheduler(0, libc::SCHED_BATCH, &param) == 0,
        )
    };
    if !unpinned || !batch {
        tracing::debug!(unpinned, batch, error = %std::io::Error::last_os_error(), "agent thread left as it was");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> i32 {
        // SAFETY: sched_getscheduler(0) reads the calling thread's policy.
        unsafe { libc::sched_getscheduler(0) }
    }

    fn cpus() -> usize {
        // SAFETY: sched_getaffinity(0, ..) fills the set of the calling thread.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            assert_eq!(
                libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
                0
            );
            libc::CPU_COUNT(&set) as usize
        }
    }

    // nextest runs each test in a process of its own: the flag and the pinning stay here.
    #[test]
    fn embedded_agent_threads_run_unpinned_under_sched_batch() {
        let allowed = cpus();
        // An engine's pinned thread: one CPU, the normal policy.
        let pinned = std::thread::spawn(move || {
            // SAFETY: as in on_agent_thread, for the calling thread only.
            unsafe {
                let mut one: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(0, &mut one);
                assert_eq!(
                    libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one),
                    0
                );
            }
            on_agent_thread();
            let standalone = (cpus(), policy());
            embed_agent_threads();
            let agent = std::thread::spawn(|| {
                on_agent_thread();
                (cpus(), policy())
            });
            (standalone, agent.join().unwrap())
        });
        let (standalone, agent) = pinned.join().unwrap();
        assert_eq!(
            standalone,
            (1, libc::SCHED_OTHER),
            "a standalone agent's thread is left as it is"
        );
        assert_eq!(
            agent,
            (allowed, libc::SCHED_BATCH),
            "an embedded agent's thread: every allowed CPU, SCHED_BATCH"
        );
    }
}
