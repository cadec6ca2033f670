//! The engine API: every operation an engine asks of an agent, declared once.
//!
//! [`OPERATIONS`] lists each operation with the roles that serve it, its HTTP route and the
//! Python methods that call it. The operations both roles have are the methods of
//! [`EngineApi`], which each role implements once ([`super::prefill::Prefill`],
//! [`super::decode::Decode`]); a role's own operations (a prefill announces rooms ready; a
//! decode requests, takes and looks up prefill groups) are methods of its type. The surfaces
//! follow from the list: the HTTP routes are registered from it (`api.rs`, which refuses to
//! start a role whose listed operation has no handler), and tests check the Python classes,
//! their stub and `kvferry.Sidecar` against it, so that an operation added to one surface
//! cannot be forgotten on another.
//!
//! A refused operation returns a [`RoomError`], turned into an HTTP status in one place
//! (`api.rs`) and into a Python exception in another (`python/src/errors.rs`).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use super::room::RoomState;
use crate::reason::Reason;

/// One operation of the engine API and the surfaces that serve it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Operation {
    /// Its name: the Rust method, and the first Python method of [`Operation::python`].
    pub name: &'static str,
    /// The roles that serve it: `prefill`, `decode` or both.
    pub roles: &'static [&'static str],
    /// Its HTTP route, method and path (`{room}` stands for a room id); `None`: not over HTTP.
    pub http: Option<(Method, &'static str)>,
    /// The Python methods that serve it, on the in-process agents (`kvferry.PrefillAgent`,
    /// `kvferry.DecodeAgent`) and on `kvferry.Sidecar` alike; empty: not in Python.
    pub python: &'static [&'static str],
}

/// The HTTP methods the engine API uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Method {
    /// `GET`.
    Get,
    /// `POST`.
    Post,
    /// `DELETE`.
    Delete,
}

impl Method {
    /// Its name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Post => "POST",
            Method::Delete => "DELETE",
        }
    }
}

const BOTH: &[&str] = &["prefill", "decode"];
const PREFILL: &[&str] = &["prefill"];
const DECODE: &[&str] = &["decode"];

/// Every operation of the engine API. `wait` is `view` with `?wait_ms=` (the same route);
/// `faults` is served only with `--fault-injection`.
pub const OPERATIONS: &[Operation] = &[
    Operation {
        name: "view",
        roles: BOTH,
        http: Some((Method::Get, "/v1/rooms/{room}")),
        python: &["view", "poll"],
    },
    Operation {
        name: "wait",
        roles: BOTH,
        http: Some((Method::Get, "/v1/rooms/{room}")),
        python: &["wait"],
    },
    Operation {
        name: "abort",
        roles: BOTH,
        http: Some((Method::Delete, "/v1/rooms/{room}")),
        python: &["abort"],
    },
    Operation {
        name: "hold",
        roles: BOTH,
        http: Some((Method::Post, "/v1/rooms/{room}/hold")),
        python: &["hold"],
    },
    Operation {
        name: "unhold",
        roles: BOTH,
        http: Some((Method::Delete, "/v1/rooms/{room}/hold")),
        python: &["unhold"],
    },
    Operation {
        name: "pool",
        roles: BOTH,
        http: Some((Method::Get, "/v1/pool")),
        python: &["pool"],
    },
    Operation {
        name: "metrics",
        roles: BOTH,
        http: Some((Method::Get, "/metrics")),
        python: &[],
    },
    Operation {
        name: "health",
        roles: BOTH,
        http: Some((Method::Get, "/healthz")),
        python: &[],
    },
    Operation {
        name: "draining",
        roles: BOTH,
        http: Some((Method::Post, "/v1/draining")),
        python: &["draining"],
    },
    Operation {
        name: "faults",
        roles: BOTH,
        http: Some((Method::Post, "/v1/faults")),
        python: &[],
    },
    Operation {
        name: "ready",
        roles: PREFILL,
        http: Some((Method::Post, "/v1/rooms/{room}/ready")),
        python: &["ready"],
    },
    Operation {
        name: "request",
        roles: DECODE,
        http: Some((Method::Post, "/v1/rooms/{room}")),
        python: &["request"],
    },
    Operation {
        name: "take",
        roles: DECODE,
        http: Some((Method::Post, "/v1/rooms/{room}/take")),
        python: &["take"],
    },
    Operation {
        name: "prefill_group",
        roles: DECODE,
        http: Some((Method::Get, "/v1/prefill-groups/{dp_rank}")),
        python: &["prefill_group"],
    },
];

impl Operation {
    /// The operations `role` serves.
    pub fn of(role: &str) -> impl Iterator<Item = &'static Operation> {
        OPERATIONS.iter().filter(move |op| op.roles.contains(&role))
    }
}

