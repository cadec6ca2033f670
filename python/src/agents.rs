//! `kvferry.PrefillAgent` and `kvferry.DecodeAgent`: the library's agents, started on the
//! module's runtime over the engine's memory, with the room operations of the Rust handles.
//!
//! Every call that can block (start, the operations, wait, close) releases the GIL. `wait`
//! waits in slices of at most [`SLICE`] so that Ctrl-C reaches the engine. The agent holds the
//! Python objects that own its memory until its tasks are joined: on `close()`, on leaving a
//! `with` block, or when the agent object is collected.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry::agent::decode::{self, HoldRequest, RoomRequest};
use kvferry::agent::prefill::{self, ReadyRequest};
use kvferry::agent::room::RoomState;
use kvferry::agent::{AgentConfig, AgentError, EngineApi, PoolCounts, RoomError, RoomLook};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use serde::Serialize;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::errors::{self, Unavailable};
use crate::{convert, memory, runtime};

/// The longest the GIL stays released in one piece of a wait.
const SLICE: Duration = Duration::from_millis(200);

/// A started agent of either role, and what it must outlive.
struct Handle<A: Send + Sync> {
    agent: Mutex<Option<Arc<A>>>,
    /// Held for the whole of a close, so that a second `close()` returns only once the agent
    /// is joined (and only then may the memory go).
    closing: Mutex<()>,
    shutdown: CancellationToken,
    /// The objects that own the engine's memory; released only after the agent is joined.
    keep: Mutex<Vec<Py<PyAny>>>,
    api_url: String,
    instance: String,
    /// The prefill's control endpoint, the decode's data endpoint.
    endpoint: String,
}

/// Builds the pool and starts an agent of either role.
fn start<A, F, Fut>(
    py: Python<'_>,
    regions: Option<&Bound<'_, PyAny>>,
    device: Option<usize>,
    options: Option<&Bound<'_, PyDict>>,
    start: F,
    names: impl Fn(&A) -> (String, String, String),
) -> PyResult<Handle<A>>
where
    A: Send + Sync + 'static,
    F: FnOnce(AgentConfig, Option<kvferry::agent::EnginePool>, CancellationToken) -> Fut + Send,
    Fut: Future<Output = Result<A, AgentError>> + Send + 'static,
{
    crate::init_logs();
    let cfg = crate::agent_config(options)?;
    if device.is_some() && regions.is_none() {
        return Err(errors::RegionError::new_err(
            "device names the CUDA device of the regions; no regions were given",
        ));
    }
    let (pool, keep) = match regions {
        Some(items) => {
            let regions = memory::regions(items, device)?;
            let pool = memory::engine_pool(cfg.layout.clone(), cfg.pool_pages, &regions)?;
            (Some(pool), regions.keep)
        }
        None => (None, Vec::new()),
    };
    let shutdown = CancellationToken::new();
    let token = shutdown.clone();
    let rt = runtime().map_err(errors::StartError::new_err)?;
    let agent = py
        // On a runtime thread: threads the agent starts (control, transport) inherit its
        // affinity, not the engine's pinned calling thread's.
        .detach(|| rt.block_on(rt.spawn(start(cfg, pool, token))))
        .map_err(|e| errors::StartError::new_err(e.to_string()))?
        .map_err(|e| errors::StartError::new_err(e.to_string()))?;
    let (api_url, instance, endpoint) = names(&agent);
    Ok(Handle {
        agent: Mutex::new(Some(Arc::new(agent))),
        closing: Mutex::new(()),
        shutdown,
        keep: Mutex::new(keep),
        api_url,
        instance,
        endpoint,
    })
}

impl<A: Send + Sync> Handle<A> {
    /// The running agent, or `Unavailable` once closed.
    fn get(&self) -> PyResult<Arc<A>> {
        let agent = self.agent.lock().unwrap_or_else(|e| e.into_inner());
        agent
            .clone()
            .ok_or_else(|| Unavailable::new_err("the agent is closed"))
    }

