//! The demo's run report: `report.md`, `result.json`, and PNG plots drawn with plotters.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::prelude::*;

use super::{wilson, DemoResult};
use crate::error::{Error, Result};

/// Font files tried for the plots' text (Debian's `fonts-dejavu-core` and common others).
const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

/// Registers a system font with plotters once; `Err` says which package provides one.
/// Registers a system TrueType font as plotters' `sans-serif` (once); an error names the
/// package to install.
///
/// # Errors
/// No font found.
pub fn font() -> std::result::Result<(), String> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        for p in FONT_PATHS {
            if let Ok(bytes) = std::fs::read(p) {
                let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
                if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                    return Ok(());
                }
            }
        }
        Err("no TrueType font found for the plots; install one with `apt-get install fonts-dejavu-core`".into())
    })
    .clone()
}

fn plot_err(e: impl std::fmt::Display) -> Error {
    Error::Invalid(format!("plot: {e}"))
}

/// Held-out success (with Wilson intervals) at every evaluation and the rollouts' success per
/// iteration.
fn success_plot(r: &DemoResult, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let max_it = r.iterations.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            format!(
                "Held-out success ({}, seed {})",
                format!("{:?}", r.config.rl.algo).to_lowercase(),
                r.config.seed
            ),
            ("sans-serif", 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(-1.2f64..max_it + 0.5, 0f64..1.0)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("RL iteration (−1 = base model, 0 = warm start)")
        .y_desc("success rate")
        .draw()
        .map_err(plot_err)?;
    let points: Vec<(f64, f64, f64, f64)> = r
        .evals
        .iter()
        .map(|e| {
            let x = if e.label == "base" {
                -1.0
            } else {
                e.iteration as f64
            };
            let k = e.success.iter().filter(|&&b| b).count();
            let (lo, hi) = wilson(k, e.success.len());
            (x, e.rate(), lo, hi)
        })
        .collect();
    chart
        .draw_series(
            points.iter().map(|&(x, _, lo, hi)| {
                PathElement::new(vec![(x, lo), (x, hi)], BLUE.stroke_width(2))
            }),
        )
        .map_err(plot_err)?;
    chart
        .draw_series(
            points
                .iter()
                .map(|&(x, y, _, _)| Circle::new((x, y), 5, BLUE.filled())),
        )
        .map_err(plot_err)?
        .label("held-out success, greedy (95 % Wilson interval)")
        .legend(|(x, y)| Circle::new((x + 10, y), 5, BLUE.filled()));
    chart
        .draw_series(LineSeries::new(
            r.iterations
                .iter()
                .map(|i| (i.iteration as f64, i.train_success)),
            RED.stroke_width(2),
        ))
        .map_err(plot_err)?
        .label("training rollouts' success (sampled)")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED.stroke_width(2)));
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// One panel per diagnostic of the updates, against the iteration.
fn training_plot(r: &DemoResult, path: &Path) -> Result<()> {
    let root = BitMapBackend::new(path, (1200, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let panels = root.split_evenly((2, 3));
    type Metric = Box<dyn Fn(&super::Iteration) -> Option<f64>>;
    let series: [(&str, Metric); 6] = [
        (
            "mean reward of rollouts",
            Box::new(|i| Some(i.train_reward)),
        ),
        (
            "approx KL to the parent",
            Box::new(|i| i.diagnostics.as_ref().map(|d| d.approx_kl)),
        ),
        (
            "clip fraction (low + high)",
            Box::new(|i| Some(i.diagnostics.as_ref()?.clip_frac())),
        ),
        (
            "turn entropy (nats / token)",
            Box::new(|i| i.diagnostics.as_ref().map(|d| d.turn_entropy)),
        ),
        (
            "mean |logp_old − logp_behavior|",
            Box::new(|i| i.diagnostics.as_ref().map(|d| d.logp_old_vs_behavior_mean)),
        ),
        (
            "value head AUC (held-out sessions)",
            Box::new(|i| i.diagnostics.as_ref()?.value_auc_heldout),
        ),
    ];
    for (area, (name, f)) in panels.iter().zip(series.iter()) {
        let pts: Vec<(f64, f64)> = r
            .iterations
            .iter()
            .filter_map(|i| {
                f(i).filter(|v| v.is_finite())
                    .map(|v| (i.iteration as f64, v))
            })
            .collect();
        let (lo, hi) = pts
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                (a.min(p.1), b.max(p.1))
            });
        let (lo, hi) = if pts.is_empty() {
            (0.0, 1.0)
        } else if (hi - lo).abs() < 1e-12 {
            (lo - 0.5 * lo.abs().max(1e-3), hi + 0.5 * hi.abs().max(1e-3))
        } else {
            (lo - 0.08 * (hi - lo), hi + 0.08 * (hi - lo))
        };
        let mut chart = ChartBuilder::on(area)
            .caption(*name, ("sans-serif", 17))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0.5f64..r.iterations.len().max(1) as f64 + 0.5, lo..hi)
            .map_err(plot_err)?;
        chart
            .configure_mesh()
            .x_desc("iteration")
            .draw()
            .map_err(plot_err)?;
        chart
            .draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))
            .map_err(plot_err)?;
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))
            .map_err(plot_err)?;
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn pct(x: f64) -> String {
    format!("{:.1} %", 100.0 * x)
}

