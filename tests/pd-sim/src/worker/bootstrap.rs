//! The prefill bootstrap server (`GET`/`PUT /route`) and decode's cached lookup of prefill's
//! KV endpoint through it.

use super::*;
use crate::http::GetError;

/// Serves `GET`/`PUT /route` and `/health` on `boot`, announcing `advertised` as prefill's KV
/// endpoint.
pub(super) fn spawn_server(boot: TcpListener, advertised: SocketAddr, w: Shared) {
    let app = Router::new()
        .route("/route", get(route_get).put(route_put))
        .route("/health", get(|| async { "OK" }))
        .layer(axum::Extension(w))
        .with_state(Arc::new(Mutex::new(advertised)));
    tokio::spawn(async move {
        if let Err(e) = axum::serve(boot, app).await {
            tracing::error!(error = %e, "bootstrap server failed");
        }
    });
}

#[derive(Deserialize)]
pub(super) struct RouteQuery {
    pub(super) engine_rank: Option<String>,
    pub(super) target_dp_group: Option<String>,
}

/// SGLang's bootstrap `GET /route`: `engine_rank=-1&target_dp_group=-1` → parallel info;
/// otherwise the rank's `{rank_ip, rank_port}`.
pub(super) async fn route_get(
    State(addr): State<Arc<Mutex<SocketAddr>>>,
    Query(q): Query<RouteQuery>,
) -> Response {
    let (Some(rank), Some(group)) = (q.engine_rank, q.target_dp_group) else {
        return (
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server.",
        )
            .into_response();
    };
    let (Ok(rank), Ok(group)) = (rank.parse::<i64>(), group.parse::<i64>()) else {
        return (
            StatusCode::BAD_REQUEST,
            "Missing inputs for bootstrap server.",
        )
            .into_response();
    };
    if rank == -1 && group == -1 {
        return axum::Json(serde_json::json!({"prefill_tp_size": 1, "prefill_dp_size": 1}))
            .into_response();
    }
    if rank != 0 || group != 0 {
        return (StatusCode::NOT_FOUND, "Bootstrap info not Found").into_response();
    }
    let a = *addr.lock().expect("route lock");
    axum::Json(serde_json::json!({"rank_ip": a.ip().to_string(), "rank_port": a.port()}))
        .into_response()
}

/// Registration of a prefill rank (`PUT /route`). The simulator has one rank, registered at
/// start; a PUT replaces its address, which is how SGLang ranks announce themselves.
pub(super) async fn route_put(
    State(addr): State<Arc<Mutex<SocketAddr>>>,
    axum::Extension(w): axum::Extension<Shared>,
    body: Bytes,
) -> Response {
    #[derive(Deserialize)]
    pub(super) struct Put {
        role: String,
        rank_ip: String,
        rank_port: u16,
        /// `--fault foreign-route-put`: an intruder's write, caused by this room's request.
        #[serde(default)]
        injected_room: Option<u64>,
    }
    w.stats.route_puts.fetch_add(1, Ordering::Relaxed);
    if let Ok(Put {
        injected_room: Some(room),
        ..
    }) = serde_json::from_slice::<Put>(&body)
    {
        w.stats.foreign_route_puts.fetch_add(1, Ordering::Relaxed);
        w.stats.faults_injected.fetch_add(1, Ordering::Relaxed);
        w.record(room, |r| r.foreign_route_puts += 1);
    }
    match serde_json::from_slice::<Put>(&body) {
        Ok(p) if p.role == "Prefill" => match p.rank_ip.parse::<IpAddr>() {
            Ok(ip) => {
                *addr.lock().expect("route lock") = SocketAddr::new(ip, p.rank_port);
                (StatusCode::OK, "OK").into_response()
            }
            Err(_) => (StatusCode::BAD_REQUEST, "bad rank_ip").into_response(),
        },
        Ok(_) => (StatusCode::OK, "OK").into_response(),
        Err(e) => (StatusCode::BAD_REQUEST, format!("bad registration: {e}")).into_response(),
    }
}

impl Worker {
    /// `--fault foreign-route-put`, for `room`'s request: prefill registers its own rank again
    /// (a member's write, which a monitor must leave alone), then asks the cluster for an
    /// intruder's write.
    pub(super) fn foreign_route_put(self: &Arc<Self>, room: u64) {
        let Some(launcher) = self.args.faults.fault_intruder else {
            return;
        };
        let Some(kv) = *self.kv_addr.lock().expect("kv addr lock") else {
            return;
        };
        let rank = SocketAddr::new(kv.ip(), self.args.advertise_kv_port.unwrap_or(kv.port()));
        let w = self.clone();
        tokio::spawn(async move {
            let body = crate::fault::registration(rank.ip(), rank.port(), None);
            let req = hyper::Request::put(format!("http://{}/route", w.boot_addr))
                .header("content-type", "application/json")
                .body(http_body_util::Full::new(Bytes::from(body)));
            match req {
                Ok(req) => match w.client.request(req).await {
                    Ok(resp) if resp.status().is_success() => {
                        let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
                    }
                    Ok(resp) => {
                        tracing::warn!(status = %resp.status(), "own registration refused")
                    }
                    Err(e) => tracing::warn!(error = %e, "own registration failed"),
                },
                Err(e) => tracing::warn!(error = %e, "own registration request"),
            }
            crate::fault::request_intruder(launcher, room, rank);
        });
    }

    /// Prefill's KV endpoint for a bootstrap server, looked up once and cached (SGLang caches
    /// the bootstrap info per prefill address, too).
    pub(super) async fn prefill_endpoint(
        &self,
        host: &str,
        port: u16,
    ) -> Result<SocketAddr, String> {
        let key = format!("{host}:{port}");
        if let Some(a) = self.routes.lock().expect("routes lock").get(&key) {
            return Ok(*a);
        }
        self.stats.route_lookups.fetch_add(1, Ordering::Relaxed);
        let uri = format!("http://{key}/route?engine_rank=0&target_dp_group=0");
        let (status, body) = crate::http::get(&self.client, &uri, Duration::from_secs(5))
            .await
            .map_err(|e| match e {
                GetError::Timeout => "bootstrap server timed out".to_string(),
                GetError::Failed(e) => e,
            })?;
        if !status.is_success() {
            return Err(format!("bootstrap server answered {status}"));
        }
        #[derive(Deserialize)]
        struct Info {
            rank_ip: String,
            rank_port: u16,
        }
        let info: Info = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
        let ip: IpAddr = info
            .rank_ip
            .parse()
            .map_err(|e| format!("bad rank_ip: {e}"))?;
        let addr = SocketAddr::new(ip, info.rank_port);
        self.routes.lock().expect("routes lock").insert(key, addr);
        Ok(addr)
    }
}
