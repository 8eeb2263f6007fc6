//! `turnwise serve`: an OpenAI-compatible chat server that logs every turn token-exact, takes
//! feedback, and learns in the background with a promotion gate and hot-swap.
//!
//! The engine thread owns llama.cpp; handlers talk to it through [`Engine`]'s async calls and a
//! bounded queue (a semaphore: when it is full the answer is 429 with `Retry-After`). A turn is
//! committed to SQLite before its reply is acknowledged (the JSON body, or the final SSE chunk).

pub mod openai;
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

impl Default for ServerConfig {
    /// The defaults `turnwise serve` runs with (database `turnwise.db` in the working
    /// directory).
    fn default() -> Self {
        ServerConfig {
            db: PathBuf::from("turnwise.db"),
            api_key: None,
            max_body: 1 << 20,
            max_tokens_limit: 512,
            queue: 8,
            learn_every_sessions: Some(20),
            learn_every_minutes: 30.0,
            learn_sessions: 200,
            learn_algo: Algo::A2tgpo,
            train_threads: 1,
            gate_kl: crate::learn::gate::DEFAULT_KL_BOUND,
            max_live_sessions: 1024,
            session_idle: Duration::from_secs(30 * 60),
            body_timeout: Duration::from_secs(30),
            learn_nice: 19,
            loopback_only: true,
            allow_origins: Vec::new(),
            reward_range: DEFAULT_REWARD_RANGE,
        }
    }
}

/// The outcomes feedback may report by default: the README's resolved (1) / unresolved (0)
/// and anything between −1 and 1.
pub const DEFAULT_REWARD_RANGE: (f64, f64) = (-1.0, 1.0);

/// Whether a `Host` header value names this machine's loopback interface.
fn loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [::1]:port
        match rest.split_once(']') {
            Some((ip, after)) if after.is_empty() || after.starts_with(':') => ip,
            _ => return false,
        }
    } else {
        host.rsplit_once(':')
            .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
            .map_or(host, |(h, _)| h)
    };
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Browser protection (as local model servers do): a web page the user opens can send
/// requests to 127.0.0.1, so requests whose `Host` is not a loopback name (DNS rebinding),
/// whose `Origin` is not allowed, or that POST anything but `application/json` (the "simple"
/// cross-origin requests a page may send without asking) are refused.
fn browser_check(cfg: &ServerConfig, req: &Request) -> Result<(), ApiError> {
    let h = req.headers();
    let forbidden = |m: String| ApiError::new(StatusCode::FORBIDDEN, "permission_error", m);
    if cfg.loopback_only {
        if let Some(host) = h.get(axum::http::header::HOST) {
            let host = host.to_str().unwrap_or("");
            if !loopback_host(host) {
                return Err(forbidden(format!(
                    "Host {host:?} is not a loopback name: this server answers requests to localhost only (bind another address with --host to serve a network)"
                )));
            }
        }
    }
    if let Some(origin) = h.get(axum::http::header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if !cfg.allow_origins.iter().any(|o| o == origin) {
            return Err(forbidden(format!(
                "requests from web pages of origin {origin:?} are not allowed (allow one with --allow-origin)"
            )));
        }
    }
    if req.method() == axum::http::Method::POST {
        let json = h
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "POST bodies must be sent as Content-Type: application/json",
            ));
        }
    }
    Ok(())
}

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
            Error::ContextOverflow { .. } | Error::Invalid(_) | Error::Template(_) => {
                Self::bad(e.to_string())
            }
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

/// The server's async runtime: two workers (generation runs on the engine thread and the
/// learner on its own, so the workers only move bytes).
///
/// # Errors
/// The runtime cannot start (no threads).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// The longest the learner waits between two steps for the server to fall idle.
pub const YIELD_MAX: Duration = Duration::from_secs(10);

impl AppState {
    /// Generations admitted and not finished.
    pub fn generating(&self) -> usize {
        self.cfg
            .queue
            .saturating_sub(self.queue.available_permits())
    }

