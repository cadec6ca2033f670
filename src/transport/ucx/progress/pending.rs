//! Operations in flight on the progress thread: each filed with the request that owns what it
//! lent UCX ([`Pending`]), cancelled when its caller gives up, and finished (the request ended
//! with UCX's report, what it lent released or handed on, the caller answered) once UCX
//! reports its end.
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
use super::op::{Op, Pending};
use crate::transport::RecvBuffers;
use crate::transport::ucx::command::{EndpointId, Received};
use crate::transport::ucx::result::{UcxError, status_name};
use crate::transport::ucx::safe::{Completion, Ended, Endpoint};
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
            let key = c.request();
            let Some(p) = self.pending.remove(&key).or_else(|| self.bulk.remove(&key)) else {
                continue;
            };
            if let Err(p) = self.finish(p, c) {
                tracing::error!(request = key, "a UCX report of another request's end; kept");
                self.insert(p);
            }
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
        map.insert(p.key(), p);
    }

    /// Finishes an operation UCX reported ended (`c`): ends its request, which frees it and
    /// hands back what it lent (released here, a receive's buffer handed on), and answers
    /// the caller. Gives the operation back when `c` reports another request.
    pub(super) fn finish(&self, p: Pending, c: Completion) -> Result<(), Pending> {
        let Pending {
            ep,
            op,
            cancelled,
            peer_failed,
        } = p;
        let back = |op| Pending {
            ep,
            op,
            cancelled,
            peer_failed,
        };
        let name = op.name();
        let error = |status| {
            if self.shutting_down {
                return UcxError::WorkerGone;
            }
            self.classify(name, ep, status, peer_failed)
        };
        let outcome = |status| match status {
            sys::UCS_OK => Ok(()),
            status => Err(error(status)),
        };
        match op {
            Op::Send { request, reply } => match request.end(c) {
                Ok(ended) => drop(reply.send(outcome(ended.status))),
                Err((request, _)) => return Err(back(Op::Send { request, reply })),
            },
            Op::Flush { request, reply } => match request.end(c) {
                Ok(ended) => drop(reply.send(outcome(ended.status))),
                Err((request, _)) => return Err(back(Op::Flush { request, reply })),
            },
            Op::Put { request, reply } => match request.end(c) {
                Ok(ended) => {
                    if let Some(reply) = reply {
                        let _ = reply.send(outcome(ended.status));
                    }
                }
                Err((request, _)) => return Err(back(Op::Put { request, reply })),
            },
            Op::Recv {
                request,
                capacity,
                into,
                reply,
            } => match request.end(c) {
                Ok(Ended { lent, status, info }) => {
                    let received = recv_result(lent.into_vec(), capacity, into, status, info);
                    let _ = reply.send(received.map_err(|e| match e {
                        RecvFail::Truncated => UcxError::Truncated { capacity },
                        RecvFail::Status(status) => error(status),
                    }));
                }
                Err((request, _)) => {
                    return Err(back(Op::Recv {
                        request,
                        capacity,
                        into,
                        reply,
                    }));
                }
            },
            Op::Run {
                request,
                group,
                expect,
            } => match request.end(c) {
                Ok((status, length)) => group.done(match (expect, status) {
                    (None, status) => outcome(status),
                    (Some(len), sys::UCS_OK) if length == len => Ok(()),
                    (Some(len), sys::UCS_OK | sys::UCS_ERR_MESSAGE_TRUNCATED) => {
                        Err(UcxError::Length {
                            expected: len,
                            got: (status == sys::UCS_OK).then_some(length),
                        })
                    }
                    (Some(_), status) => Err(error(status)),
                }),
                Err((request, _)) => {
                    return Err(back(Op::Run {
                        request,
                        group,
                        expect,
                    }));
                }
            },
        }
        Ok(())
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
/// 1 MiB memset on the progress thread for every header-only message). The buffer is as the
/// receive's request handed it back: at least as long as what arrived.
pub(super) fn recv_result(
    mut buffer: Vec<u8>,
    capacity: usize,
    into: Option<Arc<dyn RecvBuffers>>,
    status: sys::ucs_status_t,
    info: sys::ucp_tag_recv_info_t,
) -> Result<Received, RecvFail> {
    match (status, into) {
        (sys::UCS_OK, into) if info.length <= capacity.min(buffer.len()) => Ok(Received {
            tag: info.sender_tag,
            data: match into {
                Some(owner) => owner.freeze(buffer).slice(..info.length),
                None => {
                    buffer.truncate(info.length);
                    Bytes::from(buffer)
                }
            },
        }),
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
