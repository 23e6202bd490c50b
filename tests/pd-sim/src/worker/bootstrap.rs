//! SGLang's prefill bootstrap server (`CommonKVBootstrapServer`,
//! `disaggregation/common/conn.py:3015`), the prefill's registration with it (`:1562`), and
//! decode's once-per-prefill lookup: two `GET /route` and the ZMTP registration (`:1293`,
//! `:2614`, `:2802`).

use super::*;
use crate::http::{GetError, py_json};
use crate::kvlink::Registration;

/// One registered prefill rank (`PrefillRankInfo`).
#[derive(Clone, Serialize)]
struct RankInfo {
    rank_ip: String,
    rank_port: u16,
}

/// What the server learned from its first registration (`_handle_route_put`, `:3089`).
#[derive(Default)]
struct Topology {
    attn_tp_size: Option<u64>,
    attn_cp_size: Option<u64>,
    dp_size: Option<u64>,
    pp_size: Option<u64>,
    page_size: Option<u64>,
    kv_cache_dtype: Option<String>,
    follow_bootstrap_room: Option<bool>,
    prefill_http_port: Option<u64>,
    decode_allocation_policy: String,
    /// (dp group, cp rank, tp rank, pp rank) → rank.
    ranks: HashMap<(i64, i64, i64, i64), RankInfo>,
    registered: u64,
    /// `/register_dp_rank`: room → dp rank.
    room_to_dp_rank: HashMap<u64, i64>,
}

impl Topology {
    /// `_is_ready` (`:3055`).
    fn ready(&self) -> bool {
        match (
            self.attn_tp_size,
            self.attn_cp_size,
            self.pp_size,
            self.dp_size,
        ) {
            (Some(tp), Some(cp), Some(pp), Some(dp)) => self.registered >= dp * cp * tp * pp,
            _ => false,
        }
    }
}

type Server = Arc<Mutex<Topology>>;

/// Serves `/route` (PUT, GET), `/register_dp_rank`, `/query_dp_ranks` and `/health` on `boot`.
pub(super) fn spawn_server(boot: TcpListener, w: Shared) {
    let topo: Server = Arc::new(Mutex::new(Topology {
        decode_allocation_policy: "early".into(),
        ..Default::default()
    }));
    let app = Router::new()
        .route(
            "/route",
            get(route_get)
                .put(route_put)
                .fallback(|| async { text(405, "Method not allowed", "application/json") }),
        )
        .route("/register_dp_rank", post(register_dp_rank))
        .route("/query_dp_ranks", post(query_dp_ranks))
        .route("/health", get(|| async { text(200, "OK", "text/plain") }))
        .layer(axum::Extension(w))
        .with_state(topo);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(boot, app).await {
            tracing::error!(error = %e, "bootstrap server failed");
        }
    });
}

/// aiohttp's `web.Response(text=…)` / `web.json_response(…)`.
fn text(status: u16, body: impl Into<String>, media: &str) -> Response {
    let mut r = (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        body.into(),
    )
        .into_response();
    if let Ok(v) = axum::http::HeaderValue::from_str(&format!("{media}; charset=utf-8")) {
        r.headers_mut().insert(axum::http::header::CONTENT_TYPE, v);
    }
    r
}

fn json(status: u16, body: String) -> Response {
    text(status, body, "application/json")
}

/// An aiohttp handler that raised (a missing key in a registration).
fn server_error() -> Response {
    text(
        500,
        "500 Internal Server Error\n\nServer got itself in trouble",
        "text/plain",
    )
}

