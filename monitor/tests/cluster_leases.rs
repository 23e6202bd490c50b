//! Checkers that share a stream's partitions through leases (`bus::lease`), on three real
//! `nats-server`s clustered on loopback (R3 stream and buckets), with a short `--lease-ttl`:
//!
//! - three checkers split six partitions two each;
//! - one is killed (SIGKILL) while agents publish: its partitions are taken by the others;
//! - one is paused (SIGSTOP) past the TTL: the last one takes everything; resumed (SIGCONT), the
//!   paused one finds its leases gone by its own clock and judges nothing of them;
//! - a fourth joins under load, and the NATS server leading the lease bucket is killed: the
//!   partitions spread again;
//!
//! and every breach of the whole load is notified exactly once across the four (the set
//! `revenant check` finds on the same events), none twice.
//!
//! Waits are bounded conditions on the checkers' metrics; the one fixed wait is the pause
//! itself, which must outlast the TTL to be the fault under test.

mod support;

use std::collections::BTreeSet;
use std::path::Path;
use std::time::{Duration, Instant};

use revenant::LifecycleEvent;
use revenant::engine::workload::{self, Mix};
use support::cluster::{Bus, Member, WAIT, check, notified, write};
use support::{Nats, ScratchDir, http_get};

const PARTITIONS: u32 = 6;
const TTL: Duration = Duration::from_secs(3);

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + WAIT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Waits until what a checker observes, finds and notifies stopped moving for a second: no
/// notification is then between its claim and its sink (one a killed checker had spooled is
/// delivered when it starts again on its spool, which this test does not do; one it had only
/// claimed is sent by the next owner a minute later: the spool's and the claims' concern, not
/// the leases').
fn wait_settled(what: &str, m: &Member) {
    let names = [
        "revenant_events_total",
        "revenant_alerts_received_total",
        "revenant_checker_notification_claims_total",
        "revenant_alert_delivered_notifications_total",
        "revenant_spool_entries",
    ];
    let read = || names.iter().map(|n| m.metric(n)).collect::<Vec<f64>>();
    let mut last = read();
    let mut since = Instant::now();
    wait_for(what, || {
        let now = read();
        if now != last || now.iter().any(|v| *v < 0.0) {
            last = now;
            since = Instant::now();
        }
        since.elapsed() >= Duration::from_secs(1)
    });
}

/// The server leading `stream`'s Raft group, by its name.
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

fn signal(m: &Member, sig: i32) {
    // SAFETY: a signal to a child this test started and has not reaped.
    assert_eq!(unsafe { libc::kill(m.proc.pid() as i32, sig) }, 0);
}

fn owned(m: &Member) -> f64 {
    m.metric("revenant_checker_owned_partitions")
}

/// The live checkers own every partition between them, each at least `min`, none more than
/// `max`.
fn spread(live: &[&Member], min: f64, max: f64) -> bool {
    let each: Vec<f64> = live.iter().map(|m| owned(m)).collect();
    each.iter().sum::<f64>() == f64::from(PARTITIONS) && each.iter().all(|n| *n >= min && *n <= max)
}

/// The load in four consecutive slices by event time, each published by its own agent.
fn slices(dir: &Path, events: &[LifecycleEvent]) -> Vec<(std::path::PathBuf, usize)> {
    let n = events.len();
    (0..4)
        .map(|i| {
            let (lo, hi) = (
                events[i * n / 4].time_ns,
                events.get((i + 1) * n / 4).map(|e| e.time_ns),
            );
            let part: Vec<LifecycleEvent> = events
                .iter()
                .filter(|e| e.time_ns >= lo && hi.is_none_or(|h| e.time_ns < h))
                .cloned()
                .collect();
            let path = dir.join(format!("slice-{i}.jsonl"));
            write(&path, &part);
            (path, part.len())
        })
        .collect()
}

