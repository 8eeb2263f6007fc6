//! `turnwise bench --load`: completion throughput and latency of `turnwise serve` under
//! concurrent clients holding multi-turn sessions, and — when its binary is given — of
//! llama.cpp's own `llama-server` with the same model, threads, context per session and
//! `--parallel`, measured by the same client in the same run.
//!
//! Every client plays whole sessions one after another: a system prompt and an opening, then
//! follow-ups, each request carrying the history so far (the OpenAI protocol; Turnwise matches
//! it to the live session, llama-server to its slot's cached prompt). Replies are greedy and
//! `ignore_eos`, so both servers generate exactly `--reply-tokens` per request.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;
use turnwise::server::{self, AppState, ServerConfig};

use super::bench::BenchArgs;
use super::bench_serve::{percentile, request};

const SYSTEM: &str = "You are a helpful customer-service assistant for an online shop.";
const FOLLOW_UPS: [&str; 4] = [
    "It was due last Tuesday and the tracking page has not changed since. What can you do?",
    "Thanks. If it does not arrive by Friday, can I get a refund instead?",
    "One more thing: can you change the delivery address to my office?",
    "Great, please summarise what happens next.",
];

/// What one load level measured on one server.
struct Level {
    clients: usize,
    tokens: usize,
    wall_s: f64,
    latencies: Vec<f64>,
}

impl Level {
    fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.wall_s.max(1e-9)
    }
}

/// A child server process, killed when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0")?;
    Ok(l.local_addr()?.port())
}

/// One client's sessions: `sessions` × `turns` requests; returns (latencies, tokens).
fn client(
    addr: SocketAddr,
    tag: &str,
    id: usize,
    args: &BenchArgs,
    pb: &ProgressBar,
) -> anyhow::Result<(Vec<f64>, usize)> {
    let (mut lat, mut tokens) = (Vec::new(), 0usize);
    for s in 0..args.sessions {
        let sid = format!("{tag}-c{id}-s{s}");
        let mut messages = vec![
            json!({"role": "system", "content": SYSTEM}),
            json!({"role": "user", "content": format!(
                "Hi, my order {} has not arrived yet. Can you check where it is?",
                40_000 + 97 * id + 13 * s
            )}),
        ];
        for t in 0..args.turns {
            if t > 0 {
                let q = FOLLOW_UPS[(t - 1) % FOLLOW_UPS.len()];
                messages.push(json!({"role": "user", "content": q}));
            }
            let body = json!({
                "messages": messages,
                "max_tokens": args.reply_tokens,
                "temperature": 0.0,
                "ignore_eos": true,
            });
            let (code, reply, secs) = request(
                addr,
                "POST",
                "/v1/chat/completions",
                Some(&body),
                &[("X-Session-Id", &sid)],
            )?;
            if code != 200 {
                bail!("{tag}: HTTP {code} on turn {t} of {sid}: {reply}");
            }
            let content = reply["choices"][0]["message"]["content"]
                .as_str()
                .context("a reply without content")?
                .to_string();
            messages.push(json!({"role": "assistant", "content": content}));
            tokens += reply["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
            lat.push(secs);
            pb.inc(1);
        }
    }
    Ok((lat, tokens))
}

/// Every load level against one server.
fn levels(addr: SocketAddr, tag: &str, args: &BenchArgs) -> anyhow::Result<Vec<Level>> {
    // warm-up: the first request pays for allocations and page faults
    let warm = BenchArgs {
        sessions: 1,
        turns: 1,
        ..args.clone()
    };
    client(
        addr,
        &format!("{tag}-warm"),
        0,
        &warm,
        &ProgressBar::hidden(),
    )?;
    let mut out = Vec::new();
    for &n in &args.clients {
        let pb = ProgressBar::new((n * args.sessions * args.turns) as u64);
        pb.set_style(
            ProgressStyle::with_template("{prefix:>28} [{bar:30}] {pos}/{len} {elapsed_precise}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_prefix(format!("{tag}, {n} client(s)"));
        let t = Instant::now();
        let results: Vec<anyhow::Result<(Vec<f64>, usize)>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..n)
                .map(|i| {
                    let pb = &pb;
                    let tag = format!("{tag}-{n}");
                    s.spawn(move || client(addr, &tag, i, args, pb))
                })
                .collect();
            hs.into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a client panicked")))
                })
                .collect()
        });
        let wall_s = t.elapsed().as_secs_f64();
        pb.finish_and_clear();
        let mut level = Level {
            clients: n,
            tokens: 0,
            wall_s,
            latencies: Vec::new(),
        };
        for r in results {
            let (lat, tokens) = r?;
            level.latencies.extend(lat);
            level.tokens += tokens;
        }
        out.push(level);
    }
    Ok(out)
}