/// `PUT /route` (`:3089`): a prefill rank registers itself. Every write counts, also one
/// repeating a rank; a second allocation policy is refused.
async fn route_put(
    State(topo): State<Server>,
    axum::Extension(w): axum::Extension<Shared>,
    body: Bytes,
) -> Response {
    w.stats.route_puts.fetch_add(1, Ordering::Relaxed);
    let Ok(data) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return server_error();
    };
    if let Some(room) = data.get("injected_room").and_then(|r| r.as_u64()) {
        // `--fault foreign-route-put`: the oracle of an intruder's write.
        w.stats.foreign_route_puts.fetch_add(1, Ordering::Relaxed);
        w.stats.faults_injected.fetch_add(1, Ordering::Relaxed);
        w.record(room, |r| r.foreign_route_puts += 1);
    }
    let int = |k: &str| data.get(k).and_then(|v| v.as_i64());
    let (
        Some(tp),
        Some(tp_rank),
        Some(cp),
        Some(cp_rank),
        Some(dp),
        Some(dp_rank),
        Some(pp),
        Some(pp_rank),
        Some(sys_dp),
        Some(sys_dp_rank),
        Some(rank_ip),
        Some(rank_port),
        Some(page_size),
    ) = (
        int("attn_tp_size"),
        int("attn_tp_rank"),
        int("attn_cp_size"),
        int("attn_cp_rank"),
        int("attn_dp_size"),
        int("attn_dp_rank"),
        int("pp_size"),
        int("pp_rank"),
        int("system_dp_size"),
        int("system_dp_rank"),
        data.get("rank_ip").and_then(|v| v.as_str()),
        data.get("rank_port").and_then(|v| {
            v.as_u64()
                .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
        }),
        int("page_size"),
    )
    else {
        return server_error();
    };
    if data.get("kv_cache_dtype").is_none() {
        return server_error();
    }
    let policy = data
        .get("decode_allocation_policy")
        .and_then(|v| v.as_str())
        .unwrap_or("early")
        .to_string();
    let mut t = topo.lock().expect("bootstrap lock");
    if t.registered > 0 && t.decode_allocation_policy != policy {
        return text(
            400,
            "Inconsistent prefill allocation policies",
            "text/plain",
        );
    }
    t.decode_allocation_policy = policy;
    let set = |slot: &mut Option<u64>, v: i64| {
        if slot.is_none() {
            *slot = Some(v.max(0) as u64);
        }
    };
    set(&mut t.attn_tp_size, tp);
    set(&mut t.attn_cp_size, cp);
    set(&mut t.dp_size, if sys_dp == 1 { dp } else { sys_dp });
    set(&mut t.pp_size, pp);
    set(&mut t.page_size, page_size);
    if t.kv_cache_dtype.is_none() {
        t.kv_cache_dtype = data
            .get("kv_cache_dtype")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
    }
    if t.prefill_http_port.is_none() {
        t.prefill_http_port = data.get("prefill_http_port").and_then(|v| v.as_u64());
    }
    if t.follow_bootstrap_room.is_none() {
        let m = data
            .get("load_balance_method")
            .and_then(|v| v.as_str())
            .unwrap_or("follow_bootstrap_room");
        t.follow_bootstrap_room = Some(m == "follow_bootstrap_room");
    }
    let dp_group = if sys_dp == 1 { dp_rank } else { sys_dp_rank };
    t.ranks.insert(
        (dp_group, cp_rank, tp_rank, pp_rank),
        RankInfo {
            rank_ip: rank_ip.to_string(),
            rank_port: rank_port as u16,
        },
    );
    t.registered += 1;
    text(200, "OK", "text/plain")
}

#[derive(Deserialize)]
pub(super) struct RouteQuery {
    prefill_dp_rank: Option<String>,
    prefill_cp_rank: Option<String>,
    target_tp_rank: Option<String>,
    target_pp_rank: Option<String>,
}

/// `PrefillServerInfo` as `dataclasses.asdict` orders it (`:120`), `kv_layout` and
/// `dsv41_spec_layout` left out when unset (`:3234`).
#[derive(Serialize)]
struct ServerInfo<'a> {
    attn_tp_size: u64,
    attn_cp_size: u64,
    dp_size: u64,
    pp_size: u64,
    page_size: Option<u64>,
    kv_cache_dtype: Option<&'a str>,
    follow_bootstrap_room: bool,
    enable_dsa_cache_layer_split: bool,
    decode_allocation_policy: &'a str,
    enable_kv_cache_sharding: bool,
    prefill_http_port: Option<u64>,
    target_tp_rank: Option<u64>,
    target_tp_ranks: Option<Vec<u64>>,
    target_cp_ranks: Option<Vec<u64>>,
    target_pp_ranks: Option<Vec<u64>>,
    required_dst_info_num: Option<u64>,
    required_prefill_response_num: Option<u64>,
}

