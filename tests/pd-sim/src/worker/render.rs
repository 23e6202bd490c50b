//! Answers in SGLang's shapes: `/generate` (orjson, `entrypoints/http_server.py:933`) and the
//! OpenAI routes (`entrypoints/openai/serving_base.py`, `serving_completions.py`,
//! `serving_chat.py`), whole or streamed, successes and errors. Completion text is fixed
//! filler: the simulator never echoes the prompt.
//!
//! Errors, by where SGLang raises them:
//!
//! | refusal | `/generate` | `/generate` `"stream": true` | OpenAI | OpenAI streamed |
//! |---|---|---|---|---|
//! | tokenizer (context length) | 400 `{"error":{"message":M}}` (`http_server.py:2246`) | 200 SSE `data: {"error":{"message":M,"type":"invalid_request_error","code":400,"retryable":false}}`, `data: [DONE]` (`:951`) | 400 `{"object":"error","message":M,"type":"BadRequestError","param":null,"code":400}` (`serving_base.py:205`) | the same 400: the first chunk is awaited before the 200 goes out (`serving_completions.py:210`, `serving_chat.py:2426`) |
//! | scheduler abort, status 400 (`FINISH_ABORT`) | 400 `{"error":{"message":M}}` (`tokenizer_manager.py:1918` raises ValueError) | 200 SSE, a chunk whose `meta_info.finish_reason` is `{"type":"abort","message":M,"status_code":400,"err_type":…}` | 400 BadRequestError | 200 SSE `data: {"error": {"object": "error", "message": M, "type": "BAD_REQUEST", "param": null, "code": 400}}` (`json.dumps`, `serving_base.py:223`) |
//! | scheduler abort, status 500 (a transfer failure) | 500 `{"object":"error","message":M,"type":"500","param":null,"code":500}` (HTTPException, `http_server.py:578`) | 200 SSE abort chunk, `status_code` 500 | 500, `"type":"500"` (`serving_base.py:119`) | 200 SSE error, `"type": "INTERNAL_SERVER_ERROR"` |
//!
//! A graceful abort (no status code) finishes normally with `finish_reason` abort, 200.

use super::api::{Api, Parsed};
use super::*;

/// A request refused by a check or aborted by the scheduler: SGLang's `FINISH_ABORT`.
#[derive(Clone, Debug)]
pub(super) struct Refusal {
    /// 400, 500, 503; 0 = a graceful abort (no status code).
    pub(super) status: u16,
    pub(super) message: String,
    pub(super) err_type: Option<&'static str>,
}

impl Refusal {
    pub(super) fn abort(status: u16, message: String) -> Self {
        Refusal {
            status,
            message,
            err_type: None,
        }
    }
    pub(super) fn graceful(message: String) -> Self {
        Refusal {
            status: 0,
            message,
            err_type: None,
        }
    }
}

/// Completion text is fixed filler: the simulator never echoes the prompt anywhere.
pub(super) const WORDS: [&str; 8] = [
    " the", " quick", " brown", " fox", " jumps", " over", " lazy", " dogs",
];

pub(super) fn gen_text(n: u64) -> String {
    (0..n as usize).map(|i| WORDS[i % WORDS.len()]).collect()
}

pub(super) const DONE: &[u8] = b"data: [DONE]\n\n";

pub(super) fn sse(v: &impl Serialize) -> Bytes {
    Bytes::from(format!(
        "data: {}\n\n",
        serde_json::to_string(v).unwrap_or_default()
    ))
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        400 => "BAD_REQUEST",
        503 => "SERVICE_UNAVAILABLE",
        _ => "INTERNAL_SERVER_ERROR",
    }
}

pub(super) fn response(status: u16, content_type: &'static str, body: Bytes) -> Response {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .body(Body::from(body))
        .expect("static response parts")
}

#[derive(Serialize)]
struct OpenAiError<'a> {
    object: &'static str,
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<()>,
    code: u16,
}

#[derive(Serialize)]
struct Wrapped<T> {
    error: T,
}

#[derive(Serialize)]
struct MessageOnly<'a> {
    message: &'a str,
}

