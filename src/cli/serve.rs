//! `turnwise serve`: the OpenAI-compatible server with background learning.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use turnwise::learn::Algo;
use turnwise::policy::OutputHead;
use turnwise::server::{self, defaults, AppState, ServerConfig};

use super::ModelArgs;

/// Options of `turnwise serve`.
#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to bind (loopback by default)
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed)
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Bearer token required on every route
    #[arg(long, env = "TURNWISE_API_KEY")]
    api_key: Option<String>,
    /// Generations admitted at once (beyond: 429 with Retry-After)
    #[arg(long, default_value_t = defaults::QUEUE)]
    queue: usize,
    /// Largest request body in bytes
    #[arg(long, default_value_t = defaults::MAX_BODY)]
    max_body: usize,
    /// Largest max_tokens a request may ask for
    #[arg(long, default_value_t = defaults::MAX_TOKENS)]
    max_tokens_limit: usize,
    /// Do not learn in the background
    #[arg(long)]
    no_learn: bool,
    /// Run an update after this many ended sessions with feedback
    #[arg(long, default_value_t = defaults::LEARN_EVERY)]
    learn_every: usize,
    /// … or after this many minutes when new sessions ended
    #[arg(long, default_value_t = defaults::LEARN_MINUTES)]
    learn_minutes: f64,
    /// An update learns from at most this many of the newest finished live sessions
    #[arg(long, default_value_t = defaults::LEARN_SESSIONS)]
    learn_sessions: usize,
    /// Preset of the background updates
    #[arg(long, value_enum, default_value_t = Algo::A2tgpo)]
    algo: Algo,
    /// Threads of the learner's step (keeps training from starving serving)
    #[arg(long, default_value_t = defaults::TRAIN_THREADS)]
    train_threads: usize,
    /// Promotion gate: largest approximate KL of a candidate to its parent
    #[arg(long, default_value_t = turnwise::learn::gate::DEFAULT_KL_BOUND)]
    gate_kl: f64,
    /// Most conversations held in memory; the least recently used beyond it is dropped from
    /// memory (its log stays, and a later request with its session id restores it)
    #[arg(long, default_value_t = defaults::MAX_LIVE_SESSIONS)]
    max_live_sessions: usize,
    /// Minutes after which an idle conversation is dropped from memory (as above)
    #[arg(long, default_value_t = defaults::SESSION_IDLE_MINUTES)]
    session_idle_minutes: f64,
    /// Seconds a client may take to send a request body
    #[arg(long, default_value_t = defaults::BODY_TIMEOUT_S)]
    body_timeout_s: u64,
    /// Seconds a client may take to send a request's headers
    #[arg(long, default_value_t = 10)]
    header_timeout_s: u64,
    /// Most connections open at once; one more is closed as soon as it is accepted
    #[arg(long, default_value_t = 256)]
    max_connections: usize,
    /// Most connections one peer address holds at once [default: half of --max-connections],
    /// so that one client cannot take them all (on 127.0.0.1 every local process is one peer)
    #[arg(long)]
    max_connections_per_peer: Option<usize>,
    /// Nice value of the background learner (0–19; higher leaves more CPU to serving)
    #[arg(long, default_value_t = defaults::LEARN_NICE)]
    learn_nice: i32,
    /// Let web pages of this origin (`scheme://host[:port]`, repeatable) call the API; requests
    /// carrying any other `Origin` header are refused
    #[arg(long = "allow-origin", value_name = "ORIGIN")]
    allow_origins: Vec<String>,
    /// The numeric outcomes feedback may report, `LO,HI` (others are 400)
    #[arg(long, value_name = "LO,HI", default_value = "-1,1", value_parser = parse_range, allow_hyphen_values = true)]
    reward_range: (f64, f64),
}

fn parse_range(s: &str) -> Result<(f64, f64), String> {
    let (a, b) = s
        .split_once(',')
        .ok_or_else(|| format!("{s:?}: give LO,HI"))?;
    let lo: f64 = a
        .trim()
        .parse()
        .map_err(|_| format!("{a:?} is not a number"))?;
    let hi: f64 = b
        .trim()
        .parse()
        .map_err(|_| format!("{b:?} is not a number"))?;
    if !(lo.is_finite() && hi.is_finite() && lo <= hi && lo.abs().max(hi.abs()) <= 1e6) {
        return Err(format!("{s:?}: need finite LO ≤ HI within ±1e6"));
    }
    Ok((lo, hi))
}

/// Serves until killed.
///
/// # Errors
/// Model, store or bind errors.
pub fn run(args: ServeArgs, db: &Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let engine = args.model.start(verbose)?;
    let head = Arc::new(OutputHead::from_gguf(&engine.info().path)?);
    let cfg = ServerConfig {
        db: db.to_path_buf(),
        api_key: args.api_key.clone(),
        max_body: args.max_body,
        max_tokens_limit: args.max_tokens_limit,
        queue: args.queue,
        learn_every_sessions: (!args.no_learn).then_some(args.learn_every),
        learn_every_minutes: args.learn_minutes,
        learn_sessions: args.learn_sessions.max(1),
        learn_algo: args.algo,
        train_threads: args.train_threads,
        gate_kl: args.gate_kl,
        max_live_sessions: args.max_live_sessions.max(1),
        session_idle: std::time::Duration::from_secs_f64(
            (args.session_idle_minutes.max(0.0) * 60.0).min(1e9),
        ),
        body_timeout: std::time::Duration::from_secs(args.body_timeout_s.max(1)),
        learn_nice: args.learn_nice,
        loopback_only: args.host == "localhost"
            || args
                .host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback()),
        allow_origins: args.allow_origins.clone(),
        reward_range: args.reward_range,
    };
    let state = AppState::new(engine, cfg)?;
    let rt = server::runtime()?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
            .await
            .with_context(|| format!("binding {}:{}", args.host, args.port))?;
        let addr = listener.local_addr()?;
        println!("turnwise serving on http://{addr}");
        use std::io::Write;
        std::io::stdout().flush()?;
        tokio::spawn(server::learner(state.clone(), head));
        let head_timeout = std::time::Duration::from_secs(args.header_timeout_s.max(1));
        let limits = server::ConnectionLimits {
            max: args.max_connections.max(1),
            per_peer: args
                .max_connections_per_peer
                .unwrap_or(args.max_connections / 2)
                .max(1),
            head_timeout,
        };
        server::serve(listener, server::router(state), limits).await?;
        Ok::<_, anyhow::Error>(())
    })?;
    Ok(ExitCode::SUCCESS)
}