    /// Blocks the calling (learner) thread while replies are being generated, for at most
    /// [`YIELD_MAX`].
    pub fn yield_to_serving(&self) {
        let t = Instant::now();
        while self.generating() > 0 && t.elapsed() < YIELD_MAX {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Opens the store, loads the active adapter into the engine.
    ///
    /// # Errors
    /// Store errors, or an active adapter that cannot be loaded.
    pub fn new(engine: Engine, cfg: ServerConfig) -> crate::Result<Arc<Self>> {
        let mut store = Store::open(&cfg.db)?;
        // what a crash left half-written: `writing` rows and temporary adapter folders
        let unfinished = store.reject_unfinished_adapters()?;
        let stale = crate::adapter::remove_stale_temp_dirs(&cfg.db);
        if !unfinished.is_empty() || stale > 0 {
            tracing::warn!(
                "a crash left adapters half-written: versions {unfinished:?} marked rejected, {stale} temporary folders removed"
            );
        }
        // candidates without a gate verdict (a crash between writing and judging, or an
        // offline `train` without --activate) are judged now: none becomes active unjudged
        for (id, passed) in gate::regate_unjudged(&store, cfg.gate_kl, Some(Source::Live))? {
            tracing::warn!(
                "adapter {id} had no gate verdict: re-gated at start-up, {}",
                if passed { "passed" } else { "rejected" }
            );
        }
        // the active adapter, or, when it does not load or fit the model, the previous good one
        let active = loop {
            let Some(rec) = store.active_adapter()? else {
                break None;
            };
            let loaded = Adapter::load(std::path::Path::new(&rec.path))
                .and_then(|a| engine.set_adapter(Some((rec.id, Arc::new(a)))));
            match loaded {
                Ok(()) => break Some(rec.id),
                Err(e) => {
                    tracing::warn!(
                        "active adapter {} cannot be served ({e}); falling back to the previous one",
                        rec.id
                    );
                    store.rollback_adapter()?;
                    let why = json!({"error": format!("cannot be served: {e}")});
                    store.set_adapter_status(rec.id, AdapterStatus::Rejected, Some(&why))?;
                }
            }
        };
        Ok(Arc::new(AppState {
            engine,
            store: Mutex::new(store),
            queue: Arc::new(Semaphore::new(cfg.queue.max(1))),
            cfg,
            sessions: Mutex::new(HashMap::new()),
            busy: Mutex::new(std::collections::HashSet::new()),
            metrics: Metrics::default(),
            active: Mutex::new(active),
            last_update: Mutex::new(None),
            next_id: AtomicU64::new(0),
        }))
    }

    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, LiveSession>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `live` in memory under `id`, then drops what is idle for too long and, over the
    /// cap, the least recently used: their engine contexts are closed, their logs stay, and a
    /// later request with their id restores them from the store.
    fn keep_live(&self, id: String, live: LiveSession) {
        let mut map = self.live();
        map.insert(id, live);
        let now = Instant::now();
        let busy = self.busy.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut dropped: Vec<(String, i64)> = map
            .iter()
            .filter(|(k, l)| {
                now.duration_since(l.last_used) > self.cfg.session_idle && !busy.contains(*k)
            })
            .map(|(k, l)| (k.clone(), l.store_id))
            .collect();
        for (k, _) in &dropped {
            map.remove(k);
        }
        while map.len() > self.cfg.max_live_sessions {
            let Some((k, sid)) = map
                .iter()
                .filter(|(k, _)| !busy.contains(*k))
                .min_by_key(|(_, l)| l.last_used)
                .map(|(k, l)| (k.clone(), l.store_id))
            else {
                break;
            };
            map.remove(&k);
            dropped.push((k, sid));
        }
        drop(map);
        for (_, sid) in dropped {
            self.engine.close(sid as u64);
        }
    }
}

/// Marks a client session as generating; cleared when dropped (the job's end, whatever it is).
struct BusyGuard {
    st: Arc<AppState>,
    id: String,
}

impl BusyGuard {
    /// `None` when the session already has a generation in flight.
    fn take(st: &Arc<AppState>, id: &str) -> Option<BusyGuard> {
        let mut busy = st.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.insert(id.to_string()).then(|| BusyGuard {
            st: st.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.st
            .busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

fn conflict(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "conflict_error",
        format!("session {id} has a reply in progress; send the next request after it"),
    )
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

/// The largest request head (request line and headers) the server reads: beyond it, 431.
pub const MAX_HEAD: usize = 128 * 1024;

/// How many connections [`serve`] holds open, and for how long it waits for a request head.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// connections open at once; one more is closed as soon as it is accepted
    pub max: usize,
    /// connections one peer address may hold at once (one client cannot take the whole
    /// budget; on a loopback bind every local process is the same peer)
    pub per_peer: usize,
    /// time a client has to send a request's headers
    pub head_timeout: Duration,
}

impl ConnectionLimits {
    /// `max` connections, half of them (at least one) per peer, 10 s for a request head.
    pub fn new(max: usize) -> Self {
        ConnectionLimits {
            max: max.max(1),
            per_peer: (max / 2).max(1),
            head_timeout: Duration::from_secs(10),
        }
    }
}

/// A held connection slot of one peer: gives its count back when the connection ends.
struct PeerSlot {
    peers: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// Serves `app` on `listener` until the process ends: at most `limits.max` connections at
/// once and `limits.per_peer` from one peer address (one more is closed as soon as it is
/// accepted), and each request head must arrive within `limits.head_timeout` (a client that
/// opens a connection and sends nothing, or sends its headers a byte at a time, is
/// disconnected instead of holding a slot).
///
/// # Errors
/// None in practice: a failed accept is logged and serving goes on.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max.max(1)));
    let peers: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // e.g. out of file descriptors: wait a little instead of spinning
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let peer_slot = {
            let mut m = peers.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(peer.ip()).or_insert(0);
            if *n >= limits.per_peer.max(1) {
                drop(stream);
                continue;
            }
            *n += 1;
            PeerSlot {
                peers: peers.clone(),
                ip: peer.ip(),
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let (_slot, _peer) = (slot, peer_slot);
            let mut http = hyper::server::conn::http1::Builder::new();
            // a request head over MAX_HEAD is 431 whether it arrives in one read or many
            // (hyper's buffer limit alone depends on how the bytes arrive)
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.head_timeout)
                .max_header_size(MAX_HEAD);
            let io = hyper_util::rt::TokioIo::new(wire::JsonErrors::new(stream));
            if let Err(e) = http.serve_connection(io, service).await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
}

async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = browser_check(&st.cfg, &req) {
        st.metrics.errors.fetch_add(1, Ordering::Relaxed);
        return e.into_response();
    }
    if let Some(key) = &st.cfg.api_key {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k == key);
        if !ok {
            st.metrics.errors.fetch_add(1, Ordering::Relaxed);
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong bearer token",
            )
            .into_response();
        }
    }
    next.run(req).await
}

async fn read_json<T: serde::de::DeserializeOwned>(st: &AppState, body: Body) -> ApiResult<T> {
    let bytes = read_body(st, body).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))
}

/// The request body, bounded in size (413) and in time (408).
async fn read_body(st: &AppState, body: Body) -> ApiResult<Vec<u8>> {
    use tokio_stream::StreamExt as _;
    let max = st.cfg.max_body;
    let read = async {
        let mut stream = body.into_data_stream();
        let mut bytes: Vec<u8> = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk: Bytes = chunk
                .map_err(|e| ApiError::bad(format!("the request body could not be read: {e}")))?;
            if bytes.len() + chunk.len() > max {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    format!("request body over {max} bytes"),
                ));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = tokio::time::timeout(st.cfg.body_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    st.cfg.body_timeout.as_secs()
                ),
            )
        })??;
    Ok(bytes)
}

