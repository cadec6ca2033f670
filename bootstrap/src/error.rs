//! The server's one error type, [`ApiError`], and its one `IntoResponse` impl: every failure
//! of every route (including axum's own rejections, mapped by the extractors in `server`)
//! becomes a status code and a JSON body `{"error": "..."}`.
//!
//! Each 4xx response carries a [`Rejection`] (reason and message) as a response extension,
//! which the server's middleware counts and logs. The two 503s are not rejections: an
//! incomplete group (counted as a lookup) and a store that cannot reach its backend (etcd
//! down). No other 5xx is produced.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::registry::RegistryError;
use crate::store::StoreError;
use crate::types::ErrorBody;

/// The closed set of reasons a request is rejected, the `reason` label of
/// `kvferry_bootstrap_rejected_requests_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// Malformed JSON, wrong types, missing fields, impossible ranks, bad path parameters.
    BadRequest,
    /// Missing or wrong bearer token (every route but `/healthz` when a token is set).
    Unauthorized,
    /// Unknown route or unknown instance.
    NotFound,
    /// Known route, wrong method.
    MethodNotAllowed,
    /// Registration disagrees with its group or with its own earlier registration, or its
    /// slot is held by another live instance.
    Conflict,
    /// Body larger than the limit.
    TooLarge,
    /// Body sent without `Content-Type: application/json`.
    UnsupportedMediaType,
}

impl RejectReason {
    /// Every reason, in label order.
    pub const ALL: [RejectReason; 7] = [
        RejectReason::BadRequest,
        RejectReason::Unauthorized,
        RejectReason::NotFound,
        RejectReason::MethodNotAllowed,
        RejectReason::Conflict,
        RejectReason::TooLarge,
        RejectReason::UnsupportedMediaType,
    ];

    /// The metrics label value.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::BadRequest => "bad_request",
            RejectReason::Unauthorized => "unauthorized",
            RejectReason::NotFound => "not_found",
            RejectReason::MethodNotAllowed => "method_not_allowed",
            RejectReason::Conflict => "conflict",
            RejectReason::TooLarge => "too_large",
            RejectReason::UnsupportedMediaType => "unsupported_media_type",
        }
    }

    fn status(self) -> StatusCode {
        match self {
            RejectReason::BadRequest => StatusCode::BAD_REQUEST,
            RejectReason::Unauthorized => StatusCode::UNAUTHORIZED,
            RejectReason::NotFound => StatusCode::NOT_FOUND,
            RejectReason::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            RejectReason::Conflict => StatusCode::CONFLICT,
            RejectReason::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            RejectReason::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
        }
    }
}

/// The response extension of a 4xx: what the middleware counts and logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// The metrics label.
    pub reason: RejectReason,
    /// The message sent to the client.
    pub message: String,
}

/// Everything a route can answer other than success.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The client sent something wrong; the message says what.
    #[error("{message}")]
    Rejected {
        /// Status code and metrics label.
        reason: RejectReason,
        /// For the client, naming what was wrong.
        message: String,
    },
    /// The prefill group is not complete yet (503, retryable).
    #[error("{0}")]
    Incomplete(String),
    /// The store cannot serve the request now (etcd unreachable; 503, retryable elsewhere).
    #[error("{0}")]
    Unavailable(String),
    /// The registration's slot is held by another live instance (409 naming the holder).
    #[error("{message}")]
    SlotHeld {
        /// For the client, naming the slot, the holder and its lease.
        message: String,
        /// The holder's instance id.
        holder: uuid::Uuid,
        /// What is left of the holder's lease, in ms.
        remaining_ms: u64,
        /// The registry's lease length, in ms.
        lease_ttl_ms: u64,
    },
}

impl ApiError {
    /// A rejection for `reason` with `message`.
    pub fn rejected(reason: RejectReason, message: impl Into<String>) -> Self {
        ApiError::Rejected {
            reason,
            message: message.into(),
        }
    }

    /// 400 with `message`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::rejected(RejectReason::BadRequest, message)
    }

    /// The error for `e`, a store failure; `lease_ttl` is the registry's lease length (named
    /// in a [`ApiError::SlotHeld`]).
    pub fn from_store(e: StoreError, lease_ttl: std::time::Duration) -> Self {
        match e {
            StoreError::Registry(
                e @ RegistryError::SlotHeld {
                    holder,
                    remaining_ms,
                    ..
                },
            ) => ApiError::SlotHeld {
                message: e.to_string(),
                holder,
                remaining_ms,
                lease_ttl_ms: crate::registry::millis(lease_ttl),
            },
            e => e.into(),
        }
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Registry(e) => e.into(),
            e @ StoreError::Unavailable { .. } => ApiError::Unavailable(e.to_string()),
        }
    }
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        let message = e.to_string();
        match e {
            RegistryError::Invalid(_) => Self::rejected(RejectReason::BadRequest, message),
            RegistryError::Conflict(_) | RegistryError::SlotHeld { .. } => {
                Self::rejected(RejectReason::Conflict, message)
            }
            RegistryError::UnknownInstance(_) => Self::rejected(RejectReason::NotFound, message),
            RegistryError::Incomplete { .. } => ApiError::Incomplete(message),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = ErrorBody::new(String::new());
        let (status, reason) = match self {
            ApiError::Rejected { reason, message } => {
                body.error = message;
                (reason.status(), Some(reason))
            }
            ApiError::Incomplete(message) | ApiError::Unavailable(message) => {
                body.error = message;
                (StatusCode::SERVICE_UNAVAILABLE, None)
            }
            ApiError::SlotHeld {
                message,
                holder,
                remaining_ms,
                lease_ttl_ms,
            } => {
                body.error = message;
                body.holder = Some(holder);
                body.holder_lease_remaining_ms = Some(remaining_ms);
                body.lease_ttl_ms = Some(lease_ttl_ms);
                (StatusCode::CONFLICT, Some(RejectReason::Conflict))
            }
        };
        let rejection = reason.map(|reason| Rejection {
            reason,
            message: body.error.clone(),
        });
        let mut response = (status, Json(body)).into_response();
        if let Some(rejection) = rejection {
            response.extensions_mut().insert(rejection);
        } else {
            // Ranks register within seconds of each other: a lookup is worth retrying soon.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}
