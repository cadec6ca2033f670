//! The progress thread's placed messages: runs of local memory sent as tagged messages straight
//! from it, and received straight into memory at offsets the receiver chose. Each run is its
//! own request; a [`Group`] answers the caller once all of a command's runs have completed.
//!
//! On an eager worker (tcp) each run is received through a [`Revocable`](crate::transport::ucx::safe::Revocable): a cancelled group
//! revokes its runs and answers at once, whether or not UCX ever ends their requests (it does
//! not end one whose sender died mid-message). Revoked receives that no message matched yet
//! stay posted for [`REVOKED_DRAIN`], taking and dropping what the sender still had on the way,
//! then are cancelled.

use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use super::Engine;
use super::group::Group;
use super::op::{Op, Pending, Run};
use crate::memory::Span;
use crate::transport::ucx::command::{EndpointId, Reply};
use crate::transport::ucx::memory_type::MemoryType;
use crate::transport::ucx::region::RegisterableMemory;
use crate::transport::ucx::result::UcxError;
use crate::transport::ucx::safe::{MemoryRange, Request, RevocableBox, Started};
use crate::transport::ucx::sys;

/// How long revoked receives that no message matched stay posted before they are cancelled.
/// A sender queues a chunk's runs once the receiver has posted them (the agents' `Posted`), so
/// whatever it sends after a cancel is on its way within moments.
const REVOKED_DRAIN: Duration = Duration::from_secs(10);

/// Checks every run against memory of `size` bytes and the tags against overflow.
fn check(tag: u64, runs: &[Span], size: usize) -> Result<(), UcxError> {
    within(runs, size)?;
    tag_range(tag, runs.len())
}

/// Checks that the tags of `runs` runs from `tag` on do not overflow.
fn tag_range(tag: u64, runs: usize) -> Result<(), UcxError> {
    match tag.checked_add(runs as u64) {
        Some(_) => Ok(()),
        None => Err(UcxError::call("tag range", sys::UCS_ERR_INVALID_PARAM)),
    }
}

/// Checks every run against memory of `size` bytes.
fn within(runs: &[Span], size: usize) -> Result<(), UcxError> {
    for run in runs {
        if run
            .offset
            .checked_add(run.len)
            .is_none_or(|end| end > size as u64)
        {
            return Err(UcxError::OutOfBounds {
                offset: run.offset,
                len: run.len as usize,
                size: size as u64,
            });
        }
    }
    Ok(())
}

