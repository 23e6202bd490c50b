//! vLLM's request and response bodies: `/v1/completions`, `/v1/chat/completions`,
//! `/generate`, `kv_transfer_params`, the error envelope, `/v1/models` and `/metrics`.
//! Answers are serialized from structs, so their keys come in vLLM's order.

use axum::http::StatusCode;
use axum::response::Response;
use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::http::json_response;
use crate::ids::{count_tokens, now_ns};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    Completions,
    Chat,
    Generate,
}

impl Api {
    /// The prefix of the request name N (`cmpl-X`, `chatcmpl-X`).
    pub fn prefix(self) -> &'static str {
        match self {
            Api::Chat => "chatcmpl-",
            Api::Completions | Api::Generate => "cmpl-",
        }
    }
}

/// `kv_transfer_params` as a worker reads them from a request: the router's
/// `{do_remote_decode: true, …: null}` on the prefill leg, prefill's answer on the decode leg
/// (or anything else a client sends). Read leniently, as vLLM keeps them as a plain dict.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_block_ids: Option<serde_json::Value>,
    #[serde(default)]
    pub remote_request_id: Option<String>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default)]
    pub tp_size: Option<u64>,
    /// Mooncake: the router's id of the transfer, on both legs.
    #[serde(default)]
    pub transfer_id: Option<String>,
    /// Mooncake: prefill's bootstrap server (`http://host:port`), on the decode leg.
    #[serde(default)]
    pub remote_bootstrap_addr: Option<String>,
}

impl KvTransferParams {
    /// The fields decode needs before it pulls (`nixl/pull_scheduler.py:135-187`): without
    /// them vLLM logs "Got invalid KVTransferParams" and computes the prompt itself.
    pub fn pull_target(&self) -> Option<(&str, &str, &str, u16)> {
        let blocks = self
            .remote_block_ids
            .as_ref()
            .is_some_and(|b| !b.is_null() && b.as_array().is_none_or(|a| !a.is_empty()));
        match (
            blocks,
            &self.remote_engine_id,
            &self.remote_request_id,
            &self.remote_host,
            self.remote_port,
        ) {
            (true, Some(e), Some(r), Some(h), Some(p)) => Some((e, r, h, p)),
            _ => None,
        }
    }

    /// Mooncake: `(remote_engine_id, remote_bootstrap_addr, transfer_id)`, all non-empty, or
    /// "Got invalid KVTransferParams" (`mooncake_connector.py:1217-1243`).
    pub fn mooncake_target(&self) -> Option<(&str, &str, &str)> {
        fn f(v: &Option<String>) -> Option<&str> {
            v.as_deref().filter(|s| !s.is_empty())
        }
        Some((
            f(&self.remote_engine_id)?,
            f(&self.remote_bootstrap_addr)?,
            f(&self.transfer_id)?,
        ))
    }
}

/// The `kv_transfer_params` a NIXL prefill answers with, field for field as
/// `NixlPullConnectorScheduler.request_finished` builds them (`nixl/pull_scheduler.py:281-296`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IssuedParams {
    pub do_remote_prefill: bool,
    pub do_remote_decode: bool,
    /// One list per KV cache group (`BlockIds`); a plain model has one group.
    pub remote_block_ids: Vec<Vec<u64>>,
    pub remote_engine_id: String,
    /// Prefill's internal id of the request (`<engine id>-<8 hex>`).
    pub remote_request_id: String,
    /// The NIXL side channel (`VLLM_NIXL_SIDE_CHANNEL_HOST`/`_PORT`), not HTTP.
    pub remote_host: String,
    pub remote_port: u16,
    pub tp_size: u64,
    pub dcp_size: u64,
    pub pp_size: u64,
    /// `request.num_computed_tokens`: the prompt.
    pub remote_num_tokens: u64,
    /// Set only for blocks pinned on a decode node (turn-2 readback); null on prefill.
    pub remote_blocks_expiry_time: Option<f64>,
    pub remote_registration_generation: u64,
    pub transfer_mode: &'static str,
}

#[derive(Deserialize)]
struct Message {
    content: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Body {
    prompt: Option<serde_json::Value>,
    /// `/generate` also takes SGLang-style `text`.
    text: Option<serde_json::Value>,
    messages: Option<Vec<Message>>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    stream: Option<bool>,
    kv_transfer_params: Option<KvTransferParams>,
}

/// One prompt of a request: its token count, and whether it came as text (which vLLM's
/// tokenizer truncates at max_model_len + 1 before the length check) or as token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub tokens: u64,
    pub text: bool,
}

