//! A room no decode answered for: when a request ends before a decode server's answer to it
//! began (the client left at any point after the prefill got the request, or the decode
//! answered an error), the prefill server is asked to release the room, so that its KV does
//! not wait out a TTL for a decode that will never ask. The question is a one-token request
//! with `kv_transfer_params.kvferry_abort` naming the room (the vLLM connector's scheduler side
//! aborts the room of the request that holds it, or sends nothing for one still computing),
//! asked with the client's `Authorization`.

use std::sync::Arc;

use serde_json::{Value, json};

use super::failure::Server;
use super::route::{Forwarded, Posted, Proxy};

/// A request's room on a prefill server until a decode's answer began ([`Unclaimed::claimed`]);
/// dropped before that, it has the prefill server release the room (in a task of its own: the
/// request's own future may be the one being dropped).
pub(super) struct Unclaimed {
    proxy: Arc<Proxy>,
    prefill: Server,
    room: String,
    model: Value,
    asking: Forwarded,
    armed: bool,
}

impl Unclaimed {
    /// The room `room` of a request for `model` to `prefill`, asked about with `asking` (the
    /// client's `Authorization`).
    pub(super) fn new(
        proxy: Arc<Proxy>,
        prefill: Server,
        room: String,
        model: Value,
        asking: Forwarded,
    ) -> Self {
        Unclaimed {
            proxy,
            prefill,
            room,
            model,
            asking,
            armed: true,
        }
    }

    /// A decode's answer began (it took the room), or the prefill never computed the room
    /// (it refused the request, or was not reached): nothing to release.
    pub(super) fn claimed(mut self) {
        self.armed = false;
    }
}

impl Drop for Unclaimed {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let (proxy, prefill) = (self.proxy.clone(), self.prefill.clone());
        let room = std::mem::take(&mut self.room);
        let ask = json!({"model": self.model, "prompt": [1], "max_tokens": 1,
                         "kv_transfer_params": {"kvferry_abort": room}});
        let asking = self.asking.clone();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            return; // the proxy is shutting down
        };
        handle.spawn(async move {
            proxy.metrics.released();
            let said = match proxy.post(&prefill, "/v1/completions", &ask, &asking).await {
                Posted::Answered(a) => a
                    .pointer("/kv_transfer_params/kvferry_aborted")
                    .map_or("not known to the connector".to_owned(), Value::to_string),
                Posted::Refused(_) => "refused".to_owned(),
                Posted::Unreached(e) | Posted::Lost(e) => e,
            };
            tracing::info!(server = %prefill.url, room, aborted = %said, "a room no decode answered for: the prefill server was asked to release it");
        });
    }
}
