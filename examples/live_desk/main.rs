//! The live desk: simulated customers of the demo's back office talk to `turnwise serve` over
//! HTTP, as the users of a customer-service bot would, while the server learns from them in the
//! background — and held-out customers, whom the learner never trains on, measure whether the
//! served policy gets better.
//!
//! ```text
//! cargo build --release && cargo run --release --example live_desk -- --seed 1 --sessions 400
//! ```
//!
//! What it does, in order:
//! 1. a fresh run directory (`--out`, default `live-runs/seed<S>-<time>`) with its own database;
//! 2. the warm start a user would do: the scripted expert's demonstrations of `--demos` training
//!    scenarios written as JSON Lines, `turnwise import`, `turnwise train --algo sft --activate`;
//! 3. `turnwise serve` started as a separate process on 127.0.0.1 with `--learn-every`,
//!    `--learn-sessions` and the arguments after `--`;
//! 4. held-out evaluation: `--eval` scenarios of the held-out templates, greedy, each a session
//!    sent with `"learn": false` — at the start, every `--eval-every` customer sessions, and at
//!    the end;
//! 5. `--clients` customers at once, `--sessions` in all, every one a new scenario of the
//!    training templates: the client sends the conversation through `/v1/chat/completions` with
//!    a `session_id` (temperature 0.7, digits greedy, the order-id slot of the ids the customer
//!    or the back office wrote), runs the agent's `ACTION` line against the back office and
//!    sends the result back as a `tool` message, answers as the customer otherwise, and reports
//!    the session's reward through `/v1/sessions/{id}/feedback` before ending it;
//! 6. the report (`report.md`, `result.json`, `heldout.svg`): held-out success over sessions
//!    served and over wall time with Wilson intervals, a paired interval of end − start, every
//!    update with the grouping it used and its gate verdict, latency of the customers' requests
//!    while an update ran and otherwise, and the log checked against every reply a client
//!    received;
//! 7. the offline replay (`--replay-sessions`, 96; 0 skips it, `--replay-only` runs it on an
//!    earlier run's directory): the live log exported, imported into a fresh copy of the warm
//!    start, trained with one `turnwise train` update and evaluated on the same held-out
//!    customers — and the same from a log without log-probs or annotations (the live failures
//!    mixed with expert transcripts), as another system's chats would be (`replay.rs`).
//!
//! `--pool DIR...` pools finished runs over their seeds (seeds, then scenarios resampled).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use turnwise::demo::{expert_conversation, paired_bootstrap, wilson};
use turnwise::env::{self, Desk, Observation, Scenario, Split};
use turnwise::policy::sampler::Rng;
use turnwise::store::Store;

#[path = "../common/mod.rs"]
mod common;
mod export_check;
mod replay;

/// Sampling of the customers' sessions, as the demo's rollouts.
const TEMPERATURE: f64 = 0.7;
/// Most tokens of one agent reply, as the demo's.
const MAX_TOKENS: usize = 32;
/// The customer leaves after this many agent replies, as in the demo.
const PATIENCE: usize = 5;

/// `--help`.
const USAGE: &str =
    "live_desk: simulated customers talk to `turnwise serve` while it learns; held-out
