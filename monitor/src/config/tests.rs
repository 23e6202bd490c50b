use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{CommandFactory, FromArgMatches, Parser};

use super::*;
use crate::ingest::ebpf::EbpfMode;
use crate::run::RunArgs;
use crate::run::{Given, overlay};

/// The YAML block of `docs/config.md`.
fn documented_example() -> String {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/config.md"))
            .unwrap();
    let start = doc
        .find("```yaml\n")
        .expect("docs/config.md has a yaml example")
        + 8;
    let len = doc[start..].find("```").unwrap();
    doc[start..start + len].to_string()
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    run: RunArgs,
}

fn args(argv: &[&str]) -> RunArgs {
    let m = Cli::command()
        .try_get_matches_from(std::iter::once("revenant").chain(argv.iter().copied()))
        .unwrap();
    let mut run = Cli::from_arg_matches(&m).unwrap().run;
    run.given = Given::from_matches(&m);
    run
}

fn path() -> PathBuf {
    "revenant.yaml".into()
}

#[test]
fn documented_example_parses_with_every_section() {
    let cfg = RunConfig::from_yaml(&path(), &documented_example()).unwrap();
    assert_eq!(cfg.node.name.as_deref(), Some("node-a"));
    assert_eq!(cfg.node_name(), "node-a");
    assert_eq!(cfg.otlp.grpc, Some("127.0.0.1:4317".parse().unwrap()));
    assert_eq!(cfg.ebpf.mode, EbpfMode::Auto);
    assert_eq!(cfg.ebpf.pid[0].pid, 4242);
    assert_eq!(
        cfg.normalize.sglang.completion_grace,
        Duration::from_secs(5)
    );
    assert_eq!(cfg.engine.allowed_lateness(), Duration::from_secs(15));
    assert_eq!(cfg.alert.webhooks.len(), 1);
    assert_eq!(cfg.alert.flood.dedup_window, Duration::from_secs(300));
    assert_eq!(cfg.admin.addr, Some("127.0.0.1:9464".parse().unwrap()));
    assert_eq!(cfg.channel_capacity(), 1024);
    assert_eq!(cfg.drain_timeout(), Duration::from_secs(10));
    assert!(cfg.events_jsonl.is_some());
    assert_eq!(cfg.bus.nats.as_deref(), Some("nats://127.0.0.1:4222"));
    assert_eq!(
        cfg.bus,
        crate::bus::BusConfig {
            nats: cfg.bus.nats.clone(),
            ..crate::bus::BusConfig::default()
        },
        "the documented bus values are the defaults"
    );
}

#[test]
fn a_bad_key_reports_its_line_and_column() {
    let text = "otlp:\n  grpc: 127.0.0.1:4317\nengine:\n  clock_skw: 50ms\n";
    match RunConfig::from_yaml(&path(), text) {
        Err(ConfigFileError::Parse {
            line, column, msg, ..
        }) => {
            assert_eq!(line, Some(4), "{msg}");
            assert_eq!(column, Some(3), "{msg}");
            assert!(msg.contains("clock_skw"), "{msg}");
        }
        other => panic!("{other:?}"),
    }
    let e = RunConfig::from_yaml(&path(), "drain_timeout: soon\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("revenant.yaml") && e.contains("invalid duration"),
        "{e}"
    );
}

#[test]
fn engine_keys_at_the_top_level_mean_the_same() {
    let top = RunConfig::from_yaml(&path(), "clock_skew: 10ms\nrules: r.yaml\n").unwrap();
    assert_eq!(top.engine.clock_skew(), Duration::from_millis(10));
    assert_eq!(top.engine.rules, Some("r.yaml".into()));
    let both = RunConfig::from_yaml(&path(), "clock_skew: 10ms\nengine: { clock_skew: 20ms }\n");
    assert!(matches!(
        both,
        Err(ConfigFileError::Duplicate {
            key: "clock_skew",
            ..
        })
    ));
}