/// `GET /route` (`:3188`): `…=-1` everywhere → the server's parallel info; otherwise the rank's
/// `{rank_ip, rank_port}`.
async fn route_get(State(topo): State<Server>, Query(q): Query<RouteQuery>) -> Response {
    let missing = || text(400, "Missing inputs for bootstrap server.", "text/plain");
    let (Some(dp), Some(cp), Some(tp), Some(pp)) = (
        q.prefill_dp_rank.filter(|s| !s.is_empty()),
        q.prefill_cp_rank.filter(|s| !s.is_empty()),
        q.target_tp_rank.filter(|s| !s.is_empty()),
        q.target_pp_rank.filter(|s| !s.is_empty()),
    ) else {
        return missing();
    };
    let (Ok(dp), Ok(cp), Ok(tp), Ok(pp)) = (
        dp.parse::<i64>(),
        cp.parse::<i64>(),
        tp.parse::<i64>(),
        pp.parse::<i64>(),
    ) else {
        // `int()` raising in the handler.
        return server_error();
    };
    let t = topo.lock().expect("bootstrap lock");
    if !t.ready() {
        return text(
            503,
            format!(
                "Prefill server not fully registered yet ({} workers registered).",
                t.registered
            ),
            "text/plain",
        );
    }
    if (dp, cp, tp, pp) == (-1, -1, -1, -1) {
        let info = ServerInfo {
            attn_tp_size: t.attn_tp_size.unwrap_or(1),
            attn_cp_size: t.attn_cp_size.unwrap_or(1),
            dp_size: t.dp_size.unwrap_or(1),
            pp_size: t.pp_size.unwrap_or(1),
            page_size: t.page_size,
            kv_cache_dtype: t.kv_cache_dtype.as_deref(),
            follow_bootstrap_room: t.follow_bootstrap_room.unwrap_or(true),
            enable_dsa_cache_layer_split: false,
            decode_allocation_policy: &t.decode_allocation_policy,
            enable_kv_cache_sharding: false,
            prefill_http_port: t.prefill_http_port,
            target_tp_rank: None,
            target_tp_ranks: None,
            target_cp_ranks: None,
            target_pp_ranks: None,
            required_dst_info_num: None,
            required_prefill_response_num: None,
        };
        return json(200, py_json(&info));
    }
    match t.ranks.get(&(dp, cp, tp, pp)) {
        Some(r) => json(200, py_json(r)),
        None => text(
            404,
            format!(
                "Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
            ),
            "text/plain",
        ),
    }
}

/// `POST /register_dp_rank` (`:3261`).
async fn register_dp_rank(State(topo): State<Server>, body: Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return server_error();
    };
    let (Some(room), Some(dp)) = (
        v.get("bootstrap_room").and_then(|r| r.as_u64()),
        v.get("dp_rank").and_then(|r| r.as_i64()),
    ) else {
        return server_error();
    };
    topo.lock()
        .expect("bootstrap lock")
        .room_to_dp_rank
        .insert(room, dp);
    text(200, "OK", "text/plain")
}

/// `POST /query_dp_ranks` (`:3273`).
async fn query_dp_ranks(State(topo): State<Server>, body: Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return server_error();
    };
    let Some(rooms) = v.get("bootstrap_rooms").and_then(|r| r.as_array()) else {
        return server_error();
    };
    let t = topo.lock().expect("bootstrap lock");
    let mut out = serde_json::Map::new();
    for r in rooms.iter().filter_map(|r| r.as_u64()) {
        if let Some(dp) = t.room_to_dp_rank.get(&r) {
            out.insert(r.to_string(), (*dp).into());
        }
    }
    json(200, py_json(&out))
}

