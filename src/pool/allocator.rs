//! Page allocator for agent-owned pages.
//!
//! Pages an engine names in a request stay the engine's and never pass through here. Pages the
//! agent allocates itself are handed out as a [`PageLease`], which returns them when dropped
//! (RAII), so a room that is taken, expires or is aborted cannot leak its pages. The agent keeps
//! the lease alive while any write into the pages can still arrive.
//!
//! Invariants, checked by the randomized test below at every step: `free + used == total`, and
//! no page is in two leases (a page is on the free list exactly when it is not leased).

use std::sync::{Arc, Mutex, MutexGuard};

/// Errors of the allocator.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AllocError {
    /// Not enough free pages; retryable once rooms are taken or expire.
    #[error("pool exhausted: {requested} pages requested, {free} of {total} free")]
    Exhausted {
        /// Pages asked for.
        requested: usize,
        /// Pages free at the time.
        free: usize,
        /// Pages in the pool.
        total: usize,
    },
}

#[derive(Debug)]
struct State {
    /// Free pages, popped from the end; kept so that fresh pools hand out ascending runs.
    free: Vec<u32>,
    /// `leased[p]` is true while page `p` is in a lease.
    leased: Vec<bool>,
}

/// Hands out pages of a pool of `total` pages. Cheap to clone; clones share the pages.
#[derive(Clone, Debug)]
pub struct PageAllocator {
    state: Arc<Mutex<State>>,
}

impl PageAllocator {
    /// An allocator over pages `0..total`, all free.
    pub fn new(total: u32) -> Self {
        PageAllocator {
            state: Arc::new(Mutex::new(State {
                free: (0..total).rev().collect(),
                leased: vec![false; total as usize],
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // No code path panics while holding the lock, so a poisoned state is still consistent.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Allocates `n` pages, or none at all.
    pub fn allocate(&self, n: usize) -> Result<PageLease, AllocError> {
        let mut s = self.lock();
        if n > s.free.len() {
            return Err(AllocError::Exhausted {
                requested: n,
                free: s.free.len(),
                total: s.leased.len(),
            });
        }
        let at = s.free.len() - n;
        let mut pages = s.free.split_off(at);
        pages.reverse();
        for &p in &pages {
            s.leased[p as usize] = true;
        }
        Ok(PageLease {
            pages,
            state: Arc::clone(&self.state),
        })
    }

    /// Pages free now.
    pub fn free_pages(&self) -> usize {
        self.lock().free.len()
    }

    /// Pages in the pool.
    pub fn total_pages(&self) -> usize {
        self.lock().leased.len()
    }
}

/// Pages leased from a [`PageAllocator`]; dropping the lease frees them.
#[derive(Debug)]
pub struct PageLease {
    pages: Vec<u32>,
    state: Arc<Mutex<State>>,
}

impl PageLease {
    /// The leased pages, in the order they are to be filled.
    pub fn pages(&self) -> &[u32] {
        &self.pages
    }
}

impl Drop for PageLease {
    fn drop(&mut self) {
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for &p in self.pages.iter().rev() {
            // Each page of a lease was marked when it was handed out and nothing else clears it.
            s.leased[p as usize] = false;
            s.free.push(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    #[test]
    fn fresh_allocator_hands_out_ascending_runs() {
        let a = PageAllocator::new(8);
        let l = a.allocate(3).unwrap();
        assert_eq!(l.pages(), &[0, 1, 2]);
        let m = a.allocate(5).unwrap();
        assert_eq!(m.pages(), &[3, 4, 5, 6, 7]);
        assert_eq!(
            a.allocate(1).unwrap_err(),
            AllocError::Exhausted {
                requested: 1,
                free: 0,
                total: 8
            }
        );
        drop(l);
        assert_eq!(a.free_pages(), 3);
        assert_eq!(a.allocate(3).unwrap().pages(), &[0, 1, 2]);
        assert_eq!(a.allocate(0).unwrap().pages(), &[] as &[u32]);
    }

    #[test]
    fn randomized_alloc_free_keeps_the_invariants() {
        let seed: u64 = rand::rng().random();
        println!("allocator seed {seed}");
        let mut rng = StdRng::seed_from_u64(seed);
        let total = 257u32;
        let a = PageAllocator::new(total);
        let mut leases: Vec<PageLease> = Vec::new();
        for step in 0..20_000 {
            if rng.random_bool(0.55) {
                let n = rng.random_range(0..40);
                let free_before = a.free_pages();
                match a.allocate(n) {
                    Ok(l) => {
                        assert_eq!(l.pages().len(), n);
                        leases.push(l);
                    }
                    Err(AllocError::Exhausted { free, .. }) => {
                        assert!(n > free_before, "step {step}: refused {n} with {free} free");
                        assert_eq!(a.free_pages(), free_before, "a refusal must take nothing");
                    }
                }
            } else if !leases.is_empty() {
                let i = rng.random_range(0..leases.len());
                leases.swap_remove(i);
            }
            let mut owner = vec![false; total as usize];
            let used: usize = leases.iter().map(|l| l.pages().len()).sum();
            for l in &leases {
                for &p in l.pages() {
                    assert!(p < total);
                    assert!(
                        !std::mem::replace(&mut owner[p as usize], true),
                        "step {step}: page {p} in two leases"
                    );
                }
            }
            assert_eq!(a.free_pages() + used, total as usize, "step {step}");
        }
        leases.clear();
        assert_eq!(a.free_pages(), total as usize);
    }
}