/// The operations both roles have. Each role implements every one of them once; a role's
/// own operations are methods of its type.
pub trait EngineApi: Send + Sync + Sized + 'static {
    /// A room as the engine sees it (`GET /v1/rooms/{room}`).
    type View: RoomLook + Serialize + Send + 'static;
    /// What holding a room takes (`POST /v1/rooms/{room}/hold`).
    type Hold: DeserializeOwned + Send + 'static;
    /// `prefill` or `decode`.
    const ROLE: &'static str;

    /// The room's view now (`GET /v1/rooms/{room}`).
    fn view(&self, room: u64) -> Result<Self::View, RoomError>;

    /// The room's view at its next change, or after `timeout` (at most [`MAX_WAIT`]),
    /// whichever comes first; at once when it can no longer change
    /// (`GET /v1/rooms/{room}?wait_ms=`).
    fn wait(
        &self,
        room: u64,
        timeout: Duration,
    ) -> impl Future<Output = Result<Self::View, RoomError>> + Send;

    /// Aborts `room` for the engine (`DELETE /v1/rooms/{room}`), telling its peers, and
    /// returns its view.
    fn abort(
        self: &Arc<Self>,
        room: u64,
    ) -> impl Future<Output = Result<Self::View, RoomError>> + Send;

    /// Holds `room` while the engine has its request queued (`POST /v1/rooms/{room}/hold`):
    /// the other side keeps the room past its timeouts until the engine moves on, at most
    /// `--room-max-ms`. Refused while the agent drains.
    fn hold(self: &Arc<Self>, room: u64, req: Self::Hold) -> Result<(), RoomError>;

    /// Stops holding `room` (`DELETE /v1/rooms/{room}/hold`); holding nothing is not an error.
    fn unhold(self: &Arc<Self>, room: u64);

    /// The agent-owned pages (`GET /v1/pool`).
    fn pool(&self) -> PoolCounts;

    /// The agent's metrics in the OpenMetrics text format (`GET /metrics`).
    fn metrics(&self) -> String;

    /// The engine shuts down (`POST /v1/draining`): the registry is told that this rank
    /// drains, so that routers reading it send the engine no new requests. Rooms are served as
    /// before: the engine still finishes the requests it took. Once said, said.
    fn draining(&self) -> impl Future<Output = ()> + Send;
}

/// What every room view says, whatever the role: what waiting for a room reads.
pub trait RoomLook {
    /// The room's state.
    fn state(&self) -> RoomState;
    /// Why the room failed or was aborted.
    fn reason(&self) -> Option<&Reason>;
    /// No transfer reads or writes the room's pages any more.
    fn safe_to_reuse(&self) -> bool;
    /// The room can no longer change: final, and no transfer touches its pages any more.
    fn settled(&self) -> bool {
        self.state().is_final() && self.safe_to_reuse()
    }
}

/// Why a room operation was refused. Nothing changed in the agent when one is returned,
/// except a refusal counted in the metrics. The message says what was wrong and, where it
/// helps, which flag sets the limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RoomError {
    /// The request is malformed, or can never be served as given (HTTP 400): a bad token
    /// count or range, pages out of range, a room that needs more pages than the whole pool.
    #[error("{0}")]
    BadRequest(String),
    /// No such room (HTTP 404): never created here, already taken, or expired.
    #[error("unknown room {0}")]
    UnknownRoom(u64),
    /// The request conflicts with the room's state (HTTP 409): a duplicate room, a take
    /// before `safe_to_reuse`, an overlapping ready piece, another room key.
    #[error("{0}")]
    Conflict(String),
    /// No capacity now (HTTP 429): `--max-rooms` reached or agent-owned pages exhausted;
    /// retry later or elsewhere.
    #[error("{0}")]
    Exhausted(String),
    /// The agent cannot serve this now (HTTP 503): it is draining for shutdown.
    #[error("{0}")]
    Unavailable(String),
    /// The request names a peer this agent does not trust with its token (HTTP 403): a
    /// registry that is neither `--bootstrap`'s nor in `--allowed-registries`. Nothing was
    /// sent to it.
    #[error(transparent)]
    Forbidden(#[from] super::Untrusted),
}

impl RoomError {
    /// Whether the same request may succeed later or on another rank (exhausted, draining);
    /// the others fail again as long as the request and the room are unchanged.
    pub fn is_retryable(&self) -> bool {
        matches!(self, RoomError::Exhausted(_) | RoomError::Unavailable(_))
    }
}

/// The agent-owned pages of a pool (`GET /v1/pool`); pages an engine names are not counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PoolCounts {
    /// Pages free now.
    pub free_pages: usize,
    /// Every page of the pool.
    pub total_pages: usize,
}

impl PoolCounts {
    pub(crate) fn of(alloc: &crate::pool::allocator::PageAllocator) -> Self {
        PoolCounts {
            free_pages: alloc.free_pages(),
            total_pages: alloc.total_pages(),
        }
    }
}

/// The longest a wait for a room's next change lasts (`?wait_ms=` is capped to it too).
pub const MAX_WAIT: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_whether_to_retry() {
        assert!(RoomError::Exhausted(String::new()).is_retryable());
        assert!(!RoomError::UnknownRoom(3).is_retryable());
        assert_eq!(RoomError::UnknownRoom(3).to_string(), "unknown room 3");
    }

    #[test]
    fn each_route_is_one_operation_of_a_role() {
        for role in ["prefill", "decode"] {
            let mut routes: Vec<_> = Operation::of(role)
                .filter(|op| op.name != "wait")
                .filter_map(|op| op.http)
                .collect();
            let listed = routes.len();
            routes.sort();
            routes.dedup();
            assert_eq!(routes.len(), listed, "{role}: a route listed twice");
        }
        for op in OPERATIONS {
            assert!(!op.roles.is_empty(), "{}: served by no role", op.name);
            assert!(
                op.python.first().is_none_or(|p| *p == op.name),
                "{}: its first Python method is named after it",
                op.name
            );
        }
    }
}
