//! Operations in flight on the progress thread: each request filed with the buffers it uses
//! ([`Pending`]), cancelled when its caller gives up, and finished (buffers released, caller
//! answered) once UCX reports its end.
//!
//! Every request reports its end through its completion callback into the worker's list
//! (`Worker::completed`), so a round of progress costs what ended in it, not what is in
//! flight: a placed chunk keeps thousands of runs in flight, and polling each of them every
//! round made small runs pay for all the others (16 KiB placed runs went much faster with
//! completion callbacks than polling every request).
//! Abandonment is checked per operation for the few that reply one by one
//! (`Engine::pending`), per group for runs (`Engine::bulk`).

use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;

use bytes::Bytes;

use super::Engine;
use super::group::Group;
use super::op::{Op, Pending, Receiving};
use crate::transport::RecvBuffers;
use crate::transport::ucx::command::{EndpointId, Received};
use crate::transport::ucx::result::{UcxError, status_name};
use crate::transport::ucx::safe::{Endpoint, Started};
use crate::transport::ucx::sys;

impl Engine {
    /// Cancels what callers abandoned and completes what UCX reported ended; the number of
    /// operations completed.
    pub(super) fn sweep(&mut self) -> usize {
        self.reap_failed();
        self.cancel_abandoned();
        let ended = self.worker.completed();
        let count = ended.len();
        for c in ended {
            let p = match self.pending.remove(&c.request) {
                Some(p) => p,
                None => match self.bulk.remove(&c.request) {
                    Some(p) => p,
                    None => continue,
                },
            };
            self.finish(p, c.status, c.info);
        }
        count
    }

    /// Cancels the requests of callers that stopped waiting (or cancelled a group of runs),
    /// receives from failed endpoints, and everything at shutdown.
    pub(super) fn cancel_abandoned(&mut self) {
        for p in self.pending.values_mut().filter(|p| !p.cancelled) {
            let watched =
                p.ep.filter(|_| matches!(p.op, Op::Recv { .. }))
                    .and_then(|ep| failure(&self.endpoints, &self.dead, ep));
            if watched.is_some() || p.op.abandoned() || self.shutting_down {
                p.peer_failed = watched;
                p.cancel();
            }
        }
        self.groups.retain(|g| !g.answered());
        let cancelled: Vec<Rc<Group>> = self
            .groups
            .iter()
            .filter(|g| g.take_cancel())
            .cloned()
            .collect();
        for group in &cancelled {
            self.cancel_group(group);
        }
        self.end_drains();
        if self.shutting_down {
            self.bulk
                .values_mut()
                .filter(|p| !p.cancelled)
                .for_each(Pending::cancel);
        }
    }

    /// Files an operation in flight (see `pending` and `bulk`).
    pub(super) fn insert(&mut self, p: Pending) {
        let map = match p.op {
            Op::Run { .. } | Op::Put { reply: None, .. } => &mut self.bulk,
            _ => &mut self.pending,
        };
        map.insert(p.request.key(), p);
    }

    pub(super) fn finish(
        &self,
        p: Pending,
        status: sys::ucs_status_t,
        info: sys::ucp_tag_recv_info_t,
    ) {
        let Pending {
            request,
            ep,
            op,
            peer_failed,
            ..
        } = p;
        // The request is complete: free it before its buffers go.
        drop(request);
        let name = op.name();
        let error = |status| {
            if self.shutting_down {
                return UcxError::WorkerGone;
            }
            self.classify(name, ep, status, peer_failed)
        };
        match op {
            Op::Run {
                receiving: Some(Receiving { expect: len, .. }),
                group,
                ..
            } => group.done(match status {
                sys::UCS_OK if info.length == len => Ok(()),
                sys::UCS_OK | sys::UCS_ERR_MESSAGE_TRUNCATED => Err(UcxError::Length {
                    expected: len,
                    got: (status == sys::UCS_OK).then_some(info.length),
                }),
                status => Err(error(status)),
            }),
            op @ (Op::Send { .. } | Op::Put { .. } | Op::Flush { .. } | Op::Run { .. }) => {
                op.answer(if status == sys::UCS_OK {
                    Ok(())
                } else {
                    Err(error(status))
                });
            }
            Op::Recv {
                buffer,
                capacity,
                into,
                reply,
            } => {
                let _ = reply.send(recv_result(buffer, capacity, into, status, info).map_err(
                    |e| match e {
                        RecvFail::Truncated => UcxError::Truncated { capacity },
                        RecvFail::Status(status) => error(status),
                    },
                ));
            }
        }
    }

