//! `pd-sim cluster`: prefill, decode and router as three child processes of this binary.
//!
//! Children are started in dependency order, each one's READY line (stdout) gives its bound
//! ports, and the cluster prints its own READY line with all of them. On Ctrl-C/SIGTERM, or
//! when any child dies, every child gets SIGTERM, then SIGKILL after a grace period. Children
//! also get PR_SET_PDEATHSIG so a killed cluster does not leave strays behind.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::router::Mode;

#[derive(clap::Args, Clone, Debug)]
pub struct ClusterArgs {
    /// Wire formats: SGLang's (default) or vLLM's (router modes correct and
    /// handoff-after-reject).
    #[arg(long, value_enum, default_value_t = crate::Flavour::Sglang)]
    pub flavour: crate::Flavour,
    #[arg(long, value_enum, default_value_t = Mode::Correct)]
    pub mode: Mode,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The prefill's address, as on a node of its own (SGLang flavour) [default: --host].
    #[arg(long)]
    pub prefill_host: Option<String>,
    /// The decode's address [default: --host].
    #[arg(long)]
    pub decode_host: Option<String>,
    /// The router's address [default: --host].
    #[arg(long)]
    pub router_host: Option<String>,
    #[arg(long, default_value_t = 30000)]
    pub router_port: u16,
    #[arg(long, default_value_t = 30001)]
    pub prefill_port: u16,
    #[arg(long, default_value_t = 30002)]
    pub decode_port: u16,
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// Prefill's ZMTP PULL port (announced by the bootstrap server as `rank_port`).
    #[arg(long, default_value_t = 30011)]
    pub prefill_kv_port: u16,
    /// Decode's ZMTP PULL port (its `rank_port`, named in its registration, destinations and
    /// ABORTs).
    #[arg(long, default_value_t = 30012)]
    pub decode_kv_port: u16,
    /// Decode's transfer engine port (its Mooncake session id names it; prefill writes the KV
    /// there).
    #[arg(long, default_value_t = 30022)]
    pub decode_te_port: u16,
    /// SGLang's --disaggregation-decode-allocation-policy, given to both workers.
    #[arg(
        long = "decode-allocation-policy",
        visible_alias = "disaggregation-decode-allocation-policy",
        value_enum,
        default_value_t = crate::worker::AllocationPolicy::Early
    )]
    pub decode_allocation_policy: crate::worker::AllocationPolicy,
    /// vLLM flavour: prefill's side-channel port (`kv_transfer_params.remote_port`).
    #[arg(long, default_value_t = 5600)]
    pub prefill_side_channel_port: u16,
    /// vLLM flavour: decode's side-channel port (every NIXL worker binds one; a Mooncake
    /// decode binds none).
    #[arg(long, default_value_t = 5601)]
    pub decode_side_channel_port: u16,
    /// vLLM flavour: the KV connector of workers and router. `mooncake`: prefill hosts the
    /// Mooncake bootstrap server on `--bootstrap-port` and its sender ROUTER on
    /// `--prefill-side-channel-port`; the router sends `transfer_id`s; decode pulls.
    #[arg(long, value_enum, default_value_t = crate::vllm::KvConnector::Nixl)]
    pub kv_connector: crate::vllm::KvConnector,
    /// vLLM flavour, mooncake: `VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT` of both workers (how
    /// long prefill holds a pull for a request it never prefilled, e.g. one it refused), s.
    #[arg(long, default_value_t = 480)]
    pub mooncake_abort_request_timeout_secs: u64,
    /// Bind every port ephemerally (tests); the READY line tells which ports were taken.
    #[arg(long)]
    pub ephemeral: bool,
    /// OTLP/HTTP endpoint given to all three processes.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// Extra arguments for the prefill worker (whitespace-separated), override the defaults.
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub prefill_args: String,
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub decode_args: String,
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    pub router_args: String,
    /// Tokio worker threads of each child. One each measured best on a 2-core box (fewer
    /// cross-thread wakeups; see bench/throughput.sh).
    #[arg(long, default_value_t = 1)]
    pub child_threads: usize,
    /// Start only prefill and decode (put another router, e.g. the real sglang-router, in front).
    #[arg(long)]
    pub no_router: bool,
    /// Isolation breaches, passed to both workers (each acts on its own role's).
    #[command(flatten)]
    pub faults: crate::fault::FaultArgs,
}