    /// Runs an operation of the agent with the GIL released; `Unavailable` when the agent is
    /// or gets closed meanwhile.
    fn run<T, Fut>(&self, py: Python<'_>, op: impl FnOnce(Arc<A>) -> Fut + Send) -> PyResult<T>
    where
        T: Send,
        Fut: Future<Output = Result<T, RoomError>>,
    {
        let agent = self.get()?;
        // Started with the agent: an agent exists only on a running runtime.
        let rt = runtime().map_err(errors::StartError::new_err)?;
        let shutdown = &self.shutdown;
        py.detach(|| {
            rt.block_on(async {
                tokio::select! {
                    r = op(agent) => Some(r),
                    _ = shutdown.cancelled() => None,
                }
            })
        })
        .ok_or_else(|| Unavailable::new_err("the agent is closed"))?
        .map_err(errors::room_error)
    }

    /// Waits until the room is settled (see [`RoomLook::settled`] and [`finished`]) or `timeout`
    /// seconds passed.
    fn wait_final<'py, V, Fut>(
        &self,
        py: Python<'py>,
        room: u64,
        timeout: f64,
        wait: impl Fn(Arc<A>, Duration) -> Fut + Send + Sync,
    ) -> PyResult<Bound<'py, PyDict>>
    where
        V: RoomLook + Serialize + Send,
        Fut: Future<Output = Result<V, RoomError>>,
    {
        // No deadline for a timeout beyond what an Instant can hold (`float("inf")`).
        let deadline = Instant::now().checked_add(seconds(timeout)?);
        loop {
            let left = deadline.map_or(SLICE, |d| d.saturating_duration_since(Instant::now()));
            let view = self.run(py, |a| wait(a, left.min(SLICE)))?;
            if view.settled() {
                return finished(py, room, &view);
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                let dict = convert::view(py, room, &view)?;
                return Err(errors::wait_timeout(
                    py,
                    room,
                    timeout,
                    view.state().name(),
                    dict,
                ));
            }
            py.check_signals()?;
        }
    }

