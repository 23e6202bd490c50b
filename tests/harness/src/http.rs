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

/// How long a GET may go unanswered, in all its tries: a loaded machine (every stage of
/// `cargo xtask test` side by side) can hold a scrape for seconds; a dead server answers at once
/// (connection refused), which is not retried.
const GET_PATIENCE: Duration = Duration::from_secs(40);

fn request(method: &str, url: &str, body: Option<(&str, &[u8])>) -> Result<(u16, String)> {
    let started = Instant::now();
    loop {
        match exchange(method, url, body, Duration::from_secs(10)) {
            Ok(r) => return Ok((r.status, r.body)),
            // A GET that timed out is asked again (it changes nothing), within its patience.
            Err(e) if method == "GET" && timed_out(&e) && started.elapsed() < GET_PATIENCE => {
                continue;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether `e` is a read or connect that timed out (`EAGAIN` from a socket read timeout).
fn timed_out(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            )
        })
    })
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

/// The environment variable that gives a process its range of test ports, `LO-HI`: `cargo xtask
/// test` gives each of the stages it runs side by side a range of its own.
pub const PORTS_ENV: &str = "REVENANT_TEST_PORTS";

/// The range ports come from without [`PORTS_ENV`]: above every range `cargo xtask test` hands
/// out, below the kernel's ephemeral range (32768-60999), so a server that binds port 0, or an
/// outgoing connection, never takes one of them.
pub const DEFAULT_PORTS: (u16, u16) = (24000, 32767);

/// A loopback port for an address that must be known before its listener exists (a server
/// started with `--port N`). Ports come from this process's range ([`PORTS_ENV`], else
/// [`DEFAULT_PORTS`]), which lies below the kernel's ephemeral range: nothing that binds port 0
/// can take one between this call and the server's bind, and stages that run side by side have
/// ranges of their own. Each port is given out once per process, starting at an offset drawn from
/// the process id (test executables of one stage run one after another), and only when it can be
/// bound now (a server of an earlier executable that still holds it is skipped).
pub fn free_port() -> Result<u16> {
    let (lo, hi) = port_range()?;
    free_port_in(lo, hi)
}

fn port_range() -> Result<(u16, u16)> {
    match std::env::var(PORTS_ENV) {
        Err(_) => Ok(DEFAULT_PORTS),
        Ok(v) => parse_range(&v).ok_or_else(|| anyhow!("{PORTS_ENV}={v:?}: expected LO-HI")),
    }
}

fn parse_range(v: &str) -> Option<(u16, u16)> {
    let (lo, hi) = v.split_once('-')?;
    let (lo, hi): (u16, u16) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (lo > 0 && lo <= hi).then_some((lo, hi))
}

fn free_port_in(lo: u16, hi: u16) -> Result<u16> {
    static NEXT: std::sync::Mutex<Option<u32>> = std::sync::Mutex::new(None);
    let size = u32::from(hi - lo) + 1;
    let mut next = NEXT.lock().unwrap_or_else(|p| p.into_inner());
    let at = next.get_or_insert_with(|| std::process::id().wrapping_mul(97) % size);
    for _ in 0..size {
        let port = lo + (*at % size) as u16;
        *at = (*at + 1) % size;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free loopback port in {lo}-{hi}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn ports_come_from_the_range_once_each() {
        assert_eq!(super::parse_range("10000-11999"), Some((10000, 11999)));
        assert_eq!(super::parse_range("12000-11999"), None);
        assert_eq!(super::parse_range("x"), None);
        let (lo, hi) = (28100, 28163);
        let mut seen = std::collections::BTreeSet::new();
        let held = std::net::TcpListener::bind(("127.0.0.1", 28130));
        for _ in 0..32 {
            let p = super::free_port_in(lo, hi).unwrap();
            assert!((lo..=hi).contains(&p), "{p}");
            assert!(seen.insert(p), "{p} given out twice");
            if held.is_ok() {
                assert_ne!(p, 28130, "a port held by a listener is skipped");
            }
        }
    }

    #[test]
    fn dechunks_chunked_bodies() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            b"abcde"
        );
    }
}