fn content_text(v: &Option<Value>) -> ApiResult<String> {
    crate::replay::content_text(v.as_ref()).map_err(ApiError::bad)
}

fn sampler(req: &ChatRequest, limit: usize) -> ApiResult<SamplerParams> {
    let max = req.max_completion_tokens.or(req.max_tokens).unwrap_or(128);
    if max == 0 || max > limit {
        return Err(ApiError::bad(format!(
            "max_tokens must be between 1 and {limit}"
        )));
    }
    let stop = match &req.stop {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| ApiError::bad("stop must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop must be a string or an array of strings",
            ))
        }
    };
    let (most, longest) = MAX_STOP;
    if stop.len() > most || stop.iter().any(|s| s.is_empty() || s.len() > longest) {
        return Err(ApiError::bad(format!(
            "stop takes at most {most} strings of 1 to {longest} bytes"
        )));
    }
    let d = SamplerParams::default();
    let p = SamplerParams {
        temperature: req.temperature.unwrap_or(d.temperature),
        top_p: req.top_p.unwrap_or(d.top_p),
        top_k: req.top_k.unwrap_or(d.top_k),
        max_tokens: max,
        seed: req.seed.unwrap_or_else(rand_seed),
        stop,
        ignore_eog: req.ignore_eos,
        greedy_digits: false,
        id_slot: None,
    };
    if !(0.0..=2.0).contains(&p.temperature) || !(0.0..=1.0).contains(&p.top_p) || p.top_p == 0.0 {
        return Err(ApiError::bad(
            "temperature must be in [0, 2] and top_p in (0, 1]",
        ));
    }
    Ok(p)
}

