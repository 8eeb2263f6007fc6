//! `turnwise serve`: an OpenAI-compatible chat server that logs every turn token-exact, takes
//! feedback, and learns in the background with a promotion gate and hot-swap.
//!
//! The engine thread owns llama.cpp; handlers talk to it through [`Engine`]'s async calls and a
//! bounded queue (a semaphore: when it is full the answer is 429 with `Retry-After`). A turn is
//! committed to SQLite before its reply is acknowledged (the JSON body, or the final SSE chunk).
//!
//! - this file: [`ServerConfig`], the API's error type, the shared state's fields and the router;
//! - `state`: the runtime, live sessions, the per-session guard, yielding to serving;
//! - `accept`: connection limits, the browser-origin check, the token, bounded bodies;
//! - `chat`: chat completions, feedback, session end; `admin`: models, adapters, health,
//!   metrics; `learner`: the background learner;
//! - [`openai`]: the wire types; [`wire`]: parser-level errors in the API's JSON shape.

mod accept;
mod admin;
mod chat;
mod learner;
pub mod openai;
mod state;
pub mod wire;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use self::openai::{error_body, ChatRequest, FeedbackRequest, Usage};
use crate::adapter::Adapter;
use crate::error::Error;
use crate::learn::{gate, run_update, Algo, Selection, TrainConfig};
use crate::policy::{Engine, Message, OutputHead, Role, SamplerParams, StopReason};
use crate::session::{Feedback, Recorder};
use crate::store::{AdapterStatus, NewSession, Source, Store};

use accept::*;
pub use accept::{serve, ConnectionLimits, MAX_HEAD};
use admin::*;
use chat::*;
pub use learner::{learn_once, learner, lower_thread_priority, update_in_background};
use state::*;
pub use state::{runtime, YIELD_MAX};

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// the database
    pub db: PathBuf,
    /// bearer token required on every route when set
    pub api_key: Option<String>,
    /// largest request body in bytes
    pub max_body: usize,
    /// largest `max_tokens` a request may ask for
    pub max_tokens_limit: usize,
    /// generations admitted at once (running + waiting for the engine)
    pub queue: usize,
    /// background learning: wake after this many ended sessions with feedback (None: off)
    pub learn_every_sessions: Option<usize>,
    /// … or after this many minutes with new finished sessions
    pub learn_every_minutes: f64,
    /// an update learns from at most this many of the newest finished live sessions
    pub learn_sessions: usize,
    /// the update's preset
    pub learn_algo: Algo,
    /// threads of the learner's step (bounded share of the CPU)
    pub train_threads: usize,
    /// promotion gate: largest mean k3 KL of the candidate to its parent on the guard set
    pub gate_kl: f64,
    /// most conversations held in memory (least recently used dropped first)
    pub max_live_sessions: usize,
    /// an idle conversation is dropped from memory after this long
    pub session_idle: Duration,
    /// a request body must arrive within this long
    pub body_timeout: Duration,
    /// nice value of the learner's thread (and the ONNX Runtime threads it starts): 0 to 19,
    /// higher yields the CPU to serving; Linux only
    pub learn_nice: i32,
    /// the server is bound to a loopback address: requests must name a loopback host
    /// (`localhost`, `127.0.0.1`, `[::1]`), which a DNS-rebinding web page cannot
    pub loopback_only: bool,
    /// origins (`scheme://host[:port]`) whose web pages may call the API; a request with
    /// any other `Origin` header is refused (browsers send one on every cross-origin request)
    pub allow_origins: Vec<String>,
    /// the numeric outcomes feedback may report (inclusive)
    pub reward_range: (f64, f64),
}

/// The defaults of `turnwise serve`, in one place: [`ServerConfig::default`] and the
/// command's flags read them.
pub mod defaults {
    /// generations admitted at once
    pub const QUEUE: usize = 8;
    /// largest request body in bytes
    pub const MAX_BODY: usize = 1 << 20;
    /// largest `max_tokens` a request may ask for
    pub const MAX_TOKENS: usize = 512;
    /// ended sessions with feedback between background updates
    pub const LEARN_EVERY: usize = 20;
    /// minutes between background updates when new sessions ended
    pub const LEARN_MINUTES: f64 = 30.0;
    /// newest finished live sessions an update learns from
    pub const LEARN_SESSIONS: usize = 200;
    /// threads of the learner's step
    pub const TRAIN_THREADS: usize = 1;
    /// conversations held in memory
    pub const MAX_LIVE_SESSIONS: usize = 1024;
    /// minutes after which an idle conversation leaves memory
    pub const SESSION_IDLE_MINUTES: f64 = 30.0;
    /// seconds a client may take to send a request body
    pub const BODY_TIMEOUT_S: u64 = 30;
    /// nice value of the background learner
    pub const LEARN_NICE: i32 = 19;
}

