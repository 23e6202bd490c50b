use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use serde_json::Value;

/// Minimal blocking HTTP/1.1 GET on loopback (`Connection: close`): status and body, a chunked
/// body decoded.
pub fn http_get(url: &str) -> Result<(u16, String)> {
    request("GET", url, None)
}

/// [`http_get`]'s POST: `body` sent with its content type.
pub fn http_post(url: &str, content_type: &str, body: &[u8]) -> Result<(u16, String)> {
    request("POST", url, Some((content_type, body)))
}

/// A whole HTTP/1.1 exchange: status, headers (names lowercased) and body (a chunked body
/// decoded).
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl HttpResponse {
    /// The first header of that (lowercase) name.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// POST a JSON body and read the whole answer (an SSE stream until the server closes it), each
/// read waiting at most `read_timeout`.
pub fn http_post_json(url: &str, body: &[u8], read_timeout: Duration) -> Result<HttpResponse> {
    exchange("POST", url, Some(("application/json", body)), read_timeout)
}

fn request(method: &str, url: &str, body: Option<(&str, &[u8])>) -> Result<(u16, String)> {
    let r = exchange(method, url, body, Duration::from_secs(10))?;
    Ok((r.status, r.body))
}

fn exchange(
    method: &str,
    url: &str,
    body: Option<(&str, &[u8])>,
    read_timeout: Duration,
) -> Result<HttpResponse> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("not an http URL: {url}"))?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let mut s = TcpStream::connect(host).with_context(|| format!("{method} {url}"))?;
    s.set_read_timeout(Some(read_timeout))?;
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n"
    )?;
    match body {
        Some((content_type, b)) => {
            write!(
                s,
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n\r\n",
                b.len()
            )?;
            s.write_all(b)?;
        }
        None => write!(s, "\r\n")?,
    }
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let end = buf
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| anyhow!("{method} {url}: no header end"))?;
    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("{method} {url}: bad status line"))?;
    let headers = String::from_utf8_lossy(&buf[..end])
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let mut body = buf[end + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        body = dechunk(&body);
    }
    Ok(HttpResponse {
        status,
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    })
}

fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    while let Some(i) = b.windows(2).position(|w| w == b"\r\n") {
        let n = usize::from_str_radix(String::from_utf8_lossy(&b[..i]).trim(), 16).unwrap_or(0);
        if n == 0 || b.len() < i + 2 + n {
            break;
        }
        out.extend_from_slice(&b[i + 2..i + 2 + n]);
        b = &b[(i + 4 + n).min(b.len())..];
    }
    out
}

/// GET a JSON document that must come with 200.
pub fn http_json(url: &str) -> Result<Value> {
    let (status, body) = http_get(url)?;
    if status != 200 {
        bail!(
            "GET {url}: {status}: {}",
            body.chars().take(200).collect::<String>()
        );
    }
    serde_json::from_str(&body).with_context(|| format!("GET {url}: not JSON"))
}

/// Polls `{base}/health` until it answers 200, at most `timeout`.
pub fn wait_healthy(base: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok((200, _)) = http_get(&format!("{base}/health")) {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{base}/health not 200 within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// An ephemeral loopback port, free when asked (another process may take it before we bind it:
/// only for addresses that must be known before the listener exists).
pub fn free_port() -> Result<u16> {
    // The tests of one binary run in parallel threads: the kernel may hand the same ephemeral
    // port to two of them in turn once the first probe socket is closed. A port is given out
    // once per process. (Another process can still take it: callers that start a server on it
    // retry with a new port when the bind fails.)
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|p| p.into_inner());
    for _ in 0..64 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .context("bind an ephemeral loopback port")?
            .local_addr()?
            .port();
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    anyhow::bail!("no loopback port not given out before in 64 tries")
}

#[cfg(test)]
mod tests {
    #[test]
    fn dechunks_chunked_bodies() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            b"abcde"
        );
    }
}