customers measure the served policy; then the live log is replayed offline (docs/live-desk.md)

  --seed S              scenarios, sampling and the warm start's demonstrations (1)
  --sessions N          customer sessions in all (400)
  --clients K           customers at once, 1-8 (4)
  --demos D             expert demonstrations for the warm start (40)
  --eval E              held-out scenarios per evaluation (30)
  --eval-every M        evaluate after every M customer sessions (100)
  --learn-every L       serve's --learn-every (32)
  --learn-sessions B    serve's --learn-sessions (64)
  --learn-nice N        serve's --learn-nice (0: the desk keeps the cores saturated, and at
                        nice 19 the learner made two updates in 400 sessions)
  --replay-sessions R   sessions of the live log replayed offline; 0 skips the replay (96)
  --replay-only         only the replay, on the finished run in --out (its own seed,
                        demonstrations and held-out count)
  --out DIR             run directory (live-runs/seed<S>-<time>)
  --bin PATH            the turnwise binary (the one beside this example)
  -- SERVE ARGS         passed to turnwise serve
  --export-check        with --out DIR of a finished run (a live desk's, or a `turnwise demo`
                        run's with --eval N held-out customers): export its final adapter as a
                        merged model file (`adapters export --format merged`) and play the
                        held-out customers on `turnwise serve` with the adapter and on
                        `turnwise serve --model model.gguf`; count identical transcripts
  --llama-server PATH   with --export-check: play llama.cpp's own llama-server on the
                        exported files (model.gguf, --lora adapter.gguf for a block LoRA)
                        against `turnwise serve` with the adapter, both with plain OpenAI
                        requests (no id_slot)
  --llama-no-cache-prompt  with --llama-server: send cache_prompt false (every request
                        evaluated from scratch instead of after the previous one's prefix)
  --pool DIR...         pool finished runs over their seeds and print the table
";

struct Opts {
    bin: PathBuf,
    out: Option<PathBuf>,
    seed: u64,
    sessions: usize,
    clients: usize,
    demos: usize,
    eval: usize,
    eval_every: usize,
    learn_every: usize,
    learn_sessions: usize,
    learn_nice: i32,
    serve: Vec<String>,
    replay_sessions: usize,
    replay_only: bool,
    export_check: bool,
    llama_server: Option<PathBuf>,
    llama_cache_prompt: bool,
    pool: Vec<PathBuf>,
}

fn opts() -> anyhow::Result<Opts> {
    let mut o = Opts {
        bin: common::binary_beside_example()?,
        out: None,
        seed: 1,
        sessions: 400,
        clients: 4,
        demos: 40,
        eval: 30,
        eval_every: 100,
        learn_every: 32,
        learn_sessions: 64,
        learn_nice: 0,
        serve: Vec::new(),
        replay_sessions: 96,
        replay_only: false,
        export_check: false,
        llama_server: None,
        llama_cache_prompt: true,
        pool: Vec::new(),
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--bin" => o.bin = value()?.into(),
            "--out" => o.out = Some(value()?.into()),
            "--seed" => o.seed = value()?.parse()?,
            "--sessions" => o.sessions = value()?.parse()?,
            "--clients" => o.clients = value()?.parse()?,
            "--demos" => o.demos = value()?.parse()?,
            "--eval" => o.eval = value()?.parse()?,
            "--eval-every" => o.eval_every = value()?.parse()?,
            "--learn-every" => o.learn_every = value()?.parse()?,
            "--learn-sessions" => o.learn_sessions = value()?.parse()?,
            "--learn-nice" => o.learn_nice = value()?.parse()?,
            "--replay-sessions" => o.replay_sessions = value()?.parse()?,
            "--replay-only" => o.replay_only = true,
            "--export-check" => o.export_check = true,
            "--llama-server" => o.llama_server = Some(value()?.into()),
            "--llama-no-cache-prompt" => o.llama_cache_prompt = false,
            "--pool" => {
                o.pool = args.by_ref().map(PathBuf::from).collect();
                return Ok(o);
            }
            "--" => o.serve = args.by_ref().collect(),
            "-h" | "--help" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}\n\n{USAGE}"),
        }
    }
    if !(1..=8).contains(&o.clients) {
        bail!("--clients must be between 1 and 8");
    }
    if o.eval == 0 || o.demos == 0 || o.eval_every == 0 {
        bail!("--eval, --demos and --eval-every must be at least 1");
    }
    common::require_binary(&o.bin)?;
    Ok(o)
}

/// A session played over HTTP.
struct Played {
    success: bool,
    reward: f64,
    /// agent replies
    turns: usize,
}

/// One finished customer session: (index, seconds since the start, success, reward, agent
/// replies).
type Customer = (usize, f64, bool, f64, usize);

/// What the customers leave behind, shared by their threads.
#[derive(Default)]
struct Shared {
    /// next customer session to start
    next: AtomicUsize,
    /// customer sessions finished
    done: AtomicUsize,
    /// an update is running (sampled from `/metrics`)
    updating: AtomicBool,
    /// an evaluation runs: customers start no new session
    paused: AtomicBool,
    /// customer sessions in progress
    in_session: AtomicUsize,
    /// (client session id, reply) of every reply a client received
    acknowledged: Mutex<Vec<(String, String)>>,
    /// (seconds, an update ran at its start or end) of every chat request
    latency: Mutex<Vec<(f64, bool)>>,
    /// (session index, seconds since the start, success, reward, agent replies)
    customers: Mutex<Vec<Customer>>,
    /// requests that failed (not 200), with the reason
    failures: Mutex<Vec<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Plays `scenario` against the server as an application with tools would: the agent's
/// `ACTION` line runs against the back office and comes back as a `tool` message.
fn play(
    addr: &str,
    sid: &str,
    scenario: &Scenario,
    sampled: Option<u64>,
    learn: bool,
    sh: &Shared,
) -> anyhow::Result<Played> {
    play_on(addr, sid, scenario, sampled, learn, Api::Turnwise, sh)
}

/// Which server a session is played against.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    /// `turnwise serve`: the order ids said so far go in `id_slot`, the outcome is sent as
    /// feedback and the session is ended
    Turnwise,
    /// `turnwise serve` as a plain OpenAI endpoint: no `id_slot` (a server without Turnwise's
    /// slot filling answers the same request), feedback and end as above
    TurnwisePlain,
    /// llama.cpp's own `llama-server`: the OpenAI fields only (and whether it may reuse a
    /// cached prompt prefix), no feedback or end
    LlamaServer { cache_prompt: bool },
}

