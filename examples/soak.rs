//! Soak run of `turnwise serve` with faults: clients with multi-turn sessions, feedback and
//! background updates, and the server killed with SIGKILL at a random moment of every cycle.
//! After each kill it checks what a user relies on — every reply a client received is in the
//! log, SQLite's integrity check passes, the server restarts, and the active adapter loads and
//! passed the gate — and at the end prints the counts and the latency of replies while an update
//! ran against the others. 127.0.0.1 only; bounded by `--cycles`.
//!
//! ```text
//! cargo build --release && cargo run --release --example soak -- --cycles 100 --clients 4
//! ```
//!
//! Arguments after `--` go to `turnwise serve` (e.g. `-- --learn-nice 0` when another job
//! shares the machine and would otherwise starve the learner at its default nice 19).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};

mod common;
use serde_json::json;
use turnwise::store::Store;
use turnwise::AdapterStatus;

struct Opts {
    cycles: usize,
    clients: usize,
    seed: u64,
    db: Option<PathBuf>,
    bin: PathBuf,
    /// extra arguments for `turnwise serve` (after `--`)
    serve: Vec<String>,
}

fn opts() -> anyhow::Result<Opts> {
    let bin = common::binary_beside_example()?;
    let mut o = Opts {
        cycles: 100,
        clients: 4,
        seed: 1,
        db: None,
        bin,
        serve: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--cycles" => o.cycles = value()?.parse()?,
            "--clients" => o.clients = value()?.parse()?,
            "--seed" => o.seed = value()?.parse()?,
            "--db" => o.db = Some(value()?.into()),
            "--bin" => o.bin = value()?.into(),
            "--" => {
                o.serve = args.by_ref().collect();
            }
            other => bail!(
                "unknown argument {other}; use --cycles N --clients K --seed S --db PATH --bin PATH [-- SERVE ARGS]"
            ),
        }
    }
    if !(1..=8).contains(&o.clients) {
        bail!("--clients must be between 1 and 8");
    }
    common::require_binary(&o.bin)?;
    Ok(o)
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

#[derive(Default)]
struct Shared {
    /// (client session id, reply text) of every reply a client received
    acknowledged: Mutex<Vec<(String, String)>>,
    /// (seconds, an update was running at its start or end)
    latency: Mutex<Vec<(f64, bool)>>,
}

/// A client: two-turn sessions with feedback and an end, until the server goes away.
fn client(addr: String, tag: String, seed: u64, sh: Arc<Shared>, updating: Arc<AtomicBool>) {
    let mut rng = Rng(seed | 1);
    for j in 0.. {
        let sid = format!("{tag}-{j}");
        let order = 10_000 + rng.below(89_999);
        let mut messages =
            vec![json!({"role": "user", "content": format!("Hi, where is my order {order}?")})];
        for follow in ["Can I get a refund if it is lost?", ""] {
            let t = Instant::now();
            let during = updating.load(Ordering::Relaxed);
            let body = json!({"messages": messages, "max_tokens": 12, "temperature": 0.7,
                              "seed": rng.next() % 1_000_000, "session_id": sid});
            let Ok((200, v)) = common::request(&addr, "POST", "/v1/chat/completions", &body) else {
                return;
            };
            let during = during || updating.load(Ordering::Relaxed);
            let text = v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            sh.latency
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((t.elapsed().as_secs_f64(), during));
            sh.acknowledged
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push((sid.clone(), text.clone()));
            messages.push(json!({"role": "assistant", "content": text}));
            if !follow.is_empty() {
                messages.push(json!({"role": "user", "content": follow}));
            }
        }
        let outcome = rng.below(2);
        let feedback = format!("/v1/sessions/{sid}/feedback");
        if common::request(&addr, "POST", &feedback, &json!({"outcome": outcome})).is_err() {
            return;
        }
        let end = format!("/v1/sessions/{sid}/end");
        if common::request(&addr, "POST", &end, &json!({})).is_err() {
            return;
        }
        // a customer's pause before the next conversation: the learner gets the CPU now and
        // then, as on a real desk (it waits while replies are being generated)
        std::thread::sleep(Duration::from_millis(1_000 + rng.below(2_000)));
    }
}

