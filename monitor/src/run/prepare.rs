//! The first step of `revenant run`: load the config file, apply the flags, validate everything
//! and build what needs no port (normalizer, engine, alert configuration). Nothing is bound and no
//! probe is loaded when this returns, so every configuration error is found before any side effect.

use std::path::PathBuf;
use std::time::Duration;

use super::args::{Given, RunArgs, RunConfigError};
use super::memory::MemoryPlan;
use super::overlay;
use crate::access::Access;
use crate::admin::AdminArgs;
use crate::alert::{AlertConfig, JsonlConfig};
use crate::config::RunConfig;
use crate::engine::check::{Checker, CheckerConfig, RuleSet};
use crate::ingest::ebpf::EbpfMode;
use crate::normalize::Normalizer;

/// Everything validated and built, no port bound yet.
pub struct Prepared {
    pub cfg: RunConfig,
    /// The budget's split; the engine, span tree and admin rings below are built with its caps.
    pub memory: MemoryPlan,
    pub normalizer: Normalizer,
    pub checker: Checker,
    /// What `checker` was built from: `revenant checker` builds a fresh engine whenever the
    /// partitions it judges change.
    pub rules: RuleSet,
    pub engine_config: CheckerConfig,
    /// The alert configuration; `external_url` is filled in once the admin server is bound.
    pub alert: AlertConfig,
    pub admin: AdminArgs,
    /// TLS and token, loaded.
    pub access: Access,
    pub ready_file: Option<PathBuf>,
    pub pause_file: Option<PathBuf>,
    /// The flags given on the command line: log lines name a flag only when it was given.
    pub given: Given,
}

impl Prepared {
    pub fn drain_timeout(&self) -> Duration {
        self.cfg.drain_timeout()
    }
}

/// Reads `--config` (or the defaults) and applies the flags; not yet validated.
pub fn load_config(args: &RunArgs) -> Result<RunConfig, RunConfigError> {
    let mut cfg = RunConfig::load(args.config.as_deref())?;
    overlay::apply(&mut cfg, args)?;
    Ok(cfg)
}

/// Which command is being prepared: what it uses of the configuration differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Run,
    /// Sources and the bus: no engine, no alerts.
    Agent,
    /// The bus, the engine and alerts: no sources (OTLP and eBPF are off whatever the
    /// config file says).
    Checker,
}

pub fn prepare(args: &RunArgs) -> Result<Prepared, RunConfigError> {
    prepare_for(args, Role::Run)
}

pub fn prepare_for(args: &RunArgs, role: Role) -> Result<Prepared, RunConfigError> {
    let mut cfg = load_config(args)?;
    if role == Role::Checker {
        cfg.otlp.grpc = None;
        cfg.otlp.http = None;
        cfg.ebpf.mode = EbpfMode::Off;
    }
    if cfg.ebpf.mode == EbpfMode::On && !crate::telemetry::build::has_ebpf() {
        return Err(RunConfigError::NoEbpfInBuild {
            given: ebpf_mode_origin(&args.given, "on"),
        });
    }
    cfg.otlp.validate()?;
    if cfg.channel_capacity() == 0 {
        return Err(RunConfigError::Capacity);
    }
    let memory = MemoryPlan::new(cfg.engine.memory_budget())?;
    memory.bound_tree(&mut cfg.normalize.sglang);
    let normalizer = Normalizer::new(&cfg.normalize)?;
    let rules = match &cfg.engine.rules {
        Some(p) => RuleSet::from_file(p)?,
        None => RuleSet::embedded_defaults(),
    };
    let ccfg = CheckerConfig {
        clock_skew: cfg.engine.clock_skew(),
        allowed_lateness: cfg.engine.allowed_lateness(),
        max_attempts: memory.engine.max_attempts,
        max_tombstones: memory.engine.max_tombstones,
        max_requests: memory.engine.max_requests,
        ..CheckerConfig::default()
    };
    ccfg.validate()?;
    let mut admin = cfg.admin_args();
    admin.validate()?;
    bound_admin_rings(&mut admin, &memory);
    let mut alert = cfg.alert.clone();
    alert.validate()?;
    if alert.webhooks.is_empty() && alert.alertmanagers.is_empty() && alert.jsonl.is_none() {
        // An alert nobody can see is a silent loss: without any sink, alerts go to stdout.
        alert.jsonl = Some(JsonlConfig { path: "-".into() });
    }
    // Only the sizes are checked here: loading the probes happens once the ports are bound.
    cfg.ebpf.config(None)?;
    let access = Access::load(&cfg.access)?;
    warn_about_pointless_settings(&cfg, &admin, &alert, role, &args.given);
    Ok(Prepared {
        memory,
        checker: Checker::new(rules.clone(), ccfg.clone()),
        rules,
        engine_config: ccfg,
        normalizer,
        alert,
        admin,
        access,
        ready_file: args.ready_file.clone(),
        pause_file: args.pause_file.clone(),
        given: args.given.clone(),
        cfg,
    })
}

/// Lowers the admin rings to what the memory plan leaves them; a size asked for explicitly that
/// does not fit is said at start-up.
fn bound_admin_rings(admin: &mut AdminArgs, plan: &MemoryPlan) {
    let d = AdminArgs::default();
    for (flag, value, cap, default) in [
        (
            "--timeline-events",
            &mut admin.timeline_events,
            plan.timeline_events,
            d.timeline_events,
        ),
        (
            "--recent-violations",
            &mut admin.recent_violations,
            plan.recent_violations,
            d.recent_violations,
        ),
    ] {
        if *value > cap {
            if *value != default {
                tracing::warn!(
                    asked = *value,
                    kept = cap,
                    budget_bytes = plan.budget,
                    "{flag} {} does not fit the memory budget's share: keeping {cap} (raise                      --memory-budget to keep more)",
                    *value
                );
            }
            *value = cap;
        }
    }
}