    /// The error for a failed operation: a peer failure when its endpoint's error handler ran
    /// or the status is a connection error, else the UCX status.
    pub(super) fn classify(
        &self,
        op: &'static str,
        ep: Option<EndpointId>,
        status: sys::ucs_status_t,
        peer_failed: Option<sys::ucs_status_t>,
    ) -> UcxError {
        let recorded =
            peer_failed.or_else(|| ep.and_then(|ep| failure(&self.endpoints, &self.dead, ep)));
        let connection_error = matches!(
            status,
            sys::UCS_ERR_UNREACHABLE
                | sys::UCS_ERR_NOT_CONNECTED
                | sys::UCS_ERR_CONNECTION_RESET
                | sys::UCS_ERR_TIMED_OUT
        ) || (sys::UCS_ERR_LAST_ENDPOINT_FAILURE
            ..=sys::UCS_ERR_FIRST_LINK_FAILURE)
            .contains(&status);
        match (ep, recorded) {
            (Some(ep), Some(failure)) => UcxError::PeerFailed {
                op,
                endpoint: ep.0,
                status: failure,
                name: status_name(failure),
            },
            (Some(ep), None) if connection_error => UcxError::PeerFailed {
                op,
                endpoint: ep.0,
                status,
                name: status_name(status),
            },
            _ => UcxError::call(op, status),
        }
    }

    pub(super) fn track(&mut self, started: Started<()>, ep: Option<EndpointId>, op: Op) {
        match started {
            Started::Pending(request) => self.insert(Pending::new(request, ep, op)),
            Started::Done(()) => op.answer(Ok(())),
        }
    }
}

/// The failure recorded for `ep`: closed as dead, or its error handler ran.
fn failure(
    endpoints: &HashMap<u64, Rc<Endpoint>>,
    dead: &HashMap<u64, sys::ucs_status_t>,
    ep: EndpointId,
) -> Option<sys::ucs_status_t> {
    dead.get(&ep.0)
        .copied()
        .or_else(|| endpoints.get(&ep.0).and_then(|e| e.failure()))
}

pub(super) enum RecvFail {
    Truncated,
    Status(sys::ucs_status_t),
}

/// A completed receive's buffer, cut to the received length (a buffer of `into` goes back
/// there when the bytes are dropped, or at once when the receive failed). A buffer of `into`
/// keeps its length, all of it initialized, and only the bytes handed out are cut: cut
/// itself, it would be zero-filled again up to its capacity when it is next taken (a
/// 1 MiB memset on the progress thread for every header-only message).
// Takes the bytes UCX wrote into the spare capacity of the buffer it was lent.
#[allow(unsafe_code)]
pub(super) fn recv_result(
    mut buffer: Vec<u8>,
    capacity: usize,
    into: Option<Arc<dyn RecvBuffers>>,
    status: sys::ucs_status_t,
    info: sys::ucp_tag_recv_info_t,
) -> Result<Received, RecvFail> {
    match (status, into) {
        (sys::UCS_OK, Some(owner)) if info.length <= capacity.min(buffer.len()) => Ok(Received {
            tag: info.sender_tag,
            data: owner.freeze(buffer).slice(..info.length),
        }),
        (sys::UCS_OK, None) if info.length <= capacity => {
            // SAFETY: UCX completed the receive and wrote `info.length` bytes at the start of
            // the allocation, which holds `capacity >= info.length` bytes.
            unsafe { buffer.set_len(info.length) };
            Ok(Received {
                tag: info.sender_tag,
                data: Bytes::from(buffer),
            })
        }
        (failed, into) => {
            if let Some(owner) = into {
                drop(owner.freeze(buffer));
            }
            match failed {
                sys::UCS_OK | sys::UCS_ERR_MESSAGE_TRUNCATED => Err(RecvFail::Truncated),
                status => Err(RecvFail::Status(status)),
            }
        }
    }
}