impl Default for ServerConfig {
    /// The defaults `turnwise serve` runs with (database `turnwise.db` in the working
    /// directory).
    fn default() -> Self {
        ServerConfig {
            db: PathBuf::from("turnwise.db"),
            api_key: None,
            max_body: defaults::MAX_BODY,
            max_tokens_limit: defaults::MAX_TOKENS,
            queue: defaults::QUEUE,
            learn_every_sessions: Some(defaults::LEARN_EVERY),
            learn_every_minutes: defaults::LEARN_MINUTES,
            learn_sessions: defaults::LEARN_SESSIONS,
            learn_algo: Algo::A2tgpo,
            train_threads: defaults::TRAIN_THREADS,
            gate_kl: crate::learn::gate::DEFAULT_KL_BOUND,
            max_live_sessions: defaults::MAX_LIVE_SESSIONS,
            session_idle: Duration::from_secs_f64(defaults::SESSION_IDLE_MINUTES * 60.0),
            body_timeout: Duration::from_secs(defaults::BODY_TIMEOUT_S),
            learn_nice: defaults::LEARN_NICE,
            loopback_only: true,
            allow_origins: Vec::new(),
            reward_range: DEFAULT_REWARD_RANGE,
        }
    }
}

/// The outcomes feedback may report by default: the README's resolved (1) / unresolved (0)
/// and anything between −1 and 1.
pub const DEFAULT_REWARD_RANGE: (f64, f64) = (-1.0, 1.0);

/// Most stop strings a request may give (OpenAI's limit), and the longest one in bytes.
pub const MAX_STOP: (usize, usize) = (4, 256);

/// An HTTP error in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            retry_after: None,
        }
    }
    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        match e {
            Error::ContextOverflow { .. }
            | Error::Invalid(_)
            | Error::Template(_)
            | Error::NotActivatable { .. } => Self::bad(e.to_string()),
            Error::NotFound(_) => {
                Self::new(StatusCode::NOT_FOUND, "not_found_error", e.to_string())
            }
            _ => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            ),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (
            self.status,
            Json(error_body(&self.message, self.kind, None)),
        )
            .into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// A live session as the client sees it.
#[derive(Clone)]
struct LiveSession {
    store_id: i64,
    /// messages as the client sent and received them (assistant: the visible text)
    messages: Vec<Message>,
    /// when a request last used it
    last_used: Instant,
}

#[derive(Default)]
struct Metrics {
    requests: AtomicU64,
    errors: AtomicU64,
    completion_tokens: AtomicU64,
    decode_tps_milli: AtomicU64,
    updates: AtomicU64,
    ended_with_feedback: AtomicU64,
    /// 1 while an update runs in the background
    updating: AtomicU64,
}

/// Shared state of the handlers.
pub struct AppState {
    engine: Engine,
    store: Mutex<Store>,
    cfg: ServerConfig,
    sessions: Mutex<HashMap<String, LiveSession>>,
    /// client session ids with a generation in flight (one at a time per session)
    busy: Mutex<std::collections::HashSet<String>>,
    queue: Arc<Semaphore>,
    metrics: Metrics,
    active: Mutex<Option<i64>>,
    last_update: Mutex<Option<crate::learn::Diagnostics>>,
    next_id: AtomicU64,
}

/// The router with every route and the optional bearer-token check.
pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/sessions/{id}/feedback", post(feedback))
        .route("/v1/sessions/{id}/end", post(end_session))
        .route("/v1/models", get(models))
        .route("/v1/adapters", get(adapters))
        .route("/v1/adapters/{id}/activate", post(activate))
        .route("/v1/adapters/rollback", post(rollback))
        .route("/healthz", get(healthz))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            ApiError::new(StatusCode::NOT_FOUND, "not_found_error", "no such route")
        })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this route does not take that method",
            )
        })
        .layer(axum::middleware::from_fn_with_state(state.clone(), auth))
        .with_state(state)
}