struct Proc {
    name: &'static str,
    child: Child,
    pid: u32,
    ready: serde_json::Value,
}

pub(crate) fn command(sub: &str, args: Vec<String>) -> Command {
    let exe = std::env::current_exe().unwrap_or_else(|_| "pd-sim".into());
    let mut c = Command::new(exe);
    c.arg(sub)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true);
    // Own process group: a terminal Ctrl-C reaches only the cluster, which then stops the
    // children in order (otherwise a child dying of SIGINT first would look like a crash).
    // PDEATHSIG covers the cluster itself being killed.
    // SAFETY: setpgid and prctl are async-signal-safe and touch no memory of the parent.
    unsafe {
        c.pre_exec(|| {
            libc::setpgid(0, 0);
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
            Ok(())
        });
    }
    c
}

async fn start(name: &'static str, sub: &str, args: Vec<String>) -> anyhow::Result<Proc> {
    let mut child = command(sub, args).spawn()?;
    let pid = child.id().unwrap_or(0);
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("{name}: no stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let ready = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(line) = lines.next_line().await? {
            if let Some(j) = line.strip_prefix("READY ") {
                return Ok::<_, anyhow::Error>(serde_json::from_str::<serde_json::Value>(j)?);
            }
        }
        anyhow::bail!("{name} exited before it was ready")
    })
    .await
    .map_err(|_| anyhow::anyhow!("{name} not ready within 30 s"))??;
    // Keep draining so a chatty child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Ok(Proc {
        name,
        child,
        pid,
        ready,
    })
}

fn split(s: &str) -> Vec<String> {
    s.split_whitespace().map(str::to_owned).collect()
}

async fn stop_all(procs: &mut [Proc]) {
    for p in procs.iter() {
        if p.pid != 0 {
            // SAFETY: plain kill(2) on a pid we spawned and have not reaped yet.
            unsafe {
                libc::kill(p.pid as i32, libc::SIGTERM);
            }
        }
    }
    for p in procs.iter_mut() {
        match tokio::time::timeout(Duration::from_secs(5), p.child.wait()).await {
            Ok(_) => {}
            Err(_) => {
                tracing::warn!(name = p.name, "did not stop on SIGTERM; killing");
                let _ = p.child.kill().await;
            }
        }
    }
}