/// Starts llama.cpp's server on a free port and waits until it answers `/health`.
fn start_llama_server(
    bin: &Path,
    model: &Path,
    threads: i32,
    n_ctx: usize,
    parallel: usize,
    log: &Path,
) -> anyhow::Result<(ChildGuard, SocketAddr)> {
    let port = free_port()?;
    let logf = std::fs::File::create(log)?;
    let child = Command::new(bin)
        .args(["-m"])
        .arg(model)
        .args(["-t", &threads.to_string(), "-tb", &threads.to_string()])
        .args(["-c", &(n_ctx * parallel).to_string()])
        .args(["-np", &parallel.to_string()])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(Stdio::from(logf.try_clone()?))
        .stderr(Stdio::from(logf))
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let mut guard = ChildGuard(child);
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let t = Instant::now();
    loop {
        if let Some(status) = guard.0.try_wait()? {
            bail!(
                "{} exited with {status} before answering (its log: {})",
                bin.display(),
                log.display()
            );
        }
        if let Ok((200, _, _)) = request(addr, "GET", "/health", None, &[]) {
            return Ok((guard, addr));
        }
        if t.elapsed() > Duration::from_secs(180) {
            bail!(
                "{} did not become healthy in 180 s (its log: {})",
                bin.display(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Runs the load benchmark and prints its table.
///
/// # Errors
/// Model, bind, server and request errors.
pub fn run(args: BenchArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    if args.clients.is_empty() || args.clients.contains(&0) || args.turns == 0 || args.sessions == 0
    {
        bail!("--clients, --turns and --sessions must be at least 1");
    }
    if let Some(b) = &args.llama_server {
        if !b.is_file() {
            bail!(
                "--llama-server {}: no such file (build llama.cpp's `llama-server` target, e.g. from the llama-cpp-python sdist's vendor/llama.cpp)",
                b.display()
            );
        }
    }
    let dir = std::env::temp_dir().join(format!("turnwise-bench-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let out = measure(&args, &dir, verbose);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn measure(args: &BenchArgs, dir: &Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let engine = args.model.start(verbose)?;
    let info = engine.info().clone();
    let cfg = ServerConfig {
        db: dir.join("bench.db"),
        max_tokens_limit: 4096,
        queue: 256,
        learn_every_sessions: None,
        learn_every_minutes: 1e9,
        gate_kl: 0.0,
        max_live_sessions: 4096,
        ..ServerConfig::default()
    };
    let state = AppState::new(engine.clone(), cfg)?;
    let rt = server::runtime()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    rt.spawn(server::serve(
        listener,
        server::router(state.clone()),
        server::ConnectionLimits {
            // every client of the benchmark is 127.0.0.1
            per_peer: 256,
            ..server::ConnectionLimits::new(256)
        },
    ));
    let before = engine.stats().counters();
    let ours = levels(addr, "turnwise", args)?;
    let counted = engine.stats().counters().since(&before);
    drop(state);
    let theirs = match &args.llama_server {
        Some(bin) => {
            let (guard, addr) = start_llama_server(
                bin,
                &info.path,
                info.n_threads,
                info.n_ctx,
                info.n_seq,
                &dir.join("llama-server.log"),
            )?;
            let r = levels(addr, "llama-server", args)?;
            drop(guard);
            Some(r)
        }
        None => None,
    };
    println!(
        "load: {} session(s) per client × {} turns × {} greedy tokens (ignore_eos); model {}, {} threads, --parallel {}, context {} per session; {} cores",
        args.sessions,
        args.turns,
        args.reply_tokens,
        info.name,
        info.n_threads,
        info.n_seq,
        info.n_ctx,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    println!(
        "{:>7} | {:>22} | {:>22} | {:>18}",
        "clients", "turnwise serve", "llama-server", "turnwise / llama"
    );
    println!(
        "{:>7} | {:>8} {:>6} {:>6} | {:>8} {:>6} {:>6} | {:>8} {:>8}",
        "", "tok/s", "p50 s", "p95 s", "tok/s", "p50 s", "p95 s", "tok/s", "p95"
    );
    for (i, a) in ours.iter().enumerate() {
        let b = theirs.as_ref().and_then(|t| t.get(i));
        let cell = |l: Option<&Level>| match l {
            Some(l) => format!(
                "{:>8.1} {:>6.2} {:>6.2}",
                l.tokens_per_s(),
                percentile(&l.latencies, 50.0),
                percentile(&l.latencies, 95.0)
            ),
            None => format!("{:>8} {:>6} {:>6}", "–", "–", "–"),
        };
        let ratio = match b {
            Some(b) => format!(
                "{:>7.2}× {:>7.2}×",
                a.tokens_per_s() / b.tokens_per_s().max(1e-9),
                percentile(&a.latencies, 95.0) / percentile(&b.latencies, 95.0).max(1e-9)
            ),
            None => format!("{:>8} {:>8}", "–", "–"),
        };
        println!(
            "{:>7} | {} | {} | {}",
            a.clients,
            cell(Some(a)),
            cell(b),
            ratio
        );
    }
    let steps = counted.steps.max(1);
    println!(
        "turnwise engine: {} decoding steps ({:.1} s), {:.2} rows per step on average, at most {}; admissions decoded {} prompt tokens ({:.1} s); idle caches parked {} times, restored {}",
        steps,
        counted.step_us as f64 / 1e6,
        counted.rows as f64 / steps as f64,
        counted.max_rows,
        counted.prefill_tokens,
        counted.prefill_us as f64 / 1e6,
        counted.parked,
        counted.restored,
    );
    if theirs.is_some() {
        println!("goal: ≥ 0.90× llama-server's tokens/s and p95 ≤ 1.20× at 4 and 8 clients");
    }
    Ok(ExitCode::SUCCESS)
}