/// [`play`] against the server kind `api`.
fn play_on(
    addr: &str,
    sid: &str,
    scenario: &Scenario,
    sampled: Option<u64>,
    learn: bool,
    api: Api,
    sh: &Shared,
) -> anyhow::Result<Played> {
    let mut desk = Desk::new(scenario.clone(), PATIENCE);
    let mut messages = vec![
        json!({"role": "system", "content": env::SYSTEM_PROMPT}),
        json!({"role": "user", "content": scenario.opening()}),
    ];
    let mut said = vec![scenario.opening()];
    for turn in 0.. {
        let mut body = json!({
            "messages": messages, "max_tokens": MAX_TOKENS, "top_k": 0, "top_p": 1.0,
        });
        match api {
            Api::LlamaServer { cache_prompt } => body["cache_prompt"] = json!(cache_prompt),
            Api::Turnwise | Api::TurnwisePlain => {
                body["session_id"] = json!(sid);
                body["learn"] = json!(learn);
                if api == Api::Turnwise {
                    body["id_slot"] = json!(env::order_ids_in(&said.join("\n")));
                }
            }
        }
        match sampled {
            Some(seed) => {
                body["temperature"] = json!(TEMPERATURE);
                body["greedy_digits"] = json!(true);
                body["seed"] = json!(seed.wrapping_add(turn));
            }
            None => body["temperature"] = json!(0.0),
        }
        let t = Instant::now();
        let during = sh.updating.load(Ordering::Relaxed);
        let (code, v) = common::request(addr, "POST", "/v1/chat/completions", &body)?;
        if code != 200 {
            bail!("chat request of {sid}: HTTP {code}: {v}");
        }
        let during = during || sh.updating.load(Ordering::Relaxed);
        lock(&sh.latency).push((t.elapsed().as_secs_f64(), during));
        let reply = v["choices"][0]["message"]["content"]
            .as_str()
            .context("a reply without content")?
            .to_string();
        lock(&sh.acknowledged).push((sid.to_string(), reply.clone()));
        messages.push(json!({"role": "assistant", "content": reply}));
        match desk.step(&reply) {
            Observation::Customer(text) => {
                said.push(text.clone());
                messages.push(json!({"role": "user", "content": text}));
            }
            Observation::Tool(text) => {
                said.push(text.clone());
                messages.push(json!({"role": "tool", "content": text}));
            }
            Observation::End => break,
        }
    }
    let reward = desk.reward().clamp(-1.0, 1.0);
    if matches!(api, Api::LlamaServer { .. }) {
        return Ok(Played {
            success: desk.success(),
            reward,
            turns: desk.agent_turns,
        });
    }
    let (code, v) = common::request(
        addr,
        "POST",
        &format!("/v1/sessions/{sid}/feedback"),
        &json!({ "outcome": reward }),
    )?;
    if code != 200 {
        bail!("feedback of {sid}: HTTP {code}: {v}");
    }
    let (code, v) = common::request(addr, "POST", &format!("/v1/sessions/{sid}/end"), &json!({}))?;
    if code != 200 {
        bail!("end of {sid}: HTTP {code}: {v}");
    }
    Ok(Played {
        success: desk.success(),
        reward,
        turns: desk.agent_turns,
    })
}

/// One held-out evaluation.
struct Evaluation {
    label: String,
    /// seconds since the customers started (0 for the first)
    at_s: f64,
    /// customer sessions finished when it started
    served: usize,
    /// the adapter active when it started
    adapter: Option<i64>,
    /// the adapter active when it ended (an activation can land during an evaluation that
    /// runs beside an update)
    adapter_after: Option<i64>,
    success: Vec<bool>,
}

fn active_adapter(addr: &str) -> Option<i64> {
    let (_, v) = common::request(addr, "GET", "/v1/adapters", &json!({})).ok()?;
    v["active"].as_i64()
}

/// Plays the held-out scenarios greedily, one after the other, as sessions the learner never
/// trains on. The customers pause meanwhile (those in a session finish it first): a reply
/// decoded in a batch with other sessions' rows goes through other kernels than one decoded
/// alone, and greedy decoding near a tie then picks another token. Played alone, two
/// evaluations of the same adapter give the same transcripts (the starts of two runs of a
/// seed agree), so a change between them is the adapter's. An update may still run, and
/// activate its candidate, meanwhile.
fn evaluate(
    addr: &str,
    label: &str,
    held_out: &[Scenario],
    sh: &Shared,
    t0: Instant,
) -> anyhow::Result<Evaluation> {
    sh.paused.store(true, Ordering::SeqCst);
    while sh.in_session.load(Ordering::SeqCst) > 0 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let served = sh.done.load(Ordering::Relaxed);
    let adapter = active_adapter(addr);
    let at_s = t0.elapsed().as_secs_f64();
    let mut success = Vec::with_capacity(held_out.len());
    let mut played = Ok(());
    for (i, s) in held_out.iter().enumerate() {
        let sid = format!("eval-{label}-{i}");
        match play(addr, &sid, s, None, false, sh) {
            Ok(p) => success.push(p.success),
            Err(e) => {
                played = Err(e);
                break;
            }
        }
    }
    sh.paused.store(false, Ordering::SeqCst);
    played?;
    Ok(Evaluation {
        label: label.to_string(),
        at_s,
        served,
        adapter,
        adapter_after: active_adapter(addr),
        success,
    })
}

/// How long no update may have run before the final evaluation starts.
const QUIET: Duration = Duration::from_secs(5);