/// What a worker needs from a request body (never the prompt text itself).
#[derive(Debug)]
pub struct Parsed {
    pub api: Api,
    /// One per engine request: a completions batch (`prompt: [..]`) has several.
    pub prompts: Vec<Prompt>,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    /// The name the request gave its output limit (chat: `max_completion_tokens` wins).
    pub max_tokens_param: &'static str,
    pub stream: bool,
    pub kv: Option<KvTransferParams>,
}

fn tokens(v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_tokens(s),
        serde_json::Value::Array(a) if a.iter().all(|x| x.is_number()) => a.len() as u64,
        serde_json::Value::Array(a) => a.iter().map(tokens).sum(),
        serde_json::Value::Object(o) => o.get("text").map(tokens).unwrap_or(0),
        _ => 0,
    }
}

/// A completions `prompt`: a string, a list of token ids, or a batch of either.
fn prompts(v: &serde_json::Value) -> Vec<Prompt> {
    use serde_json::Value as V;
    match v {
        V::Array(a) if !a.is_empty() && a.iter().all(|x| x.is_string() || x.is_array()) => a
            .iter()
            .map(|p| Prompt {
                tokens: tokens(p),
                text: p.is_string(),
            })
            .collect(),
        V::Array(a) if a.iter().all(|x| x.is_number()) => vec![Prompt {
            tokens: a.len() as u64,
            text: false,
        }],
        other => vec![Prompt {
            tokens: tokens(other),
            text: true,
        }],
    }
}

/// Why a body was refused (400 before the engine). The message never quotes the body.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BodyError {
    #[error("invalid request body: {kind} error at line {line} column {column}")]
    Json {
        kind: &'static str,
        line: usize,
        column: usize,
    },
    #[error("{0}")]
    Missing(&'static str),
}

impl From<serde_json::Error> for BodyError {
    fn from(e: serde_json::Error) -> Self {
        let kind = match e.classify() {
            serde_json::error::Category::Io => "io",
            serde_json::error::Category::Syntax => "syntax",
            serde_json::error::Category::Data => "data",
            serde_json::error::Category::Eof => "eof",
        };
        BodyError::Json {
            kind,
            line: e.line(),
            column: e.column(),
        }
    }
}

pub fn parse(api: Api, body: &[u8]) -> Result<Parsed, BodyError> {
    let b: Body = serde_json::from_slice(body)?;
    let prompts = match api {
        Api::Chat => vec![Prompt {
            tokens: b
                .messages
                .ok_or(BodyError::Missing("messages is required"))?
                .iter()
                .filter_map(|m| m.content.as_ref())
                .map(tokens)
                .sum(),
            text: true,
        }],
        Api::Completions | Api::Generate => prompts(
            b.prompt
                .as_ref()
                .or(b.text.as_ref())
                .ok_or(BodyError::Missing("prompt is required"))?,
        ),
    };
    let (max_tokens, max_tokens_param) = match (api, b.max_completion_tokens) {
        (Api::Chat, Some(m)) => (Some(m), "max_completion_tokens"),
        _ => (b.max_tokens.or(b.max_completion_tokens), "max_tokens"),
    };
    Ok(Parsed {
        api,
        prompt_tokens: prompts.iter().map(|p| p.tokens).sum(),
        prompts,
        max_tokens,
        max_tokens_param,
        stream: b.stream.unwrap_or(false),
        kv: b.kv_transfer_params,
    })
}

/// Which error envelope and length rule a worker follows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ErrorShape {
    /// vLLM ≥ 0.10.1: `{"error":{message,type,param,code}}`; a prompt longer than
    /// max_model_len is refused, a max_tokens that does not fit next to it is clamped.
    #[default]
    Current,
    /// vLLM before 0.10.1: flat `{"object":"error",…}`; refused when prompt + max_tokens >
    /// max_model_len ("you requested N tokens (P in the messages, C in the completion)").
    Legacy,
}

/// A refusal: its message and the parameter vLLM names (`VLLMValidationError.parameter`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<&'static str>,
}

