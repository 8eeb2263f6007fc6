//! `turnwise bench --serve`: completion latency of `turnwise serve` while the background
//! learner updates the adapter, against the same requests on an idle server.
//!
//! The server runs in this process on 127.0.0.1 with the real engine, store and learner; a
//! plain HTTP/1.1 client sends the requests one after another. Logged sessions with outcomes
//! are created first so that an update has work to do. In the second phase updates run back to
//! back on the learner's thread (`update_in_background`, the server's own path) for as long as
//! the requests take. Candidates are refused by a KL bound of 0, so the policy stays the same
//! and both phases generate the same greedy tokens: the difference is the learner's load alone.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};
use turnwise::policy::OutputHead;
use turnwise::server::{self, AppState, ServerConfig};

use super::bench::BenchArgs;

/// One request over a fresh connection: (status, body, seconds).
fn post(addr: SocketAddr, path: &str, body: &Value) -> anyhow::Result<(u16, Value, f64)> {
    request(addr, "POST", path, Some(body), &[])
}

/// One HTTP/1.1 request over a fresh connection, with extra headers: (status, body, seconds).
pub(super) fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    headers: &[(&str, &str)],
) -> anyhow::Result<(u16, Value, f64)> {
    let t = Instant::now();
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(600)))?;
    let b = body.map(Value::to_string).unwrap_or_default();
    let extra: String = headers
        .iter()
        .map(|(k, v)| format!("{k}: {v}\r\n"))
        .collect();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{b}",
        b.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let secs = t.elapsed().as_secs_f64();
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("malformed HTTP response")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status code")?;
    let chunked = head.lines().any(|l| {
        l.to_ascii_lowercase()
            .starts_with("transfer-encoding: chunked")
    });
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    Ok((
        status,
        serde_json::from_str(&body).unwrap_or(Value::Null),
        secs,
    ))
}

/// The payload of a chunked HTTP/1.1 body.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}

pub(super) fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let k = ((p / 100.0) * (s.len() as f64 - 1.0)).round() as usize;
    s[k.min(s.len() - 1)]
}

fn completion(i: usize, session: Option<&str>, max_tokens: usize) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": format!(
            "Hello, this is about order {}. It has not arrived yet; can you check where it is?",
            40_000 + 37 * i
        )}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    });
    if let Some(s) = session {
        b["session_id"] = json!(s);
    }
    b
}

