//! `turnwise compare`: the results of several demo runs side by side — each run's held-out gain
//! with its paired interval, each preset's gain pooled over seeds, and the pooled difference
//! between presets on the same held-out scenarios. Pooled intervals resample seeds, then
//! scenarios within each drawn seed (hierarchical bootstrap): runs of one seed differ by more
//! than their scenarios say. The scenario-only interval is printed beside it, and every
//! per-seed difference is listed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context as _};
use clap::Args;
use serde_json::Value;
use turnwise::demo::{hierarchical_bootstrap, stratified_bootstrap};

/// Options of `turnwise compare`.
#[derive(Args)]
pub struct CompareArgs {
    /// Demo run directories (each holds a result.json)
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Bootstrap replicates
    #[arg(long, default_value_t = 10_000)]
    reps: usize,
}

/// One run as the comparison needs it.
struct Run {
    dir: PathBuf,
    preset: String,
    seed: u64,
    warm: Vec<bool>,
    fin: Vec<bool>,
    gain: (f64, f64, f64),
    iterations: usize,
    activated: usize,
    wall_min: f64,
    /// how the warm start was made (runs of a seed with the same one share it)
    warm_kind: String,
    /// transcripts of the base-model and warm-start evaluations, one JSON text per scenario
    base_transcripts: Vec<String>,
    warm_transcripts: Vec<String>,
}

fn transcripts(r: &Value, label: &str) -> Vec<String> {
    r["evals"]
        .as_array()
        .and_then(|evals| evals.iter().find(|e| e["label"] == label))
        .and_then(|e| e["transcripts"].as_array())
        .map(|ts| ts.iter().map(Value::to_string).collect())
        .unwrap_or_default()
}

fn successes(r: &Value, label: &str) -> Option<Vec<bool>> {
    r["evals"]
        .as_array()?
        .iter()
        .rev()
        .find(|e| e["label"] == label)?["success"]
        .as_array()?
        .iter()
        .map(Value::as_bool)
        .collect()
}

fn load(dir: &Path) -> anyhow::Result<Run> {
    let file = if dir.is_file() {
        dir.to_path_buf()
    } else {
        dir.join("result.json")
    };
    let text =
        std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let r: Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))?;
    let c = &r["config"];
    // the preset: `config.rl.algo` (or `config.algo` in runs before the config embedded it)
    let preset = c["rl"]["algo"]
        .as_str()
        .or_else(|| c["algo"].as_str())
        .with_context(|| format!("{}: no preset in config", file.display()))?
        .to_lowercase();
    // runs that trained another adapter or wrote ids without the slot are other presets: their
    // gains are not pooled with the default's
    let mut preset = preset;
    if let Some(k) = c["rl"]["block"]["k"].as_u64() {
        preset.push_str(&format!(" block k={k}"));
    } else if let Some(k) = c["block_warm"].as_u64() {
        preset.push_str(&format!(" block-warm k={k}"));
    }
    if c["id_slot"].as_bool() == Some(false) {
        preset.push_str(" no id slot");
    }
    let seed = c["seed"]
        .as_u64()
        .with_context(|| format!("{}: no seed", file.display()))?;
    let (warm, fin) = match (successes(&r, "warm start"), successes(&r, "final")) {
        (Some(w), Some(f)) if w.len() == f.len() && !w.is_empty() => (w, f),
        _ => bail!(
            "{}: no warm-start and final evaluations of equal size",
            file.display()
        ),
    };
    let g = &r["rl_gain"];
    let its = r["iterations"].as_array().map_or(&[][..], Vec::as_slice);
    let warm_kind = match (c["block_warm"].as_u64(), c["rl"]["block"]["k"].as_u64()) {
        (Some(k), _) | (None, Some(k)) => format!("block k={k}"),
        _ => "output".to_string(),
    };
    Ok(Run {
        dir: dir.to_path_buf(),
        preset,
        seed,
        warm,
        fin,
        gain: (
            g[0].as_f64().unwrap_or(0.0),
            g[1].as_f64().unwrap_or(0.0),
            g[2].as_f64().unwrap_or(0.0),
        ),
        iterations: its.len(),
        activated: its.iter().filter(|i| i["activated"] == true).count(),
        wall_min: r["wall_s"].as_f64().unwrap_or(0.0) / 60.0,
        warm_kind,
        base_transcripts: transcripts(&r, "base"),
        warm_transcripts: transcripts(&r, "warm start"),
    })
}

fn diff(a: &[bool], b: &[bool]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from(u8::from(y)) - f64::from(u8::from(x)))
        .collect()
}

fn pts((p, lo, hi): (f64, f64, f64)) -> String {
    format!("{:+.1} [{:+.1}, {:+.1}]", 100.0 * p, 100.0 * lo, 100.0 * hi)
}

fn ci((_, lo, hi): (f64, f64, f64)) -> String {
    format!("[{:+.1}, {:+.1}]", 100.0 * lo, 100.0 * hi)
}

