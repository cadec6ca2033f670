//! Reads (`--serve-reads`): a decode names the pages of this prefill's pool itself
//! ([`TransferRequest::src_pages`]), for rooms no engine announced, as a byte arena such as
//! LMCache's transfer channel needs. A prefill that serves reads serves nothing else.

use std::sync::Arc;

use super::Prefill;
use super::rooms::ReadyRequest;
use crate::agent::engine_api::RoomError;
use crate::protocol::TransferRequest;
use crate::reason::{FailureCode, Reason};

impl Prefill {
    /// A read ([`TransferRequest::src_pages`]): the decode names the pages of this pool that
    /// are `room`, a room no engine announced. A prefill that serves reads (`--serve-reads`)
    /// serves nothing else (its engine announces no rooms, [`Prefill::ready`]), so a read never
    /// meets an engine's room; it announces the pages as the whole room with an engine's checks
    /// (in range, enough for the tokens, none twice) and serves the request like any other. The
    /// pages are counted in this pool's page size, so the decode's must be the same.
    pub(super) async fn open_read(
        self: &Arc<Self>,
        room: u64,
        req: &TransferRequest,
        decode_page_size: usize,
    ) -> Result<(), Reason> {
        let Some(pages) = req.src_pages.clone() else {
            if !self.cfg.serve_reads {
                return Ok(());
            }
            self.metrics.protocol_error("inconsistent");
            return Err(Reason::new(
                FailureCode::BadMessage,
                format!(
                    "room {room}: this prefill serves only reads (--serve-reads), and the request names none of its pages"
                ),
            ));
        };
        if !self.cfg.serve_reads {
            self.metrics.protocol_error("unauthorized");
            return Err(Reason::new(
                FailureCode::Unauthorized,
                format!(
                    "room {room}: the request names this prefill's pages (a read), but it serves no reads (--serve-reads)"
                ),
            ));
        }
        let page_size = self.cfg.layout.page_size;
        if decode_page_size != page_size {
            return Err(Reason::new(
                FailureCode::IncompatibleLayout,
                format!(
                    "room {room}: a read names pages of {page_size} tokens here, but the decode's pages are {decode_page_size} tokens"
                ),
            ));
        }
        if self.rooms().contains_key(&room) {
            self.metrics.protocol_error("inconsistent");
            return Err(Reason::new(
                FailureCode::BadMessage,
                format!("room {room} exists here: a read names a room of its own"),
            ));
        }
        let ready = ReadyRequest {
            tokens: req.tokens.end as usize,
            pages: Some(pages),
            ..ReadyRequest::default()
        };
        match self.ready_piece(room, ready, None).await {
            Ok(_) => Ok(()),
            Err(e) => {
                self.metrics.protocol_error("inconsistent");
                let code = match e {
                    RoomError::Unavailable(_) => FailureCode::Shutdown,
                    _ => FailureCode::BadMessage,
                };
                Err(Reason::new(code, format!("room {room}: the read: {e}")))
            }
        }
    }

    /// A prefill that serves reads serves nothing else: its engine announces no rooms.
    pub(super) fn refuse_reads_only(&self) -> Result<(), RoomError> {
        match self.cfg.serve_reads {
            true => Err(RoomError::BadRequest(
                "this prefill serves reads (--serve-reads): its rooms are the pages decodes name, an engine announces none".into(),
            )),
            false => Ok(()),
        }
    }
}