pub async fn run(a: ClusterArgs) -> anyhow::Result<()> {
    a.faults.validate()?;
    let vllm = a.flavour == crate::Flavour::Vllm;
    if let Some(f) = a
        .faults
        .faults
        .iter()
        .find(|f| crate::fault::FaultArgs::vllm_only(**f) != vllm)
    {
        anyhow::bail!(
            "--fault {} is not a fault of the {} flavour",
            f.as_str(),
            if vllm { "vLLM" } else { "SGLang" }
        );
    }
    if !vllm && a.kv_connector != crate::vllm::KvConnector::Nixl {
        anyhow::bail!("--kv-connector is a vLLM flavour flag");
    }
    if vllm {
        return run_vllm(a).await;
    }
    let port = |p: u16| if a.ephemeral { 0 } else { p };
    let mut common = vec!["--threads".to_string(), a.child_threads.max(1).to_string()];
    if let Some(e) = &a.otlp_endpoint {
        common.push("--otlp-endpoint".to_string());
        common.push(e.clone());
    }
    let mut procs: Vec<Proc> = Vec::new();
    // `--fault foreign-route-put`: this process starts the intruders prefill asks for (it is
    // none of the cluster's workers, and no monitor follows it into its children).
    let intruders = if a
        .faults
        .faults
        .contains(&crate::fault::Fault::ForeignRoutePut)
    {
        Some(tokio::net::UdpSocket::bind(("127.0.0.1", 0)).await?)
    } else {
        None
    };
    let mut prefill_faults = a.faults.clone();
    if let Some(s) = &intruders {
        prefill_faults.fault_intruder = Some(s.local_addr()?);
    }
    let result = async {
        // Prefill: a KV pool of 8192 tokens but inputs capped at 4096, so over-capacity
        // prompts (4097..8191 words) pass the tokenizer and are rejected by the scheduler,
        // as in the fixtures. Decode is provisioned larger, as decode nodes usually are.
        let prefill_host = a.prefill_host.clone().unwrap_or_else(|| a.host.clone());
        let decode_host = a.decode_host.clone().unwrap_or_else(|| a.host.clone());
        let router_host = a.router_host.clone().unwrap_or_else(|| a.host.clone());
        let mut pargs = vec![
            "--host".into(),
            prefill_host.clone(),
            "--port".into(),
            port(a.prefill_port).to_string(),
            "--disaggregation-bootstrap-port".into(),
            port(a.bootstrap_port).to_string(),
            "--kv-port".into(),
            port(a.prefill_kv_port).to_string(),
            "--context-length".into(),
            "8192".into(),
            "--max-total-num-tokens".into(),
            "8192".into(),
            "--max-req-input-len".into(),
            "4096".into(),
        ];
        pargs.extend([
            "--decode-allocation-policy".to_string(),
            a.decode_allocation_policy.as_str().to_string(),
        ]);
        if a.mode == Mode::HandoffAfterReject {
            pargs.push("--transfer-after-reject".into());
        }
        if !a.no_router && matches!(a.mode, Mode::Correct | Mode::HandoffAfterReject) {
            // The sequential modes wait for prefill's verdict before they contact decode.
            pargs.push("--status-at-admission".into());
        }
        pargs.extend(common.clone());
        pargs.extend(prefill_faults.to_args());
        pargs.extend(split(&a.prefill_args));
        let prefill = start("prefill", "prefill", pargs).await?;
        let p_port = prefill.ready["port"].as_u64().unwrap_or(0);
        let b_port = prefill.ready["bootstrap_port"].as_u64().unwrap_or(0);
        procs.push(prefill);
        if let Some(sock) = intruders {
            let ip: std::net::IpAddr = prefill_host.parse()?;
            let bootstrap = std::net::SocketAddr::new(ip, b_port as u16);
            tokio::spawn(crate::fault::launch_intruders(sock, bootstrap));
        }

        let mut dargs = vec![
            "--host".into(),
            decode_host.clone(),
            "--port".into(),
            port(a.decode_port).to_string(),
            "--kv-port".into(),
            port(a.decode_kv_port).to_string(),
            "--te-port".into(),
            port(a.decode_te_port).to_string(),
            "--decode-allocation-policy".into(),
            a.decode_allocation_policy.as_str().to_string(),
            "--context-length".into(),
            "32768".into(),
            "--max-total-num-tokens".into(),
            "65536".into(),
        ];
        dargs.extend(common.clone());
        dargs.extend(a.faults.to_args());
        dargs.extend(split(&a.decode_args));
        let decode = start("decode", "decode", dargs).await?;
        let d_port = decode.ready["port"].as_u64().unwrap_or(0);
        procs.push(decode);

        if a.no_router {
            return Ok::<(), anyhow::Error>(());
        }
        let mut rargs = vec![
            "--host".into(),
            router_host,
            "--port".into(),
            port(a.router_port).to_string(),
            "--mode".into(),
            serde_json::to_value(a.mode)?
                .as_str()
                .unwrap_or("correct")
                .to_string(),
            "--prefill".into(),
            format!("http://{prefill_host}:{p_port}"),
            "--bootstrap-port".into(),
            b_port.to_string(),
            "--decode".into(),
            format!("http://{decode_host}:{d_port}"),
        ];
        rargs.extend(common.clone());
        rargs.extend(a.faults.to_args());
        rargs.extend(split(&a.router_args));
        let router = start("router", "router", rargs).await?;
        procs.push(router);
        Ok::<(), anyhow::Error>(())
    }
    .await;
    if let Err(e) = result {
        stop_all(&mut procs).await;
        return Err(e);
    }
    announce(
        &a,
        &procs,
        None,
        &[
            ("bootstrap_port", "prefill", "bootstrap_port"),
            ("prefill_kv_port", "prefill", "kv_port"),
            ("decode_kv_port", "decode", "kv_port"),
            ("decode_te_port", "decode", "te_port"),
            (
                "decode_allocation_policy",
                "decode",
                "decode_allocation_policy",
            ),
        ],
        ("bootstrap port", "bootstrap_port"),
    )?;
    supervise(procs).await
}