/// The Markdown report.
pub fn markdown(r: &DemoResult, plots: &[PathBuf], plot_note: Option<&str>) -> String {
    let mut s = String::new();
    let c = &r.config;
    let algo = format!("{:?}", c.rl.algo).to_lowercase();
    let _ = writeln!(s, "# Turnwise demo: {algo}, seed {}\n", c.seed);
    let budget = match (c.max_iterations, c.minutes) {
        (Some(n), None) => format!("{n} RL iterations"),
        (None, Some(m)) => format!("as many RL iterations as fit in {m} minutes"),
        (Some(n), Some(m)) => format!("at most {n} RL iterations and {m} minutes"),
        (None, None) => "no iteration limit".to_string(),
    };
    let _ = writeln!(
        s,
        "Budget: {budget} ({} run, {:.1} min). Machine: {}.\n",
        r.iterations.len(),
        r.wall_s / 60.0,
        r.machine.line()
    );
    let _ = writeln!(
        s,
        "Model `{}` (file {}); {} held-out scenarios (templates never used in training), greedy replies, at most {} agent replies of {} tokens. \
         Order ids written through the id slot (only ids the conversation holds): {}. \
         Customers repeat their request when they give the order id: {}. \
         Warm start: {} scripted-expert demonstrations, {} epochs of supervised fine-tuning{}. \
         RL: {} scenarios{} × {} rollouts per iteration at temperature {}{}, lr {}, {:?} ratios, clip range [1 − {}, 1 + {}]{}, {} epochs, process signal `{:?}`{}, digit tokens {}, gate |approx KL| ≤ {}{}, experience library {}. Sessions played on {} llama.cpp engine(s).\n",
        r.model, model_file_line(&r.model_file), c.eval_scenarios, c.patience, c.max_tokens,
        if c.id_slot { "on" } else { "off" },
        if c.restate { "on" } else { "off" },
        c.demos, c.warm.epochs,
        if c.warm.sft_digit_class { " (digits as a class)" } else { "" },
        c.scenarios_per_iter,
        match (c.stratify, c.paraphrase) {
            (true, true) => " (intents balanced, openings paraphrased)",
            (true, false) => " (intents balanced)",
            (false, true) => " (openings paraphrased)",
            (false, false) => "",
        },
        c.group_size, c.temperature,
        if c.greedy_digits { " (digits greedy)" } else { "" },
        c.rl.lr,
        c.rl.objective.granularity,
        c.rl.objective.eps_low, c.rl.objective.eps_high,
        c.rl.objective.active_guard().map_or(String::new(), |(lo, hi)| format!(" (token guard [1 − {lo}, 1 + {hi}])")),
        c.rl.epochs, c.process,
        if c.process == crate::demo::ProcessSignal::InfoGain {
            use crate::learn::annotate::{IgContext, IgPolicy, IgSpace};
            format!(
                " (each turn scored {} by {}, as a change of {})",
                match c.ig_context {
                    IgContext::Observation => "after what it brought back",
                    IgContext::Reply => "right after its reply",
                },
                match c.ig_policy {
                    IgPolicy::Frozen => "the base model",
                    IgPolicy::Sampling => "the adapter that sampled it",
                },
                match c.ig_space {
                    IgSpace::Logprob => "log-prob",
                    IgSpace::Prob => "probability",
                }
            )
        } else {
            String::new()
        },
        if c.rl.mask_digits {
            "masked from the policy gradient"
        } else if c.rl.mask_negative_digits {
            "trained only in turns with a positive advantage"
        } else {
            "trained"
        }, c.gate_kl,
        if c.val_scenarios > 0 {
            format!(" and greedy success ≥ the active adapter's on {} fresh validation scenarios (unseen phrasings{})", c.val_scenarios,
                if c.shadow_gate { "; the active adapter replays only the scenarios where its greedy choices differed from the candidate's" } else { "" })
        } else {
            String::new()
        },
        if c.experience { "on" } else { "off" },
        c.engines
    );
    let _ = writeln!(
        s,
        "RL trains {}.\n",
        match &c.rl.block {
            Some(b) => format!(
                "a LoRA on {} of the last {} blocks (r {}, alpha {}), served by llama.cpp with no output-projection LoRA (the warm start fits it alone), so `adapters export --format gguf` carries the whole policy; old and new log-probs from the block graph, TIS cap {}",
                b.targets.join(","),
                b.k,
                b.r,
                b.alpha,
                c.rl.objective.tis_cap.map_or("off".into(), |x| x.to_string())
            ),
            None => match c.block_warm {
                Some(k) => format!("the output-projection LoRA, on top of a block LoRA (q,v of the last {k} blocks) trained on the demonstrations"),
                None => "the output-projection LoRA".into(),
            },
        }
    );
    let (d, lo, hi) = r.rl_gain;
    let _ = writeln!(
        s,
        "**RL's own contribution (final − warm start, held-out success): {:+.1} points, 95 % paired bootstrap interval [{:+.1}, {:+.1}].**\n",
        100.0 * d,
        100.0 * lo,
        100.0 * hi
    );
    let _ = writeln!(s, "## Held-out evaluations\n");
    let _ = writeln!(s, "| evaluation | after iteration | adapter | success | 95 % interval | mean reward | agent replies | malformed / session | repeated trigrams |");
    let _ = writeln!(s, "|---|---|---|---|---|---|---|---|---|");
    for e in &r.evals {
        let k = e.success.iter().filter(|&&b| b).count();
        let (l, h) = wilson(k, e.success.len());
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} ({k}/{}) | {} – {} | {:.3} | {:.2} | {:.2} | {} |",
            e.label,
            e.iteration,
            e.adapter_id.map_or("none".into(), |a| a.to_string()),
            pct(e.rate()),
            e.success.len(),
            pct(l),
            pct(h),
            super::mean(&e.reward),
            e.mean_turns,
            e.malformed_per_session,
            pct(e.repeated_trigram_share())
        );
    }
    if let (Some(w), Some(f)) = (
        r.evals.iter().find(|e| e.label == "warm start"),
        r.evals.last(),
    ) {
        let _ = writeln!(s, "\n## Example held-out sessions (warm start → final)\n");
        for i in 0..w.transcripts.len().min(4) {
            for (e, tag) in [(w, "warm start"), (f, "final")] {
                let _ = writeln!(
                    s,
                    "**scenario {} — {tag}: {}**\n",
                    i + 1,
                    if e.success[i] { "solved" } else { "not solved" }
                );
                let _ = writeln!(s, "```text");
                for (role, text) in &e.transcripts[i] {
                    let _ = writeln!(s, "{role:>9}: {}", text.replace('\n', " ⏎ "));
                }
                let _ = writeln!(s, "```\n");
            }
        }
    }
    let _ = writeln!(s, "\n## RL iterations\n");
    let _ = writeln!(s, "| it | sampled with | rollout success | mean reward | trained on | update | candidate | validation (candidate / active) | active | approx KL | clip frac | turn entropy | \\|logp_old − logp_beh\\| | process signal | note |");
    let _ = writeln!(
        s,
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    );
    for i in &r.iterations {
        let d = i.diagnostics.as_ref();
        let f = |v: Option<f64>| v.map_or("–".into(), |v| format!("{v:.4}"));
        let clip = d.map_or("–".into(), |d| format!("{:.3}", d.clip_frac()));
        let _ = writeln!(
            s,
            "| {} | {} | {} | {:.3} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
            i.iteration,
            i.sampled_with.map_or("none".into(), |a| a.to_string()),
            pct(i.train_success),
            i.train_reward,
            i.trained_on,
            i.update_id.map_or("–".into(), |a| a.to_string()),
            i.candidate.map_or("–".into(), |a| a.to_string()),
            i.validation
                .map_or("–".into(), |[(cs, cr), (as_, ar)]| format!(
                    "{} ({cr:.2}) / {} ({ar:.2}){}",
                    pct(cs),
                    pct(as_),
                    i.gate_replayed
                        .filter(|(r, n)| r < n)
                        .map_or(String::new(), |(r, n)| format!(
                            ", active replayed {r} of {n}"
                        ))
                )),
            if i.activated { "yes" } else { "no" },
            f(d.map(|d| d.approx_kl)),
            clip,
            f(d.map(|d| d.turn_entropy)),
            f(d.map(|d| d.logp_old_vs_behavior_mean)),
            d.map_or("–".into(), |d| d.process_signal.describe()),
            i.note.as_deref().unwrap_or("")
        );
    }
    if c.experience {
        let _ = writeln!(
            s,
            "\n## Experience library\n\n{} injections recorded in logged turns; live entries at the end:\n",
            r.experience_injections
        );
        let _ = writeln!(s, "| cluster | kind | entry | context | score |");
        let _ = writeln!(s, "|---|---|---|---|---|");
        for e in &r.experience_entries {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.2} |",
                e.cluster,
                e.kind,
                e.text.replace('|', "\\|").replace('\n', " "),
                e.context.replace('|', "\\|"),
                e.score
            );
        }
    }
    let _ = writeln!(s, "\n## Time\n\nOn {}.\n", r.machine.line());
    for (p, t) in &r.phase_seconds {
        let _ = writeln!(s, "- {p}: {t:.0} s");
    }
    let _ = writeln!(s, "- total: {:.0} s ({:.1} min)", r.wall_s, r.wall_s / 60.0);
    let updates: Vec<f64> = r
        .iterations
        .iter()
        .filter_map(|i| i.diagnostics.as_ref().map(|d| d.seconds))
        .collect();
    if !updates.is_empty() {
        let _ = writeln!(
            s,
            "- RL update (learner only): {:.1} s on average over {} updates",
            super::mean(&updates),
            updates.len()
        );
    }
    let _ = writeln!(s, "- peak resident memory: {:.0} MiB\n", r.peak_rss_mib);
    let _ = writeln!(s, "## Plots\n");
    for p in plots {
        if let Some(name) = p.file_name().and_then(|n| n.to_str()) {
            let _ = writeln!(s, "![{name}]({name})\n");
        }
    }
    if let Some(n) = plot_note {
        let _ = writeln!(s, "(plots not drawn: {n})\n");
    }
    let _ = writeln!(
        s,
        "The run's turn log is `turnwise.db` in this directory: `turnwise --db turnwise.db sessions list`, \
         and the `turn_credit` view for each turn's credit."
    );
    s
}

