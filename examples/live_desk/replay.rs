//! Offline replay of what the live run logged, measured on the same held-out customers.
//!
//! Two logs, each imported into a fresh copy of the same warm start and trained with one
//! `turnwise train` update of the server's algorithm (A²TGPO), then served without learning and
//! evaluated greedily on the live run's held-out scenarios:
//! - `live-log`: the live run's own log, `turnwise export --source live`, its newest
//!   `--replay-sessions` learnable sessions (outcomes, annotations and metadata as exported);
//! - `other-system`: a log as another system would leave it — messages and an outcome, nothing
//!   else: the live run's newest failures (at most half) mixed with the scripted expert's
//!   transcripts of new training scenarios.
//!
//! Neither carries log-probs (the export format does not): `turnwise import` rescores every
//! assistant turn under the base model, as it does for any chat log.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use turnwise::adapter::adapter_dir;
use turnwise::demo::{expert_conversation, hierarchical_bootstrap, paired_bootstrap, wilson};
use turnwise::env::{self, Split};
use turnwise::policy::sampler::Rng;

use crate::{
    common, evaluate, held_out_scenarios, rate, warm_start, wire_messages, Opts, Shared, PATIENCE,
};

/// Runs `turnwise --db DB ARGS`; returns (exit code, stdout). A failure other than the codes
/// in `allowed` is an error with the command's stderr.
fn turnwise(o: &Opts, db: &Path, args: &[&str], allowed: &[i32]) -> anyhow::Result<(i32, String)> {
    let out = Command::new(&o.bin)
        .arg("--db")
        .arg(db)
        .args(args)
        .output()?;
    let code = out.status.code().unwrap_or(-1);
    if !out.status.success() && !allowed.contains(&code) {
        bail!(
            "`turnwise {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((code, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Copies a folder (a database with its adapters) recursively.
fn copy_dir(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// Serves `db` without learning and plays the held-out scenarios against it.
fn evaluate_db(o: &Opts, db: &Path, label: &str) -> anyhow::Result<(Option<i64>, Vec<bool>)> {
    let (mut child, addr) = common::start_server(&o.bin, db, &["--no-learn".to_string()])?;
    let sh = Shared::default();
    let e = evaluate(
        &addr,
        label,
        &held_out_scenarios(o),
        &sh,
        std::time::Instant::now(),
    );
    let _ = child.kill();
    let _ = child.wait();
    let e = e?;
    Ok((e.adapter, e.success))
}

fn write_jsonl(path: &Path, lines: &[Value]) -> anyhow::Result<()> {
    let mut s = String::new();
    for l in lines {
        s.push_str(&l.to_string());
        s.push('\n');
    }
    std::fs::write(path, s)?;
    Ok(())
}

fn is_failure(line: &Value) -> bool {
    line["outcome"].as_f64().is_some_and(|r| r < 0.5)
}

/// The replay: warm start, the two logs, one update each, the held-out evaluations.
pub fn replay(o: &Opts, dir: &Path, live: &Value) -> anyhow::Result<Value> {
    let rdir = dir.join("replay");
    if rdir.exists() {
        std::fs::remove_dir_all(&rdir)?;
    }
    let warm = rdir.join("warm");
    std::fs::create_dir_all(&warm)?;
    let warm_db = warm.join("turnwise.db");
    println!("replay: the warm start again in a fresh database");
    warm_start(o, &warm, &warm_db)?;
    let live_db = dir.join("turnwise.db");
    let live_start: Vec<bool> =
        serde_json::from_value(live["evaluations"][0]["success"].clone()).unwrap_or_default();
    // the warm start's fit is deterministic: when its weights are the live run's byte for byte,
    // the live run's start evaluation (greedy, nothing else running) is this one's
    let live_warm = live["evaluations"][0]["adapter"].as_i64();
    let weights = |db: &Path, id: i64| {
        std::fs::read(adapter_dir(db, id).join(turnwise::adapter::WEIGHTS_FILE)).ok()
    };
    let same = live_warm
        .and_then(|id| Some(weights(&live_db, id)? == weights(&warm_db, id)?))
        .unwrap_or(false)
        && live_start.len() == o.eval;
    let (warm_adapter, baseline) = if same {
        println!(
            "replay: the warm start's weights equal the live run's; its start evaluation stands"
        );
        (live_warm, live_start.clone())
    } else {
        evaluate_db(o, &warm_db, "replay-warm")?
    };
    println!(
        "replay: warm start held-out {:.0} % (the live run's start: {:.0} %)",
        100.0 * rate(&baseline),
        100.0 * rate(&live_start)
    );

    // the live run's log as a user exports it
    let exported = rdir.join("live-export.jsonl");
    let out = exported.display().to_string();
    turnwise(
        o,
        &live_db,
        &["export", "--source", "live", "--out", &out],
        &[],
    )?;
    let lines: Vec<Value> = std::fs::read_to_string(&exported)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("reading the export")?;
    let learnable: Vec<Value> = lines
        .into_iter()
        .filter(|l| l["metadata"]["held_out"] != json!(true) && l["outcome"].is_number())
        .collect();
    let n = o.replay_sessions.min(learnable.len());
    if n == 0 {
        bail!("the live run logged no learnable session with an outcome");
    }
    let newest = &learnable[learnable.len() - n..];

    // the same run's failures mixed with the expert's transcripts: outcomes, no log-probs
    let mut failures: Vec<Value> = learnable
        .iter()
        .rev()
        .filter(|l| is_failure(l))
        .take(n / 2)
        .map(|l| json!({"messages": l["messages"], "outcome": l["outcome"]}))
        .collect();
    failures.reverse();
    let mut rng = Rng::new(o.seed ^ 0x5245_504c);
    let experts: Vec<Value> = (0..n - failures.len())
        .map(|_| {
            let c = expert_conversation(&env::scenario(&mut rng, Split::Train), PATIENCE);
            json!({"messages": wire_messages(&c), "outcome": c.outcome})
        })
        .collect();
    let mut other = Vec::with_capacity(n);
    let (mut f, mut e) = (failures.iter(), experts.iter());
    loop {
        match (e.next(), f.next()) {
            (None, None) => break,
            (a, b) => other.extend(a.into_iter().chain(b).cloned()),
        }
    }

    let mut variants = Vec::new();
    for (name, log) in [("live-log", newest.to_vec()), ("other-system", other)] {
        let vdir = rdir.join(name);
        copy_dir(&warm, &vdir)?;
        let db = vdir.join("turnwise.db");
        let file = vdir.join("log.jsonl");
        write_jsonl(&file, &log)?;
        let successes = log.iter().filter(|l| !is_failure(l)).count();
        println!(
            "replay {name}: importing {} sessions ({successes} successes), one update",
            log.len()
        );
        turnwise(o, &db, &["import", &file.display().to_string()], &[])?;
        let limit = log.len().to_string();
        let (_, stdout) = turnwise(
            o,
            &db,
            &[
                "train",
                "--algo",
                "a2tgpo",
                "--source",
                "import",
                "--limit",
                &limit,
                "--activate",
                "--force",
            ],
            &[],
        )?;
        let candidate: Option<i64> = stdout
            .lines()
            .find_map(|l| l.split("wrote candidate adapter ").nth(1))
            .and_then(|id| id.trim().parse().ok());
        let gate: Value = stdout
            .lines()
            .find_map(|l| l.strip_prefix("gate: "))
            .and_then(|g| serde_json::from_str(g).ok())
            .unwrap_or(Value::Null);
        let diagnostics: Value = stdout
            .find("\n{")
            .and_then(|i| {
                let rest = &stdout[i + 1..];
                let end = rest.find("\n}")?;
                serde_json::from_str(&rest[..end + 2]).ok()
            })
            .unwrap_or(Value::Null);
        // a refused candidate is still measured: `--force` activates it past the gate (by hand
        // it could not be: a refused candidate is rejected), and the report says so
        let forced = gate["passed"] == json!(false);
        let (adapter, success) = evaluate_db(o, &db, name)?;
        let (gain, lo, hi) = paired_bootstrap(&baseline, &success, 10_000, o.seed);
        println!(
            "replay {name}: held-out {:.0} % vs warm start {:.0} %: {:+.1} points [{:+.1}, {:+.1}]{}",
            100.0 * rate(&success),
            100.0 * rate(&baseline),
            100.0 * gain,
            100.0 * lo,
            100.0 * hi,
            if forced { " (refused by the gate, measured anyway)" } else { "" }
        );
        let k = success.iter().filter(|&&b| b).count();
        variants.push(json!({
            "log": name, "sessions": log.len(), "successes_in_log": successes,
            "candidate": candidate, "adapter": adapter, "gate": gate, "refused_and_forced": forced,
            "approx_kl": diagnostics["approx_kl"], "grouping": diagnostics["grouping"],
            "groups": diagnostics["groups"], "fallback_sessions": diagnostics["fallback_sessions"],
            "outcome_share": diagnostics["advantage_balance"]["outcome_share"],
            "successes": k, "n": success.len(), "wilson": wilson(k, success.len()),
            "success": success,
            "gain_vs_warm_start": {"points": 100.0 * gain, "ci95": [100.0 * lo, 100.0 * hi]},
        }));
    }
    let k = baseline.iter().filter(|&&b| b).count();
    Ok(json!({
        "replay_sessions": o.replay_sessions,
        "warm_start": {"adapter": warm_adapter, "successes": k, "n": baseline.len(),
                       "wilson": wilson(k, baseline.len()), "success": baseline,
                       "same_weights_as_live_warm_start": same,
                       "same_as_live_start": baseline == live_start},
        "variants": variants,
    }))
}

/// The replay's part of `report.md`.
pub fn markdown(r: &Value) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    let w = &r["warm_start"];
    let _ = writeln!(
        s,
        "\n## Offline replay\n\nWarm start in a fresh database: held-out {}/{} (same outcomes as the live run's start: {}).\n",
        w["successes"], w["n"], w["same_as_live_start"]
    );
    let _ = writeln!(s, "| log | sessions (successes) | grouping (groups, fallback) | outcome share | approx KL | gate | held-out success | vs warm start [95 %] |\n|---|---|---|---|---|---|---|---|");
    for v in r["variants"].as_array().into_iter().flatten() {
        let g = &v["gain_vs_warm_start"];
        let _ = writeln!(
            s,
            "| {} | {} ({}) | {} ({}, {}) | {} | {} | {} | {}/{} | {:+.1} [{:+.1}, {:+.1}] |",
            v["log"].as_str().unwrap_or_default(),
            v["sessions"],
            v["successes_in_log"],
            v["grouping"].as_str().unwrap_or("-"),
            v["groups"],
            v["fallback_sessions"],
            v["outcome_share"],
            v["approx_kl"],
            if v["refused_and_forced"] == true {
                format!(
                    "refused ({}), measured anyway",
                    v["gate"]["reason"].as_str().unwrap_or("-")
                )
            } else {
                "passed".to_string()
            },
            v["successes"],
            v["n"],
            g["points"].as_f64().unwrap_or(0.0),
            g["ci95"][0].as_f64().unwrap_or(0.0),
            g["ci95"][1].as_f64().unwrap_or(0.0),
        );
    }
    s
}

/// `--pool DIR...`: the live gain (end − start) and each replay's gain over the warm start,
/// pooled over the runs' seeds with a hierarchical bootstrap (seeds, then held-out scenarios).
pub fn pool(dirs: &[std::path::PathBuf]) -> anyhow::Result<()> {
    let runs: Vec<Value> = dirs
        .iter()
        .map(|d| {
            let p = d.join("result.json");
            let text =
                std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str(&text).with_context(|| format!("parsing {}", p.display()))
        })
        .collect::<anyhow::Result<_>>()?;
    let bools = |v: &Value| -> Vec<bool> { serde_json::from_value(v.clone()).unwrap_or_default() };
    let diffs = |a: &[bool], b: &[bool]| -> Vec<f64> {
        a.iter()
            .zip(b)
            .map(|(&x, &y)| f64::from(u8::from(y)) - f64::from(u8::from(x)))
            .collect()
    };
    let mut rows = Vec::new();
    let live: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| {
            let e = r["evaluations"].as_array().cloned().unwrap_or_default();
            let start = e.first().map(|x| bools(&x["success"])).unwrap_or_default();
            let end = e.last().map(|x| bools(&x["success"])).unwrap_or_default();
            diffs(&start, &end)
        })
        .collect();
    rows.push(("live: end − start".to_string(), live));
    for name in ["live-log", "other-system"] {
        let strata: Vec<Vec<f64>> = runs
            .iter()
            .filter_map(|r| {
                let base = bools(&r["replay"]["warm_start"]["success"]);
                let v = r["replay"]["variants"]
                    .as_array()?
                    .iter()
                    .find(|v| v["log"] == json!(name))?;
                Some(diffs(&base, &bools(&v["success"])))
            })
            .collect();
        if !strata.is_empty() {
            rows.push((format!("replay {name}: trained − warm start"), strata));
        }
    }
    println!(
        "| comparison | seeds | per-seed points | pooled [95 %, seeds then scenarios] |\n|---|---|---|---|"
    );
    for (name, strata) in rows {
        let per: Vec<String> = strata
            .iter()
            .map(|s| {
                format!(
                    "{:+.0}",
                    100.0 * s.iter().sum::<f64>() / s.len().max(1) as f64
                )
            })
            .collect();
        let (m, lo, hi) = hierarchical_bootstrap(&strata, 10_000, 1);
        println!(
            "| {name} | {} | {} | {:+.1} [{:+.1}, {:+.1}] |",
            strata.len(),
            per.join(", "),
            100.0 * m,
            100.0 * lo,
            100.0 * hi
        );
    }
    Ok(())
}