impl Refusal {
    pub fn bad_request(message: String, param: Option<&'static str>) -> Refusal {
        Refusal {
            status: StatusCode::BAD_REQUEST,
            message,
            param,
        }
    }
}

/// `str(VLLMValidationError)`: the message, then ` (parameter=…, value=…)`
/// (`vllm/exceptions.py:49-56`); `create_error_response` puts that string in the body.
fn validation(message: String, param: &'static str, value: u64) -> Refusal {
    Refusal::bad_request(
        format!("{message} (parameter={param}, value={value})"),
        Some(param),
    )
}

/// vLLM's length rules: `Ok(max_tokens)` (clamped) or the refusal, per `shape`.
/// `default_max` stands for the model's generation config when the request names no limit.
pub fn check_length(
    p: &Parsed,
    max_model_len: u64,
    shape: ErrorShape,
    default_max: u64,
) -> Result<u64, Refusal> {
    let l = max_model_len;
    if shape == ErrorShape::Legacy {
        let c = p.max_tokens.unwrap_or(default_max);
        let prompt = p.prompts.iter().map(|x| x.tokens).max().unwrap_or(0);
        if prompt.saturating_add(c) > l {
            return Err(Refusal::bad_request(
                format!(
                    "This model's maximum context length is {l} tokens. However, you requested {} tokens ({prompt} in the messages, {c} in the completion). Please reduce the length of the messages or completion.",
                    prompt.saturating_add(c)
                ),
                None,
            ));
        }
        return Ok(c);
    }
    // TokenizeParams.__post_init__ (`renderers/params.py:268-282`), before any tokenizing.
    let out = p.max_tokens.unwrap_or(0);
    if out > l {
        return Err(validation(
            format!(
                "{}={out} cannot be greater than max_model_len={l}. Please request fewer output tokens.",
                p.max_tokens_param
            ),
            p.max_tokens_param,
            out,
        ));
    }
    // `_token_len_check` (`renderers/params.py:536-553`): text is tokenized with
    // `max_length = max_model_len + 1` (`get_encode_kwargs`), so an over-long text prompt is
    // reported as "at least L+1"; token ids keep their count.
    for prompt in &p.prompts {
        if prompt.tokens > l {
            let count = if prompt.text { l + 1 } else { prompt.tokens };
            let qualifier = if count == l + 1 { "at least " } else { "" };
            return Err(validation(
                format!(
                    "This model's maximum context length is {l} tokens. However, your prompt contains {qualifier}{count} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt."
                ),
                "input_tokens",
                count,
            ));
        }
    }
    // `get_max_tokens` (`serve/utils/api_utils.py:234-270`): what does not fit is clamped.
    let longest = p.prompts.iter().map(|x| x.tokens).max().unwrap_or(0);
    Ok((l - longest).min(p.max_tokens.unwrap_or(default_max)))
}

#[derive(Serialize)]
struct ErrorInfo<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: u16,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorInfo<'a>,
}

#[derive(Serialize)]
struct LegacyErrorBody<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<&'a str>,
    code: u16,
}

fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    }
}

/// The error body as vLLM's `JSONResponse(ErrorResponse.model_dump())` writes it (Starlette:
/// compact separators, no ASCII escaping): `serve/exception_handling/error_response.py:14-105`,
/// `serve/engine/protocol.py:79-87`. Legacy: the flat envelope before 0.10.1.
pub fn error_body(shape: ErrorShape, r: &Refusal) -> String {
    let kind = error_type(r.status);
    let code = r.status.as_u16();
    match shape {
        ErrorShape::Current => serde_json::to_string(&ErrorBody {
            error: ErrorInfo {
                message: &r.message,
                kind,
                param: r.param,
                code,
            },
        }),
        ErrorShape::Legacy => serde_json::to_string(&LegacyErrorBody {
            object: "error",
            message: &r.message,
            kind,
            param: r.param,
            code,
        }),
    }
    .unwrap_or_else(|_| "{}".into())
}

pub fn error(shape: ErrorShape, r: &Refusal) -> Response {
    json_response(r.status, error_body(shape, r))
}