impl Engine {
    /// Starts the tagged send of every run of `source` through `ep` (run `i` under `tag + i`).
    pub(super) fn send_runs(
        &mut self,
        ep: EndpointId,
        tag: u64,
        source: Arc<dyn RegisterableMemory>,
        runs: Vec<Span>,
        reply: Reply<()>,
    ) {
        let checked = check(tag, &runs, source.size())
            .and_then(|()| self.movable("send_run", source.as_ref()))
            .and_then(|_| self.endpoint("send_run", ep));
        let endpoint = match checked {
            Ok(e) => e,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        let group = Group::new(runs.len().max(1), reply, None);
        if runs.is_empty() {
            group.done(Ok(()));
        }
        for (i, &run) in runs.iter().enumerate() {
            let started = MemoryRange::new(source.clone(), run).and_then(|range| {
                endpoint
                    .tag_send(range, tag + i as u64)
                    .map_err(|(e, _)| self.failure_of("send_run", ep, e))
            });
            match started {
                Ok(started) => self.track_run(started, Some(ep), &group, Run::Range, None),
                Err(e) => group.done(Err(e)),
            }
        }
    }

    /// Posts a tagged receive straight into `memory` for every run (`tag + i` lands in the
    /// pieces of run `i`, one after the other), then answers `posted`; `cancel` cancels those
    /// still open. A run of several pieces needs an eager worker, whose unpack callback copies
    /// each part into place.
    pub(super) fn recv_runs(
        &mut self,
        tag: u64,
        memory: Arc<dyn RegisterableMemory>,
        runs: Vec<Vec<Span>>,
        posted: tokio::sync::oneshot::Sender<()>,
        cancel: Arc<AtomicBool>,
        reply: Reply<()>,
    ) {
        let checked = runs
            .iter()
            .try_for_each(|pieces| within(pieces, memory.size()))
            .and_then(|()| tag_range(tag, runs.len()))
            .and_then(|()| self.movable("recv_run", memory.as_ref()))
            .and_then(|kind| match (kind, self.eager) {
                // An eager worker lands runs through its own unpack callback, a host copy.
                (MemoryType::Cuda, true) => Err(UcxError::MemoryType {
                    op: "recv_run",
                    memory: kind,
                    why: "eager workers land runs by host copies (UCX_TLS of tcp only)",
                }),
                (_, false) if runs.iter().any(|r| r.len() != 1) => Err(UcxError::call(
                    "recv_run of several pieces",
                    sys::UCS_ERR_INVALID_PARAM,
                )),
                _ => Ok(()),
            });
        if let Err(e) = checked {
            let _ = reply.send(Err(e));
            return;
        }
        let group = Group::new(runs.len().max(1), reply, Some(cancel));
        if runs.is_empty() {
            group.done(Ok(()));
        }
        for (i, run) in runs.iter().enumerate() {
            let tag = tag + i as u64;
            let expect = Some(run.iter().map(|p| p.len as usize).sum());
            let filed = match (self.eager, &run[..]) {
                (false, &[one]) => MemoryRange::new(memory.clone(), one)
                    .and_then(|range| self.recv_tag(range, tag, u64::MAX).map_err(|(e, _)| e))
                    .map(|started| self.track_run(started, None, &group, Run::Range, expect)),
                _ => RevocableBox::new(memory.clone(), run)
                    .and_then(|target| self.recv_tag(target, tag, u64::MAX).map_err(|(e, _)| e))
                    .map(|started| self.track_run(started, None, &group, Run::Revocable, expect)),
            };
            if let Err(e) = filed {
                group.done(Err(e));
            }
        }
        let _ = posted.send(());
    }

    /// Revokes the runs of a cancelled `group` that are [`Revocable`](crate::transport::ucx::safe::Revocable) and answers it at once
    /// (when it has any; its others are cancelled as usual). Their requests stay filed until
    /// UCX ends them; those no message matched yet are cancelled after [`REVOKED_DRAIN`].
    pub(super) fn cancel_group(&mut self, group: &Rc<Group>) {
        let mut revoked = false;
        for key in group.requests() {
            let Some(p) = self.bulk.get_mut(&key) else {
                continue;
            };
            if !p.op().group().is_some_and(|g| Rc::ptr_eq(g, group)) {
                continue;
            }
            match p.op().revocable() {
                Some(target) => {
                    target.revoke();
                    revoked = true;
                    if !target.touched() {
                        self.draining
                            .push_back((Instant::now() + REVOKED_DRAIN, key));
                    }
                }
                None => p.cancel(),
            }
        }
        if revoked {
            group.revoked();
        }
    }

    /// Cancels the revoked receives whose drain time is over and that no message matched.
    pub(super) fn end_drains(&mut self) {
        let now = Instant::now();
        while let Some(&(due, key)) = self.draining.front() {
            if due > now {
                break;
            }
            self.draining.pop_front();
            // The key may belong to a newer request by now: only a revoked, unmatched one.
            if let Some(p) = self.bulk.get_mut(&key)
                && p.op()
                    .revocable()
                    .is_some_and(|t| t.revoked() && !t.touched())
            {
                p.cancel();
            }
        }
    }

    /// Files a run's started request with its group (`run` says which kind it is), or counts
    /// it done when UCX completed it at once.
    fn track_run<L>(
        &mut self,
        started: Started<L>,
        ep: Option<EndpointId>,
        group: &Rc<Group>,
        run: fn(Request<L>) -> Run,
        expect: Option<usize>,
    ) {
        match started {
            Started::Pending(request) => {
                group.requests.borrow_mut().push(request.key());
                if group.requests.borrow().len() == 1 {
                    self.groups.push(group.clone());
                }
                self.insert(Pending::new(
                    ep,
                    Op::Run {
                        request: run(request),
                        group: group.clone(),
                        expect,
                    },
                ));
            }
            // A send done at once; receives never complete immediately (NO_IMM_CMPL).
            Started::Done(_) => group.done(Ok(())),
        }
    }
}
