//! The HTTP client every role uses and SGLang's error envelope.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn http_client(max_idle_per_host: usize) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(max_idle_per_host)
        .pool_idle_timeout(std::time::Duration::from_secs(30))
        .build(conn)
}

/// Why a [`get`] failed.
#[derive(Debug, thiserror::Error)]
pub enum GetError {
    /// No answer within the bound.
    #[error("timeout")]
    Timeout,
    #[error("{0}")]
    Failed(String),
}

/// `GET url` (empty body): the status and the whole body; at most `timeout` for the answer to
/// start.
pub async fn get(
    client: &HttpClient,
    url: &str,
    timeout: std::time::Duration,
) -> Result<(StatusCode, Bytes), GetError> {
    let failed = |e: &dyn std::fmt::Display| GetError::Failed(e.to_string());
    let req = hyper::Request::get(url)
        .body(Full::new(Bytes::new()))
        .map_err(|e| failed(&e))?;
    let resp = tokio::time::timeout(timeout, client.request(req))
        .await
        .map_err(|_| GetError::Timeout)?
        .map_err(|e| failed(&e))?;
    let status = resp.status();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| failed(&e))?
        .to_bytes();
    Ok((status, body))
}

/// SGLang's error body, e.g. `{"object":"error","message":"...","type":"BadRequestError",
/// "param":null,"code":400}`, used by both `/generate` and the OpenAI routes.
pub fn error_response(status: StatusCode, message: &str) -> Response {
    let kind = match status {
        StatusCode::BAD_REQUEST => "BadRequestError",
        StatusCode::SERVICE_UNAVAILABLE => "ServiceUnavailableError",
        StatusCode::NOT_FOUND => "NotFoundError",
        _ => "InternalServerError",
    };
    let body = serde_json::json!({
        "object": "error",
        "message": message,
        "type": kind,
        "param": null,
        "code": status.as_u16(),
    });
    json_response(status, body.to_string())
}

pub fn json_response(status: StatusCode, body: String) -> Response {
    let mut r = (status, body).into_response();
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    r
}