/// An error inside a 200 stream: `data: ` + Python's default `json.dumps` of the same body
/// (`", "`/`": "` separators, ASCII escapes: `generate/base/serving.py:160-175`).
pub fn stream_error_event(r: &Refusal) -> Bytes {
    let msg: String = serde_json::to_string(&r.message)
        .unwrap_or_default()
        .chars()
        .flat_map(|c| {
            if c.is_ascii() {
                vec![c]
            } else {
                let mut buf = [0u16; 2];
                c.encode_utf16(&mut buf)
                    .iter()
                    .flat_map(|u| format!("\\u{u:04x}").chars().collect::<Vec<_>>())
                    .collect()
            }
        })
        .collect();
    let param = r
        .param
        .map(|p| format!("\"{p}\""))
        .unwrap_or_else(|| "null".into());
    Bytes::from(format!(
        "data: {{\"error\": {{\"message\": {msg}, \"type\": \"{}\", \"param\": {param}, \"code\": {}}}}}\n\n",
        error_type(r.status),
        r.status.as_u16()
    ))
}

pub const OVERLOADED: &str =
    "The server is overloaded and cannot accept the request at this time. Please retry later.";

/// A transfer that failed under the default `kv_load_failure_policy: fail` ends the request
/// with finish reason `error`, which the API turns into a `GenerationError`.
pub const GENERATION_FAILED: &str = "Internal server error";

#[derive(Serialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub total_tokens: u64,
    pub completion_tokens: u64,
    pub prompt_tokens_details: Option<()>,
}

impl Usage {
    pub fn new(prompt: u64, completion: u64) -> Usage {
        Usage {
            prompt_tokens: prompt,
            total_tokens: prompt + completion,
            completion_tokens: completion,
            prompt_tokens_details: None,
        }
    }
}

#[derive(Serialize)]
struct CompletionChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<()>,
}

