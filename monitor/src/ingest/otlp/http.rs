//! OTLP/HTTP: `POST /v1/traces` and `/v1/logs`, `application/x-protobuf` or `application/json`,
//! optionally gzip-compressed.
//!
//! Status codes follow the OTLP/HTTP spec: 200 accepted; 400 malformed or over the item cap;
//! 413 too large (as sent or after decompression); 415 unknown content type or encoding; 503
//! with `Retry-After` when the pipeline is full (the SDKs retry 429/502/503/504). Every error
//! body is a `google.rpc.Status` encoded like the request (protobuf, or JSON for JSON requests;
//! protobuf when the content type itself was refused), so exporters log its message.

use std::io::Read;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use prost::Message;

use super::{AcceptError, Ingest, RETRY_AFTER, RejectReason, RpcStatus, Transport, json};
use crate::access::{Access, Incoming, Server};
use opentelemetry_proto::tonic::collector::logs::v1::{
    ExportLogsServiceRequest, ExportLogsServiceResponse,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};

#[derive(Clone)]
struct AppState {
    ingest: Arc<Ingest>,
    access: Access,
    max_message_bytes: usize,
    max_decompressed_bytes: usize,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Protobuf,
    Json,
}

/// A refusal: status code, counted reason, short message for the client and the log.
struct Refusal {
    status: StatusCode,
    reason: RejectReason,
    msg: String,
}

impl Refusal {
    fn new(status: StatusCode, reason: RejectReason, msg: impl Into<String>) -> Self {
        Refusal {
            status,
            reason,
            msg: msg.into(),
        }
    }
}

pub fn router(
    ingest: Arc<Ingest>,
    max_message_bytes: usize,
    max_decompressed_bytes: usize,
    access: Access,
) -> Router {
    let state = AppState {
        ingest,
        access,
        max_message_bytes,
        max_decompressed_bytes,
    };
    Router::new()
        .route("/v1/traces", post(traces))
        .route("/v1/logs", post(logs))
        // Bodies are read through `read_body` with our own limit, so the 413 is counted.
        .layer(DefaultBodyLimit::disable())
        .with_state(state)
}

pub async fn serve(
    incoming: Incoming,
    ingest: Arc<Ingest>,
    max_message_bytes: usize,
    max_decompressed_bytes: usize,
    access: Access,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = router(ingest, max_message_bytes, max_decompressed_bytes, access);
    match incoming {
        Incoming::Plain(l) => axum::serve(l, app).with_graceful_shutdown(shutdown).await,
        Incoming::Tls(l) => axum::serve(l, app).with_graceful_shutdown(shutdown).await,
    }
}

async fn read_body(
    st: &AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<(Encoding, Vec<u8>), (Encoding, Refusal)> {
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let mime = ctype
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    // The token first: a client without it learns nothing else, and its body is never read.
    if let Some(token) = &st.access.token
        && !token.admits(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()))
    {
        st.access.stats.unauthenticated(Server::OtlpHttp);
        let enc = match mime.as_str() {
            "application/json" => Encoding::Json,
            _ => Encoding::Protobuf,
        };
        return Err((
            enc,
            Refusal::new(
                StatusCode::UNAUTHORIZED,
                RejectReason::Unauthenticated,
                "missing or wrong bearer token (authorization header)",
            ),
        ));
    }
    let enc = match mime.as_str() {
        "application/x-protobuf" | "application/protobuf" => Encoding::Protobuf,
        "application/json" => Encoding::Json,
        _ => {
            return Err((
                Encoding::Protobuf,
                Refusal::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    RejectReason::UnsupportedMediaType,
                    "content-type must be application/x-protobuf or application/json",
                ),
            ));
        }
    };
    let raw: Bytes = axum::body::to_bytes(body, st.max_message_bytes)
        .await
        .map_err(|_| {
            Refusal::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                RejectReason::TooLarge,
                format!("body over {} bytes (or unreadable)", st.max_message_bytes),
            )
        })
        .map_err(|r| (enc, r))?;
    let cenc = headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("identity")
        .trim()
        .to_ascii_lowercase();
    let bytes = match cenc.as_str() {
        "" | "identity" => raw.to_vec(),
        "gzip" | "x-gzip" => gunzip(&raw, st.max_decompressed_bytes).map_err(|r| (enc, r))?,
        other => {
            return Err((
                enc,
                Refusal::new(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    RejectReason::UnsupportedMediaType,
                    format!(
                        "content-encoding {:?} not supported (gzip or identity)",
                        crate::event::truncate_reason(other)
                    ),
                ),
            ));
        }
    };
    Ok((enc, bytes))
}

/// Decompresses at most `limit` bytes: a small gzip bomb cannot make us allocate more.
fn gunzip(raw: &[u8], limit: usize) -> Result<Vec<u8>, Refusal> {
    let mut out = Vec::with_capacity(raw.len().saturating_mul(4).min(limit));
    let mut dec = flate2::read::MultiGzDecoder::new(raw).take(limit as u64 + 1);
    dec.read_to_end(&mut out).map_err(|e| {
        Refusal::new(
            StatusCode::BAD_REQUEST,
            RejectReason::BadEncoding,
            format!("gzip: {e}"),
        )
    })?;
    if out.len() > limit {
        return Err(Refusal::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            RejectReason::TooLarge,
            format!("decompressed body over {limit} bytes"),
        ));
    }
    Ok(out)
}

