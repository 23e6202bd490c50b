//! Cluster mode under faults, each with every violation found once (the set `revenant check`
//! finds on the same events, no violation reported twice):
//!
//! - NATS unreachable while an agent has events: the agent keeps them in its outbox, says so
//!   in `/readyz` (503, `down.nats`), and publishes them once NATS is back; the checker, cut
//!   off too, catches up. The outage lasts `REVENANT_OUTAGE_SECS` (default 30 s).
//! - An agent killed (SIGKILL) with unpublished batches: the next agent on the same spool
//!   directory publishes them.
//! - A three-node NATS cluster, R3 stream: its leader killed while an agent publishes (what
//!   fails until a new leader is elected is retried with its message id), then a follower.
//! - A checker killed (SIGKILL) mid-stream and another started on its partitions: it reads
//!   them again from before where the first had come, and sends every notification the first
//!   did not send, none twice; NATS goes away in the middle of its reading and it reads on.
//! - A partition's durable consumer deleted under a running checker: it is created again, and
//!   what it delivers again is recognised.

use crate::support;

use std::path::Path;
use std::time::{Duration, Instant};

use revenant::engine::workload::{self, Mix};
use revenant::{LifecycleEvent, RuleSet};
use support::cluster::{
    Bus, Member, WAIT, check, key_list, keys, notified, wait_batches_taken, wait_metric, write,
};
use support::{Nats, ScratchDir, http_get};

fn events() -> Vec<LifecycleEvent> {
    workload::stream(&Mix {
        attempts: 800,
        reject_every: 5,
        spacing_ns: 300_000,
        ..Mix::default()
    })
}

/// Every violation once, and the same set as `check`.
fn assert_once_and_as_check(dir: &Path, events: &[LifecycleEvent], got: &str) {
    let rules = RuleSet::embedded_defaults();
    let merged = dir.join("merged.jsonl");
    write(&merged, events);
    let expected = keys(&rules, &check(&merged));
    assert!(
        expected.len() > 10,
        "too few violations to tell: {expected:?}"
    );
    let list = key_list(&rules, got);
    let set: std::collections::BTreeSet<_> = list.iter().cloned().collect();
    assert_eq!(list.len(), set.len(), "a violation reported twice");
    assert_eq!(
        set,
        expected,
        "missing {:?}, extra {:?}",
        expected.difference(&set).collect::<Vec<_>>(),
        set.difference(&expected).collect::<Vec<_>>()
    );
}

