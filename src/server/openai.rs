//! OpenAI chat-completions wire types, converted to engine types at the edge.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One message of a request.
#[derive(Debug, Clone, Deserialize)]
pub struct WireMessage {
    /// system | developer | user | assistant | tool
    pub role: String,
    /// text, array of text parts, or null
    #[serde(default)]
    pub content: Option<Value>,
}

/// `POST /v1/chat/completions` body.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    /// the conversation so far
    pub messages: Vec<WireMessage>,
    /// model name (informational; one model is served)
    #[serde(default)]
    pub model: Option<String>,
    /// sampling temperature
    #[serde(default)]
    pub temperature: Option<f32>,
    /// nucleus mass
    #[serde(default)]
    pub top_p: Option<f32>,
    /// top-k (extension)
    #[serde(default)]
    pub top_k: Option<usize>,
    /// reply length limit (legacy name)
    #[serde(default)]
    pub max_tokens: Option<usize>,
    /// reply length limit
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    /// seed
    #[serde(default)]
    pub seed: Option<u64>,
    /// stop string(s)
    #[serde(default)]
    pub stop: Option<Value>,
    /// SSE streaming
    #[serde(default)]
    pub stream: bool,
    /// session id (extension)
    #[serde(default)]
    pub session_id: Option<String>,
    /// OpenAI's end-user id, used as session id when `session_id` is absent
    #[serde(default)]
    pub user: Option<String>,
    /// where the arg-max token writes only digits, take it instead of sampling (numbers such
    /// as order ids are copied as greedy decoding copies them; extension)
    #[serde(default)]
    pub greedy_digits: bool,
    /// the order-id slot of an `ACTION <verb> <id>` line may only spell one of these numbers
    /// (the ids the conversation holds, as a tool schema's enum constrains an argument; at most
    /// 64 ids of 1 to 20 digits; extension)
    #[serde(default)]
    pub id_slot: Option<Vec<String>>,
    /// `false`: no update ever learns from this session — held-out evaluation traffic; it stays
    /// held out for good once a request of the session says so (send it on the first one)
    /// (extension)
    #[serde(default)]
    pub learn: Option<bool>,
    /// never end the reply with an end-of-turn token: generate `max_tokens` (extension, as
    /// llama.cpp's server names it; for load tests)
    #[serde(default)]
    pub ignore_eos: bool,
}

/// Usage counts.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    /// tokens appended before the reply
    pub prompt_tokens: usize,
    /// tokens of the reply
    pub completion_tokens: usize,
    /// sum
    pub total_tokens: usize,
}

/// `POST /v1/sessions/{id}/feedback` body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FeedbackRequest {
    /// turn index the thumb is about (default: the last assistant turn)
    #[serde(default)]
    pub turn: Option<i64>,
    /// "up" | "down"
    #[serde(default)]
    pub thumb: Option<String>,
    /// "resolved" | "unresolved" | number
    #[serde(default)]
    pub outcome: Option<Value>,
    /// free text
    #[serde(default)]
    pub note: Option<String>,
}

/// An OpenAI-shaped error body.
pub fn error_body(message: &str, kind: &str, code: Option<&str>) -> Value {
    serde_json::json!({"error": {"message": message, "type": kind, "param": null, "code": code}})
}
