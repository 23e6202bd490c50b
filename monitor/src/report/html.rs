//! Escaping and the page shell every page shares. Ids come from clients (`x-request-id`) and
//! span attributes come from whoever exports spans: everything a page shows from an event or a
//! violation goes through [`Esc`], in text and in attributes alike.

use std::fmt::{self, Write as _};

/// Text safe inside an element or a quoted attribute (HTML and SVG): `& < > " '` escaped, and
/// control characters other than tab and newline dropped (they are invalid in XML, and SVG
/// inline in HTML is parsed leniently anyway, but a page must not depend on that).
pub struct Esc<'a>(pub &'a str);

impl fmt::Display for Esc<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        while let Some(i) = rest.find(|c: char| {
            matches!(c, '&' | '<' | '>' | '"' | '\'') || (c.is_control() && c != '\t' && c != '\n')
        }) {
            f.write_str(&rest[..i])?;
            let c = rest[i..].chars().next().expect("found above");
            match c {
                '&' => f.write_str("&amp;")?,
                '<' => f.write_str("&lt;")?,
                '>' => f.write_str("&gt;")?,
                '"' => f.write_str("&quot;")?,
                '\'' => f.write_str("&#39;")?,
                _ => {}
            }
            rest = &rest[i + c.len_utf8()..];
        }
        f.write_str(rest)
    }
}

/// `s` as one URL path segment or query value: unreserved bytes kept, every other byte
/// percent-encoded (so `/`, `?`, `#` and quotes in an id cannot change where a link goes).
pub fn url_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The page's own policy, also in the document (a report opened from disk has no headers): no
/// script runs, whatever an id smuggled in; styles are inline, images only inline SVG.
pub const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'self'";

const STYLE: &str = "
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1a202c;max-width:1200px}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #cbd5e0;padding:2px 8px;text-align:left;vertical-align:top}
th{background:#edf2f7}code,.id{font-family:ui-monospace,monospace;word-break:break-all}
.sev-critical{background:#c53030;color:#fff}.sev-warning{background:#d69e2e;color:#000}.sev-info{background:#3182ce;color:#fff}
.sev{padding:0 6px;border-radius:3px;font-weight:600}
.notice{background:#fefcbf;border:1px solid #d69e2e;padding:4px 8px}
.legend span{display:inline-block;margin-right:1em}
.sw{display:inline-block;width:10px;height:10px;border-radius:5px;margin-right:4px;vertical-align:middle}
svg text{font:11px system-ui,sans-serif}
nav a{margin-right:1em}
";

/// A whole document: `title` (escaped here) and `body` (already escaped HTML).
pub fn page(title: &str, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 2048);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta http-equiv=\"Content-Security-Policy\" content=\"{}\">\
         <meta name=\"referrer\" content=\"no-referrer\">\
         <title>{}</title><style>{STYLE}</style></head><body>\n{body}\n</body></html>\n",
        Esc(CSP),
        Esc(title),
    );
    out
}

/// Event-time nanoseconds relative to `t0` as milliseconds, `+12.345 ms`.
pub fn rel_ms(t: u64, t0: u64) -> String {
    let d = t as i128 - t0 as i128;
    format!("{:+.3} ms", d as f64 / 1e6)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_markup_quotes_and_controls() {
        assert_eq!(
            Esc("<img src=x onerror='a()'>&\"\u{0}\u{7}ok\n").to_string(),
            "&lt;img src=x onerror=&#39;a()&#39;&gt;&amp;&quot;ok\n"
        );
        assert_eq!(Esc("plain é").to_string(), "plain é");
        assert_eq!(url_segment("a/b?c#d e\"<"), "a%2Fb%3Fc%23d%20e%22%3C");
    }
}
