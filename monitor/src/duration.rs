//! Durations in config files as humantime strings ("50ms", "5s", "5m30s"), the one serde helper
//! every section uses (`#[serde(with = "crate::duration")]`), so that every bad duration
//! is reported the same way, with the file's line and column from the YAML parser.

use std::time::Duration;

use serde::{Deserialize, Deserializer, Serializer};

/// Parses a humantime duration; the error names the value and shows the accepted spelling.
pub fn parse(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("invalid duration {s:?}: {e} (write e.g. 50ms, 5s, 5m30s)"))
}

/// Formats a duration the way [`parse`] reads it back.
pub fn format(d: Duration) -> String {
    humantime::format_duration(d).to_string()
}

pub fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&format(*d))
}

pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    let s = String::deserialize(d)?;
    parse(&s).map_err(serde::de::Error::custom)
}

/// The same for `Option<Duration>` fields (`null` or absent: `None`).
pub mod option {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&super::format(*d)),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
        Option::<String>::deserialize(d)?
            .map(|s| super::parse(&s).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, serde::Serialize, serde::Deserialize, PartialEq)]
    struct T {
        #[serde(with = "super")]
        d: Duration,
        #[serde(default, with = "super::option")]
        o: Option<Duration>,
    }

    #[test]
    fn round_trips_and_names_bad_values() {
        let t: T = serde_saphyr::from_str("d: 5m30s\no: 50ms\n").unwrap();
        assert_eq!(t.d, Duration::from_secs(330));
        assert_eq!(t.o, Some(Duration::from_millis(50)));
        let back: T = serde_saphyr::from_str(&serde_saphyr::to_string(&t).unwrap()).unwrap();
        assert_eq!(back, t);
        let t: T = serde_saphyr::from_str("d: 1s\n").unwrap();
        assert_eq!(t.o, None);
        let e = serde_saphyr::from_str::<T>("d: soon\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("invalid duration \"soon\""), "{e}");
    }
}