/// The whole-answer error of a refusal (see the module table).
pub(super) fn error_answer(api: Api, r: &Refusal) -> Response {
    let status = if r.status == 0 { 400 } else { r.status };
    let body = match (api, status) {
        (Api::Generate, 400) => serde_json::to_string(&Wrapped {
            error: MessageOnly {
                message: &r.message,
            },
        }),
        (Api::Generate, s) | (_, s) if s != 400 => serde_json::to_string(&OpenAiError {
            object: "error",
            message: &r.message,
            kind: &s.to_string(),
            param: None,
            code: s,
        }),
        _ => serde_json::to_string(&OpenAiError {
            object: "error",
            message: &r.message,
            kind: "BadRequestError",
            param: None,
            code: 400,
        }),
    };
    response(
        status,
        "application/json",
        Bytes::from(body.unwrap_or_default()),
    )
}

/// The tokenizer's refusal (context length), as the route and `stream` make it.
pub(super) fn tokenizer_refusal(p: &Parsed, message: &str) -> Response {
    match (p.api, p.stream) {
        (Api::Generate, true) => {
            let mut body = stream_error(p, message).to_vec();
            body.extend_from_slice(DONE);
            response(200, "text/event-stream", Bytes::from(body))
        }
        (api, _) => error_answer(
            api,
            &Refusal {
                status: 400,
                message: message.to_string(),
                err_type: Some("BadRequestError"),
            },
        ),
    }
}

/// A request that raised after its stream had started (parallel sampling's prefix request
/// refused): `/generate`'s SSE error event (`http_server.py:965`), or the OpenAI streamed error.
pub(super) fn stream_error(p: &Parsed, message: &str) -> Bytes {
    match p.api {
        Api::Generate => {
            #[derive(Serialize)]
            struct SseError<'a> {
                message: &'a str,
                #[serde(rename = "type")]
                kind: &'static str,
                code: u16,
                retryable: bool,
            }
            sse(&Wrapped {
                error: SseError {
                    message,
                    kind: "invalid_request_error",
                    code: 400,
                    retryable: false,
                },
            })
        }
        _ => Bytes::from(format!(
            "data: {}\n\n",
            crate::http::py_json(&Wrapped {
                error: OpenAiError {
                    object: "error",
                    message,
                    kind: "BadRequestError",
                    param: None,
                    code: 400,
                },
            })
        )),
    }
}

/// One sub-request's outcome, as its answer needs it.
#[derive(Clone, Debug)]
pub(super) struct SubAnswer {
    /// Its place in the answer (`index`).
    pub(super) index: usize,
    pub(super) rid: String,
    pub(super) input_tokens: u64,
    pub(super) completion_tokens: u64,
    /// `None`: finished normally (`length`).
    pub(super) abort: Option<Refusal>,
    /// `finish_reason.length` of a normal finish (prefill reports 0, `prefill.py:1226`).
    pub(super) length: u64,
}

#[derive(Serialize)]
struct FinishAbort<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    message: &'a str,
    status_code: Option<u16>,
    err_type: Option<&'static str>,
}

#[derive(Serialize)]
struct FinishLength {
    #[serde(rename = "type")]
    kind: &'static str,
    length: u64,
}

#[derive(Serialize)]
#[serde(untagged)]
enum Finish<'a> {
    Abort(FinishAbort<'a>),
    Length(FinishLength),
}

#[derive(Serialize)]
struct MetaInfo<'a> {
    id: &'a str,
    finish_reason: Option<Finish<'a>>,
    prompt_tokens: u64,
    completion_tokens: u64,
    cached_tokens: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    e2e_latency: Option<f64>,
}

#[derive(Serialize)]
struct GenerateOut<'a> {
    text: &'a str,
    output_ids: Vec<u32>,
    meta_info: MetaInfo<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    index: Option<usize>,
}

fn finish(a: &SubAnswer) -> Finish<'_> {
    match &a.abort {
        Some(r) => Finish::Abort(FinishAbort {
            kind: "abort",
            message: &r.message,
            status_code: (r.status != 0).then_some(r.status),
            err_type: r.err_type,
        }),
        None => Finish::Length(FinishLength {
            kind: "length",
            length: a.length,
        }),
    }
}

fn generate_out<'a>(
    a: &'a SubAnswer,
    text: &'a str,
    batch: bool,
    last: bool,
    secs: Option<f64>,
) -> GenerateOut<'a> {
    GenerateOut {
        text,
        output_ids: (0..a.completion_tokens as u32).map(|i| 1000 + i).collect(),
        meta_info: MetaInfo {
            id: &a.rid,
            finish_reason: last.then(|| finish(a)),
            prompt_tokens: a.input_tokens,
            completion_tokens: a.completion_tokens,
            cached_tokens: 0,
            e2e_latency: secs,
        },
        index: batch.then_some(a.index),
    }
}

