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

/// `serde_json` output in the layout of Python's `json.dumps` defaults (`", "` and `": "`
/// separators, non-ASCII escaped): what `requests.put(json=…)`, aiohttp's `json_response` and
/// SGLang's `create_streaming_error_response` put on the wire. Key order is the value's own
/// (structs keep their field order; `serde_json::Value` maps are sorted).
pub fn py_json<T: serde::Serialize + ?Sized>(v: &T) -> String {
    struct Py;
    impl serde_json::ser::Formatter for Py {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first { Ok(()) } else { w.write_all(b", ") }
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(b": ")
        }
        fn write_string_fragment<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            fragment: &str,
        ) -> std::io::Result<()> {
            // ensure_ascii=True: anything past ASCII as \uXXXX (UTF-16 units).
            for c in fragment.chars() {
                if c.is_ascii() {
                    w.write_all(&[c as u8])?;
                } else {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        write!(w, "\\u{u:04x}")?;
                    }
                }
            }
            Ok(())
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Py);
    if v.serialize(&mut ser).is_err() {
        return "null".into();
    }
    String::from_utf8(out).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    #[test]
    fn py_json_is_pythons_json_dumps() {
        #[derive(serde::Serialize)]
        struct E<'a> {
            object: &'a str,
            message: &'a str,
            param: Option<u8>,
            code: u16,
            list: [u8; 2],
        }
        let s = super::py_json(&E {
            object: "error",
            message: "caf\u{e9} \"x\"",
            param: None,
            code: 400,
            list: [1, 2],
        });
        assert_eq!(
            s,
            r#"{"object": "error", "message": "caf\u00e9 \"x\"", "param": null, "code": 400, "list": [1, 2]}"#
        );
    }
}