/// Where the eBPF mode came from, as a log line names it: `--ebpf off`, or the config file's
/// `ebpf.mode: off` (no flag is blamed that was not given).
pub fn ebpf_mode_origin(given: &Given, mode: &str) -> String {
    if given.contains("ebpf") {
        format!("--ebpf {mode}")
    } else {
        format!("ebpf.mode: {mode} in --config")
    }
}

/// Settings that are valid but cannot do what they look like they do: said at start-up.
fn warn_about_pointless_settings(
    cfg: &RunConfig,
    admin: &AdminArgs,
    alert: &AlertConfig,
    role: Role,
    given: &Given,
) {
    if role != Role::Checker
        && cfg.ebpf.mode == EbpfMode::Off
        && !(cfg.ebpf.watch.is_empty() && cfg.ebpf.pid.is_empty())
    {
        tracing::warn!(
            watch = cfg.ebpf.watch.len(),
            pid = cfg.ebpf.pid.len(),
            "--watch/--pid select processes for the eBPF source, which is off ({}): they do \
             nothing",
            ebpf_mode_origin(given, "off")
        );
    }
    // The agent sends no alerts: its admin address is in no link.
    if role != Role::Agent
        && !admin.no_admin
        && admin.admin.ip().is_unspecified()
        && alert.external_url.is_none()
    {
        tracing::warn!(
            admin = %admin.admin,
            "alert links will say http://{}/…, which no receiver can open: give --external-url \
             (the address others reach this node's admin server at, e.g. http://NODE:{})",
            admin.admin,
            admin.admin.port()
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::config::ConfigFileError;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn args(config: Option<PathBuf>) -> RunArgs {
        let mut argv = vec!["revenant".to_string()];
        if let Some(c) = config {
            argv.push("--config".into());
            argv.push(c.display().to_string());
        }
        parse(&argv)
    }

    /// As `main` parses: with the explicitly given flags recorded.
    fn parse(argv: &[String]) -> RunArgs {
        use clap::{CommandFactory, FromArgMatches};
        let m = Cli::command().try_get_matches_from(argv).unwrap();
        let mut run = Cli::from_arg_matches(&m).unwrap().run;
        run.given = Given::from_matches(&m);
        run
    }

    fn write(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!(
            "revenant-run-cfg-{}-{name}.yaml",
            std::process::id()
        ));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn example_config_is_valid() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/otlp/run-config.yaml");
        let prepared = prepare(&args(Some(p))).unwrap();
        assert_eq!(
            prepared.cfg.otlp.grpc,
            Some("127.0.0.1:4317".parse().unwrap())
        );
        assert_eq!(prepared.cfg.normalize.generic.len(), 1);
        assert_eq!(
            prepared.cfg.normalize.sglang.completion_grace,
            Duration::from_secs(5)
        );
    }

    #[test]
    fn defaults_and_flag_overrides() {
        let p = prepare(&args(None)).unwrap();
        assert_eq!(p.cfg.otlp.grpc, Some("127.0.0.1:4317".parse().unwrap()));
        assert_eq!(p.cfg.otlp.http, Some("127.0.0.1:4318".parse().unwrap()));
        assert_eq!(p.cfg.otlp.max_message_bytes, 8 << 20);
        let mut a = args(None);
        a.otlp_grpc = Some("off".into());
        a.otlp_http = Some("127.0.0.1:9999".into());
        a.max_message_bytes = Some(64 << 20);
        let p = prepare(&a).unwrap();
        assert_eq!(p.cfg.otlp.grpc, None);
        assert_eq!(p.cfg.otlp.http, Some("127.0.0.1:9999".parse().unwrap()));
        assert!(p.cfg.otlp.max_decompressed_bytes >= 64 << 20);
    }

    #[test]
    fn bad_configs_are_refused_before_binding() {
        let typo = write("typo", "otlp:\n  grcp: 127.0.0.1:1\n");
        let e = prepare(&args(Some(typo))).err().unwrap().to_string();
        assert!(e.contains("grcp"), "{e}");
        let zero = write("zero", "channel_capacity: 0\n");
        assert!(matches!(
            prepare(&args(Some(zero))),
            Err(RunConfigError::Capacity)
        ));
        let same = write(
            "same",
            "otlp:\n  grpc: 127.0.0.1:7000\n  http: 127.0.0.1:7000\n",
        );
        assert!(matches!(
            prepare(&args(Some(same))),
            Err(RunConfigError::Otlp(_))
        ));
        let profile = write("profile", "normalize:\n  by_service_name: { x: sglangg }\n");
        assert!(matches!(
            prepare(&args(Some(profile))),
            Err(RunConfigError::Normalize(_))
        ));
        let mut a = args(None);
        a.otlp_grpc = Some("localhost".into());
        assert!(matches!(prepare(&a), Err(RunConfigError::Addr { .. })));
        assert!(matches!(
            prepare(&args(Some("/nonexistent/revenant.yaml".into()))),
            Err(RunConfigError::File(ConfigFileError::Read { .. }))
        ));
    }
}