fn rand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Resolves the session a request continues and the messages it adds.
fn route_session(
    st: &AppState,
    id: String,
    msgs: Vec<Message>,
) -> ApiResult<(String, LiveSession, Vec<Message>)> {
    let known = st.live().get(&id).cloned();
    let known = match known {
        Some(k) => Some(k),
        None => restore(st, &id)?,
    };
    if let Some(live) = known {
        let n = live.messages.len();
        let extends = msgs.len() > n
            && msgs[..n] == live.messages[..]
            && msgs[n..].iter().all(|m| m.role != Role::Assistant);
        if extends {
            return Ok((id, live.clone(), msgs[n..].to_vec()));
        }
    }
    // a new session, or a new branch of one whose history the request does not extend
    let mut s = NewSession::new(Source::Live);
    s.metadata = json!({"client_session_id": id});
    let store_id = Recorder::open(&st.store(), &s)?.id();
    Ok((
        id,
        LiveSession {
            store_id,
            messages: Vec::new(),
            last_used: Instant::now(),
        },
        msgs,
    ))
}

/// After a restart: the newest open session with this client id, restored token-exact.
fn restore(st: &AppState, client_id: &str) -> ApiResult<Option<LiveSession>> {
    let store = st.store();
    let found = store.session_of_client(client_id, true)?;
    let Some(sid) = found else { return Ok(None) };
    let turns = store.turns(sid)?;
    drop(store);
    let tokens: Vec<i32> = turns
        .iter()
        .flat_map(|t| t.token_ids.iter().copied())
        .collect();
    let messages: Vec<Message> = turns
        .iter()
        .map(|t| Message::new(t.role, t.text.clone()))
        .collect();
    // the engine call blocks: keep it off the async worker's back
    tokio::task::block_in_place(|| st.engine.restore(sid as u64, tokens, messages.clone()))?;
    Ok(Some(LiveSession {
        store_id: sid,
        messages,
        last_used: Instant::now(),
    }))
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let req: ChatRequest = read_json(&st, body).await?;
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty"));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = Role::parse(&m.role)
            .map_err(|_| ApiError::bad(format!("messages[{i}]: unknown role {:?}", m.role)))?;
        msgs.push(Message::new(role, content_text(&m.content)?));
    }
    // the context budget, before anything is rendered or tokenised: every message takes its
    // template's markers (at least two tokens) and its text at least bytes / longest piece
    let info = st.engine.info();
    let least: usize = msgs
        .iter()
        .map(|m| 2 + m.content.len() / info.max_piece_bytes.max(1))
        .sum();
    if least > info.n_ctx {
        return Err(ApiError::bad(format!(
            "the messages need at least {least} tokens; the context window holds {}",
            info.n_ctx
        )));
    }
    if !matches!(msgs.last().map(|m| m.role), Some(Role::User | Role::Tool)) {
        return Err(ApiError::bad(
            "the last message must be from the user or a tool",
        ));
    }
    let params = sampler(&req, st.cfg.max_tokens_limit)?;
    let client_id = req
        .session_id
        .clone()
        .or_else(|| {
            headers
                .get("x-session-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        })
        .or_else(|| req.user.clone());
    let permit = st.queue.clone().try_acquire_owned().map_err(|_| ApiError {
        retry_after: Some(1),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the generation queue is full; retry shortly",
        )
    })?;
    // one generation at a time per session: a second request on it, or on a new session id
    // being created, is answered 409 instead of interleaving into one context
    let client_id = client_id.unwrap_or_else(|| {
        format!(
            "s{}-{}",
            rand_seed() % 1_000_000_007,
            st.next_id.fetch_add(1, Ordering::Relaxed)
        )
    });
    let busy = BusyGuard::take(&st, &client_id).ok_or_else(|| conflict(&client_id))?;
    let (client_id, live, new_msgs) = route_session(&st, client_id, msgs)?;
    let model = st.engine.info().name.clone();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let cid = format!("chatcmpl-{}-{}", live.store_id, live.messages.len());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let st2 = st.clone();
    let (p2, live2, client2) = (params.clone(), live.clone(), client_id.clone());
    // generation + commit run to completion even if the client goes away
    let job = tokio::spawn(async move {
        let _permit = permit;
        let _busy = busy;
        let g = st2
            .engine
            .generate_async(
                live2.store_id as u64,
                new_msgs.clone(),
                p2.clone(),
                Some(tx),
            )
            .await?;
        let info = st2.engine.info();
        let committed =
            Recorder::resume(live2.store_id).generation(&mut st2.store(), &g, &p2, info);
        if let Err(e) = committed {
            // the engine's context is ahead of the log: drop it, so that the next request on
            // this session starts again from what the log holds
            st2.live().remove(&client2);
            st2.engine.close(live2.store_id as u64);
            return Err(e);
        }
        let mut live3 = live2.clone();
        live3.messages.extend(new_msgs);
        live3
            .messages
            .push(Message::new(Role::Assistant, g.reply.visible.clone()));
        live3.last_used = Instant::now();
        st2.keep_live(client2, live3);
        let n = g.reply.tokens.len() as u64;
        st2.metrics
            .completion_tokens
            .fetch_add(n, Ordering::Relaxed);
        if g.reply.decode_ms > 0.0 {
            st2.metrics.decode_tps_milli.store(
                (n as f64 / (g.reply.decode_ms / 1e3) * 1e3) as u64,
                Ordering::Relaxed,
            );
        }
        Ok::<_, Error>(g)
    });
    let usage = |g: &crate::policy::Generation| Usage {
        prompt_tokens: g.prompt.iter().map(|t| t.tokens.len()).sum(),
        completion_tokens: g.reply.tokens.len(),
        total_tokens: g.prompt.iter().map(|t| t.tokens.len()).sum::<usize>() + g.reply.tokens.len(),
    };
    let finish = |s: StopReason| {
        if s == StopReason::MaxTokens {
            "length"
        } else {
            "stop"
        }
    };
    if !req.stream {
        while rx.recv().await.is_some() {}
        let g = job.await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
        })??;
        return Ok(Json(json!({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": g.reply.visible},
                         "finish_reason": finish(g.reply.stop)}],
            "usage": usage(&g), "session_id": client_id, "adapter_id": g.reply.adapter_id,
        }))
        .into_response());
    }
    let (etx, erx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let chunk = |delta: Value, fin: Option<&str>| {
            json!({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": fin}], "session_id": client_id})
        };
        let _ = etx
            .send(Ok(
                Event::default().data(chunk(json!({"role": "assistant"}), None).to_string())
            ))
            .await;
        while let Some(piece) = rx.recv().await {
            if etx
                .send(Ok(
                    Event::default().data(chunk(json!({"content": piece}), None).to_string())
                ))
                .await
                .is_err()
            {
                // the client left: dropping the receiver cancels the generation; what was
                // produced is still committed by the job
                drop(rx);
                let _ = job.await;
                return;
            }
        }
        match job.await {
            Ok(Ok(g)) => {
                let mut last = chunk(json!({}), Some(finish(g.reply.stop)));
                last["usage"] = serde_json::to_value(usage(&g)).unwrap_or(Value::Null);
                last["adapter_id"] = json!(g.reply.adapter_id);
                let _ = etx.send(Ok(Event::default().data(last.to_string()))).await;
                let _ = etx.send(Ok(Event::default().data("[DONE]"))).await;
            }
            Ok(Err(e)) => {
                let _ = etx
                    .send(Ok(Event::default().data(
                        error_body(&e.to_string(), "server_error", None).to_string(),
                    )))
                    .await;
            }
            Err(e) => {
                let _ = etx
                    .send(Ok(Event::default().data(
                        error_body(&e.to_string(), "server_error", None).to_string(),
                    )))
                    .await;
            }
        }
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(erx)).into_response())
}