/// Waits until every metric in `names` of `member` read the same for `quiet` in a row (a process
/// that has stopped moving), at most [`WAIT`].
fn wait_quiet(what: &str, member: &Member, names: &[&str], quiet: Duration) {
    let read = || names.iter().map(|n| member.metric(n)).collect::<Vec<f64>>();
    let mut last = read();
    let mut since = Instant::now();
    wait_for(what, || {
        let now = read();
        if now != last || now.iter().any(|v| *v < 0.0) {
            last = now;
            since = Instant::now();
        }
        since.elapsed() >= quiet
    });
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_agent_keeps_what_nats_did_not_take_and_publishes_it_once_nats_is_back() {
    let mut nats = Nats::single().unwrap();
    let dir = ScratchDir::new("cluster-outage").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "OUTAGE".into(),
        partitions: 2,
    };
    let mut checker = Member::checker(&bus, &dir.path().join("checker"), &[0, 1], &[]);
    nats.nodes[0].kill();

    let events = events();
    write(&dir.path().join("events.jsonl"), &events);
    let mut agent = Member::agent(
        &bus,
        &dir.path().join("agent"),
        "node-a",
        Some(&dir.path().join("events.jsonl")),
    );
    wait_metric(
        "the agent routing its file",
        &[&agent.admin],
        "revenant_agent_events_total",
        events.len() as f64,
    );
    wait_for("batches waiting in the outbox", || {
        agent.metric("revenant_agent_outbox_batches") > 0.0
    });
    let (status, body) = http_get(&format!("http://{}/readyz", agent.admin)).unwrap();
    assert_eq!(status, 503, "{body}");
    let ready: serde_json::Value = serde_json::from_str(&body).unwrap();
    let why = ready["down"]["nats"].as_str().unwrap_or_default();
    assert!(why.contains("unreachable"), "{body}");
    assert_eq!(agent.metric("revenant_agent_nats_connected"), 0.0);

    let outage: u64 = std::env::var("REVENANT_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    std::thread::sleep(Duration::from_secs(outage));
    assert_eq!(agent.metric("revenant_agent_events_dropped_total"), 0.0);

    checker.assert_alive();
    nats.nodes[0].start().unwrap();
    nats.wait_ready().unwrap();
    wait_for("the outbox to empty", || {
        agent.metric("revenant_agent_outbox_batches") == 0.0
    });
    wait_for("the agent ready again", || {
        matches!(
            http_get(&format!("http://{}/readyz", agent.admin)),
            Ok((200, _))
        )
    });
    agent.stop();
    wait_batches_taken(
        "the checker taking every batch",
        &[&checker.admin],
        agent.published() as f64,
    );
    checker.stop();
    assert_once_and_as_check(dir.path(), &events, &checker.violations());
}

#[test]
fn a_killed_agents_outbox_is_published_by_the_next_one() {
    let mut nats = Nats::single().unwrap();
    let dir = ScratchDir::new("cluster-agent-restart").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "RESTART".into(),
        partitions: 1,
    };
    nats.nodes[0].kill();
    let events = events();
    write(&dir.path().join("events.jsonl"), &events);
    let agent_dir = dir.path().join("agent");
    let mut first = Member::agent(
        &bus,
        &agent_dir,
        "node-a",
        Some(&dir.path().join("events.jsonl")),
    );
    wait_metric(
        "the agent routing its file",
        &[&first.admin],
        "revenant_agent_events_total",
        events.len() as f64,
    );
    // Every batch sealed (the open ones after the linger) and on disk, none published.
    let mut last = -1.0;
    wait_for("the outbox to stop growing", || {
        let now = first.metric("revenant_agent_outbox_batches");
        let stable = now > 0.0 && now == last;
        last = now;
        stable
    });
    let sealed = first.metric("revenant_agent_batches_sealed_total");
    assert_eq!(first.metric("revenant_agent_batches_published_total"), 0.0);
    first.proc.stop(libc::SIGKILL, Duration::ZERO);

    nats.nodes[0].start().unwrap();
    nats.wait_ready().unwrap();
    let mut checker = Member::checker(&bus, &dir.path().join("checker"), &[0], &[]);
    let mut second = Member::agent(&bus, &agent_dir, "node-a", None);
    wait_for("the resumed outbox to empty", || {
        second.metric("revenant_agent_outbox_batches") == 0.0
            && second.metric("revenant_agent_batches_published_total") >= sealed
    });
    second.stop();
    wait_batches_taken("the checker taking every batch", &[&checker.admin], sealed);
    checker.stop();
    assert_once_and_as_check(dir.path(), &events, &checker.violations());
}

/// The name of `stream`'s leader, asked of the first running node that knows.
fn leader(nats: &mut Nats, stream: &str) -> Option<String> {
    for n in &mut nats.nodes {
        if !n.is_running() {
            continue;
        }
        let url = format!(
            "http://127.0.0.1:{}/jsz?accounts=true&streams=true",
            n.monitor
        );
        let Ok((200, body)) = http_get(&url) else {
            continue;
        };
        let v: serde_json::Value = serde_json::from_str(&body).ok()?;
        for a in v["account_details"].as_array().into_iter().flatten() {
            for s in a["stream_detail"].as_array().into_iter().flatten() {
                if s["name"] == stream
                    && let Some(l) = s["cluster"]["leader"].as_str()
                {
                    return Some(l.to_owned());
                }
            }
        }
    }
    None
}

#[test]
fn the_stream_leader_and_then_a_follower_killed_while_an_agent_publishes() {
    let mut nats = Nats::cluster3().unwrap();
    let dir = ScratchDir::new("cluster-leader").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "LEADER".into(),
        partitions: 2,
    };
    let mut checker = Member::checker(
        &bus,
        &dir.path().join("checker"),
        &[0, 1],
        &["--replicas", "3"],
    );
    let mut name = None;
    wait_for("a stream leader", || {
        name = leader(&mut nats, "LEADER");
        name.is_some()
    });
    let events = workload::stream(&Mix {
        attempts: 4000,
        reject_every: 5,
        spacing_ns: 300_000,
        ..Mix::default()
    });
    write(&dir.path().join("events.jsonl"), &events);
    let mut agent = Member::agent(
        &bus,
        &dir.path().join("agent"),
        "node-a",
        Some(&dir.path().join("events.jsonl")),
    );
    // The leader goes while the agent publishes: some batches stored, others waiting.
    // (Events, not batches: an agent announces itself with empty batches first.)
    wait_for("the first events stored", || {
        agent.metric("revenant_agent_events_published_total") > 0.0
    });
    let i = nats
        .nodes
        .iter()
        .position(|n| Some(&n.name) == name.as_ref())
        .unwrap();
    nats.nodes[i].kill();
    let waiting = agent.metric("revenant_agent_outbox_batches");
    assert!(
        waiting > 0.0,
        "everything was published before the leader went: nothing tested"
    );
    wait_metric(
        "the agent routing its file",
        &[&agent.admin],
        "revenant_agent_events_total",
        events.len() as f64,
    );
    wait_for("the outbox to empty under the new leader", || {
        agent.metric("revenant_agent_outbox_batches") == 0.0
    });
    eprintln!(
        "leader {} killed with {waiting} batches waiting: {} publishes failed or timed out and \
         were retried",
        nats.nodes[i].name,
        agent.metric("revenant_agent_publish_failures_total")
    );
    nats.nodes[i].start().unwrap();
    nats.wait_ready().unwrap();
    // Then a follower.
    let now = leader(&mut nats, "LEADER");
    let f = nats
        .nodes
        .iter()
        .position(|n| Some(&n.name) != now.as_ref() && n.name != nats.nodes[i].name)
        .unwrap_or((i + 1) % 3);
    nats.nodes[f].kill();
    agent.stop();
    nats.nodes[f].start().unwrap();
    wait_batches_taken(
        "the checker taking every batch",
        &[&checker.admin],
        agent.published() as f64,
    );
    checker.stop();
    assert_once_and_as_check(dir.path(), &events, &checker.violations());
}

