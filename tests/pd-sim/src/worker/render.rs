//! Response bodies in SGLang's `/generate` and OpenAI chat shapes, whole or as stream chunks.

use super::api::{Api, Parsed};
use super::*;

/// Completion text is fixed filler: the simulator never echoes the prompt anywhere.
pub(super) const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dogs",
];

pub(super) fn gen_text(n: u64) -> String {
    (0..n as usize).map(|i| WORDS[i % WORDS.len()]).collect()
}

/// The content type of an answer made by [`render_final`]: an SSE stream when asked for one.
pub(super) fn final_content_type(stream: bool) -> &'static str {
    if stream {
        "text/event-stream"
    } else {
        "application/json"
    }
}

pub(super) fn render_final(
    p: &Parsed,
    rid: &str,
    model: &str,
    text: &str,
    completion: u64,
    abort: Option<&str>,
    secs: f64,
) -> Bytes {
    let finish = match abort {
        Some(m) => serde_json::json!({"type": "abort", "message": m}),
        None => serde_json::json!({"type": "length", "length": completion}),
    };
    let v = match p.api {
        Api::Generate => serde_json::json!({
            "text": text,
            "meta_info": {
                "id": rid,
                "finish_reason": finish,
                "prompt_tokens": p.input_tokens,
                "completion_tokens": completion,
                "cached_tokens": 0,
                "e2e_latency": secs,
            },
        }),
        Api::Chat => serde_json::json!({
            "id": rid,
            "object": "chat.completion",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": if abort.is_some() { "abort" } else { "length" }}],
            "usage": {"prompt_tokens": p.input_tokens, "completion_tokens": completion,
                      "total_tokens": p.input_tokens + completion},
        }),
    };
    if p.stream {
        Bytes::from(format!("data: {v}\n\ndata: [DONE]\n\n"))
    } else {
        Bytes::from(v.to_string())
    }
}

pub(super) fn render_chunk(
    p: &Parsed,
    rid: &str,
    model: &str,
    text: &str,
    delta: &str,
    done: u64,
    last: bool,
) -> Bytes {
    let v = match p.api {
        Api::Generate => serde_json::json!({
            "text": text,
            "meta_info": {
                "id": rid,
                "finish_reason": if last { serde_json::json!({"type": "length", "length": done}) } else { serde_json::Value::Null },
                "prompt_tokens": p.input_tokens,
                "completion_tokens": done,
                "cached_tokens": 0,
            },
            "index": 0,
        }),
        Api::Chat => serde_json::json!({
            "id": rid,
            "object": "chat.completion.chunk",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": 0, "delta": {"content": delta},
                         "finish_reason": if last { serde_json::json!("length") } else { serde_json::Value::Null }}],
        }),
    };
    Bytes::from(format!("data: {v}\n\n"))
}