fn is_error(a: &SubAnswer) -> bool {
    a.abort.as_ref().is_some_and(|r| r.status >= 400)
}

/// The whole (non-streamed) answer once every sub-request finished. An error abort of any
/// sub-request makes the whole answer that error (SGLang raises from the first one).
pub(super) fn final_answer(p: &Parsed, model: &str, answers: &[SubAnswer], secs: f64) -> Response {
    if let Some(r) = answers
        .iter()
        .find(|a| is_error(a))
        .and_then(|a| a.abort.clone())
    {
        return error_answer(p.api, &r);
    }
    let texts: Vec<String> = answers
        .iter()
        .map(|a| gen_text(a.completion_tokens))
        .collect();
    let body = match p.api {
        Api::Generate => {
            let outs: Vec<GenerateOut> = answers
                .iter()
                .zip(&texts)
                .map(|(a, t)| generate_out(a, t, false, true, Some(secs)))
                .collect();
            if p.is_single {
                serde_json::to_string(&outs[0])
            } else {
                serde_json::to_string(&outs)
            }
        }
        Api::Chat | Api::Completions => {
            serde_json::to_string(&openai_final(p, model, answers, &texts))
        }
    };
    response(
        200,
        "application/json",
        Bytes::from(body.unwrap_or_default()),
    )
}

fn openai_finish(a: &SubAnswer) -> &'static str {
    if a.abort.is_some() { "abort" } else { "length" }
}

fn openai_final(
    p: &Parsed,
    model: &str,
    answers: &[SubAnswer],
    texts: &[String],
) -> serde_json::Value {
    let (prompt, completion): (u64, u64) = (
        answers.iter().map(|a| a.input_tokens).sum(),
        answers.iter().map(|a| a.completion_tokens).sum(),
    );
    let id = answers.first().map(|a| a.rid.as_str()).unwrap_or("");
    let choices: Vec<serde_json::Value> = answers
        .iter()
        .zip(texts)
        .map(|(a, t)| match p.api {
            Api::Chat => {
                serde_json::json!({"index": a.index, "message": {"role": "assistant", "content": t},
                "finish_reason": openai_finish(a)})
            }
            _ => serde_json::json!({"index": a.index, "text": t, "logprobs": null,
                "finish_reason": openai_finish(a)}),
        })
        .collect();
    serde_json::json!({
        "id": id,
        "object": if p.api == Api::Chat { "chat.completion" } else { "text_completion" },
        "created": now_ns() / 1_000_000_000,
        "model": model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion},
    })
}

/// One streamed chunk of sub-request `a` (`done` tokens so far, `delta` the newest), or its
/// final chunk (`last`), which for an error abort is SGLang's error chunk.
pub(super) fn chunk(
    p: &Parsed,
    model: &str,
    a: &SubAnswer,
    text: &str,
    delta: &str,
    last: bool,
) -> Bytes {
    if last
        && let Some(r) = a.abort.as_ref().filter(|r| r.status >= 400)
        && p.api != Api::Generate
    {
        // `create_streaming_error_response` with the HTTPStatus's name (`json.dumps`).
        return Bytes::from(format!(
            "data: {}\n\n",
            crate::http::py_json(&Wrapped {
                error: OpenAiError {
                    object: "error",
                    message: &r.message,
                    kind: reason_phrase(r.status),
                    param: None,
                    code: r.status,
                },
            })
        ));
    }
    match p.api {
        Api::Generate => sse(&generate_out(
            &SubAnswer {
                completion_tokens: if last {
                    a.completion_tokens
                } else {
                    count_words(text)
                },
                ..a.clone()
            },
            text,
            !p.is_single,
            last,
            None,
        )),
        Api::Chat => sse(&serde_json::json!({
            "id": a.rid,
            "object": "chat.completion.chunk",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": a.index, "delta": {"content": delta},
                         "finish_reason": if last { serde_json::json!(openai_finish(a)) } else { serde_json::Value::Null }}],
        })),
        Api::Completions => sse(&serde_json::json!({
            "id": a.rid,
            "object": "text_completion",
            "created": now_ns() / 1_000_000_000,
            "model": model,
            "choices": [{"index": a.index, "text": delta, "logprobs": null,
                         "finish_reason": if last { serde_json::json!(openai_finish(a)) } else { serde_json::Value::Null }}],
        })),
    }
}

fn count_words(text: &str) -> u64 {
    text.split_whitespace().count() as u64
}