fn main() -> anyhow::Result<()> {
    let o = opts()?;
    let tmp = std::env::temp_dir().join(format!("turnwise-soak-{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let db = o.db.clone().unwrap_or_else(|| tmp.join("soak.db"));
    let sh = Arc::new(Shared::default());
    // updates over the newest 24 sessions every 2 ended ones, so that they finish between kills
    let serve_args: Vec<String> = ["--learn-every", "2", "--learn-sessions", "24"]
        .iter()
        .map(|a| a.to_string())
        .chain(o.serve.iter().cloned())
        .collect();
    let mut rng = Rng(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let (mut lost, mut integrity, mut failed_restarts, mut ungated, mut unloadable) =
        (0usize, 0usize, 0usize, 0usize, 0usize);
    let checked = AtomicUsize::new(0);
    let bar = indicatif::ProgressBar::new(o.cycles as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("soak [{bar:30}] {pos}/{len} cycles {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let t0 = Instant::now();
    for cycle in 0..o.cycles {
        let (mut child, addr) = match common::start_server(&o.bin, &db, &serve_args) {
            Ok(x) => x,
            Err(e) => {
                failed_restarts += 1;
                eprintln!("cycle {cycle}: {e:#}");
                continue;
            }
        };
        let updating = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let monitor = {
            let (addr, updating, stop) = (addr.clone(), updating.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some(m) = common::metrics(&addr) {
                        updating.store(
                            common::metric(&m, "turnwise_update_running") == Some(1.0),
                            Ordering::Relaxed,
                        );
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            })
        };
        let clients: Vec<_> = (0..o.clients)
            .map(|k| {
                let (addr, sh, up) = (addr.clone(), sh.clone(), updating.clone());
                let seed = rng.next();
                std::thread::spawn(move || client(addr, format!("c{cycle}-{k}"), seed, sh, up))
            })
            .collect();
        // a random moment: in most cycles within the first sessions, in every fourth one late
        // enough for an update (which yields to the replies being generated) to be written,
        // gated and activated — or to be killed anywhere in between
        let window = if cycle % 4 == 3 { 60_000 } else { 12_000 };
        std::thread::sleep(Duration::from_millis(500 + rng.below(window)));
        child.kill()?; // SIGKILL
        child.wait()?;
        stop.store(true, Ordering::Relaxed);
        for c in clients {
            let _ = c.join();
        }
        let _ = monitor.join();

        // what a user relies on, after the kill
        let store = Store::open(&db)?;
        let conn = store.connection();
        let ok: String = conn.query_row("PRAGMA integrity_check", [], |r| r.get(0))?;
        integrity += usize::from(ok != "ok");
        let acked = sh
            .acknowledged
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let mut st = conn.prepare(
            "SELECT count(*) FROM sessions s JOIN turns t ON t.session_id = s.id
             WHERE s.client_session_id = ?1 AND t.role = 'assistant' AND rtrim(t.text) = rtrim(?2)",
        )?;
        let mut missing = 0;
        for (sid, text) in &acked {
            let n: i64 = st.query_row([sid, text], |r| r.get(0))?;
            missing += usize::from(n == 0);
        }
        lost = lost.max(missing);
        checked.store(acked.len(), Ordering::Relaxed);
        if let Some(ad) = store.active_adapter()? {
            unloadable +=
                usize::from(turnwise::adapter::Adapter::load(Path::new(&ad.path)).is_err());
            // an adapter activated by the learner passed its gate; the soak never forces one
            ungated += usize::from(
                ad.status == AdapterStatus::Active && !turnwise::learn::gate::passed(&ad.metrics),
            );
        }
        bar.set_message(format!(
            "{} replies acknowledged, {lost} lost, {failed_restarts} failed restarts",
            acked.len()
        ));
        bar.inc(1);
    }
    bar.finish();
    // the server starts once more on what the cycles left
    let restart_ok = match common::start_server(&o.bin, &db, &serve_args) {
        Ok((mut child, addr)) => {
            let ok = matches!(
                common::request(&addr, "GET", "/healthz", &json!({})),
                Ok((200, _))
            );
            let _ = child.kill();
            let _ = child.wait();
            ok
        }
        Err(_) => false,
    };
    failed_restarts += usize::from(!restart_ok);
    let store = Store::open(&db)?;
    let adapters = store.adapters()?;
    let updates: i64 = store
        .connection()
        .query_row("SELECT count(*) FROM updates", [], |r| r.get(0))?;
    let lat = sh.latency.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let during: Vec<f64> = lat.iter().filter(|l| l.1).map(|l| l.0).collect();
    let idle: Vec<f64> = lat.iter().filter(|l| !l.1).map(|l| l.0).collect();
    println!(
        "soak: {} cycles, {} clients, {:.1} min, database {}",
        o.cycles,
        o.clients,
        t0.elapsed().as_secs_f64() / 60.0,
        db.display()
    );
    println!("| measure | value |");
    println!("|---|---|");
    for (k, v) in [
        (
            "replies acknowledged",
            checked.load(Ordering::Relaxed).to_string(),
        ),
        ("acknowledged replies lost", lost.to_string()),
        ("integrity failures", integrity.to_string()),
        ("failed restarts", failed_restarts.to_string()),
        ("ungated active adapters", ungated.to_string()),
        ("unloadable active adapters", unloadable.to_string()),
        ("updates recorded", updates.to_string()),
        ("adapters written", adapters.len().to_string()),
        (
            "adapters activated",
            adapters
                .iter()
                .filter(|a| a.activated_at.is_some())
                .count()
                .to_string(),
        ),
    ] {
        println!("| {k} | {v} |");
    }
    println!(
        "| reply latency, no update running: p50 / p95 | {:.2} s / {:.2} s ({} replies) |",
        common::percentile(&idle, 50.0),
        common::percentile(&idle, 95.0),
        idle.len()
    );
    println!(
        "| reply latency, an update running: p50 / p95 | {:.2} s / {:.2} s ({} replies) |",
        common::percentile(&during, 50.0),
        common::percentile(&during, 95.0),
        during.len()
    );
    if o.db.is_none() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if lost + integrity + failed_restarts + ungated + unloadable > 0 {
        bail!("the soak found faults (see the table)");
    }
    Ok(())
}