#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'static str,
    reasoning_content: Option<()>,
    content: &'a str,
    tool_calls: [(); 0],
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessageOut<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
    stop_reason: Option<()>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Choices<'a> {
    Completion([CompletionChoice<'a>; 1]),
    Chat([ChatChoice<'a>; 1]),
}

#[derive(Serialize)]
struct Final<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: Choices<'a>,
    /// `CompletionResponse` (`completion/protocol.py:705-722`): service_tier and
    /// system_fingerprint before usage, ec_transfer_params and metrics after the KV params.
    #[serde(skip_serializing_if = "Option::is_none")]
    service_tier: Option<Option<()>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    system_fingerprint: Option<Option<()>>,
    usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Option<()>>,
    kv_transfer_params: Option<&'a IssuedParams>,
    #[serde(skip_serializing_if = "Option::is_none")]
    ec_transfer_params: Option<Option<()>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    metrics: Option<Option<()>>,
}

fn created() -> u64 {
    now_ns() / 1_000_000_000
}

/// The whole (non-stream) answer.
pub fn render_final(
    api: Api,
    id: &str,
    model: &str,
    text: &str,
    usage: Usage,
    kv: Option<&IssuedParams>,
) -> Bytes {
    let (object, choices, prompt_logprobs) = match api {
        Api::Chat => (
            "chat.completion",
            Choices::Chat([ChatChoice {
                index: 0,
                message: ChatMessageOut {
                    role: "assistant",
                    reasoning_content: None,
                    content: text,
                    tool_calls: [],
                },
                logprobs: None,
                finish_reason: "length",
                stop_reason: None,
            }]),
            Some(None),
        ),
        Api::Completions | Api::Generate => (
            "text_completion",
            Choices::Completion([CompletionChoice {
                index: 0,
                text,
                logprobs: None,
                finish_reason: Some("length"),
                stop_reason: None,
                prompt_logprobs: None,
            }]),
            None,
        ),
    };
    let completion = api != Api::Chat;
    let v = Final {
        id,
        object,
        created: created(),
        model,
        choices,
        service_tier: completion.then_some(None),
        system_fingerprint: completion.then_some(None),
        usage,
        prompt_logprobs,
        kv_transfer_params: kv,
        ec_transfer_params: completion.then_some(None),
        metrics: completion.then_some(None),
    };
    Bytes::from(serde_json::to_vec(&v).unwrap_or_default())
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    content: &'a str,
}

#[derive(Serialize)]
struct ChatChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stop_reason: Option<Option<()>>,
}

#[derive(Serialize)]
#[serde(untagged)]
enum ChunkChoices<'a> {
    Completion([CompletionChoice<'a>; 1]),
    Chat([ChatChunkChoice<'a>; 1]),
    None([(); 0]),
}

#[derive(Serialize)]
struct Chunk<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: ChunkChoices<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    /// Completions chunks set it on every chunk, null until the final one
    /// (`completion/serving.py:531-535`, dumped with `exclude_unset`).
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<Option<&'a IssuedParams>>,
}

fn chunk_object(api: Api) -> &'static str {
    match api {
        Api::Chat => "chat.completion.chunk",
        Api::Completions | Api::Generate => "text_completion",
    }
}

fn sse(v: &impl Serialize) -> Bytes {
    let mut out = b"data: ".to_vec();
    out.extend(serde_json::to_vec(v).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
    Bytes::from(out)
}

/// Chat streams open with the assistant role and empty content, as vLLM's do.
pub fn render_role_chunk(id: &str, model: &str) -> Bytes {
    sse(&Chunk {
        id,
        object: "chat.completion.chunk",
        created: created(),
        model,
        choices: ChunkChoices::Chat([ChatChunkChoice {
            index: 0,
            delta: Delta {
                role: Some("assistant"),
                content: "",
            },
            logprobs: None,
            finish_reason: None,
            stop_reason: None,
        }]),
        usage: None,
        kv_transfer_params: None,
    })
}

/// One generated token as an SSE event; `last` carries `finish_reason`.
pub fn render_token_chunk(
    api: Api,
    id: &str,
    model: &str,
    token: &str,
    last: bool,
    kv: Option<&IssuedParams>,
) -> Bytes {
    let finish = last.then_some("length");
    let choices = match api {
        Api::Chat => ChunkChoices::Chat([ChatChunkChoice {
            index: 0,
            delta: Delta {
                role: None,
                content: token,
            },
            logprobs: None,
            finish_reason: finish,
            stop_reason: last.then_some(None),
        }]),
        Api::Completions | Api::Generate => ChunkChoices::Completion([CompletionChoice {
            index: 0,
            text: token,
            logprobs: None,
            finish_reason: finish,
            stop_reason: None,
            prompt_logprobs: None,
        }]),
    };
    sse(&Chunk {
        id,
        object: chunk_object(api),
        created: created(),
        model,
        choices,
        usage: None,
        kv_transfer_params: (api != Api::Chat).then_some(kv.filter(|_| last)),
    })
}

/// The stream's last event before `[DONE]`: no choices, the usage.
pub fn render_usage_chunk(api: Api, id: &str, model: &str, usage: Usage) -> Bytes {
    sse(&Chunk {
        id,
        object: chunk_object(api),
        created: created(),
        model,
        choices: ChunkChoices::None([]),
        usage: Some(usage),
        kv_transfer_params: None,
    })
}

pub const DONE: &[u8] = b"data: [DONE]\n\n";

/// `GET /v1/models`.
pub fn models(model: &str, max_model_len: u64, created: u64) -> serde_json::Value {
    #[derive(Serialize)]
    struct Model<'a> {
        id: &'a str,
        object: &'static str,
        created: u64,
        owned_by: &'static str,
        root: &'a str,
        parent: Option<()>,
        max_model_len: u64,
        permission: [(); 0],
    }
    #[derive(Serialize)]
    struct List<'a> {
        object: &'static str,
        data: [Model<'a>; 1],
    }
    serde_json::to_value(List {
        object: "list",
        data: [Model {
            id: model,
            object: "model",
            created,
            owned_by: "vllm",
            root: model,
            parent: None,
            max_model_len,
            permission: [],
        }],
    })
    .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_completions_chat_and_params() {
        let p = parse(
            Api::Completions,
            br#"{"model":"m","prompt":"a b c","max_tokens":1,"min_tokens":1,"stream":false,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}"#,
        )
        .unwrap();
        assert_eq!(p.prompt_tokens, 3);
        assert_eq!(p.max_tokens, Some(1));
        let kv = p.kv.unwrap();
        assert!(kv.do_remote_decode && !kv.do_remote_prefill);
        let p = parse(
            Api::Chat,
            br#"{"messages":[{"role":"user","content":"one two"},{"role":"user","content":[{"type":"text","text":"x"}]}],"max_tokens":4,"stream":true,"kv_transfer_params":null}"#,
        )
        .unwrap();
        assert_eq!(
            (p.prompt_tokens, p.max_tokens, p.stream),
            (3, Some(4), true)
        );
        assert!(p.kv.is_none());
        assert_eq!(
            parse(Api::Completions, br#"{"prompt":[1,2,3,4]}"#)
                .unwrap()
                .prompt_tokens,
            4
        );
    }

    #[test]
    fn bad_bodies_are_typed_errors_that_do_not_quote_the_prompt() {
        let e = parse(
            Api::Completions,
            br#"{"prompt":"secret CANARY","stream":"x"}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(!e.contains("CANARY") && !e.contains("secret"), "{e}");
        assert_eq!(
            parse(Api::Chat, b"{}").unwrap_err(),
            BodyError::Missing("messages is required")
        );
        assert!(parse(Api::Completions, b"\xff").is_err());
    }

    #[test]
    fn answers_keep_vllms_key_order() {
        let kv = IssuedParams {
            do_remote_prefill: true,
            do_remote_decode: false,
            remote_block_ids: vec![vec![1]],
            remote_engine_id: "e".into(),
            remote_request_id: "cmpl-x-0-0123abcd".into(),
            remote_host: "127.0.0.1".into(),
            remote_port: 5600,
            tp_size: 1,
            dcp_size: 1,
            pp_size: 1,
            remote_num_tokens: 3,
            remote_blocks_expiry_time: None,
            remote_registration_generation: 0,
            transfer_mode: "pull",
        };
        let b = render_final(
            Api::Completions,
            "cmpl-x",
            "m",
            " the",
            Usage::new(3, 1),
            Some(&kv),
        );
        let s = std::str::from_utf8(&b).unwrap();
        assert!(
            s.starts_with(r#"{"id":"cmpl-x","object":"text_completion","created":"#),
            "{s}"
        );
        assert!(s.contains(r#""finish_reason":"length","stop_reason":null}],"service_tier":null,"system_fingerprint":null,"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1"#), "{s}");
        assert!(s.ends_with(r#""kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"cmpl-x-0-0123abcd","remote_host":"127.0.0.1","remote_port":5600,"tp_size":1,"dcp_size":1,"pp_size":1,"remote_num_tokens":3,"remote_blocks_expiry_time":null,"remote_registration_generation":0,"transfer_mode":"pull"},"ec_transfer_params":null,"metrics":null}"#), "{s}");
    }

    #[test]
    fn length_rules_refuse_clamp_and_keep_the_legacy_shape() {
        let p = |prompt: &str, max: Option<u64>| Parsed {
            api: Api::Completions,
            prompts: vec![Prompt {
                tokens: count_tokens(prompt),
                text: true,
            }],
            prompt_tokens: count_tokens(prompt),
            max_tokens: max,
            max_tokens_param: "max_tokens",
            stream: false,
            kv: None,
        };
        let long = "w ".repeat(20);
        let r = check_length(&p(&long, Some(1)), 10, ErrorShape::Current, 16).unwrap_err();
        assert_eq!(r.param, Some("input_tokens"));
        assert_eq!(
            error_body(ErrorShape::Current, &r),
            r#"{"error":{"message":"This model's maximum context length is 10 tokens. However, your prompt contains at least 11 input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value=11)","type":"BadRequestError","param":"input_tokens","code":400}}"#
        );
        assert_eq!(
            check_length(&p("a b c", Some(9)), 10, ErrorShape::Current, 16),
            Ok(7)
        );
        assert_eq!(
            check_length(&p("a b c", None), 10, ErrorShape::Current, 4),
            Ok(4)
        );
        let r = check_length(&p("a", Some(11)), 10, ErrorShape::Current, 16).unwrap_err();
        assert_eq!(r.param, Some("max_tokens"));
        let r = check_length(&p("a b c", Some(8)), 10, ErrorShape::Legacy, 16).unwrap_err();
        assert_eq!(
            error_body(ErrorShape::Legacy, &r),
            r#"{"object":"error","message":"This model's maximum context length is 10 tokens. However, you requested 11 tokens (3 in the messages, 8 in the completion). Please reduce the length of the messages or completion.","type":"BadRequestError","param":null,"code":400}"#
        );
        assert_eq!(
            &stream_error_event(&Refusal {
                status: StatusCode::INTERNAL_SERVER_ERROR,
                message: GENERATION_FAILED.into(),
                param: None
            })[..],
            &b"data: {\"error\": {\"message\": \"Internal server error\", \"type\": \"InternalServerError\", \"param\": null, \"code\": 500}}\n\n"[..]
        );
    }
}