fn live_session(st: &AppState, id: &str) -> ApiResult<i64> {
    if let Some(l) = st.live().get(id) {
        return Ok(l.store_id);
    }
    st.store().session_of_client(id, false)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("unknown session {id}"),
        )
    })
}

async fn feedback(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Json<Value>> {
    let req: FeedbackRequest = read_json(&st, body).await?;
    let rec = Recorder::resume(live_session(&st, &id)?);
    let sid = rec.id();
    let mut store = st.store();
    let mut n = 0;
    if let Some(t) = &req.thumb {
        let up = match t.as_str() {
            "up" => true,
            "down" => false,
            _ => return Err(ApiError::bad("thumb must be \"up\" or \"down\"")),
        };
        let turn = match req.turn {
            Some(t) => Some(assistant_turn(&store, sid, &id, t)?),
            None => store
                .turns(sid)?
                .iter()
                .rev()
                .find(|t| t.role == Role::Assistant)
                .map(|t| t.idx),
        };
        let note = req.note.as_deref();
        rec.feedback(&mut store, &Feedback::Thumb { turn, up, note })?;
        n += 1;
    }
    if let Some(o) = &req.outcome {
        let v = match o {
            Value::String(s) if s == "resolved" => 1.0,
            Value::String(s) if s == "unresolved" => 0.0,
            Value::Number(x) => {
                let (lo, hi) = st.cfg.reward_range;
                x.as_f64()
                    .filter(|v| v.is_finite() && (lo..=hi).contains(v))
                    .ok_or_else(|| {
                        ApiError::bad(format!(
                            "outcome must be a number from {lo} to {hi} (the server's --reward-range)"
                        ))
                    })?
            }
            _ => {
                return Err(ApiError::bad(
                    "outcome must be \"resolved\", \"unresolved\" or a number",
                ))
            }
        };
        let note = req.note.as_deref();
        rec.feedback(&mut store, &Feedback::Outcome { value: v, note })?;
        n += 1;
    }
    if n == 0 {
        match &req.note {
            Some(text) => {
                let turn = match req.turn {
                    Some(t) => Some(assistant_turn(&store, sid, &id, t)?),
                    None => None,
                };
                rec.feedback(&mut store, &Feedback::Note { turn, text })?
            }
            None => return Err(ApiError::bad("give a thumb, an outcome or a note")),
        }
    }
    Ok(Json(json!({"session_id": id, "recorded": true})))
}

/// `t` when it is the index of an assistant turn of session `sid` (client id `id`), else 400.
fn assistant_turn(store: &Store, sid: i64, id: &str, t: i64) -> ApiResult<i64> {
    let ok = store
        .turns(sid)?
        .iter()
        .any(|x| x.idx == t && x.role == Role::Assistant);
    if ok {
        Ok(t)
    } else {
        Err(ApiError::bad(format!(
            "turn {t} is not an assistant turn of session {id}"
        )))
    }
}

async fn end_session(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    // ending while a reply is being written would let the finishing job re-open the session
    let _busy = BusyGuard::take(&st, &id).ok_or_else(|| conflict(&id))?;
    let rec = Recorder::resume(live_session(&st, &id)?);
    let sid = rec.id();
    let has_feedback = {
        let store = st.store();
        rec.end(&store)?;
        !store.feedback(sid)?.is_empty()
    };
    st.live().remove(&id);
    st.engine.close(sid as u64);
    if has_feedback {
        st.metrics
            .ended_with_feedback
            .fetch_add(1, Ordering::Relaxed);
    }
    Ok(Json(json!({"session_id": id, "ended": true})))
}

async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.engine.info().name, "object": "model", "owned_by": "turnwise"}]}),
    )
}

