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

/// `kv_transfer_params` as the router sends them to prefill (`do_remote_decode`) and as
/// prefill answers them for decode (`do_remote_prefill` with the remote endpoint).
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
pub struct KvTransferParams {
    #[serde(default)]
    pub do_remote_prefill: bool,
    #[serde(default)]
    pub do_remote_decode: bool,
    #[serde(default)]
    pub remote_engine_id: Option<String>,
    #[serde(default)]
    pub remote_block_ids: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remote_request_id: Option<String>,
    #[serde(default)]
    pub remote_host: Option<String>,
    #[serde(default)]
    pub remote_port: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tp_size: Option<u64>,
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

/// What a worker needs from a request body (never the prompt text itself).
#[derive(Debug)]
pub struct Parsed {
    pub api: Api,
    pub prompt_tokens: u64,
    pub max_tokens: Option<u64>,
    pub stream: bool,
    pub kv: Option<KvTransferParams>,
}

fn tokens(v: &serde_json::Value) -> u64 {
    match v {
        serde_json::Value::String(s) => count_tokens(s),
        // A list of token ids counts its length; a list of strings (a batch) their words.
        serde_json::Value::Array(a) if a.iter().all(|x| x.is_number()) => a.len() as u64,
        serde_json::Value::Array(a) => a.iter().map(tokens).sum(),
        serde_json::Value::Object(o) => o.get("text").map(tokens).unwrap_or(0),
        _ => 0,
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
    let prompt_tokens = match api {
        Api::Chat => b
            .messages
            .ok_or(BodyError::Missing("messages is required"))?
            .iter()
            .filter_map(|m| m.content.as_ref())
            .map(tokens)
            .sum(),
        Api::Completions | Api::Generate => tokens(
            b.prompt
                .as_ref()
                .or(b.text.as_ref())
                .ok_or(BodyError::Missing("prompt is required"))?,
        ),
    };
    Ok(Parsed {
        api,
        prompt_tokens,
        max_tokens: b.max_completion_tokens.or(b.max_tokens),
        stream: b.stream.unwrap_or(false),
        kv: b.kv_transfer_params,
    })
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    param: Option<()>,
    code: u16,
}

/// vLLM's error envelope `{"object":"error","message":…,"type":…,"param":null,"code":…}`.
pub fn error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        404 => "NotFoundError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let body = ErrorBody {
        object: "error",
        message,
        kind,
        param: None,
        code: status.as_u16(),
    };
    json_response(
        status,
        serde_json::to_string(&body).unwrap_or_else(|_| "{}".into()),
    )
}

/// vLLM's context-length message (`P in the messages, C in the completion`).
pub fn too_long_message(max_model_len: u64, prompt: u64, completion: u64) -> String {
    format!(
        "This model's maximum context length is {max_model_len} tokens. However, you requested {} tokens ({prompt} in the messages, {completion} in the completion). Please reduce the length of the messages or completion.",
        prompt.saturating_add(completion)
    )
}

pub const OVERLOADED: &str =
    "The server is overloaded and cannot accept the request at this time. Please retry later.";

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
    usage: Usage,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_logprobs: Option<Option<()>>,
    kv_transfer_params: Option<&'a KvTransferParams>,
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
    kv: Option<&KvTransferParams>,
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
    let v = Final {
        id,
        object,
        created: created(),
        model,
        choices,
        usage,
        prompt_logprobs,
        kv_transfer_params: kv,
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
    })
}

/// One generated token as an SSE event; `last` carries `finish_reason`.
pub fn render_token_chunk(api: Api, id: &str, model: &str, token: &str, last: bool) -> Bytes {
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

/// What `/metrics` reports.
pub struct MetricsView<'a> {
    pub model: &'a str,
    pub block_size: u64,
    pub num_gpu_blocks: u64,
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub success: u64,
}

/// Prometheus text; the first family is `vllm:cache_config_info`, as in vLLM (the labels the
/// contract names first, in its order, then the rest of vLLM's CacheConfig).
pub fn metrics(m: &MetricsView<'_>) -> String {
    let labels = format!("engine=\"0\",model_name=\"{}\"", m.model);
    let mut s = String::with_capacity(2048);
    s.push_str("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n");
    s.push_str("# TYPE vllm:cache_config_info gauge\n");
    s.push_str(&format!(
        "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"auto\",enable_prefix_caching=\"True\",gpu_memory_utilization=\"0.9\",num_cpu_blocks=\"0\",num_gpu_blocks=\"{}\",calculate_kv_scales=\"False\",cpu_offload_gb=\"0\",engine=\"0\",is_attention_free=\"False\",num_gpu_blocks_override=\"None\",prefix_caching_hash_algo=\"sha256\",sliding_window=\"None\",swap_space=\"4\",swap_space_bytes=\"4294967296\"}} 1.0\n",
        m.block_size, m.num_gpu_blocks
    ));
    let gauge = |s: &mut String, name: &str, help: &str, v: String| {
        s.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v}\n"
        ));
    };
    gauge(
        &mut s,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        format!("{:.1}", m.running as f64),
    );
    gauge(
        &mut s,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        format!("{:.1}", m.waiting as f64),
    );
    gauge(
        &mut s,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        format!("{:?}", m.kv_usage),
    );
    let counter = |s: &mut String, name: &str, help: &str, extra: &str, v: u64| {
        s.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}{extra}}} {:.1}\n",
            v as f64
        ));
    };
    counter(
        &mut s,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        "",
        m.prompt_tokens,
    );
    counter(
        &mut s,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        "",
        m.generation_tokens,
    );
    counter(
        &mut s,
        "vllm:request_success_total",
        "Count of successfully processed requests.",
        ",finished_reason=\"length\"",
        m.success,
    );
    s
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
        let kv = KvTransferParams {
            do_remote_prefill: true,
            remote_request_id: Some("cmpl-x".into()),
            tp_size: Some(1),
            ..Default::default()
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
        assert!(s.contains(r#""choices":[{"index":0,"text":" the","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1"#), "{s}");
        assert!(s.contains(r#""kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,"remote_engine_id":null,"remote_block_ids":null,"remote_request_id":"cmpl-x","remote_host":null,"remote_port":null,"tp_size":1}"#), "{s}");
        let m = metrics(&MetricsView {
            model: "m",
            block_size: 16,
            num_gpu_blocks: 256,
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prompt_tokens: 0,
            generation_tokens: 0,
            success: 0,
        });
        assert!(m.starts_with("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size=\"16\",cache_dtype=\"auto\","));
        assert!(m.contains("num_gpu_blocks=\"256\""));
        let e = too_long_message(4096, 5000, 1);
        assert_eq!(
            e,
            "This model's maximum context length is 4096 tokens. However, you requested 5001 tokens (5000 in the messages, 1 in the completion). Please reduce the length of the messages or completion."
        );
    }
}
