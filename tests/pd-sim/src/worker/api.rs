//! SGLang's worker HTTP API: the `/generate`, `/v1/completions` and `/v1/chat/completions`
//! bodies and how one body becomes sub-requests, the info routes (`/server_info`,
//! `/model_info`, `/v1/models`) and the simulator's `/sim/*` views.
//!
//! One body, several sub-requests (`managers/io_struct.py`): a batch (`text`/`input_ids`/
//! `prompt` a list) has one sub-request per prompt, each with its own rid (`{rid}_{i}` for a
//! string rid, `:759`) and room: a scalar `bootstrap_room` becomes `room + i`, a list is taken
//! as is (`:925`). With `n > 1` (parallel sampling) the tokenizer first sends one prefix-caching
//! sub-request per prompt (`max_new_tokens` 0) and waits for it, then `n` samples per prompt, all
//! copies of the prompt's sub-request: the prefix request and every sample of prompt `i` carry
//! room `room + i`, each with a fresh uuid rid (`managers/tokenizer_manager.py:2130`). SGLang runs
//! the samples concurrently on that one room; pd-sim runs them one after the other (see README).

use super::*;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Api {
    Generate,
    Chat,
    Completions,
}

/// One sub-request of a body.
#[derive(Clone, Debug)]
pub(super) struct Sub {
    /// Its place in the answer.
    pub(super) index: usize,
    pub(super) rid: String,
    pub(super) room: Option<u64>,
    pub(super) input_tokens: u64,
    pub(super) max_new_tokens: u64,
    /// The prefix-caching request of parallel sampling (not part of the answer).
    pub(super) prefix: bool,
}

pub(super) struct Parsed {
    pub(super) api: Api,
    pub(super) stream: bool,
    /// A single prompt without parallel sampling: the answer is one object, not a list.
    pub(super) is_single: bool,
    /// Parallel sampling `n`.
    pub(super) n: usize,
    pub(super) subs: Vec<Sub>,
    pub(super) bootstrap: Option<(String, u16)>,
}