/// The notifications in an alerts JSONL file, as (lead rule, incident key).
/// Two nodes' recordings of `events`: the first half of the time (`node-a`), then the second
/// (`node-b`), as files in one directory.
struct Halves {
    dir: std::path::PathBuf,
    early: usize,
    late: usize,
}

impl Halves {
    fn write(dir: &Path, events: &[LifecycleEvent]) -> Halves {
        let middle = events[events.len() / 2].time_ns;
        let (early, late): (Vec<_>, Vec<_>) =
            events.iter().cloned().partition(|e| e.time_ns < middle);
        write(&dir.join("early.jsonl"), &early);
        write(&dir.join("late.jsonl"), &late);
        Halves {
            dir: dir.into(),
            early: early.len(),
            late: late.len(),
        }
    }

    fn publish(&self, bus: &Bus, half: &str, node: &str, n: usize) -> Member {
        Member::publish_file(
            bus,
            &self.dir.join(format!("agent-{half}")),
            node,
            &self.dir.join(format!("{half}.jsonl")),
            n,
        )
    }

    /// The first half through an agent on `node-a`, which then stops.
    fn publish_early(&self, bus: &Bus) -> Member {
        self.publish(bus, "early", "node-a", self.early)
    }

    /// The second half through an agent on `node-b`, which then stops.
    fn publish_late(&self, bus: &Bus) -> Member {
        self.publish(bus, "late", "node-b", self.late)
    }
}