/// Each stratum's mean in points: `+18, −4, …`.
fn per_seed(strata: &[Vec<f64>]) -> String {
    strata
        .iter()
        .map(|s| {
            format!(
                "{:+.0}",
                100.0 * s.iter().sum::<f64>() / s.len().max(1) as f64
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn rate(v: &[bool]) -> String {
    let k = v.iter().filter(|&&b| b).count();
    format!(
        "{k}/{} ({:.0} %)",
        v.len(),
        100.0 * k as f64 / v.len() as f64
    )
}

/// How many of two runs' transcripts differ (`None` when either run lacks them or their
/// numbers differ).
fn differing(a: &[String], b: &[String]) -> Option<usize> {
    (!a.is_empty() && a.len() == b.len()).then(|| a.iter().zip(b).filter(|(x, y)| x != y).count())
}

/// Checks that runs of one seed played the same base-model and warm-start evaluations (runs
/// with the same warm start hold the same adapter there, and evaluations are played
/// canonically): a paired comparison between presets is only fair when they did.
fn shared_evaluations(runs: &[Run]) {
    let mut groups: BTreeMap<(u64, &str), Vec<&Run>> = BTreeMap::new();
    for r in runs {
        groups.entry((r.seed, &r.warm_kind)).or_default().push(r);
    }
    let groups: Vec<_> = groups.into_iter().filter(|(_, rs)| rs.len() > 1).collect();
    if groups.is_empty() {
        return;
    }
    println!("\n| seed | warm start | runs | base-model evaluation | warm-start evaluation |");
    println!("|---|---|---|---|---|");
    let say = |n: Option<usize>, total: usize| match n {
        Some(0) => format!("identical ({total} transcripts)"),
        Some(k) => format!(
            "**{k} of {total} transcripts differ**: the runs did not play this evaluation alike"
        ),
        None => "not comparable (missing or of another size)".to_string(),
    };
    for ((seed, kind), rs) in groups {
        let first = rs[0];
        let mut base = Some(0);
        let mut warm = Some(0);
        for r in &rs[1..] {
            base = base
                .zip(differing(&first.base_transcripts, &r.base_transcripts))
                .map(|(a, b)| a.max(b));
            warm = warm
                .zip(differing(&first.warm_transcripts, &r.warm_transcripts))
                .map(|(a, b)| a.max(b));
        }
        let presets: Vec<&str> = rs.iter().map(|r| r.preset.as_str()).collect();
        println!(
            "| {seed} | {kind} | {} | {} | {} |",
            presets.join(", "),
            say(base, first.base_transcripts.len()),
            say(warm, first.warm_transcripts.len())
        );
    }
}

/// Prints the comparison as Markdown tables.
///
/// # Errors
/// A run directory without a readable result.json.
pub fn run(args: CompareArgs) -> anyhow::Result<ExitCode> {
    let mut runs = args
        .runs
        .iter()
        .map(|d| load(d))
        .collect::<anyhow::Result<Vec<_>>>()?;
    runs.sort_by(|a, b| (a.seed, &a.preset).cmp(&(b.seed, &b.preset)));
    println!("| preset | seed | held-out warm start → final | RL gain, points [95 %] | iterations (activated) | wall | run |");
    println!("|---|---|---|---|---|---|---|");
    for r in &runs {
        println!(
            "| {} | {} | {} → {} | {} | {} ({}) | {:.1} min | {} |",
            r.preset,
            r.seed,
            rate(&r.warm),
            rate(&r.fin),
            pts(r.gain),
            r.iterations,
            r.activated,
            r.wall_min,
            r.dir.display()
        );
    }
    // each preset's gain pooled over its seeds: seeds resampled, then scenarios within each
    let mut by_preset: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in &runs {
        by_preset.entry(&r.preset).or_default().push(r);
    }
    println!(
        "\nPooled intervals resample seeds, then scenarios within each seed (hierarchical \
         bootstrap, {} replicates); the last column resamples scenarios only, inside fixed runs.",
        args.reps
    );
    println!("\n| preset | seeds | gain per seed, points | pooled RL gain [95 %, seeds and scenarios] | [95 %, scenarios only] |");
    println!("|---|---|---|---|---|");
    for (p, rs) in &by_preset {
        let strata: Vec<Vec<f64>> = rs.iter().map(|r| diff(&r.warm, &r.fin)).collect();
        let seeds: Vec<String> = rs.iter().map(|r| r.seed.to_string()).collect();
        println!(
            "| {p} | {} | {} | {} | {} |",
            seeds.join(", "),
            per_seed(&strata),
            pts(hierarchical_bootstrap(&strata, args.reps, 1)),
            ci(stratified_bootstrap(&strata, args.reps, 1))
        );
    }
    // each pair of presets on the seeds both ran: final success of the second minus the first,
    // scenario by scenario (a seed fixes the held-out set)
    let presets: Vec<&str> = by_preset.keys().copied().collect();
    let mut pairs = Vec::new();
    for (i, a) in presets.iter().enumerate() {
        for b in &presets[i + 1..] {
            let mut strata = Vec::new();
            let mut seeds = Vec::new();
            for ra in &by_preset[a] {
                let Some(rb) = by_preset[b].iter().find(|r| r.seed == ra.seed) else {
                    continue;
                };
                // a seed fixes the held-out scenarios; the warm starts differ only between
                // presets that warm-start differently (a block LoRA)
                if ra.fin.len() != rb.fin.len() {
                    bail!(
                        "seed {}: {a} and {b} do not share their held-out set",
                        ra.seed
                    );
                }
                strata.push(diff(&ra.fin, &rb.fin));
                seeds.push(ra.seed.to_string());
            }
            if !strata.is_empty() {
                pairs.push((
                    format!("{b} − {a}"),
                    seeds.join(", "),
                    per_seed(&strata),
                    hierarchical_bootstrap(&strata, args.reps, 2),
                    stratified_bootstrap(&strata, args.reps, 2),
                ));
            }
        }
    }
    shared_evaluations(&runs);
    if !pairs.is_empty() {
        println!("\n| difference in final held-out success | seeds | per seed, points | pooled [95 %, seeds and scenarios] | [95 %, scenarios only] |");
        println!("|---|---|---|---|---|");
        for (name, seeds, each, d, s) in pairs {
            println!("| {name} | {seeds} | {each} | {} | {} |", pts(d), ci(s));
        }
    }
    Ok(ExitCode::SUCCESS)
}