/// A prefill rank's registration, the payload of `register_to_bootstrap` (`:1584`) in its key
/// order, as `requests.put(json=…)` sends it; `injected_room` marks an intruder's write
/// (`--fault foreign-route-put`, the oracle; SGLang ignores unknown keys).
pub fn registration_body(
    rank_ip: IpAddr,
    rank_port: u16,
    prefill_http_port: u16,
    policy: &str,
    injected_room: Option<u64>,
) -> String {
    #[derive(Serialize)]
    struct Put<'a> {
        attn_tp_size: u8,
        attn_tp_rank: u8,
        attn_cp_size: u8,
        attn_cp_rank: u8,
        attn_dp_size: u8,
        attn_dp_rank: u8,
        pp_size: u8,
        pp_rank: u8,
        system_dp_size: u8,
        system_dp_rank: u8,
        rank_ip: String,
        rank_port: u16,
        page_size: u8,
        kv_cache_dtype: &'a str,
        kv_layout: Option<&'a str>,
        dsv41_spec_layout: Option<&'a str>,
        load_balance_method: &'a str,
        enable_dsa_cache_layer_split: bool,
        enable_kv_cache_sharding: bool,
        prefill_http_port: u16,
        decode_allocation_policy: &'a str,
        #[serde(skip_serializing_if = "Option::is_none")]
        injected_room: Option<u64>,
    }
    py_json(&Put {
        attn_tp_size: 1,
        attn_tp_rank: 0,
        attn_cp_size: 1,
        attn_cp_rank: 0,
        attn_dp_size: 1,
        attn_dp_rank: 0,
        pp_size: 1,
        pp_rank: 0,
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: rank_ip.to_string(),
        rank_port,
        page_size: 1,
        kv_cache_dtype: "auto",
        kv_layout: None,
        dsv41_spec_layout: None,
        load_balance_method: "follow_bootstrap_room",
        enable_dsa_cache_layer_split: false,
        enable_kv_cache_sharding: false,
        prefill_http_port,
        decode_allocation_policy: policy,
        injected_room,
    })
}

/// What decode knows of a prefill after its lookup (`PrefillServerInfo` and the rank).
#[derive(Clone, Debug)]
pub(super) struct PrefillPeer {
    /// Prefill's rank port, where every decode → prefill frame goes.
    pub(super) rank: SocketAddr,
    pub(super) policy: String,
}

impl Worker {
    /// The rank address this worker announces (`--advertise-kv-port` puts a tap in front).
    pub(super) fn advertised_rank(&self) -> SocketAddr {
        SocketAddr::new(
            self.kv_addr.ip(),
            self.args.advertise_kv_port.unwrap_or(self.kv_addr.port()),
        )
    }

