//! What a page is drawn from: a request's correlated timeline (the `/api/requests/{alias}`
//! answer, built by admin's recent-events index or by `check` from a recorded file) and the
//! cancellation windows the rules allow after a refusal.

use serde::Serialize;

use crate::engine::rules::{RuleSet, Shape};
use crate::event::{Kind, RoomFields, Source, Stage};

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct TimelineEvent {
    pub time_ns: u64,
    pub stage: Stage,
    pub kind: Kind,
    pub source: Source,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rid: Option<String>,
    /// `bootstrap_room` (decimal string) and `bootstrap_room_hex`, as every output names a room.
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub room: Option<RoomFields>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub worker: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub to: Option<Stage>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Aliases {
    pub request_ids: Vec<String>,
    pub trace_ids: Vec<String>,
    pub rids: Vec<String>,
    /// One `{"bootstrap_room": "<decimal>", "bootstrap_room_hex": "0x…"}` object per room.
    pub bootstrap_rooms: Vec<RoomFields>,
}

#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct Timeline {
    pub query: String,
    pub aliases: Aliases,
    pub events: Vec<TimelineEvent>,
    /// More events were linked than the response limit allows; the oldest were left out.
    pub truncated: bool,
}

/// How long after a refusal the rules still tolerate a dispatch (a never_after rule triggered
/// by a rejection, with a grace): what a page draws as the cancellation window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CancelWindow {
    pub rule: String,
    pub grace_ns: u64,
}

impl CancelWindow {
    /// Every enabled rule whose trigger names `rejected` explicitly and that has a grace.
    pub fn of_rules<'a>(
        rules: impl IntoIterator<Item = &'a crate::engine::rules::Rule>,
    ) -> Vec<CancelWindow> {
        rules
            .into_iter()
            .filter(|r| r.enabled)
            .filter_map(|r| match &r.shape {
                Shape::NeverAfter(n)
                    if !n.grace.is_zero()
                        && n.trigger.iter().any(|m| m.kind.contains(&Kind::Rejected)) =>
                {
                    Some(CancelWindow {
                        rule: r.name.clone(),
                        grace_ns: n.grace.ns(),
                    })
                }
                _ => None,
            })
            .collect()
    }

    /// [`CancelWindow::of_rules`] over a rule set.
    pub fn of_set(set: &RuleSet) -> Vec<CancelWindow> {
        CancelWindow::of_rules(&set.rules)
    }
}