/// `name, TYPE (origin), sha256 abcdef12…` from a model stamp.
fn model_file_line(m: &serde_json::Value) -> String {
    let get = |k: &str| m.get(k).and_then(|v| v.as_str()).unwrap_or("?");
    let sha = get("sha256");
    format!(
        "`{}`, {} ({}), sha256 {}…",
        get("file"),
        get("file_type"),
        get("origin"),
        &sha[..sha.len().min(12)]
    )
}

/// Writes `result.json`, the plots and `report.md` into `dir`; returns the files written.
///
/// # Errors
/// I/O errors (a missing font only skips the plots, with a note in the report).
pub fn write(r: &DemoResult, dir: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let mut files = Vec::new();
    let json = dir.join("result.json");
    std::fs::write(&json, serde_json::to_vec_pretty(r)?).map_err(|e| Error::io(&json, e))?;
    files.push(json);
    let mut plots = Vec::new();
    let note = match font() {
        Ok(()) => {
            let a = dir.join("heldout_success.png");
            success_plot(r, &a)?;
            let b = dir.join("training.png");
            training_plot(r, &b)?;
            plots.extend([a, b]);
            None
        }
        Err(e) => Some(e),
    };
    let md = dir.join("report.md");
    std::fs::write(&md, markdown(r, &plots, note.as_deref())).map_err(|e| Error::io(&md, e))?;
    files.extend(plots);
    files.push(md);
    Ok(files)
}