async fn adapters(State(st): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let mut list =
        serde_json::to_value(st.store().adapters()?).map_err(|e| ApiError::from(Error::from(e)))?;
    // where adapters live on disk is the server's business, not the client's
    if let Some(rows) = list.as_array_mut() {
        for r in rows.iter_mut().filter_map(Value::as_object_mut) {
            r.remove("path");
        }
    }
    Ok(Json(
        json!({"object": "list", "data": list, "active": *st.active.lock().unwrap_or_else(|p| p.into_inner())}),
    ))
}

/// Puts the engine (and `active`) on adapter `id` as the store records it.
fn switch_to(st: &AppState, id: Option<i64>) -> crate::Result<()> {
    let adapter = match id {
        Some(id) => {
            let rec = st.store().adapter(id)?;
            Some((
                id,
                Arc::new(Adapter::load(std::path::Path::new(&rec.path))?),
            ))
        }
        None => None,
    };
    st.engine.set_adapter(adapter)?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = id;
    Ok(())
}

/// Body of `POST /v1/adapters/{id}/activate` (optional).
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct ActivateRequest {
    /// activate a candidate that has not passed the gate (recorded with the adapter)
    #[serde(default)]
    force: bool,
}

async fn activate(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Json<Value>> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::bad(format!("adapter id {id:?} is not an integer")))?;
    // an empty body asks for no force
    let bytes = read_body(&st, body).await?;
    let req: ActivateRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        ActivateRequest::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?
    };
    {
        let store = st.store();
        let rec = store.adapter(id)?;
        if rec.status == AdapterStatus::Candidate && !gate::passed(&rec.metrics) {
            if !req.force {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_request_error",
                    format!(
                        "adapter {id} has not passed the gate; send {{\"force\": true}} to activate it anyway (recorded with the adapter)"
                    ),
                ));
            }
            let mut metrics = rec.metrics.clone();
            if !metrics.is_object() {
                metrics = json!({});
            }
            metrics["forced"] = json!({"via": "POST /v1/adapters/{id}/activate", "gate": rec.metrics["gate"].clone()});
            store.set_adapter_status(id, AdapterStatus::Candidate, Some(&metrics))?;
        }
    }
    let previous = *st.active.lock().unwrap_or_else(|p| p.into_inner());
    // checked by the engine first, written active after (learn::gate::activate)
    tokio::task::block_in_place(|| {
        // its own connection: the handlers' shared one stays free for `restore`
        let mut store = Store::open(&st.cfg.db)?;
        gate::activate(
            &mut store,
            id,
            |a| st.engine.set_adapter(Some((id, a))),
            || switch_to(&st, previous),
        )
    })
    .map_err(|e| match e {
        crate::Error::NotFound(_) => ApiError::from(e),
        e => ApiError::bad(e.to_string()),
    })?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    Ok(Json(json!({"active": id})))
}