    /// `PUT /route` to its own bootstrap server, as each SGLang prefill rank does at start.
    async fn put_route(&self) -> Result<(), String> {
        let rank = self.advertised_rank();
        let body = registration_body(
            rank.ip(),
            rank.port(),
            self.http_port,
            self.policy.as_str(),
            None,
        );
        let req = hyper::Request::put(format!("http://{}/route", self.boot_addr))
            .header("content-type", "application/json")
            .body(http_body_util::Full::new(Bytes::from(body)))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(5), self.client.request(req))
            .await
            .map_err(|_| "timed out".to_string())?
            .map_err(|e| e.to_string())?;
        let status = resp.status();
        let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
        if status.is_success() {
            Ok(())
        } else {
            Err(format!("answered {status}"))
        }
    }

    /// Registration at start, with SGLang's retries (`_register_topology_row`, `:1635`).
    pub(super) async fn register_own_rank(&self) -> anyhow::Result<()> {
        let mut delay = Duration::from_millis(100);
        let mut last = String::new();
        for _ in 0..5 {
            match self.put_route().await {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            tokio::time::sleep(delay).await;
            delay *= 2;
        }
        anyhow::bail!("prefill could not register with its bootstrap server: {last}")
    }

    /// `--fault foreign-route-put`, for `room`'s request: prefill registers its own rank again
    /// (a member's write, which a monitor must leave alone), then asks the cluster for an
    /// intruder's write.
    pub(super) fn foreign_route_put(self: &Arc<Self>, room: u64) {
        let Some(launcher) = self.args.faults.fault_intruder else {
            return;
        };
        let w = self.clone();
        tokio::spawn(async move {
            if let Err(e) = w.put_route().await {
                tracing::warn!(error = %e, "own registration failed");
            }
            crate::fault::request_intruder(
                launcher,
                room,
                w.advertised_rank(),
                w.http_port,
                w.policy.as_str(),
            );
        });
    }

    /// What decode knows of the prefill behind `host:port`, looked up once: `GET /route` with
    /// every rank -1 (the parallel info, `:1302`), `GET /route` for rank (0, 0, 0, 0) (`:2700`),
    /// then the ZMTP registration to that rank (`:2802`). Concurrent first requests wait for
    /// the one lookup; a failed lookup is tried again by the next request.
    pub(super) async fn prefill_peer(&self, host: &str, port: u16) -> Result<PrefillPeer, String> {
        let key = format!("{host}:{port}");
        let cell = self
            .peers
            .lock()
            .expect("peers lock")
            .entry(key.clone())
            .or_default()
            .clone();
        cell.get_or_try_init(|| self.look_up(&key))
            .await
            .cloned()
            .inspect_err(|_| {
                self.stats.route_failures.fetch_add(1, Ordering::Relaxed);
            })
    }

    async fn look_up(&self, key: &str) -> Result<PrefillPeer, String> {
        self.stats.route_lookups.fetch_add(1, Ordering::Relaxed);
        let get = |q: &'static str| {
            let uri = format!(
                "http://{key}/route?prefill_dp_rank={q}&prefill_cp_rank={q}&target_tp_rank={q}&target_pp_rank={q}"
            );
            async move {
                let (status, body) = crate::http::get(&self.client, &uri, Duration::from_secs(5))
                    .await
                    .map_err(|e| match e {
                        GetError::Timeout => "bootstrap server timed out".to_string(),
                        GetError::Failed(e) => e,
                    })?;
                if !status.is_success() {
                    return Err(format!(
                        "Failed to get prefill server info: {}, {}",
                        status.as_u16(),
                        String::from_utf8_lossy(&body)
                    ));
                }
                serde_json::from_slice::<serde_json::Value>(&body).map_err(|e| e.to_string())
            }
        };
        let info = get("-1").await?;
        let policy = info
            .get("decode_allocation_policy")
            .and_then(|v| v.as_str())
            .unwrap_or("early")
            .to_string();
        let rank = get("0").await?;
        let ip: IpAddr = rank
            .get("rank_ip")
            .and_then(|v| v.as_str())
            .ok_or("no rank_ip")?
            .parse()
            .map_err(|e| format!("bad rank_ip: {e}"))?;
        let port = rank
            .get("rank_port")
            .and_then(|v| v.as_u64())
            .ok_or("no rank_port")?;
        let rank = SocketAddr::new(ip, port as u16);
        let reg = self.registration();
        self.pushers.send(rank, &reg.frames()).await;
        self.stats.registrations.fetch_add(1, Ordering::Relaxed);
        Ok(PrefillPeer { rank, policy })
    }

    /// Decode's registration (`mooncake/conn.py:3215`): its KV and metadata buffers.
    pub(super) fn registration(&self) -> Registration {
        let mut t = self.decode.lock().expect("decode lock");
        Registration {
            ip: self.kv_addr.ip().to_string(),
            port: self.advertised_rank().port(),
            session_id: self.session_id(),
            kv_ptrs: t.kv_ptrs.to_vec(),
            aux_ptrs: vec![t.aux_ptr],
            kv_item_len: t.kv_item_len(self.args.kv_bytes_per_token),
        }
    }

    /// The Mooncake session id: `host:port` of decode's transfer engine.
    pub(super) fn session_id(&self) -> String {
        self.te_addr.to_string()
    }
}
