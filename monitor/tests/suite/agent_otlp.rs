//! `revenant agent` as a node's OTLP receiver: it takes exports for as long as it can batch
//! them, well past what its event channel's share of `--memory-budget` holds at once (each
//! batch it takes off the channel is credited back, as the engine task does in `run`).

use crate::support;

use support::cluster::{Bus, Member};
use support::{Nats, ScratchDir, http_post, workspace_root};

#[test]
fn an_agent_takes_otlp_exports_past_its_event_channel_share() {
    let nats = Nats::single().unwrap();
    let dir = ScratchDir::new("agent-otlp").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "AGENTOTLP".into(),
        partitions: 2,
    };
    // The smallest budget: the channel's share is about 1.3 MiB.
    let (mut agent, otlp) = Member::agent_otlp(
        &bus,
        &dir.path().join("agent"),
        "node-a",
        &["--memory-budget", "80MiB"],
    );
    let export =
        std::fs::read(workspace_root().join("fuzz/corpus/otlp_json/smg-1.13.0-spans.json"))
            .unwrap();
    let url = format!("http://{otlp}/v1/traces");
    let event_bytes = std::mem::size_of::<revenant::LifecycleEvent>() as f64;
    let channel_share = channel_cap(&agent.admin);
    assert!(channel_share > 0.0, "no event channel cap exposed");
    let mut posts = 0;
    // Three times the share, counting each event at its least (no strings, no spare capacity).
    while agent.metric("revenant_agent_events_total") * event_bytes < 3.0 * channel_share {
        let (status, body) = http_post(&url, "application/json", &export).unwrap();
        assert_eq!(status, 200, "export {posts} refused: {body}");
        posts += 1;
        assert!(
            posts < 200_000,
            "the agent routes no events from these exports"
        );
    }
    assert_eq!(
        agent.metric("revenant_otlp_requests_rejected_total"),
        0.0,
        "refused exports"
    );
    agent.stop();
}

/// `revenant_memory_cap_bytes{structure="event_channel"}`.
fn channel_cap(admin: &str) -> f64 {
    let (_, body) = support::http_get(&format!("http://{admin}/metrics")).unwrap();
    support::metric_sum(
        &support::parse_metrics(&body),
        "revenant_memory_cap_bytes",
        &[("structure", "event_channel")],
    )
}
