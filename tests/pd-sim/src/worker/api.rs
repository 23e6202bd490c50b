//! SGLang's worker HTTP API: the `/generate` and `/v1/chat/completions` bodies, the info
//! routes (`/server_info`, `/model_info`, `/v1/models`) and the simulator's `/sim/*` views.

use super::trace::ReqTrace;
use super::*;

#[derive(Deserialize)]
pub(super) struct SamplingParams {
    pub(super) max_new_tokens: Option<u64>,
}

#[derive(Deserialize)]
pub(super) struct GenerateBody {
    pub(super) text: Option<serde_json::Value>,
    pub(super) input_ids: Option<Vec<serde::de::IgnoredAny>>,
    pub(super) sampling_params: Option<SamplingParams>,
    pub(super) stream: Option<bool>,
    pub(super) rid: Option<String>,
    pub(super) bootstrap_room: Option<u64>,
    pub(super) bootstrap_host: Option<String>,
    pub(super) bootstrap_port: Option<u16>,
}

#[derive(Deserialize)]
pub(super) struct ChatMessage {
    pub(super) content: Option<serde_json::Value>,
}

#[derive(Deserialize)]
pub(super) struct ChatBody {
    pub(super) messages: Vec<ChatMessage>,
    pub(super) max_tokens: Option<u64>,
    pub(super) max_completion_tokens: Option<u64>,
    pub(super) stream: Option<bool>,
    pub(super) rid: Option<String>,
    pub(super) bootstrap_room: Option<u64>,
    pub(super) bootstrap_host: Option<String>,
    pub(super) bootstrap_port: Option<u16>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Generate,
    Chat,
}

pub(super) struct Parsed {
    pub(super) api: Api,
    pub(super) input_tokens: u64,
    pub(super) max_new_tokens: Option<u64>,
    pub(super) stream: bool,
    pub(super) rid: Option<String>,
    pub(super) room: Option<u64>,
    pub(super) bootstrap: Option<(String, u16)>,
}

pub(super) fn text_tokens(v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_tokens(s),
        serde_json::Value::Array(a) => a.iter().map(text_tokens).sum(),
        serde_json::Value::Object(o) => o.get("text").map(text_tokens).unwrap_or(0),
        _ => 0,
    }
}

/// serde_json's messages can quote the offending value (i.e. prompt text): say only where
/// and what kind of error it was.
pub(super) fn body_error(e: serde_json::Error) -> String {
    let kind = match e.classify() {
        serde_json::error::Category::Io => "io",
        serde_json::error::Category::Syntax => "syntax",
        serde_json::error::Category::Data => "data",
        serde_json::error::Category::Eof => "eof",
    };
    format!(
        "invalid request body: {kind} error at line {} column {}",
        e.line(),
        e.column()
    )
}

pub(super) fn parse_body(api: Api, body: &[u8]) -> Result<Parsed, String> {
    match api {
        Api::Generate => {
            let b: GenerateBody = serde_json::from_slice(body).map_err(body_error)?;
            let input_tokens = match (&b.text, &b.input_ids) {
                (Some(t), _) => text_tokens(t),
                (None, Some(ids)) => ids.len() as u64,
                (None, None) => return Err("Either text or input_ids should be provided.".into()),
            };
            Ok(Parsed {
                api,
                input_tokens,
                max_new_tokens: b.sampling_params.and_then(|s| s.max_new_tokens),
                stream: b.stream.unwrap_or(false),
                rid: b.rid,
                room: b.bootstrap_room,
                bootstrap: b.bootstrap_host.zip(b.bootstrap_port),
            })
        }
        Api::Chat => {
            let b: ChatBody = serde_json::from_slice(body).map_err(body_error)?;
            let input_tokens = b
                .messages
                .iter()
                .filter_map(|m| m.content.as_ref())
                .map(text_tokens)
                .sum();
            Ok(Parsed {
                api,
                input_tokens,
                max_new_tokens: b.max_completion_tokens.or(b.max_tokens),
                stream: b.stream.unwrap_or(false),
                rid: b.rid,
                room: b.bootstrap_room,
                bootstrap: b.bootstrap_host.zip(b.bootstrap_port),
            })
        }
    }
}

/// The worker's HTTP routes; `/server_info` reports `boot_port` and `http_port`.
pub(super) fn routes(w: &Shared, boot_port: u16, http_port: u16) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/health_generate", get(|| async { StatusCode::OK }))
        .route("/server_info", get(server_info))
        .route("/get_server_info", get(server_info))
        .route("/model_info", get(model_info))
        .route("/get_model_info", get(model_info))
        .route("/v1/models", get(models))
        .route("/sim/stats", get(sim_stats))
        .route("/sim/rooms", get(sim_rooms))
        .layer(axum::Extension(Arc::new(BootstrapPort(
            boot_port, http_port,
        ))))
        // Last, so it covers every route above.
        .layer(axum::extract::DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(w.clone())
}