#[test]
fn checkers_take_over_each_others_partitions_and_every_breach_is_notified_once() {
    let mut nats = Nats::cluster3().unwrap();
    let dir = ScratchDir::new("cluster-leases").unwrap();
    let bus = Bus {
        nats: nats.urls(),
        stream: "LEASES".into(),
        partitions: PARTITIONS,
    };
    let mut events = workload::stream(&Mix {
        attempts: 2400,
        reject_every: 5,
        spacing_ns: 300_000,
        ..Mix::default()
    });
    events.sort_by_key(|e| e.time_ns);
    let slices = slices(dir.path(), &events);
    let ttl = format!("{}s", TTL.as_secs());
    // One notification per (rule, request), sent at once, none rate-limited: each breach's
    // notification is countable.
    let flags = [
        "--replicas",
        "3",
        "--lease-ttl",
        ttl.as_str(),
        "--group-wait",
        "0s",
        "--rate-limit",
        "0",
    ];
    let names = ["checker-0", "checker-1", "checker-2", "checker-3"];
    let start = |i: usize| Member::checker_shared(&bus, &dir.path().join(names[i]), &flags);
    let mut c0 = start(0);
    let mut c1 = start(1);
    let mut c2 = start(2);
    wait_for("three checkers holding two partitions each", || {
        spread(&[&c0, &c1, &c2], 2.0, 2.0)
    });
    let publish = |i: usize| {
        let (path, n) = &slices[i];
        Member::publish_file(
            &bus,
            &dir.path().join(format!("agent-{i}")),
            &format!("node-{i}"),
            path,
            *n,
        )
    };
    publish(0);
    wait_settled("the first checker settled", &c0);

    // A checker killed, then the second slice published at once: its two partitions go to the
    // two others, within the TTL of its last renewal (plus one look).
    let killed = Instant::now();
    c0.proc.stop(libc::SIGKILL, Duration::ZERO);
    let agent = std::thread::scope(|s| {
        let a = s.spawn(|| publish(1));
        wait_for("the killed checker's partitions taken", || {
            spread(&[&c1, &c2], 3.0, 3.0)
        });
        eprintln!("takeover after SIGKILL: {:?}", killed.elapsed());
        a.join().unwrap()
    });
    drop(agent);
    assert!(
        c1.metric("revenant_checker_leases_acquired_total")
            + c2.metric("revenant_checker_leases_acquired_total")
            >= 6.0,
        "the survivors took the killed checker's partitions"
    );

    // A checker paused past the TTL: the last one takes everything; resumed, the paused one
    // finds by its own clock that its leases are gone, before it judges anything of them.
    wait_settled("the second checker settled", &c1);
    signal(&c1, libc::SIGSTOP);
    let paused = Instant::now();
    wait_for("the live checker holding every partition", || {
        spread(&[&c2], 6.0, 6.0)
    });
    eprintln!("takeover after SIGSTOP: {:?}", paused.elapsed());
    publish(2);
    signal(&c1, libc::SIGCONT);
    wait_for("the resumed checker noticing its leases lost", || {
        c1.metric("revenant_checker_leases_lost_total") >= 1.0
    });
    // It rejoins and gets its share back from the other.
    wait_for("the partitions spread over two again", || {
        spread(&[&c1, &c2], 3.0, 3.0)
    });

    // A fourth checker joins while the last slice is published, and the server leading the
    // lease bucket is killed: the partitions spread over three (two each) all the same.
    let mut c3 = start(3);
    let mut name = None;
    wait_for("a leader of the lease bucket", || {
        name = leader(&mut nats, "KV_LEASES_LEASES");
        name.is_some()
    });
    let i = nats
        .nodes
        .iter()
        .position(|n| Some(&n.name) == name.as_ref())
        .unwrap();
    std::thread::scope(|s| {
        let a = s.spawn(|| publish(3));
        nats.nodes[i].kill();
        wait_for("the partitions spread over three", || {
            spread(&[&c1, &c2, &c3], 2.0, 2.0)
        });
        a.join().unwrap()
    });
    eprintln!(
        "lease bucket leader {} killed: leases lost meanwhile {}",
        nats.nodes[i].name,
        [&c1, &c2, &c3]
            .iter()
            .map(|m| m.metric("revenant_checker_leases_lost_total"))
            .sum::<f64>()
    );

    // Every agent stream ended and every partition read again where it was taken: the input
    // is whole; then the live checkers drain together (judging what they hold).
    for m in [&c1, &c2, &c3] {
        wait_for("every checker at the end of every stream", || {
            m.metric("revenant_checker_recovering_partitions") == 0.0
                && m.metric("revenant_checker_partitions_behind") == 0.0
                && m.metric("revenant_checker_agent_streams") == 0.0
        });
    }
    // SIGTERM to all before waiting for any (a second SIGTERM would cut a drain short).
    for m in [&c1, &c2, &c3] {
        signal(m, libc::SIGTERM);
    }
    for m in [&mut c1, &mut c2, &mut c3] {
        let mut status = None;
        wait_for("a checker's clean exit", || {
            status = m.proc.exited();
            status.is_some()
        });
        assert!(
            status.is_some_and(|s| s.success()),
            "{}: {status:?}\n{}",
            m.proc.name,
            support::tail(&m.dir.join("stderr"), 20)
        );
    }

    let merged = dir.path().join("merged.jsonl");
    write(&merged, &events);
    let expected: BTreeSet<(String, String)> = check(&merged)
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str::<revenant::Violation>(l).unwrap())
        .filter(|v| !v.corroborates)
        .map(|v| {
            let key = revenant::alert::notification::incident_alias(&v);
            (v.rule, key)
        })
        .collect();
    assert!(expected.len() > 10, "too few breaches to tell");
    let all: Vec<(String, String)> = names
        .iter()
        .flat_map(|n| notified(&dir.path().join(n).join("alerts.jsonl")))
        .collect();
    let set: BTreeSet<_> = all.iter().cloned().collect();
    assert_eq!(
        all.len(),
        set.len(),
        "a breach notified twice: {:?}",
        all.iter()
            .filter(|k| all.iter().filter(|j| j == k).count() > 1)
            .take(5)
            .collect::<Vec<_>>()
    );
    assert_eq!(
        set,
        expected,
        "missing {:?}, extra {:?}",
        expected.difference(&set).take(5).collect::<Vec<_>>(),
        set.difference(&expected).take(5).collect::<Vec<_>>()
    );
}