/// The `google.rpc.Code` carried in the Status body for an HTTP refusal.
fn rpc_code(status: StatusCode) -> i32 {
    match status {
        StatusCode::PAYLOAD_TOO_LARGE => 8,    // RESOURCE_EXHAUSTED
        StatusCode::SERVICE_UNAVAILABLE => 14, // UNAVAILABLE
        StatusCode::UNAUTHORIZED => 16,        // UNAUTHENTICATED
        _ => 3,                                // INVALID_ARGUMENT
    }
}

/// An error response whose body is a `google.rpc.Status` in the request's encoding.
fn status_response(status: StatusCode, enc: Encoding, msg: &str) -> Response {
    let st = RpcStatus {
        code: rpc_code(status),
        message: msg.to_string(),
    };
    match enc {
        Encoding::Protobuf => (
            status,
            [(header::CONTENT_TYPE, "application/x-protobuf")],
            st.encode_to_vec(),
        )
            .into_response(),
        Encoding::Json => (
            status,
            [(header::CONTENT_TYPE, "application/json")],
            serde_json::json!({"code": st.code, "message": st.message}).to_string(),
        )
            .into_response(),
    }
}

/// Refuses an export whose items could not be counted (unreadable, undecodable, too large):
/// it counts as one rejected item, so `revenant_otlp_rejected_items_total` moves for every
/// refused export, not only for those that decoded.
fn refuse(st: &AppState, enc: Encoding, r: Refusal) -> Response {
    st.ingest.stats.rejected(Transport::Http, r.reason, 1);
    st.ingest
        .log_refusal(Transport::Http, r.reason, r.status.as_u16(), &r.msg);
    let mut resp = status_response(r.status, enc, &r.msg);
    if r.status == StatusCode::UNAUTHORIZED {
        resp.headers_mut()
            .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    }
    resp
}

fn accept_error(st: &AppState, enc: Encoding, e: AcceptError) -> Response {
    let msg = e.to_string();
    match e {
        AcceptError::Full | AcceptError::Closed => {
            let reason = if e == AcceptError::Full {
                RejectReason::PipelineFull
            } else {
                RejectReason::PipelineClosed
            };
            st.ingest.log_refusal(Transport::Http, reason, 503, &msg);
            let mut resp = status_response(StatusCode::SERVICE_UNAVAILABLE, enc, &msg);
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(RETRY_AFTER.as_secs()),
            );
            resp
        }
        AcceptError::TooManyItems { .. } => {
            st.ingest
                .log_refusal(Transport::Http, RejectReason::TooManyItems, 400, &msg);
            status_response(StatusCode::BAD_REQUEST, enc, &msg)
        }
    }
}

fn ok(enc: Encoding, protobuf_body: Vec<u8>) -> Response {
    match enc {
        Encoding::Protobuf => (
            [(header::CONTENT_TYPE, "application/x-protobuf")],
            protobuf_body,
        )
            .into_response(),
        Encoding::Json => ([(header::CONTENT_TYPE, "application/json")], "{}").into_response(),
    }
}

async fn traces(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (enc, bytes) = match read_body(&st, &headers, body).await {
        Ok(v) => v,
        Err((enc, r)) => return refuse(&st, enc, r),
    };
    let req = match enc {
        Encoding::Protobuf => {
            ExportTraceServiceRequest::decode(bytes.as_slice()).map_err(|e| e.to_string())
        }
        Encoding::Json => json::decode_traces(&bytes).map_err(|e| e.to_string()),
    };
    let req = match req {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                &st,
                enc,
                Refusal::new(StatusCode::BAD_REQUEST, RejectReason::Malformed, e),
            );
        }
    };
    match st.ingest.accept_traces(&req, Transport::Http) {
        Ok(_) => ok(
            enc,
            ExportTraceServiceResponse {
                partial_success: None,
            }
            .encode_to_vec(),
        ),
        Err(e) => accept_error(&st, enc, e),
    }
}

async fn logs(State(st): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let (enc, bytes) = match read_body(&st, &headers, body).await {
        Ok(v) => v,
        Err((enc, r)) => return refuse(&st, enc, r),
    };
    let req = match enc {
        Encoding::Protobuf => {
            ExportLogsServiceRequest::decode(bytes.as_slice()).map_err(|e| e.to_string())
        }
        Encoding::Json => json::decode_logs(&bytes).map_err(|e| e.to_string()),
    };
    let mut req = match req {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                &st,
                enc,
                Refusal::new(StatusCode::BAD_REQUEST, RejectReason::Malformed, e),
            );
        }
    };
    // Log bodies may hold prompt text: drop them before anything else sees the request.
    for rl in &mut req.resource_logs {
        for sl in &mut rl.scope_logs {
            for rec in &mut sl.log_records {
                rec.body = None;
            }
        }
    }
    match st.ingest.accept_logs(&req, Transport::Http) {
        Ok(_) => ok(
            enc,
            ExportLogsServiceResponse {
                partial_success: None,
            }
            .encode_to_vec(),
        ),
        Err(e) => accept_error(&st, enc, e),
    }
}