    /// The views of the settled rooms among `rooms`, by room, and `None` for rooms the agent
    /// does not know (taken, expired, never made); never blocks.
    fn poll<'py, V: RoomLook + Serialize>(
        &self,
        py: Python<'py>,
        rooms: Vec<u64>,
        view: impl Fn(&A, u64) -> Result<V, RoomError>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let agent = self.get()?;
        let out = PyDict::new(py);
        for room in rooms {
            match view(&agent, room) {
                Ok(v) if v.settled() => out.set_item(room, convert::view(py, room, &v)?)?,
                Ok(_) => {}
                Err(RoomError::UnknownRoom(_)) => out.set_item(room, py.None())?,
                Err(e) => return Err(errors::room_error(e)),
            }
        }
        Ok(out)
    }

    /// Cancels the agent and joins its tasks; [`Self::release`] then lets the memory go.
    fn close(&self, join: impl Fn(A) -> std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) {
        let _closing = self.closing.lock().unwrap_or_else(|e| e.into_inner());
        let taken = self.agent.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.shutdown.cancel();
        if let Some(mut agent) = taken {
            // Operations in flight hold a clone for at most one slice after the cancel.
            let agent = loop {
                match Arc::try_unwrap(agent) {
                    Ok(a) => break a,
                    Err(shared) => {
                        agent = shared;
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
            };
            // An agent exists only on a running runtime.
            if let Ok(rt) = runtime() {
                rt.block_on(join(agent));
            }
        }
    }

    /// Releases the engine's objects (once the agent is joined).
    fn release(&self) {
        self.keep.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// A room's final view: the dict on success, its reason's exception otherwise.
fn finished<'py, V: RoomLook + Serialize>(
    py: Python<'py>,
    room: u64,
    view: &V,
) -> PyResult<Bound<'py, PyDict>> {
    let dict = convert::view(py, room, view)?;
    match (view.state(), view.reason()) {
        (RoomState::Success, _) => Ok(dict),
        (_, Some(reason)) => Err(errors::room_failed(py, room, reason, dict)),
        (state, None) => Err(errors::RoomFailed::new_err(format!(
            "room {room} is {} without a reason",
            state.name()
        ))),
    }
}

/// A timeout in seconds (`inf` is the longest there is).
fn seconds(timeout: f64) -> PyResult<Duration> {
    if timeout == f64::INFINITY {
        return Ok(Duration::MAX);
    }
    Duration::try_from_secs_f64(timeout).map_err(|_| {
        errors::BadRequest::new_err(format!("timeout {timeout} is not a number of seconds >= 0"))
    })
}

fn pool_dict(py: Python<'_>, counts: PoolCounts) -> PyResult<Bound<'_, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("free_pages", counts.free_pages)?;
    dict.set_item("total_pages", counts.total_pages)?;
    Ok(dict)
}

/// A Python class over one role's agent: construction, the getters, the operations both roles
/// have (`view`, `poll`, `wait`, `abort`, `pool`, `draining`, `close`, the `with` protocol, close on drop),
/// and the role's own operations given as `$extra`. (PyO3 takes one `#[pymethods]` block per
/// class, so the shared methods cannot live in a trait.)
macro_rules! agent_class {
    ($(#[$doc:meta])* $class:ident, $agent:path, $endpoint:ident, { $($extra:tt)* }) => {
        $(#[$doc])*
        #[pyclass(module = "kvferry", frozen)]
        pub(crate) struct $class(Handle<$agent>);

        #[pymethods]
        impl $class {
            #[new]
            #[pyo3(signature = (regions=None, device=None, **options))]
            fn new(
                py: Python<'_>,
                regions: Option<&Bound<'_, PyAny>>,
                device: Option<usize>,
                options: Option<&Bound<'_, PyDict>>,
            ) -> PyResult<Self> {
                let handle = start(
                    py,
                    regions,
                    device,
                    options,
                    |cfg, pool, shutdown| async move {
                        match pool {
                            Some(pool) => <$agent>::start_with_pool(cfg, pool, shutdown).await,
                            None => <$agent>::start(cfg, shutdown).await,
                        }
                    },
                    |a| (a.api_url.clone(), a.instance.to_string(), a.$endpoint.clone()),
                )?;
                Ok($class(handle))
            }

            #[getter]
            fn api_url(&self) -> &str {
                &self.0.api_url
            }

            #[getter]
            fn instance(&self) -> &str {
                &self.0.instance
            }

            #[getter]
            fn $endpoint(&self) -> &str {
                &self.0.endpoint
            }

            fn view<'py>(&self, py: Python<'py>, room: u64) -> PyResult<Bound<'py, PyDict>> {
                let view = self.0.get()?.view(room).map_err(errors::room_error)?;
                convert::view(py, room, &view)
            }

            fn poll<'py>(
                &self,
                py: Python<'py>,
                rooms: &Bound<'py, PyAny>,
            ) -> PyResult<Bound<'py, PyDict>> {
                self.0
                    .poll(py, convert::rooms(rooms)?, |a, room| a.view(room))
            }

            fn wait<'py>(
                &self,
                py: Python<'py>,
                room: u64,
                timeout: f64,
            ) -> PyResult<Bound<'py, PyDict>> {
                self.0.wait_final(
                    py,
                    room,
                    timeout,
                    |a, t| async move { a.wait(room, t).await },
                )
            }

            fn abort<'py>(&self, py: Python<'py>, room: u64) -> PyResult<Bound<'py, PyDict>> {
                let view = self.0.run(py, |a| async move { a.abort(room).await })?;
                convert::view(py, room, &view)
            }

            fn pool<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
                pool_dict(py, self.0.get()?.pool())
            }

            /// Tells the registry that this rank drains, in the background: the engine's step
            /// never waits on the registry.
            fn draining(&self) -> PyResult<()> {
                let agent = self.0.get()?;
                let rt = runtime().map_err(errors::StartError::new_err)?;
                rt.spawn(async move { agent.draining().await });
                Ok(())
            }

            fn close(&self, py: Python<'_>) {
                py.detach(|| self.0.close(|a| Box::pin(a.join())));
                self.0.release();
            }

            fn __enter__(slf: Py<Self>) -> Py<Self> {
                slf
            }

            #[pyo3(signature = (*_exc))]
            fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, pyo3::types::PyTuple>) {
                self.close(py);
            }

            $($extra)*
        }

        impl Drop for $class {
            fn drop(&mut self) {
                self.0.close(|a| Box::pin(a.join()));
                self.0.release();
            }
        }
    };
}

agent_class!(
    /// A prefill agent in this process: the engine says which pages of a room are ready, the
    /// agent gathers them from the engine's memory and pushes them to the decodes that ask.
    PrefillAgent,
    prefill::PrefillAgent,
    control_endpoint,
    {
        /// Holds `room` while the engine has its request queued (see `EngineApi::hold`
        /// in Rust).
        fn hold(&self, py: Python<'_>, room: u64) -> PyResult<()> {
            self.0
                .run(py, |a| async move { a.hold(room, prefill::HoldRequest {}) })
        }

        /// Stops holding `room`.
        fn unhold(&self, py: Python<'_>, room: u64) -> PyResult<()> {
            self.0.run(py, |a| async move {
                a.unhold(room);
                Ok(())
            })
        }

        #[pyo3(signature = (room, tokens, pages=None, token_range=None, layer_range=None, last=None, aux=None, room_key=None, cuda_event=None, prompt_digest=None))]
        #[allow(clippy::too_many_arguments)]
        fn ready<'py>(
            &self,
            py: Python<'py>,
            room: u64,
            tokens: usize,
            pages: Option<Vec<u32>>,
            token_range: Option<(usize, usize)>,
            layer_range: Option<(usize, usize)>,
            last: Option<bool>,
            aux: Option<&Bound<'py, PyBytes>>,
            room_key: Option<&Bound<'py, PyAny>>,
            cuda_event: Option<u64>,
            prompt_digest: Option<String>,
        ) -> PyResult<Bound<'py, PyDict>> {
            let mut req: ReadyRequest = convert::request(json!({
                "tokens": tokens,
                "room_key": convert::room_key(room_key)?,
                "prompt_digest": prompt_digest,
            }))?;
            req.pages = pages;
            req.token_range = token_range.map(|(a, b)| [a, b]);
            req.layer_range = layer_range.map(|(a, b)| [a, b]);
            req.last = last;
            req.aux = aux.map(|b| b.as_bytes().to_vec());
            let ready = match cuda_event {
                Some(event) => Some(memory::follow(self.0.get()?.device(), event)?),
                None => None,
            };
            let view = self.0.run(py, |a| async move {
                match ready {
                    Some(ready) => a.ready_after(room, req, ready).await,
                    None => a.ready(room, req).await,
                }
            })?;
            convert::view(py, room, &view)
        }
    }
);

