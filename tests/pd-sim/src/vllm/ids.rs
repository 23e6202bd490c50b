//! vLLM 0.34's request names (see `vllm/mod.rs`).

use rand::RngExt;

use super::api::Api;

/// `vllm.utils.random_uuid()`: 16 lowercase hex digits (`utils/__init__.py:11`).
pub fn random_uuid() -> String {
    format!("{:016x}", rand::rng().random::<u64>())
}

/// The names of one HTTP request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    /// X: `X-Request-Id`, or a random uuid (`serve/engine/serving.py:133-142`).
    pub x: String,
    /// The response body's `id`: `cmpl-X` (`completion/serving.py:192`), `chatcmpl-X`
    /// (`chat_completion/serving.py:321`).
    pub response_id: String,
    /// One engine request per prompt: `cmpl-X-i` (`completion/serving.py:228`); chat's
    /// single one is `chatcmpl-X` (`chat_completion/serving.py:346`).
    pub engine_ids: Vec<String>,
}

pub fn names(api: Api, x: Option<&str>, prompts: usize) -> Names {
    let x = x.map(str::to_owned).unwrap_or_else(random_uuid);
    let response_id = format!("{}{x}", api.prefix());
    let engine_ids = match api {
        Api::Chat => vec![response_id.clone()],
        Api::Completions | Api::Generate => (0..prompts.max(1))
            .map(|i| format!("{response_id}-{i}"))
            .collect(),
    };
    Names {
        x,
        response_id,
        engine_ids,
    }
}

/// `InputProcessor.assign_request_id` (`v1/engine/input_processor.py:342-359`): the engine
/// id plus `-` and the first 8 characters of a random uuid, unless randomization is off.
pub fn internal_id(engine_id: &str, randomize: bool) -> String {
    if randomize {
        format!("{engine_id}-{:.8}", random_uuid())
    } else {
        engine_id.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_vllm() {
        let n = names(Api::Completions, Some("X"), 1);
        assert_eq!(n.response_id, "cmpl-X");
        assert_eq!(n.engine_ids, ["cmpl-X-0"]);
        assert_eq!(
            names(Api::Completions, Some("X"), 3).engine_ids,
            ["cmpl-X-0", "cmpl-X-1", "cmpl-X-2"]
        );
        let c = names(Api::Chat, Some("X"), 1);
        assert_eq!(
            (c.response_id.as_str(), c.engine_ids[0].as_str()),
            ("chatcmpl-X", "chatcmpl-X")
        );
        let r = names(Api::Completions, None, 1);
        assert_eq!(r.x.len(), 16);
        let i = internal_id("cmpl-X-0", true);
        let tail = i.strip_prefix("cmpl-X-0-").unwrap();
        assert!(
            tail.len() == 8 && tail.bytes().all(|b| b.is_ascii_hexdigit()),
            "{i}"
        );
        assert_eq!(internal_id("cmpl-X-0", false), "cmpl-X-0");
    }
}