#[test]
fn given_flags_win_over_the_file_and_others_keep_it() {
    let text = "admin: { addr: 127.0.0.1:9000, recent_violations: 5 }\nebpf: { mode: off, watch: [\"decode=a\"] }\nnode: { name: from-file }\n";
    let mut cfg = RunConfig::from_yaml(&path(), text).unwrap();
    overlay::apply(&mut cfg, &args(&[])).unwrap();
    assert_eq!(cfg.admin_args().admin, "127.0.0.1:9000".parse().unwrap());
    assert_eq!(cfg.admin_args().recent_violations, 5);
    assert_eq!(cfg.ebpf.mode, EbpfMode::Off);
    assert_eq!(cfg.alert.node.as_deref(), Some("from-file"));

    let mut cfg = RunConfig::from_yaml(&path(), text).unwrap();
    let a = args(&[
        "--admin",
        "127.0.0.1:9464",
        "--ebpf",
        "auto",
        "--watch",
        "prefill=b",
        "--node",
        "from-flag",
        "--cluster",
        "c1",
    ]);
    overlay::apply(&mut cfg, &a).unwrap();
    assert_eq!(cfg.admin_args().admin, "127.0.0.1:9464".parse().unwrap());
    assert_eq!(cfg.ebpf.mode, EbpfMode::Auto);
    assert_eq!(cfg.ebpf.watch.len(), 2, "--watch adds to the file's rules");
    assert_eq!(cfg.node.name.as_deref(), Some("from-flag"));
    assert_eq!(cfg.alert.node.as_deref(), Some("from-flag"));
    assert_eq!(cfg.alert.cluster, "c1");

    let mut cfg = RunConfig::from_yaml(&path(), text).unwrap();
    overlay::apply(&mut cfg, &args(&["--no-admin"])).unwrap();
    assert!(cfg.admin_args().no_admin);
}

#[test]
fn node_identity_falls_back_to_the_alert_configuration() {
    let mut cfg = RunConfig::from_yaml(&path(), "alert: { node: n1, cluster: prod }\n").unwrap();
    overlay::apply(&mut cfg, &args(&[])).unwrap();
    assert_eq!(cfg.node_name(), "n1");
    assert_eq!(cfg.node.cluster.as_deref(), Some("prod"));
    let mut cfg = RunConfig::from_yaml(
        &path(),
        "node: { cluster: staging }\nalert: { cluster: prod }\n",
    )
    .unwrap();
    overlay::apply(&mut cfg, &args(&[])).unwrap();
    assert_eq!(cfg.alert.cluster, "staging");
}

#[test]
fn memory_budget_reads_units_in_the_file_at_either_level_and_from_the_flag() {
    assert_eq!(
        RunConfig::default().engine.memory_budget(),
        DEFAULT_MEMORY_BUDGET
    );
    let eng = RunConfig::from_yaml(&path(), "engine: { memory_budget: 256MiB }\n").unwrap();
    assert_eq!(eng.engine.memory_budget(), 256 << 20);
    let top = RunConfig::from_yaml(&path(), "memory_budget: 1GiB\n").unwrap();
    assert_eq!(top.engine.memory_budget(), 1 << 30);
    let bytes = RunConfig::from_yaml(&path(), "engine: { memory_budget: 200000000 }\n").unwrap();
    assert_eq!(bytes.engine.memory_budget(), 200_000_000);
    let both = RunConfig::from_yaml(
        &path(),
        "memory_budget: 1GiB\nengine: { memory_budget: 256MiB }\n",
    );
    assert!(matches!(
        both,
        Err(ConfigFileError::Duplicate {
            key: "memory_budget",
            ..
        })
    ));
    assert!(matches!(
        RunConfig::from_yaml(&path(), "engine: { memory_budget: 12 parsecs }\n"),
        Err(ConfigFileError::Parse { .. })
    ));
    let a = args(&["--memory-budget", "300MiB"]);
    let cfg = crate::run::load_config(&a).unwrap();
    assert_eq!(cfg.engine.memory_budget(), 300 << 20);
}

#[test]
fn sizes_parse_with_binary_and_decimal_units_and_reject_the_rest() {
    assert_eq!(parse_size("4096"), Ok(4096));
    assert_eq!(parse_size("512MiB"), Ok(512 << 20));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size("64KiB"), Ok(64 << 10));
    assert_eq!(parse_size("5MB"), Ok(5_000_000));
    for bad in ["", "MiB", "1.5GiB", "-1", "10TB", "99999999999999999999GiB"] {
        assert!(parse_size(bad).is_err(), "{bad:?} accepted");
    }
}

#[test]
fn a_budget_too_small_to_run_is_refused_before_anything_starts() {
    let a = args(&["--memory-budget", "1MiB", "--no-admin"]);
    let err = crate::run::prepare(&a).err().expect("1 MiB is refused");
    let msg = err.to_string();
    assert!(
        msg.contains("memory budget") && msg.contains("too small"),
        "{msg}"
    );
}