/// Prints the cluster's READY line: role, flavour, mode, the three HTTP addresses and pids, and
/// `fields` (cluster key, child, child key) from the children's own READY lines; then a line for
/// people naming `port` (its label and cluster key). Returns what it printed.
fn announce(
    a: &ClusterArgs,
    procs: &[Proc],
    flavour: Option<&str>,
    fields: &[(&str, &str, &str)],
    port: (&str, &str),
) -> anyhow::Result<serde_json::Value> {
    let field = |n: &str, k: &str| {
        procs
            .iter()
            .find(|p| p.name == n)
            .map(|p| p.ready[k].clone())
            .unwrap_or(serde_json::Value::Null)
    };
    let mut ready = serde_json::json!({
        "role": "cluster",
        "mode": if a.no_router { serde_json::Value::Null } else { serde_json::to_value(a.mode)? },
        "router": field("router", "http"),
        "prefill": field("prefill", "http"),
        "decode": field("decode", "http"),
        "pids": {"router": field("router", "pid"), "prefill": field("prefill", "pid"), "decode": field("decode", "pid")},
    });
    if let Some(f) = flavour {
        ready["flavour"] = f.into();
    }
    for (key, child, child_key) in fields {
        ready[*key] = field(child, child_key);
    }
    crate::serve::print_ready(ready.clone());
    let mode = if a.no_router {
        "no router".to_string()
    } else {
        format!("{:?}", a.mode)
    };
    eprintln!(
        "pd-sim cluster ({}{mode}) ready: router {} prefill {} decode {} {} {}",
        flavour.map(|f| format!("{f}, ")).unwrap_or_default(),
        ready["router"],
        ready["prefill"],
        ready["decode"],
        port.0,
        ready[port.1]
    );
    Ok(ready)
}

/// Wait for a signal or a child's death, then stop every child.
async fn supervise(mut procs: Vec<Proc>) -> anyhow::Result<()> {
    let exited = {
        let waits = procs.iter_mut().map(|p| {
            let name = p.name;
            Box::pin(async move { (name, p.child.wait().await) })
        });
        tokio::select! {
            _ = crate::serve::shutdown_signal() => None,
            ((name, s), _, _) = futures_util::future::select_all(waits) => Some((name, s)),
        }
    };
    stop_all(&mut procs).await;
    if let Some((name, status)) = exited {
        anyhow::bail!("{name} exited unexpectedly ({status:?}); cluster stopped");
    }
    Ok(())
}