impl Parsed {
    /// The first room of the body (the one a router drew).
    #[cfg(test)]
    pub(super) fn room(&self) -> Option<u64> {
        self.subs.first().and_then(|s| s.room)
    }
    /// Every sub-request names SGLang's fake bootstrap host: no KV moves.
    pub(super) fn fake_transfer(&self) -> bool {
        self.bootstrap
            .as_ref()
            .is_some_and(|(h, _)| h == FAKE_BOOTSTRAP_HOST)
    }
    /// The sub-requests of prompt `i`, in the order SGLang sends them.
    pub(super) fn groups(&self) -> Vec<Vec<Sub>> {
        if self.n <= 1 {
            return self.subs.iter().map(|s| vec![s.clone()]).collect();
        }
        self.subs.chunks(self.n + 1).map(|c| c.to_vec()).collect()
    }
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

/// The prompts of a body: `Some(list of token counts)`, or an error message. A single prompt
/// (a string, or a list of token ids) is one element; `single` says which it was.
fn prompts(v: &serde_json::Value, ids: bool) -> Option<(Vec<u64>, bool)> {
    match v {
        serde_json::Value::String(s) if !ids => Some((vec![count_tokens(s)], true)),
        serde_json::Value::Array(a) if a.is_empty() => None,
        serde_json::Value::Array(a) if a[0].is_number() => Some((vec![a.len() as u64], true)),
        serde_json::Value::Array(a) => {
            let mut out = Vec::with_capacity(a.len());
            for x in a {
                match x {
                    serde_json::Value::String(s) if !ids => out.push(count_tokens(s)),
                    serde_json::Value::Array(t) => out.push(t.len() as u64),
                    _ => return None,
                }
            }
            Some((out, false))
        }
        _ => None,
    }
}

fn as_u64(v: Option<&serde_json::Value>) -> Option<u64> {
    v.and_then(|v| v.as_u64())
}

pub(super) fn parse_body(api: Api, body: &[u8], default_max_new: u64) -> Result<Parsed, String> {
    let v: serde_json::Value = serde_json::from_slice(body).map_err(body_error)?;
    let obj = v.as_object().ok_or("request body must be a JSON object")?;
    let (lens, single) = match api {
        Api::Generate => match (obj.get("text"), obj.get("input_ids")) {
            (Some(t), _) if !t.is_null() => prompts(t, false),
            (_, Some(i)) if !i.is_null() => prompts(i, true),
            _ => return Err("Either text or input_ids should be provided.".into()),
        },
        Api::Completions => obj.get("prompt").and_then(|p| prompts(p, false)),
        Api::Chat => {
            let msgs = obj
                .get("messages")
                .and_then(|m| m.as_array())
                .ok_or("messages should be provided")?;
            let n = msgs
                .iter()
                .filter_map(|m| m.get("content"))
                .map(text_tokens)
                .sum();
            Some((vec![n], true))
        }
    }
    .ok_or("the prompt is neither a string, token ids, nor a list of them")?;
    let stream = match obj.get("stream") {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(_) => return Err("invalid request body: stream must be a boolean".into()),
    };
    let sp = obj.get("sampling_params");
    let sp0 = match sp {
        Some(serde_json::Value::Array(a)) => a.first(),
        other => other,
    };
    let (n, max_new) = match api {
        Api::Generate => (
            as_u64(sp0.and_then(|s| s.get("n"))).unwrap_or(1),
            as_u64(sp0.and_then(|s| s.get("max_new_tokens"))),
        ),
        _ => (
            as_u64(obj.get("n")).unwrap_or(1),
            as_u64(obj.get("max_completion_tokens")).or(as_u64(obj.get("max_tokens"))),
        ),
    };
    let n = n.max(1) as usize;
    let max_new = max_new.unwrap_or(default_max_new);
    let bootstrap = match (obj.get("bootstrap_host"), as_u64(obj.get("bootstrap_port"))) {
        (Some(serde_json::Value::String(h)), Some(p)) => Some((h.clone(), p as u16)),
        (Some(serde_json::Value::String(h)), None) if h == FAKE_BOOTSTRAP_HOST => {
            Some((h.clone(), 0))
        }
        _ => None,
    };
    let batch = lens.len();
    let num = batch * n;
    // `_normalize_bootstrap_params` (`io_struct.py:907`).
    let room_of = |k: usize| -> Option<u64> {
        match obj.get("bootstrap_room") {
            Some(serde_json::Value::Number(r)) => r.as_u64().map(|r| r.wrapping_add(k as u64)),
            Some(serde_json::Value::Array(a)) if !a.is_empty() => a[k % a.len()].as_u64(),
            _ => None,
        }
    };
    let rid = obj.get("rid");
    let is_single = single && n == 1;
    let mut subs = Vec::with_capacity(num + batch);
    if n == 1 {
        for (i, &tokens) in lens.iter().enumerate() {
            // `_normalize_rid` (`io_struct.py:759`).
            let rid = match rid {
                Some(serde_json::Value::String(s)) if is_single => s.clone(),
                Some(serde_json::Value::String(s)) => format!("{s}_{i}"),
                Some(serde_json::Value::Array(a)) => a
                    .get(i)
                    .and_then(|r| r.as_str())
                    .map(str::to_owned)
                    .unwrap_or_else(new_rid),
                _ => new_rid(),
            };
            subs.push(Sub {
                index: i,
                rid,
                room: room_of(i),
                input_tokens: tokens,
                max_new_tokens: max_new,
                prefix: false,
            });
        }
    } else {
        for (i, &tokens) in lens.iter().enumerate() {
            let room = room_of(i);
            subs.push(Sub {
                index: usize::MAX,
                rid: new_rid(),
                room,
                input_tokens: tokens,
                max_new_tokens: 0,
                prefix: true,
            });
            for j in 0..n {
                subs.push(Sub {
                    index: i * n + j,
                    rid: new_rid(),
                    room,
                    input_tokens: tokens,
                    max_new_tokens: max_new,
                    prefix: false,
                });
            }
        }
    }
    Ok(Parsed {
        api,
        stream,
        is_single,
        n,
        subs,
        bootstrap,
    })
}

/// The worker's HTTP routes; `/server_info` reports `boot_port` and `http_port`.
pub(super) fn routes(w: &Shared, boot_port: u16, http_port: u16) -> Router {
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
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
    let (prefill_rooms, decode_rooms) = (
        w.prefill.lock().map(|p| p.len()).unwrap_or(0),
        w.decode.lock().map(|d| d.len()).unwrap_or(0),
    );
    axum::Json(serde_json::json!({
        "role": w.role.as_str(),
        "decode_allocation_policy": w.policy.as_str(),
        "worker": &w.stats,
        "inflight": w.inflight.load(Ordering::Relaxed),
        "pending_rooms": if w.role == Role::Prefill { prefill_rooms } else { decode_rooms },
        "kv_link": {
            "messages_sent": l.messages_sent.load(Ordering::Relaxed),
            "messages_lost": l.messages_lost.load(Ordering::Relaxed),
            "connect_failures": l.connect_failures.load(Ordering::Relaxed),
            "messages_received": l.messages_received.load(Ordering::Relaxed),
            "bad_connections": l.bad_connections.load(Ordering::Relaxed),
        },
        "transfer_engine": &*w.te_stats,
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

pub(super) async fn completions(
    State(w): State<Shared>,
    conn: Option<axum::Extension<ClientConn>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    serve(w, Api::Completions, conn.map(|c| c.0), headers, body).await
}

/// What a role's handler gets: the parsed body and the request's context.
pub(super) struct Ctx {
    pub(super) request_id: Option<String>,
    pub(super) conn: Option<ClientConn>,
    /// The caller's trace context: every sub-request's root span is a child of it.
    pub(super) tp: Option<TraceParent>,
    pub(super) t0: u64,
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
    let p = match parse_body(api, &body, w.args.default_max_new_tokens) {
        Ok(p) => p,
        Err(msg) => {
            w.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
            return render::error_answer(
                api,
                &render::Refusal {
                    status: 400,
                    message: msg,
                    err_type: Some("BadRequestError"),
                },
            );
        }
    };
    drop(body);
    w.stats
        .sub_requests
        .fetch_add(p.subs.len() as u64, Ordering::Relaxed);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let tp = headers
        .get("traceparent")
        .and_then(|v| v.to_str().ok())
        .and_then(TraceParent::parse);
    let ctx = Ctx {
        request_id,
        conn,
        tp,
        t0,
    };
    match w.role {
        Role::Prefill => super::prefill::serve(w, p, ctx).await,
        Role::Decode => super::decode::serve(w, p, ctx).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_generate_text_and_bootstrap_fields() {
        let b = br#"{"text":"a b c","sampling_params":{"max_new_tokens":4},"stream":false,"bootstrap_host":"127.0.0.1","bootstrap_port":8998,"bootstrap_room":9066467638188682269}"#;
        let p = parse_body(Api::Generate, b, 16).unwrap();
        assert!(p.is_single);
        assert_eq!(p.subs.len(), 1);
        assert_eq!(p.subs[0].input_tokens, 3);
        assert_eq!(p.subs[0].max_new_tokens, 4);
        assert_eq!(p.room(), Some(9066467638188682269));
        assert_eq!(p.bootstrap, Some(("127.0.0.1".into(), 8998)));
    }

    #[test]
    fn a_batch_owns_room_plus_i_and_rid_underscore_i() {
        let b = br#"{"text":["a b","c d e"],"rid":"r","bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":100}"#;
        let p = parse_body(Api::Generate, b, 16).unwrap();
        assert!(!p.is_single);
        let got: Vec<_> = p
            .subs
            .iter()
            .map(|s| (s.rid.as_str(), s.room, s.input_tokens))
            .collect();
        assert_eq!(got, [("r_0", Some(100), 2), ("r_1", Some(101), 3)]);
    }

    #[test]
    fn parallel_sampling_shares_the_prompts_room_after_a_prefix_request() {
        let b = br#"{"text":"a b","sampling_params":{"n":3,"max_new_tokens":2},"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#;
        let p = parse_body(Api::Generate, b, 16).unwrap();
        assert!(!p.is_single);
        assert_eq!(p.subs.len(), 4);
        assert!(p.subs[0].prefix && p.subs[0].max_new_tokens == 0);
        assert!(p.subs.iter().all(|s| s.room == Some(7)));
        let rids: std::collections::HashSet<_> = p.subs.iter().map(|s| &s.rid).collect();
        assert_eq!(rids.len(), 4, "a fresh rid each");
        assert_eq!(p.groups().len(), 1);
        let chat = br#"{"messages":[{"role":"user","content":"x y"}],"n":2,"bootstrap_host":"h","bootstrap_port":1,"bootstrap_room":7}"#;
        assert_eq!(parse_body(Api::Chat, chat, 16).unwrap().subs.len(), 3);
    }

    #[test]
    fn parses_chat_and_completions() {
        let b = br#"{"model":"m","messages":[{"role":"user","content":"one two"},{"role":"user","content":[{"type":"text","text":"three"}]}],"max_tokens":2}"#;
        let p = parse_body(Api::Chat, b, 16).unwrap();
        assert_eq!(p.subs[0].input_tokens, 3);
        assert_eq!(p.subs[0].max_new_tokens, 2);
        let c = br#"{"model":"m","prompt":["a","b c"],"max_tokens":1}"#;
        let p = parse_body(Api::Completions, c, 16).unwrap();
        assert_eq!(p.subs.len(), 2);
    }

    #[test]
    fn garbage_body_is_an_error_that_does_not_quote_the_prompt() {
        assert!(parse_body(Api::Generate, b"\x00\xff", 16).is_err());
        let Err(msg) = parse_body(
            Api::Generate,
            br#"{"text": "secret words", "stream": "CANARY"}"#,
            16,
        ) else {
            panic!("a string stream flag is invalid")
        };
        assert!(!msg.contains("CANARY") && !msg.contains("secret"), "{msg}");
        assert!(parse_body(Api::Generate, b"{}", 16).is_err());
    }
}
