//! Listen addresses as every flag and config key of `revenant run` takes them: `IP:PORT`, one
//! message for every refusal (flags and files alike). Host names are not resolved: a listener
//! binds one address, and `localhost` may name two.

use std::net::SocketAddr;

use serde::{Deserialize, Deserializer};

/// Parses `IP:PORT`; the error names the value and shows the accepted spelling.
pub fn parse(s: &str) -> Result<SocketAddr, String> {
    s.parse().map_err(|_| {
        format!(
            "{s:?} is not a listen address: give IP:PORT, e.g. 127.0.0.1:9464 (host names are \
             not resolved)"
        )
    })
}

/// `Option<SocketAddr>` config keys: `null` disables, a string is [`parse`]d.
pub fn deserialize_option<'de, D: Deserializer<'de>>(d: D) -> Result<Option<SocketAddr>, D::Error> {
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => parse(&s).map(Some).map_err(serde::de::Error::custom),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_message_for_every_refusal() {
        assert_eq!(super::parse("127.0.0.1:1").unwrap().port(), 1);
        assert_eq!(super::parse("[::1]:2").unwrap().port(), 2);
        let e = super::parse("localhost:4317").unwrap_err();
        assert!(
            e.starts_with("\"localhost:4317\" is not a listen address: give IP:PORT"),
            "{e}"
        );
    }
}