/// `cluster --flavour vllm`: vLLM-flavoured prefill (`--max-model-len 4096`) and decode
/// (`--max-model-len 32768`), each with KV capacity for one request of its limit, and the
/// vLLM-flavoured router. Over-long prompts are rejected by prefill; decode, provisioned
/// larger, admits them (which is what `handoff-after-reject` relies on).
async fn run_vllm(a: ClusterArgs) -> anyhow::Result<()> {
    if !matches!(
        a.mode,
        Mode::Correct | Mode::HandoffAfterReject | Mode::ReuseKvParams | Mode::ForgeKvParams
    ) {
        anyhow::bail!(
            "--flavour vllm supports --mode correct, handoff-after-reject, reuse-kv-params and \
             forge-kv-params"
        );
    }
    let port = |p: u16| if a.ephemeral { 0 } else { p };
    let mut common = vec!["--threads".to_string(), a.child_threads.max(1).to_string()];
    if let Some(e) = &a.otlp_endpoint {
        common.push("--otlp-endpoint".to_string());
        common.push(e.clone());
    }
    let worker = |p: u16, side: u16, len: u64, extra: &str| {
        let mut v: Vec<String> = vec![
            "--flavour".into(),
            "vllm".into(),
            "--host".into(),
            a.host.clone(),
            "--port".into(),
            port(p).to_string(),
            "--side-channel-port".into(),
            port(side).to_string(),
            "--max-model-len".into(),
            len.to_string(),
            "--num-gpu-blocks".into(),
            len.div_ceil(16).to_string(),
            "--block-size".into(),
            "16".into(),
            "--kv-connector".into(),
            a.kv_connector.as_str().into(),
            "--mooncake-abort-request-timeout-secs".into(),
            a.mooncake_abort_request_timeout_secs.to_string(),
        ];
        v.extend(common.clone());
        v.extend(split(extra));
        v
    };
    let mut procs: Vec<Proc> = Vec::new();
    let result = async {
        let mut pargs = worker(
            a.prefill_port,
            a.prefill_side_channel_port,
            4096,
            &a.prefill_args,
        );
        pargs.extend(a.faults.to_args());
        pargs.extend([
            "--disaggregation-bootstrap-port".into(),
            port(a.bootstrap_port).to_string(),
        ]);
        procs.push(start("prefill", "prefill", pargs).await?);
        let dargs = worker(
            a.decode_port,
            a.decode_side_channel_port,
            32768,
            &a.decode_args,
        );
        procs.push(start("decode", "decode", dargs).await?);
        if a.no_router {
            return Ok::<(), anyhow::Error>(());
        }
        let url = |i: usize| procs[i].ready["http"].as_str().unwrap_or("").to_string();
        let mut rargs = vec![
            "--flavour".into(),
            "vllm".into(),
            "--host".into(),
            a.host.clone(),
            "--port".into(),
            port(a.router_port).to_string(),
            "--mode".into(),
            serde_json::to_value(a.mode)?
                .as_str()
                .unwrap_or("correct")
                .to_string(),
            "--prefill".into(),
            url(0),
            "--decode".into(),
            url(1),
            "--kv-connector".into(),
            a.kv_connector.as_str().into(),
        ];
        if let Some(b) = procs[0].ready["bootstrap_port"].as_u64() {
            rargs.extend(["--bootstrap-port".into(), b.to_string()]);
        }
        rargs.extend(common.clone());
        rargs.extend(split(&a.router_args));
        procs.push(start("router", "router", rargs).await?);
        Ok(())
    }
    .await;
    if let Err(e) = result {
        stop_all(&mut procs).await;
        return Err(e);
    }
    announce(
        &a,
        &procs,
        Some("vllm"),
        &[
            ("side_channel_port", "prefill", "side_channel_port"),
            ("prefill_side_channel_port", "prefill", "side_channel_port"),
            ("decode_side_channel_port", "decode", "side_channel_port"),
            ("prefill_max_model_len", "prefill", "max_model_len"),
            ("decode_max_model_len", "decode", "max_model_len"),
            ("kv_connector", "prefill", "kv_connector"),
            ("bootstrap_port", "prefill", "bootstrap_port"),
        ],
        ("side channel port", "side_channel_port"),
    )?;
    supervise(procs).await
}
