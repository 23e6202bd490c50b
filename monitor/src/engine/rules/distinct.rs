//! `distinct`: an alias class must take one value on one key.
//!
//! E.g. a bootstrap room belongs to one client request: two request ids on one room are two
//! requests whose KV share a room (SGLang #40125: a duplicate client-supplied room). The
//! correlator judges it as it resolves an event's ids (the values are ids, not events kept in
//! slots) and the checker reports it once per room. The requests stay joined through the room:
//! whose KV a collided room moves cannot be told, so its activity counts for each of them, and
//! which request arrived first changes no verdict.

use serde::{Deserialize, Serialize};

/// The alias class that must take a single value.
///
/// Only the request id: it is the one alias that names a client request on every leg (routers
/// send both legs and every retry under one `x-request-id`). Trace ids are not: workers that do
/// not continue the router's trace start one of their own per stage, so one room legitimately
/// shows several.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistinctAlias {
    RequestId,
}

/// The key whose events must agree on the alias.
///
/// Only the bootstrap room: the attempt key that a router mints once per attempt. (vLLM pairs
/// name an attempt by the router's X-Request-Id, which is the request id itself.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistinctKey {
    BootstrapRoom,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Distinct {
    pub alias: DistinctAlias,
    pub per: DistinctKey,
}

impl DistinctAlias {
    pub fn as_str(self) -> &'static str {
        match self {
            DistinctAlias::RequestId => "request_id",
        }
    }
}

/// What a `distinct` rule found: the key and the two values of the alias on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Collision {
    pub alias: DistinctAlias,
    /// The value the key had first (as the events arrived).
    pub first: String,
    /// The value the event brought.
    pub second: String,
}

impl std::fmt::Display for Collision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Sorted, so the summary does not depend on which request arrived first.
        let (a, b) = if self.first <= self.second {
            (&self.first, &self.second)
        } else {
            (&self.second, &self.first)
        };
        write!(f, "{} {a} and {b}", self.alias.as_str())
    }
}