async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    if st.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine thread has stopped"})),
        )
            .into_response()
    }
}

async fn rollback(State(st): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let now = st.store().rollback_adapter()?;
    tokio::task::block_in_place(|| switch_to(&st, now))?;
    Ok(Json(json!({"active": now})))
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let (sessions, turns) = {
        let s = st.store();
        s.storage_stats()
            .map(|x| (x.sessions, x.turns))
            .unwrap_or((0, 0))
    };
    let in_use = st.generating();
    let last = st
        .last_update
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut out = String::new();
    let mut line = |name: &str, kind: &str, help: &str, v: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    line(
        "turnwise_requests_total",
        "counter",
        "HTTP requests received",
        m.requests.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_errors_total",
        "counter",
        "requests refused for authentication",
        m.errors.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_completion_tokens_total",
        "counter",
        "tokens generated",
        m.completion_tokens.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_decode_tokens_per_second",
        "gauge",
        "decode speed of the last reply",
        m.decode_tps_milli.load(Ordering::Relaxed) as f64 / 1e3,
    );
    line(
        "turnwise_update_running",
        "gauge",
        "1 while a background update runs",
        m.updating.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_queue_depth",
        "gauge",
        "generations admitted and not finished",
        in_use as f64,
    );
    let (steps, rows, max_rows) = st.engine.stats().snapshot();
    line(
        "turnwise_decode_steps_total",
        "counter",
        "batched decoding steps (one token of every reply in flight)",
        steps as f64,
    );
    line(
        "turnwise_decode_rows_total",
        "counter",
        "tokens those steps decoded (rows / steps = mean batch)",
        rows as f64,
    );
    line(
        "turnwise_decode_batch_max",
        "gauge",
        "largest batch of one decoding step",
        max_rows as f64,
    );
    line(
        "turnwise_sessions",
        "gauge",
        "sessions in the log",
        sessions as f64,
    );
    line("turnwise_turns", "gauge", "turns in the log", turns as f64);
    line(
        "turnwise_live_sessions",
        "gauge",
        "conversations held in memory",
        st.live().len() as f64,
    );
    line(
        "turnwise_updates_total",
        "counter",
        "background updates run",
        m.updates.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_active_adapter",
        "gauge",
        "id of the active adapter (0: none)",
        st.active.lock().map(|a| a.unwrap_or(0)).unwrap_or(0) as f64,
    );
    if let Some(d) = &last {
        for (key, v) in [
            ("loss", d.loss),
            ("approx_kl", d.approx_kl),
            ("clip_frac_low", d.clip_frac_low),
            ("clip_frac_high", d.clip_frac_high),
            ("grad_norm", d.grad_norm),
        ] {
            line(
                &format!("turnwise_last_update_{key}"),
                "gauge",
                "diagnostic of the last update",
                v,
            );
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}

/// The background learner: wakes every `learn_every_sessions` ended sessions with feedback or
/// every `learn_every_minutes`, runs an update over the live sessions, gates the candidate and
/// hot-swaps it in when it passes.
pub async fn learner(st: Arc<AppState>, head: Arc<OutputHead>) {
    let Some(every) = st.cfg.learn_every_sessions else {
        return;
    };
    let mut last_run = Instant::now();
    let mut seen = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ended = st.metrics.ended_with_feedback.load(Ordering::Relaxed);
        let due_sessions = ended.saturating_sub(seen) as usize >= every.max(1);
        let due_time =
            last_run.elapsed().as_secs_f64() >= st.cfg.learn_every_minutes * 60.0 && ended > seen;
        if !(due_sessions || due_time) {
            continue;
        }
        seen = ended;
        last_run = Instant::now();
        match update_in_background(st.clone(), head.clone()).await {
            Ok(msg) => tracing::info!("{msg}"),
            Err(e) => tracing::warn!("background update: {e}"),
        }
    }
}

/// Runs [`learn_once`] on a thread of its own at the learner's priority
/// ([`ServerConfig::learn_nice`]): the async runtime's workers and the engine thread keep
/// serving, and when both want the CPU the scheduler gives it to serving. No lock of the
/// handlers is held meanwhile (the learner writes through its own store connection).
///
/// # Errors
/// The update's errors; a panic of the update thread.
pub async fn update_in_background(
    st: Arc<AppState>,
    head: Arc<OutputHead>,
) -> crate::Result<String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let nice = st.cfg.learn_nice;
    std::thread::Builder::new()
        .name("turnwise-learner".into())
        .spawn(move || {
            lower_thread_priority(nice);
            st.metrics.updating.store(1, Ordering::Relaxed);
            let r = learn_once(&st, &head);
            st.metrics.updating.store(0, Ordering::Relaxed);
            let _ = tx.send(r);
        })
        .map_err(|e| crate::Error::Invalid(format!("cannot start the learner thread: {e}")))?;
    rx.await
        .map_err(|_| crate::Error::Invalid("the update thread panicked".into()))?
}