/// Returns once `/metrics` has said "no update running" for [`QUIET`] in a row (at most 15
/// minutes).
fn wait_until_learner_quiet(sh: &Shared) {
    let start = Instant::now();
    let mut quiet_since = Instant::now();
    while start.elapsed() < Duration::from_secs(900) {
        if sh.updating.load(Ordering::Relaxed) {
            quiet_since = Instant::now();
        } else if quiet_since.elapsed() >= QUIET {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A customer thread: new training-template scenarios until the budget is spent.
fn customer(addr: String, seed: u64, budget: usize, sh: Arc<Shared>, t0: Instant) {
    loop {
        // announce the session before looking at the pause, so that an evaluation that sets
        // the pause and then sees no session in progress cannot be overtaken by one
        sh.in_session.fetch_add(1, Ordering::SeqCst);
        if sh.paused.load(Ordering::SeqCst) {
            sh.in_session.fetch_sub(1, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(100));
            continue;
        }
        let i = sh.next.fetch_add(1, Ordering::Relaxed);
        if i >= budget {
            sh.in_session.fetch_sub(1, Ordering::SeqCst);
            return;
        }
        let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(i as u64));
        let scenario = env::scenario(&mut rng, Split::Train);
        let sid = format!("c{i}");
        let played = play(&addr, &sid, &scenario, Some(rng.next_u64()), true, &sh);
        sh.in_session.fetch_sub(1, Ordering::SeqCst);
        match played {
            Ok(p) => lock(&sh.customers).push((
                i,
                t0.elapsed().as_secs_f64(),
                p.success,
                p.reward,
                p.turns,
            )),
            Err(e) => lock(&sh.failures).push(format!("{sid}: {e:#}")),
        }
        sh.done.fetch_add(1, Ordering::Relaxed);
        // a pause before the next customer, as on a real desk: the learner gets the CPU now
        // and then (it yields while replies are being generated)
        std::thread::sleep(Duration::from_millis(300 + rng.next_u64() % 1_200));
    }
}

/// A conversation's messages as the import format writes them.
fn wire_messages(c: &turnwise::replay::Conversation) -> Vec<Value> {
    c.messages
        .iter()
        .map(|m| json!({"role": m.role.as_str(), "content": m.content}))
        .collect()
}

/// The warm start a user would run: the expert's demonstrations imported and fitted.
fn warm_start(o: &Opts, dir: &Path, db: &Path) -> anyhow::Result<()> {
    let mut rng = Rng::new(o.seed ^ 0x5741_524d);
    let mut lines = String::new();
    for _ in 0..o.demos {
        let c = expert_conversation(&env::scenario(&mut rng, Split::Train), PATIENCE);
        let line = json!({"messages": wire_messages(&c), "outcome": c.outcome, "group": c.group,
                          "reference": c.reference, "metadata": c.metadata});
        writeln!(lines, "{line}")?;
    }
    let demos = dir.join("demonstrations.jsonl");
    std::fs::write(&demos, lines)?;
    for args in [
        vec!["import".to_string(), demos.display().to_string()],
        vec![
            "train".into(),
            "--algo".into(),
            "sft".into(),
            "--activate".into(),
        ],
    ] {
        let out = Command::new(&o.bin)
            .arg("--db")
            .arg(db)
            .args(&args)
            .output()?;
        if !out.status.success() {
            bail!(
                "`turnwise {}` failed ({}): {}",
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
    Ok(())
}

fn rate(v: &[bool]) -> f64 {
    v.iter().filter(|&&b| b).count() as f64 / v.len().max(1) as f64
}

/// Held-out success over sessions served and over minutes, with Wilson intervals; activations
/// as vertical lines.
fn plot(
    evals: &[Evaluation],
    activations: &[(f64, usize, i64)],
    path: &Path,
) -> anyhow::Result<()> {
    use plotters::prelude::*;
    turnwise::demo::report::font().map_err(anyhow::Error::msg)?;
    let root = SVGBackend::new(path, (1200, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let (left, right) = root.split_horizontally(600);
    let max_served = evals.iter().map(|e| e.served).max().unwrap_or(1).max(1) as f64;
    let max_min = evals.iter().map(|e| e.at_s / 60.0).fold(1.0, f64::max);
    for (area, by_sessions) in [(&left, true), (&right, false)] {
        let x_max = if by_sessions { max_served } else { max_min } * 1.05;
        let mut chart = ChartBuilder::on(area)
            .caption(
                if by_sessions {
                    "Held-out success over customer sessions served"
                } else {
                    "Held-out success over wall time"
                },
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(-0.02 * x_max..x_max, 0f64..1.0)?;
        chart
            .configure_mesh()
            .x_desc(if by_sessions {
                "customer sessions finished"
            } else {
                "minutes"
            })
            .y_desc("success (greedy, 95 % Wilson)")
            .draw()?;
        let x = |e: &Evaluation| {
            if by_sessions {
                e.served as f64
            } else {
                e.at_s / 60.0
            }
        };
        for &(at_s, served, _) in activations {
            let ax = if by_sessions {
                served as f64
            } else {
                at_s / 60.0
            };
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(ax, 0.0), (ax, 1.0)],
                GREEN.mix(0.6).stroke_width(1),
            )))?;
        }
        chart.draw_series(evals.iter().map(|e| {
            let k = e.success.iter().filter(|&&b| b).count();
            let (lo, hi) = wilson(k, e.success.len());
            PathElement::new(vec![(x(e), lo), (x(e), hi)], BLUE.stroke_width(2))
        }))?;
        chart.draw_series(
            evals
                .iter()
                .map(|e| Circle::new((x(e), rate(&e.success)), 5, BLUE.filled())),
        )?;
        chart.draw_series(LineSeries::new(
            evals.iter().map(|e| (x(e), rate(&e.success))),
            BLUE.mix(0.5),
        ))?;
    }
    root.present()?;
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut o = opts()?;
    if !o.pool.is_empty() {
        return replay::pool(&o.pool);
    }
    if o.replay_only || o.export_check {
        let dir = o
            .out
            .clone()
            .context("--replay-only and --export-check need --out DIR of a finished run")?;
        let p = dir.join("result.json");
        let text =
            std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
        let mut result: Value = serde_json::from_str(&text)?;
        // the run's own settings, not the flags' defaults: the seed draws the demonstrations
        // and the held-out scenarios the replay is compared on
        let setting = |key: &str| {
            result[key]
                .as_u64()
                .with_context(|| format!("{} has no `{key}`", p.display()))
        };
        let demo_run = result["seed"].is_null() && result["config"]["seed"].is_u64();
        if o.export_check && demo_run {
            // a `turnwise demo` run: its seed draws the held-out customers, --eval counts them
            // (the check plays the live desk's held-out draw, not the demo's evaluation set)
            o.seed = result["config"]["seed"].as_u64().unwrap_or(o.seed);
        } else {
            o.seed = setting("seed")?;
            o.demos = usize::try_from(setting("demos")?)?;
            o.eval = usize::try_from(setting("eval_scenarios")?)?;
        }
        println!(
            "{} of {}: seed {}, {} demonstrations, {} held-out scenarios (the run's own)",
            if o.export_check {
                "export check"
            } else {
                "replay"
            },
            dir.display(),
            o.seed,
            o.demos,
            o.eval
        );
        if o.export_check {
            let summary = export_check::export_check(&o, &dir, &result)?;
            println!("{}", serde_json::to_string_pretty(&summary)?);
            if demo_run {
                // the demo's own report stays as the demo wrote it; the check's summary is in
                // export-check/export-check.json
                return Ok(());
            }
            result["export_check"] = summary;
        } else {
            result["replay"] = replay::replay(&o, &dir, &result)?;
        }
        return write_report(&dir, &result);
    }
    let dir = o.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from(format!("live-runs/seed{}-{t}", o.seed))
    });
    let db = dir.join("turnwise.db");
    if db.exists() {
        bail!(
            "{} exists: a live desk run starts from a fresh database",
            db.display()
        );
    }
    std::fs::create_dir_all(&dir)?;
    println!(
        "live desk: seed {}, {} customer sessions, {} clients → {}",
        o.seed,
        o.sessions,
        o.clients,
        dir.display()
    );
    let t_warm = Instant::now();
    warm_start(&o, &dir, &db)?;
    println!(
        "warm start: {} demonstrations imported and fitted in {:.0} s",
        o.demos,
        t_warm.elapsed().as_secs_f64()
    );
    let mut serve_args: Vec<String> = vec![
        "--learn-every".into(),
        o.learn_every.to_string(),
        "--learn-sessions".into(),
        o.learn_sessions.to_string(),
        "--learn-nice".into(),
        o.learn_nice.to_string(),
    ];
    serve_args.extend(o.serve.iter().cloned());
    let (mut child, addr) = common::start_server(&o.bin, &db, &serve_args)?;
    let result = run(&o, &dir, &addr);
    let _ = child.kill();
    let _ = child.wait();
    let report = result?;
    // what a user relies on: every reply a client received is in the log
    let store = Store::open(&db)?;
    let mut st = store.connection().prepare(
        "SELECT count(*) FROM sessions s JOIN turns t ON t.session_id = s.id
         WHERE s.client_session_id = ?1 AND t.role = 'assistant' AND rtrim(t.text) = rtrim(?2)",
    )?;
    let acked = report.acknowledged;
    let mut lost = 0usize;
    for (sid, text) in &acked {
        let n: i64 = st.query_row(rusqlite::params![sid, text], |r| r.get(0))?;
        lost += usize::from(n == 0);
    }
    drop(st);
    let mut result = report.json;
    result["acknowledged_replies"] = json!(acked.len());
    result["lost_replies"] = json!(lost);
    result["updates"] = updates(&store)?;
    drop(store);
    write_report(&dir, &result)?;
    if lost > 0 {
        bail!("{lost} acknowledged replies are missing from the log");
    }
    if o.replay_sessions > 0 {
        result["replay"] = replay::replay(&o, &dir, &result)?;
        write_report(&dir, &result)?;
    }
    Ok(())
}

/// Writes `result.json` and `report.md` and prints the report.
fn write_report(dir: &Path, result: &Value) -> anyhow::Result<()> {
    std::fs::write(
        dir.join("result.json"),
        serde_json::to_string_pretty(result)?,
    )?;
    let mut md = markdown(result);
    if result["replay"].is_object() {
        md.push_str(&replay::markdown(&result["replay"]));
    }
    let x = &result["export_check"];
    // how often the two servers agreed, and the served side's held-out success
    let agreement = |x: &Value| {
        format!(
            "{} of {} transcripts identical, {} of {} replies; held-out success {}/{} served",
            x["identical_transcripts"],
            x["scenarios"],
            x["identical_replies"],
            x["replies_compared"],
            x["served_successes"],
            x["scenarios"],
        )
    };
    if x.is_object() && x["llama_server"].is_string() {
        let _ = write!(
            md,
            "\n## The final adapter in llama.cpp's own server\n\nAdapter {} exported with \
             `adapters export --format merged` ({:.0} MB{}); the held-out customers played \
             greedily with plain OpenAI requests (no `id_slot`) on `turnwise serve` with the \
             adapter and on `llama-server` ({}) with the exported files: {}, {}/{} \
             llama-server.\n",
            x["adapter"],
            x["merged_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            if x["block_lora"].is_string() {
                " and the block LoRA as `--lora`"
            } else {
                ""
            },
            x["llama_server_version"]
                .as_str()
                .unwrap_or("version unknown"),
            agreement(x),
            x["llama_server_successes"],
            x["scenarios"],
        );
    } else if x.is_object() {
        let _ = write!(
            md,
            "\n## The final adapter outside Turnwise\n\nAdapter {} exported with `adapters export \
             --format merged` ({:.0} MB); the held-out customers played greedily on `turnwise \
             serve` with the adapter and on `turnwise serve --model model.gguf`: {}, {}/{} \
             merged (the run's end evaluation: {}/{}).\n",
            x["adapter"],
            x["merged_bytes"].as_f64().unwrap_or(0.0) / 1e6,
            agreement(x),
            x["merged_successes"],
            x["scenarios"],
            x["run_end_successes"]["successes"],
            x["scenarios"],
        );
    }
    std::fs::write(dir.join("report.md"), &md)?;
    println!("{md}");
    Ok(())
}

/// The held-out customers of a seed: the same scenarios at every evaluation and in the replay.
fn held_out_scenarios(o: &Opts) -> Vec<Scenario> {
    let mut rng = Rng::new(o.seed ^ 0x4845_4c44);
    (0..o.eval)
        .map(|_| env::scenario(&mut rng, Split::HeldOut))
        .collect()
}

/// Every update the server ran: the sessions and grouping it used, its KL and the gate's verdict.
fn updates(store: &Store) -> anyhow::Result<Value> {
    let mut st = store.connection().prepare(
        "SELECT u.id, u.created_at, u.adapter_id, u.status, u.diagnostics, a.status, a.metrics
         FROM updates u LEFT JOIN adapters a ON a.id = u.adapter_id ORDER BY u.id",
    )?;
    let rows = st.query_map([], |r| {
        let diag: Option<String> = r.get(4)?;
        let metrics: Option<String> = r.get(6)?;
        Ok((
            r.get::<_, i64>(0)?,
            r.get::<_, String>(1)?,
            r.get::<_, Option<i64>>(2)?,
            r.get::<_, String>(3)?,
            diag,
            r.get::<_, Option<String>>(5)?,
            metrics,
        ))
    })?;
    let mut out = Vec::new();
    for row in rows {
        let (id, at, adapter, status, diag, astatus, metrics) = row?;
        let d: Value = diag
            .and_then(|d| serde_json::from_str(&d).ok())
            .unwrap_or(Value::Null);
        let m: Value = metrics
            .and_then(|m| serde_json::from_str(&m).ok())
            .unwrap_or(Value::Null);
        out.push(json!({
            "update": id, "created_at": at, "adapter": adapter, "status": status,
            "adapter_status": astatus, "sessions": d["sessions"], "grouping": d["grouping"],
            "groups": d["groups"], "fallback_sessions": d["fallback_sessions"],
            "approx_kl": d["approx_kl"], "advantage": d["advantage"],
            "outcome_share": d["advantage_balance"]["outcome_share"],
            "gate": m["gate"],
        }));
    }
    Ok(Value::Array(out))
}

struct Report {
    json: Value,
    acknowledged: Vec<(String, String)>,
}

fn run(o: &Opts, dir: &Path, addr: &str) -> anyhow::Result<Report> {
    let held_out = held_out_scenarios(o);
    let sh = Arc::new(Shared::default());
    let t0 = Instant::now();
    let mut evals = vec![evaluate(addr, "start", &held_out, &sh, t0)?];
    println!(
        "held-out success at the start: {:.0} % (adapter {:?})",
        100.0 * rate(&evals[0].success),
        evals[0].adapter
    );
    let stop = Arc::new(AtomicBool::new(false));
    // the metrics watcher: update running, activations
    let activations = Arc::new(Mutex::new(Vec::<(f64, usize, i64)>::new()));
    let watcher = {
        let (addr, sh, stop, act) = (
            addr.to_string(),
            sh.clone(),
            stop.clone(),
            activations.clone(),
        );
        let first = evals[0].adapter.unwrap_or(0);
        std::thread::spawn(move || {
            let mut active = first;
            while !stop.load(Ordering::Relaxed) {
                if let Some(m) = common::metrics(&addr) {
                    sh.updating.store(
                        common::metric(&m, "turnwise_update_running") == Some(1.0),
                        Ordering::Relaxed,
                    );
                    let now = common::metric(&m, "turnwise_active_adapter").unwrap_or(0.0) as i64;
                    if now != active {
                        active = now;
                        lock(&act).push((
                            t0.elapsed().as_secs_f64(),
                            sh.done.load(Ordering::Relaxed),
                            now,
                        ));
                    }
                }
                std::thread::sleep(Duration::from_millis(250));
            }
        })
    };
    let bar = indicatif::ProgressBar::new(o.sessions as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("customers [{bar:30}] {pos}/{len} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let clients: Vec<_> = (0..o.clients)
        .map(|_| {
            let (addr, sh) = (addr.to_string(), sh.clone());
            let (seed, budget) = (o.seed, o.sessions);
            std::thread::spawn(move || customer(addr, seed, budget, sh, t0))
        })
        .collect();
    let mut next_eval = o.eval_every;
    loop {
        let done = sh.done.load(Ordering::Relaxed);
        bar.set_position(done as u64);
        let ok = lock(&sh.customers).iter().filter(|c| c.2).count();
        bar.set_message(format!(
            "{ok} solved, {} activations, {} failed requests",
            lock(&activations).len(),
            lock(&sh.failures).len()
        ));
        if done >= o.sessions {
            break;
        }
        if done >= next_eval {
            let e = evaluate(addr, &format!("after-{done}"), &held_out, &sh, t0)?;
            bar.println(format!(
                "held-out success after {} sessions: {:.0} % (adapter {:?})",
                e.served,
                100.0 * rate(&e.success),
                e.adapter
            ));
            evals.push(e);
            next_eval += o.eval_every;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    for c in clients {
        let _ = c.join();
    }
    bar.finish_and_clear();
    // The final evaluation judges the last adapter, so the learner must be done: an update may
    // be running, and the last customers' sessions may have made one due that the learner
    // (it looks every 0.5 s) has not started yet. Wait until no update has run for QUIET;
    // should an activation still land during the evaluation, evaluate again.
    let mut end = None;
    for _ in 0..3 {
        wait_until_learner_quiet(&sh);
        let e = evaluate(addr, "end", &held_out, &sh, t0)?;
        let clean = e.adapter == e.adapter_after;
        end = Some(e);
        if clean {
            break;
        }
    }
    evals.extend(end);
    stop.store(true, Ordering::Relaxed);
    let _ = watcher.join();
    let activations = lock(&activations).clone();
    plot(&evals, &activations, &dir.join("heldout.svg"))?;
    let (start, end) = (&evals[0].success, &evals[evals.len() - 1].success);
    let (gain, lo, hi) = paired_bootstrap(start, end, 10_000, o.seed);
    let latency = lock(&sh.latency).clone();
    let idle: Vec<f64> = latency.iter().filter(|l| !l.1).map(|l| l.0).collect();
    let during: Vec<f64> = latency.iter().filter(|l| l.1).map(|l| l.0).collect();
    let customers = lock(&sh.customers).clone();
    let json = json!({
        "seed": o.seed, "sessions": o.sessions, "clients": o.clients, "demos": o.demos,
        "eval_scenarios": o.eval, "eval_every": o.eval_every, "serve_args": o.serve,
        "wall_s": t0.elapsed().as_secs_f64(),
        "evaluations": evals.iter().map(|e| json!({
            "label": e.label, "at_s": e.at_s, "served": e.served, "adapter": e.adapter,
            "adapter_after": e.adapter_after,
            "successes": e.success.iter().filter(|&&b| b).count(), "n": e.success.len(),
            "wilson": wilson(e.success.iter().filter(|&&b| b).count(), e.success.len()),
            "success": e.success,
        })).collect::<Vec<_>>(),
        "gain_end_minus_start": {"points": 100.0 * gain, "ci95": [100.0 * lo, 100.0 * hi]},
        "activations": activations.iter().map(|a| json!({"at_s": a.0, "served": a.1, "adapter": a.2})).collect::<Vec<_>>(),
        "customer_success": customers.iter().filter(|c| c.2).count() as f64 / customers.len().max(1) as f64,
        "customer_sessions_completed": customers.len(),
        "customer_mean_reward": customers.iter().map(|c| c.3).sum::<f64>() / customers.len().max(1) as f64,
        "customer_mean_agent_replies": customers.iter().map(|c| c.4 as f64).sum::<f64>() / customers.len().max(1) as f64,
        "customer_success_by_quarter": quarters(&customers, o.sessions),
        "failed_requests": lock(&sh.failures).clone(),
        "latency_s": {
            "idle": {"n": idle.len(), "p50": common::percentile(&idle, 50.0), "p95": common::percentile(&idle, 95.0)},
            "during_updates": {"n": during.len(), "p50": common::percentile(&during, 50.0), "p95": common::percentile(&during, 95.0)},
        },
        "command": format!("cargo run --release --example live_desk -- --seed {} --sessions {} --clients {} --eval {} --eval-every {} --learn-every {} --learn-sessions {} --learn-nice {}{}", o.seed, o.sessions, o.clients, o.eval, o.eval_every, o.learn_every, o.learn_sessions, o.learn_nice,
            if o.serve.is_empty() { String::new() } else { format!(" -- {}", o.serve.join(" ")) }),
    });
    let acknowledged = lock(&sh.acknowledged).clone();
    Ok(Report { json, acknowledged })
}

/// Customer success in each quarter of the budget (by session index).
fn quarters(customers: &[Customer], budget: usize) -> Vec<f64> {
    (0..4)
        .map(|q| {
            let r = q * budget / 4..(q + 1) * budget / 4;
            let v: Vec<bool> = customers
                .iter()
                .filter(|c| r.contains(&c.0))
                .map(|c| c.2)
                .collect();
            rate(&v)
        })
        .collect()
}

fn markdown(r: &Value) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# Live desk, seed {}\n", r["seed"]);
    let _ = writeln!(s, "`{}`\n", r["command"].as_str().unwrap_or_default());
    let _ = writeln!(s, "| evaluation | customer sessions served | minutes | adapter | held-out success [95 % Wilson] |\n|---|---|---|---|---|");
    for e in r["evaluations"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "| {} | {} | {:.1} | {} | {}/{} [{:.0} %, {:.0} %] |",
            e["label"].as_str().unwrap_or_default(),
            e["served"],
            e["at_s"].as_f64().unwrap_or(0.0) / 60.0,
            match (&e["adapter"], &e["adapter_after"]) {
                (a, b) if b.is_null() || a == b => a.to_string(),
                (a, b) => format!("{a} → {b} (activated during it)"),
            },
            e["successes"],
            e["n"],
            100.0 * e["wilson"][0].as_f64().unwrap_or(0.0),
            100.0 * e["wilson"][1].as_f64().unwrap_or(0.0),
        );
    }
    let g = &r["gain_end_minus_start"];
    let _ = writeln!(
        s,
        "\nEnd − start (paired bootstrap over the held-out scenarios): {:+.1} points [{:+.1}, {:+.1}].\n",
        g["points"].as_f64().unwrap_or(0.0),
        g["ci95"][0].as_f64().unwrap_or(0.0),
        g["ci95"][1].as_f64().unwrap_or(0.0)
    );
    let _ = writeln!(
        s,
        "Customers: {} sessions completed, {:.0} % solved (by quarter of the budget: {}); {} failed requests.\n",
        r["customer_sessions_completed"],
        100.0 * r["customer_success"].as_f64().unwrap_or(0.0),
        r["customer_success_by_quarter"].as_array().into_iter().flatten().map(|q| format!("{:.0} %", 100.0 * q.as_f64().unwrap_or(0.0))).collect::<Vec<_>>().join(", "),
        r["failed_requests"].as_array().map_or(0, Vec::len)
    );
    let l = &r["latency_s"];
    let _ = writeln!(
        s,
        "Request latency: idle p50 {:.2} s / p95 {:.2} s ({} requests); while an update ran p50 {:.2} s / p95 {:.2} s ({} requests).\n",
        l["idle"]["p50"].as_f64().unwrap_or(f64::NAN),
        l["idle"]["p95"].as_f64().unwrap_or(f64::NAN),
        l["idle"]["n"],
        l["during_updates"]["p50"].as_f64().unwrap_or(f64::NAN),
        l["during_updates"]["p95"].as_f64().unwrap_or(f64::NAN),
        l["during_updates"]["n"],
    );
    let _ = writeln!(s, "| update | sessions | grouping (groups, fallback) | outcome share | approx KL | adapter status | gate |\n|---|---|---|---|---|---|---|");
    for u in r["updates"].as_array().into_iter().flatten() {
        let _ = writeln!(
            s,
            "| {} | {} | {} ({}, {}) | {} | {} | {} | {} |",
            u["update"],
            u["sessions"],
            u["grouping"].as_str().unwrap_or("-"),
            u["groups"],
            u["fallback_sessions"],
            u["outcome_share"],
            u["approx_kl"],
            u["adapter_status"].as_str().unwrap_or("-"),
            u["gate"]["reason"]
                .as_str()
                .unwrap_or(if u["gate"]["passed"] == true {
                    "passed"
                } else {
                    "-"
                }),
        );
    }
    let _ = writeln!(
        s,
        "\nReplies acknowledged to clients: {}; missing from the log: {}.",
        r["acknowledged_replies"], r["lost_replies"]
    );
    s
}