#[test]
fn a_killed_checker_is_replaced_and_every_notification_goes_out_once() {
    let mut nats = Nats::single().unwrap();
    let dir = ScratchDir::new("cluster-checker-kill").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "CHECKERKILL".into(),
        partitions: 2,
    };
    let events = workload::stream(&Mix {
        attempts: 3000,
        reject_every: 5,
        spacing_ns: 300_000,
        ..Mix::default()
    });
    let halves = Halves::write(dir.path(), &events);
    // One notification per (rule, request), sent at once, none rate-limited: each breach's
    // notification is countable.
    let alerting = ["--group-wait", "0s", "--rate-limit", "0"];
    let pause = dir.path().join("pause");
    let first_dir = dir.path().join("checker-1");
    let mut first = Member::checker(
        &bus,
        &first_dir,
        &[0, 1],
        &[&alerting[..], &["--pause-file", pause.to_str().unwrap()]].concat(),
    );
    let agent = halves.publish_early(&bus);
    wait_batches_taken(
        "the first checker taking the first half",
        &[&first.admin],
        agent.published() as f64,
    );
    wait_for("the first checker's notifications", || {
        !notified(&first_dir.join("alerts.jsonl")).is_empty()
    });
    // The first checker stops taking batches (so that no notification is between its spool and
    // its claim when it dies), the second half is published, and it is killed.
    // Paused once nothing moves any more: no event observed, no violation found, every
    // notification looked up, spooled and delivered (under load that takes what it takes).
    std::fs::write(&pause, b"").unwrap();
    wait_quiet(
        "the first checker to pause and settle",
        &first,
        &[
            "revenant_events_total",
            "revenant_alerts_received_total",
            "revenant_checker_notification_claims_total",
            "revenant_alerts_notified_total",
            "revenant_alert_delivered_notifications_total",
            "revenant_spool_entries",
        ],
        Duration::from_secs(1),
    );
    halves.publish_late(&bus);
    first.proc.stop(libc::SIGKILL, Duration::ZERO);

    // The replacement reads its partitions again with its engine paused and a short channel,
    // so that NATS goes away in the middle of that reading and stays away past the reading's
    // own patience (10 s without a message): the checker must keep running, hold the
    // notifications of what it finds meanwhile (their claims cannot be looked up), and read on
    // once NATS is back.
    let second_dir = dir.path().join("checker-2");
    let paused = dir.path().join("pause-2");
    std::fs::write(&paused, b"").unwrap();
    let mut second = Member::checker(
        &bus,
        &second_dir,
        &[0, 1],
        &[
            &alerting[..],
            &["--pause-file", paused.to_str().unwrap()],
            &["--channel-capacity", "4"],
        ]
        .concat(),
    );
    wait_for("the second checker reading its partitions again", || {
        second.metric("revenant_checker_recovered_messages_total") > 0.0
    });
    nats.nodes[0].kill();
    std::fs::remove_file(&paused).unwrap();
    std::thread::sleep(Duration::from_secs(13));
    second.assert_alive();
    nats.nodes[0].start().unwrap();
    nats.wait_ready().unwrap();
    // Every agent stream ended (its last batches taken): the input is whole.
    wait_for("the second checker at the end of every stream", || {
        second.metric("revenant_checker_recovering_partitions") == 0.0
            && second.metric("revenant_checker_partitions_behind") == 0.0
            && second.metric("revenant_checker_agent_streams") == 0.0
            && second.metric("revenant_checker_messages_total") > 0.0
    });
    let recovered = second.metric("revenant_checker_recovered_messages_total");
    assert!(
        recovered >= agent.published() as f64,
        "the second checker read {recovered} messages again, fewer than the {} its predecessor took",
        agent.published()
    );
    second.stop();

    let merged = dir.path().join("merged.jsonl");
    write(&merged, &events);
    let expected: std::collections::BTreeSet<(String, String)> = check(&merged)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<revenant::Violation>(l).unwrap())
        .filter(|v| !v.corroborates)
        .map(|v| {
            let key = revenant::alert::notification::incident_alias(&v);
            (v.rule, key)
        })
        .collect();
    let before = notified(&first_dir.join("alerts.jsonl"));
    let after = notified(&second_dir.join("alerts.jsonl"));
    assert!(
        !before.is_empty() && !after.is_empty(),
        "{} then {}",
        before.len(),
        after.len()
    );
    let all: Vec<_> = before.iter().chain(&after).cloned().collect();
    let set: std::collections::BTreeSet<_> = all.iter().cloned().collect();
    assert_eq!(all.len(), set.len(), "a notification sent twice");
    assert_eq!(
        set,
        expected,
        "missing {:?}, extra {:?}",
        expected.difference(&set).take(5).collect::<Vec<_>>(),
        set.difference(&expected).take(5).collect::<Vec<_>>()
    );
    assert!(
        second.stopped_field("notifications_sent_before") >= before.len() as f64,
        "the second checker found the first one's breaches again and sent none of them"
    );
}

/// Deletes a durable consumer as an operator (or a stream edit) would.
fn delete_consumer(url: &str, stream: &str, name: &str) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let s = js.get_stream(stream).await.unwrap();
        assert!(s.delete_consumer(name).await.unwrap().success);
    });
}

#[test]
fn a_deleted_consumer_is_created_again_and_nothing_is_judged_twice() {
    let nats = Nats::single().unwrap();
    let dir = ScratchDir::new("cluster-consumer-deleted").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "DELETED".into(),
        partitions: 1,
    };
    let events = events();
    let halves = Halves::write(dir.path(), &events);
    let mut checker = Member::checker(&bus, &dir.path().join("checker"), &[0], &[]);
    halves.publish_early(&bus);
    wait_metric(
        "the checker taking the first half",
        &[&checker.admin],
        "revenant_checker_bus_events_total",
        halves.early as f64,
    );
    delete_consumer(&bus.nats, &bus.stream, "DELETED-p0");
    halves.publish_late(&bus);
    // The consumer created again starts from the stream's first message: the first half comes
    // again and is recognised.
    wait_metric(
        "the checker taking the second half from a new consumer",
        &[&checker.admin],
        "revenant_checker_bus_events_total",
        events.len() as f64,
    );
    wait_for("the first half recognised when delivered again", || {
        checker.metric("revenant_checker_duplicate_batches_total") > 0.0
    });
    assert_eq!(
        checker.metric("revenant_checker_bus_events_total"),
        events.len() as f64
    );
    // One family per name in the exposition (two counters of one name would add up).
    let (_, body) = http_get(&format!("http://{}/metrics", checker.admin)).unwrap();
    let mut families = std::collections::BTreeSet::new();
    for l in body.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = l.split_whitespace().nth(2).unwrap();
        assert!(families.insert(name.to_owned()), "{name} declared twice");
    }
    checker.stop();
    assert_once_and_as_check(dir.path(), &events, &checker.violations());
}