/// Sets the calling thread's nice value (threads it starts later inherit it). Best effort: a
/// refusal is logged, and other systems than Linux keep the default priority. (Measured with
/// `turnwise bench --serve` on 2 cores: Linux's idle scheduling class on top of nice 19 made
/// completions slower, not faster — p50 1.93× idle against 1.09× — so it is not used.)
pub fn lower_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        let nice = nice.clamp(0, 19);
        // SAFETY: gettid and setpriority only read their arguments; on Linux PRIO_PROCESS
        // with a thread id addresses that thread alone
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
        };
        if rc != 0 {
            tracing::debug!(
                "could not lower the learner's priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// One background update with the promotion gate. Returns a line for the log.
///
/// # Errors
/// Update or store errors (the active adapter is unchanged then).
pub fn learn_once(st: &AppState, head: &OutputHead) -> crate::Result<String> {
    // the learner's own connection: handlers keep reading and writing the log meanwhile (WAL)
    let mut store = Store::open(&st.cfg.db)?;
    store.set_policy_model(&crate::assets::model_stamp_json(&st.engine.info().path));
    let parent = {
        match store.active_adapter()? {
            Some(rec) => Some((
                rec.id,
                Arc::new(Adapter::load(std::path::Path::new(&rec.path))?),
            )),
            None => None,
        }
    };
    let mut cfg = TrainConfig::preset(st.cfg.learn_algo);
    cfg.threads = st.cfg.train_threads;
    cfg.epochs = 1;
    let sel = Selection {
        source: Some(Source::Live),
        since: None,
        until: None,
        limit: st.cfg.learn_sessions.max(1),
    };
    // between steps the learner waits while replies are being generated (at most
    // YIELD_MAX per step, so that a server that is never idle still learns)
    let report = run_update(
        &mut store,
        &st.cfg.db,
        head,
        parent.clone(),
        &cfg,
        &sel,
        |_, _, _| st.yield_to_serving(),
    )?;
    st.metrics.updates.fetch_add(1, Ordering::Relaxed);
    *st.last_update.lock().unwrap_or_else(|p| p.into_inner()) = Some(report.diagnostics.clone());
    let Some(id) = report.adapter_id else {
        return Ok("update wrote no adapter".into());
    };
    // gate: the KL to the parent on the batch (the guard set of logged sessions) is bounded,
    // and the value head's estimate of success does not regress
    let kl = report.diagnostics.approx_kl;
    let verdict = gate::decide(
        kl,
        st.cfg.gate_kl,
        || {
            let cand = Adapter::load(&crate::adapter::adapter_dir(&st.cfg.db, id))?;
            gate::value_check(
                &store,
                &cand,
                parent.as_ref().map(|p| p.1.as_ref()),
                Some(Source::Live),
                gate::VALUE_SESSIONS,
            )
            .map(Some)
        },
        || Ok(None),
    )?;
    gate::record(&store, id, &verdict)?;
    let line = serde_json::to_string(&verdict)?;
    if !verdict.passed {
        return Ok(format!("adapter {id} failed the gate ({line})"));
    }
    let previous = parent.as_ref().map(|p| p.0);
    gate::activate(
        &mut store,
        id,
        |a| st.engine.set_adapter(Some((id, a))),
        || switch_to(st, previous),
    )?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    Ok(format!(
        "adapter {id} passed the gate and is active ({line})"
    ))
}