/// Runs the benchmark and prints its table.
///
/// # Errors
/// Model, store, bind and request errors.
pub fn run(args: BenchArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let dir = std::env::temp_dir().join(format!("turnwise-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let out = measure(&args, &dir, verbose);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn measure(args: &BenchArgs, dir: &std::path::Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let engine = args.model.start(verbose)?;
    let head = Arc::new(OutputHead::from_gguf(&engine.info().path)?);
    let threads = engine.info().n_threads;
    let cfg = ServerConfig {
        db: dir.join("bench.db"),
        max_tokens_limit: 4096,
        queue: 64,
        learn_every_sessions: None,
        learn_every_minutes: 1e9,
        train_threads: args.serve_train_threads,
        gate_kl: 0.0,
        learn_nice: args.learn_nice,
        ..ServerConfig::default()
    };
    let state = AppState::new(engine, cfg)?;
    let rt = server::runtime()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    let app = server::router(state.clone());
    rt.spawn(server::serve(
        listener,
        app,
        server::ConnectionLimits::new(64),
    ));

    let bar = |n: usize, what: &str| {
        let b = ProgressBar::new(n as u64);
        b.set_style(
            ProgressStyle::with_template("{prefix:>22} [{bar:30}] {pos}/{len} {elapsed_precise}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        b.set_prefix(what.to_string());
        b
    };
    // logged sessions with outcomes: the learner's batch
    let pb = bar(args.seed_sessions, "logging sessions");
    for i in 0..args.seed_sessions {
        let id = format!("seed-{i}");
        let mut req = completion(i, Some(&id), 24);
        req["temperature"] = json!(0.8);
        req["seed"] = json!(i);
        let (code, body, _) = post(addr, "/v1/chat/completions", &req)?;
        if code != 200 {
            bail!("seeding session {i}: HTTP {code} {body}");
        }
        let outcome = if i % 2 == 0 { "resolved" } else { "unresolved" };
        let (code, body, _) = post(
            addr,
            &format!("/v1/sessions/{id}/feedback"),
            &json!({"outcome": outcome}),
        )?;
        if code != 200 {
            bail!("feedback of session {i}: HTTP {code} {body}");
        }
        post(addr, &format!("/v1/sessions/{id}/end"), &json!({}))?;
        pb.inc(1);
    }
    pb.finish_and_clear();

    let requests = |label: &str| -> anyhow::Result<(Vec<f64>, usize, Vec<Instant>)> {
        let pb = bar(args.requests, label);
        let (mut lat, mut tokens) = (Vec::with_capacity(args.requests), 0usize);
        let mut starts = Vec::with_capacity(args.requests);
        for i in 0..args.requests {
            starts.push(Instant::now());
            let (code, body, secs) = post(
                addr,
                "/v1/chat/completions",
                &completion(1000 + i, None, args.decode_tokens.min(64)),
            )?;
            if code != 200 {
                bail!("request {i}: HTTP {code} {body}");
            }
            tokens += body["usage"]["completion_tokens"].as_u64().unwrap_or(0) as usize;
            lat.push(secs);
            pb.inc(1);
        }
        pb.finish_and_clear();
        Ok((lat, tokens, starts))
    };
    let (idle, idle_tokens, _) = requests("idle")?;

    // updates back to back on the learner's thread while the same requests run
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let busy = Arc::new(Mutex::new(Vec::<(Instant, Instant)>::new()));
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let learner = {
        let (st, head, stop, done, busy, errors) = (
            state.clone(),
            head.clone(),
            stop.clone(),
            done.clone(),
            busy.clone(),
            errors.clone(),
        );
        rt.spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                match server::update_in_background(st.clone(), head.clone()).await {
                    Ok(_) => {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(e.to_string());
                        return;
                    }
                }
                busy.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((t, Instant::now()));
            }
        })
    };
    // the first update is under way before the first request
    std::thread::sleep(Duration::from_millis(500));
    let t_phase = Instant::now();
    let (during, during_tokens, starts) = requests("during updates")?;
    let phase_s = t_phase.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    rt.block_on(learner)?;
    if let Some(e) = errors.lock().unwrap_or_else(|p| p.into_inner()).first() {
        bail!("the background update failed: {e}");
    }
    let spans = busy.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let update_s: Vec<f64> = spans
        .iter()
        .map(|(a, b)| b.duration_since(*a).as_secs_f64())
        .collect();
    let busy_s: f64 = spans
        .iter()
        .map(|(a, b)| {
            let a = (*a).max(t_phase);
            let end = t_phase + Duration::from_secs_f64(phase_s);
            (*b).min(end).saturating_duration_since(a).as_secs_f64()
        })
        .sum();

    println!(
        "turnwise serve: completion latency while the learner updates (127.0.0.1, {} requests of ≤ {} greedy tokens each, one at a time; engine {threads} threads, learner {} threads at nice {}; {} cores)",
        args.requests,
        args.decode_tokens.min(64),
        args.serve_train_threads,
        args.learn_nice,
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    );
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>12}",
        "phase", "p50 s", "p99 s", "mean s", "tokens"
    );
    let row = |name: &str, v: &[f64], tokens: usize| {
        println!(
            "{:<16} {:>9.3} {:>9.3} {:>9.3} {:>12}",
            name,
            percentile(v, 50.0),
            percentile(v, 99.0),
            v.iter().sum::<f64>() / v.len().max(1) as f64,
            tokens
        );
    };
    row("idle", &idle, idle_tokens);
    row("during updates", &during, during_tokens);
    println!(
        "ratio during/idle: p50 {:.2}×, p99 {:.2}× (goal p99 ≤ 1.5×)",
        percentile(&during, 50.0) / percentile(&idle, 50.0),
        percentile(&during, 99.0) / percentile(&idle, 99.0)
    );
    println!(
        "updates: {} finished, {:.1} s each (median), learner busy {:.0} % of the measured phase ({} logged sessions)",
        done.load(Ordering::Relaxed),
        if update_s.is_empty() {
            0.0
        } else {
            percentile(&update_s, 50.0)
        },
        100.0 * busy_s / phase_s.max(1e-9),
        args.seed_sessions
    );
    // the slowest requests, and whether an update ended (wrote its candidate) while they ran
    let mut order: Vec<usize> = (0..during.len()).collect();
    order.sort_by(|&a, &b| during[b].total_cmp(&during[a]));
    let slowest: Vec<String> = order
        .iter()
        .take(3)
        .map(|&i| {
            let (a, b) = (starts[i], starts[i] + Duration::from_secs_f64(during[i]));
            let ended = spans.iter().any(|(_, e)| *e >= a && *e <= b);
            let began = spans.iter().any(|(s, _)| *s >= a && *s <= b);
            format!(
                "{:.3} s{}",
                during[i],
                match (began, ended) {
                    (_, true) => " (an update wrote its candidate meanwhile)",
                    (true, false) => " (an update started meanwhile)",
                    _ => "",
                }
            )
        })
        .collect();
    println!("slowest during updates: {}", slowest.join(", "));
    if idle_tokens != during_tokens {
        println!(
            "note: the phases generated different token counts ({idle_tokens} vs {during_tokens})"
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `turnwise bench --lookup N`: a log of `n` live sessions with client ids, then feedback on
/// unknown ids from 4 clients at once while `/healthz` is timed, against the idle server.
///
/// # Errors
/// Model, store, bind and request errors.
pub fn lookup(args: &BenchArgs, n: usize, verbose: bool) -> anyhow::Result<ExitCode> {
    let dir = std::env::temp_dir().join(format!("turnwise-bench-lookup-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let out = measure_lookup(args, n, &dir, verbose);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

fn measure_lookup(
    args: &BenchArgs,
    n: usize,
    dir: &std::path::Path,
    verbose: bool,
) -> anyhow::Result<ExitCode> {
    let db = dir.join("lookup.db");
    {
        let store = turnwise::store::Store::open(&db)?;
        let pb = ProgressBar::new(n as u64);
        pb.set_style(
            ProgressStyle::with_template("{prefix:>22} [{bar:30}] {pos}/{len} {elapsed_precise}")
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        pb.set_prefix("logging sessions");
        let tx = store.connection().unchecked_transaction()?;
        {
            let mut st = tx.prepare(
                "INSERT INTO sessions (source, ended_at, outcome_reward, metadata) \
                 VALUES ('live', strftime('%Y-%m-%dT%H:%M:%fZ', 'now'), 1.0, ?1)",
            )?;
            for i in 0..n {
                st.execute([json!({"client_session_id": format!("client-{i}")}).to_string()])?;
                if i % 10_000 == 0 {
                    pb.set_position(i as u64);
                }
            }
        }
        tx.commit()?;
        pb.finish_and_clear();
    }
    let engine = args.model.start(verbose)?;
    let cfg = ServerConfig {
        db: db.clone(),
        learn_every_minutes: 1e9,
        ..ServerConfig::default()
    };
    let state = AppState::new(engine, cfg)?;
    let rt = server::runtime()?;
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let addr = listener.local_addr()?;
    rt.spawn(server::serve(
        listener,
        server::router(state),
        server::ConnectionLimits::new(64),
    ));
    let health = |k: usize| -> anyhow::Result<Vec<f64>> {
        let mut v = Vec::with_capacity(k);
        for _ in 0..k {
            let (code, _, secs) = request(addr, "GET", "/healthz", None, &[])?;
            if code != 200 {
                bail!("/healthz: HTTP {code}");
            }
            v.push(secs);
        }
        Ok(v)
    };
    let per_client = args.requests.max(1) * 25;
    let unknown = move |client: usize, k: usize| -> anyhow::Result<Vec<f64>> {
        let mut v = Vec::with_capacity(k);
        for i in 0..k {
            let (code, _, secs) = post(
                addr,
                &format!("/v1/sessions/no-such-{client}-{i}/feedback"),
                &json!({"outcome": 1}),
            )?;
            if code != 404 {
                bail!("feedback on an unknown id: HTTP {code}, expected 404");
            }
            v.push(secs);
        }
        Ok(v)
    };
    let idle_health = health(100)?;
    let idle_unknown = unknown(99, 200)?;
    let flood: Vec<_> = (0..4)
        .map(|c| std::thread::spawn(move || unknown(c, per_client)))
        .collect();
    let mut busy_health = Vec::new();
    while !flood.iter().all(|h| h.is_finished()) {
        busy_health.extend(health(1)?);
    }
    let mut flooded = Vec::new();
    for h in flood {
        let r = h
            .join()
            .map_err(|_| anyhow::anyhow!("a flooding client panicked"))??;
        flooded.extend(r);
    }
    let ms = |v: &[f64], p: f64| 1e3 * percentile(v, p);
    println!(
        "session lookup with {n} logged live sessions (127.0.0.1, one connection per request)"
    );
    println!("| measure | requests | p50 ms | p95 ms | max ms |");
    println!("|---|---|---|---|---|");
    for (name, v) in [
        ("/healthz, idle", &idle_health),
        ("feedback on an unknown id, one client", &idle_unknown),
        ("feedback on an unknown id, 4 clients at once", &flooded),
        ("/healthz during that flood", &busy_health),
    ] {
        println!(
            "| {name} | {} | {:.2} | {:.2} | {:.2} |",
            v.len(),
            ms(v, 50.0),
            ms(v, 95.0),
            ms(v, 100.0)
        );
    }
    Ok(ExitCode::SUCCESS)
}