agent_class!(
    /// A decode agent in this process: the engine asks for a room into its own pages, waits
    /// for it and takes it.
    DecodeAgent,
    decode::DecodeAgent,
    data_endpoint,
    {
        #[pyo3(signature = (room, tokens, pages=None, start_token=0, bootstrap=None, dp_rank=None, room_key=None, prompt_digest=None, source_pages=None))]
        #[allow(clippy::too_many_arguments)]
        fn request<'py>(
            &self,
            py: Python<'py>,
            room: u64,
            tokens: usize,
            pages: Option<Vec<u32>>,
            start_token: usize,
            bootstrap: Option<String>,
            dp_rank: Option<u32>,
            room_key: Option<&Bound<'py, PyAny>>,
            prompt_digest: Option<String>,
            source_pages: Option<Vec<u32>>,
        ) -> PyResult<Bound<'py, PyDict>> {
            let mut req: RoomRequest = convert::request(json!({
                "tokens": tokens,
                "room_key": convert::room_key(room_key)?,
                "prompt_digest": prompt_digest,
            }))?;
            req.pages = pages;
            req.start_token = start_token;
            req.bootstrap = bootstrap;
            req.dp_rank = dp_rank;
            req.source_pages = source_pages;
            let view = self
                .0
                .run(py, |a| async move { a.request(room, req).await })?;
            convert::view(py, room, &view)
        }

        /// Holds `room` at its prefill while the engine has its request queued (see
        /// `EngineApi::hold` in Rust): returns at once.
        #[pyo3(signature = (room, bootstrap=None, dp_rank=None))]
        fn hold(&self, py: Python<'_>, room: u64, bootstrap: Option<String>, dp_rank: Option<u32>) -> PyResult<()> {
            let req = HoldRequest { bootstrap, dp_rank };
            self.0.run(py, |a| async move { a.hold(room, req) })
        }

        /// Stops holding `room`.
        fn unhold(&self, py: Python<'_>, room: u64) -> PyResult<()> {
            self.0.run(py, |a| async move {
                a.unhold(room);
                Ok(())
            })
        }

        /// The prefill group `dp_rank` as the registry at `bootstrap` lists it (see
        /// `DecodeAgent::prefill_group` in Rust): a dict as `GET /v1/groups/{dp_rank}` answers.
        #[pyo3(signature = (bootstrap=None, dp_rank=0))]
        fn prefill_group<'py>(
            &self,
            py: Python<'py>,
            bootstrap: Option<String>,
            dp_rank: u32,
        ) -> PyResult<Bound<'py, PyAny>> {
            let group = self.0.run(py, |a| async move {
                a.prefill_group(bootstrap.as_deref(), dp_rank).await
            })?;
            let json = serde_json::to_value(&group)
                .map_err(|e| errors::Error::new_err(format!("prefill group: {e}")))?;
            Ok(convert::object(py, &json)?.into_bound(py))
        }

        fn take<'py>(&self, py: Python<'py>, room: u64) -> PyResult<Bound<'py, PyDict>> {
            let taken = self.0.run(py, |a| async move { a.take(room).await })?;
            let dict = convert::taken(py, room, &taken)?;
            match (taken.room.state, &taken.room.reason) {
                (RoomState::Success, _) => Ok(dict),
                (_, Some(reason)) => Err(errors::room_failed(py, room, reason, dict)),
                (state, None) => Err(errors::RoomFailed::new_err(format!(
                    "room {room} was taken {} without a reason",
                    state.name()
                ))),
            }
        }
    }
);