pub(super) async fn server_info(
    State(w): State<Shared>,
    axum::Extension(bp): axum::Extension<Arc<BootstrapPort>>,
) -> Response {
    let mut v = w.server_info(bp.0);
    v["port"] = bp.1.into();
    axum::Json(v).into_response()
}

pub(super) async fn model_info(State(w): State<Shared>) -> Response {
    axum::Json(serde_json::json!({
        "model_path": w.args.model_path,
        "tokenizer_path": w.args.model_path,
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }))
    .into_response()
}

pub(super) async fn models(State(w): State<Shared>) -> Response {
    axum::Json(serde_json::json!({
        "object": "list",
        "data": [{"id": w.args.model_path, "object": "model", "owned_by": "sglang", "root": w.args.model_path,
                  "max_model_len": w.args.context_length}],
    }))
    .into_response()
}

pub(super) async fn sim_stats(State(w): State<Shared>) -> Response {
    let l = &w.link_stats;
    axum::Json(serde_json::json!({
        "role": w.role.as_str(),
        "worker": &w.stats,
        "inflight": w.inflight.load(Ordering::Relaxed),
        "pending_rooms": w.pending.lock().map(|p| p.len()).unwrap_or(0),
        "kv_link": {
            "messages_sent": l.messages_sent.load(Ordering::Relaxed),
            "messages_lost": l.messages_lost.load(Ordering::Relaxed),
            "connect_failures": l.connect_failures.load(Ordering::Relaxed),
            "messages_received": l.messages_received.load(Ordering::Relaxed),
            "bad_connections": l.bad_connections.load(Ordering::Relaxed),
        },
        "otlp": &*w.spans.stats,
    }))
    .into_response()
}

#[derive(Deserialize)]
pub(super) struct RoomsQuery {
    pub(super) room: Option<u64>,
}

pub(super) async fn sim_rooms(State(w): State<Shared>, Query(q): Query<RoomsQuery>) -> Response {
    let log = w.rooms.lock().expect("rooms lock");
    let recs: Vec<&RoomRecord> = match q.room {
        Some(r) => log.map.get(&r).into_iter().collect(),
        None => log.order.iter().filter_map(|r| log.map.get(r)).collect(),
    };
    axum::Json(recs).into_response()
}

pub(super) async fn generate(
    State(w): State<Shared>,
    conn: Option<axum::Extension<ClientConn>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(w, Api::Generate, conn.map(|c| c.0), headers, body).await
}

pub(super) async fn chat(
    State(w): State<Shared>,
    conn: Option<axum::Extension<ClientConn>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(w, Api::Chat, conn.map(|c| c.0), headers, body).await
}

pub(super) async fn serve(
    w: Shared,
    api: Api,
    conn: Option<ClientConn>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let t0 = now_ns();
    w.stats.requests.fetch_add(1, Ordering::Relaxed);
    let p = match parse_body(api, &body) {
        Ok(p) => p,
        Err(msg) => {
            w.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return error_response(StatusCode::BAD_REQUEST, &msg);
        }
    };
    drop(body);
    let rid = p.rid.clone().unwrap_or_else(new_rid);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let tp = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let mut trace = ReqTrace::new(w.spans.enabled(), tp);
    trace.input_tokens = p.input_tokens;
    match w.role {
        Role::Prefill => super::prefill::prefill(w, p, rid, request_id, trace, t0).await,
        Role::Decode => super::decode::decode(w, p, rid, request_id, conn, trace, t0).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_generate_text_and_bootstrap_fields() {
        let b = br#"{"text":"a b c","sampling_params":{"max_new_tokens":4},"stream":false,"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":9066467638188682269}"#;
        let p = parse_body(Api::Generate, b).unwrap();
        assert_eq!(p.input_tokens, 3);
        assert_eq!(p.max_new_tokens, Some(4));
        assert_eq!(p.room, Some(9066467638188682269));
        assert_eq!(p.bootstrap, Some(("127.0.0.1".into(), 8998)));
    }

    #[test]
    fn parses_chat_messages() {
        let b = br#"{"model":"m","messages":[{"role":"user","content":"one two"},{"role":"user","content":[{"type":"text","text":"three"}]}],"max_tokens":2}"#;
        let p = parse_body(Api::Chat, b).unwrap();
        assert_eq!(p.input_tokens, 3);
        assert_eq!(p.max_new_tokens, Some(2));
    }

    #[test]
    fn garbage_body_is_an_error_that_does_not_quote_the_prompt() {
        assert!(parse_body(Api::Generate, b"\x00\xff").is_err());
        let Err(msg) = parse_body(
            Api::Generate,
            br#"{"text": "secret words", "stream": "CANARY"}"#,
        ) else {
            panic!("a string stream flag is invalid")
        };
        assert!(!msg.contains("CANARY") && !msg.contains("secret"), "{msg}");
        assert!(parse_body(Api::Generate, b"{}").is_err());
    }
}
