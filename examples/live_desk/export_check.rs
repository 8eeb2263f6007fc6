//! `--export-check`: is the adapter a run ended with the same policy once it leaves Turnwise?
//!
//! The run's final adapter is exported with `turnwise adapters export --format merged` (the
//! output LoRA folded into a copy of the model file). Two servers then play the run's held-out
//! customers greedily, one after the other and alone: `turnwise serve` on a copy of the run's
//! database (the adapter active, its output LoRA applied by Turnwise on top of llama.cpp's
//! logits), and `turnwise serve --model model.gguf` on a fresh database (no adapter: llama.cpp
//! computes everything from the merged file). The check counts the sessions whose transcripts
//! are identical, the first reply where the others part, and each server's held-out success.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use turnwise::store::Store;

use super::{common, held_out_scenarios, play, Opts, Shared};

/// Plays every held-out scenario greedily against a new server on `db` and returns, per
/// scenario, (success, the agent's replies).
fn play_all(
    o: &Opts,
    db: &Path,
    args: &[String],
    label: &str,
) -> anyhow::Result<Vec<(bool, Vec<String>)>> {
    let (mut child, addr) = common::start_server(&o.bin, db, args)?;
    let sh = Shared::default();
    let mut out = Vec::new();
    let mut result = Ok(());
    for (i, s) in held_out_scenarios(o).iter().enumerate() {
        let sid = format!("export-check-{label}-{i}");
        let before = super::lock(&sh.acknowledged).len();
        match play(&addr, &sid, s, None, false, &sh) {
            Ok(p) => {
                let replies = super::lock(&sh.acknowledged)[before..]
                    .iter()
                    .map(|(_, r)| r.clone())
                    .collect();
                out.push((p.success, replies));
            }
            Err(e) => {
                result = Err(e);
                break;
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    result.map(|_| out)
}

/// Runs the check on the finished run in `dir` and returns its summary.
pub fn export_check(o: &Opts, dir: &Path, result: &Value) -> anyhow::Result<Value> {
    // what the run's own end evaluation scored with this adapter (played alone, like these)
    let run_end = result["evaluations"]
        .as_array()
        .and_then(|e| e.last())
        .map(|e| json!({"adapter": e["adapter"], "successes": e["successes"]}))
        .unwrap_or(Value::Null);
    let run_db = dir.join("turnwise.db");
    let check = dir.join("export-check");
    if check.exists() {
        std::fs::remove_dir_all(&check)?;
    }
    std::fs::create_dir_all(&check)?;
    // a copy: the held-out sessions of the check must not enter the run's own log
    let served_db = check.join("served.db");
    {
        let store =
            Store::open(&run_db).with_context(|| format!("opening {}", run_db.display()))?;
        store
            .connection()
            .execute_batch(&format!("VACUUM INTO '{}'", served_db.display()))?;
    }
    let store = Store::open(&served_db)?;
    let active = store
        .active_adapter()?
        .context("the run has no active adapter")?;
    drop(store);
    let id = active.id;
    let t = std::time::Instant::now();
    let status = Command::new(&o.bin)
        .arg("--db")
        .arg(&served_db)
        .args([
            "adapters",
            "export",
            &id.to_string(),
            "--format",
            "merged",
            "--out",
        ])
        .arg(&check)
        .status()?;
    if !status.success() {
        bail!("turnwise adapters export {id} --format merged failed");
    }
    let export_s = t.elapsed().as_secs_f64();
    let merged = check.join("model.gguf");
    if check.join("adapter.gguf").exists() {
        bail!("adapter {id} has a block LoRA: this check serves the merged file alone");
    }
    println!(
        "adapter {id} exported as {} in {export_s:.1} s; playing {} held-out customers on each server",
        merged.display(),
        o.eval
    );
    let no_learn = vec!["--no-learn".to_string()];
    let served = play_all(o, &served_db, &no_learn, "served")?;
    let mut merged_args = no_learn;
    merged_args.extend(["--model".to_string(), merged.display().to_string()]);
    let merged_run = play_all(o, &check.join("merged.db"), &merged_args, "merged")?;

    let mut identical = 0usize;
    let mut replies = 0usize;
    let mut same_replies = 0usize;
    let mut first_differences = Vec::new();
    for (i, ((_, a), (_, b))) in served.iter().zip(&merged_run).enumerate() {
        if a == b {
            identical += 1;
        } else if let Some(k) = a.iter().zip(b).position(|(x, y)| x != y) {
            first_differences.push(json!({
                "scenario": i, "reply": k, "served": a[k], "merged": b[k],
            }));
        } else {
            first_differences.push(json!({
                "scenario": i, "reply": a.len().min(b.len()),
                "served": a.len(), "merged": b.len(),
            }));
        }
        for (x, y) in a.iter().zip(b) {
            replies += 1;
            same_replies += usize::from(x == y);
        }
    }
    let success = |v: &[(bool, Vec<String>)]| v.iter().filter(|(s, _)| *s).count();
    let summary = json!({
        "adapter": id,
        "merged_model": merged.display().to_string(),
        "merged_bytes": std::fs::metadata(&merged)?.len(),
        "export_s": export_s,
        "scenarios": served.len(),
        "identical_transcripts": identical,
        "replies_compared": replies,
        "identical_replies": same_replies,
        "served_successes": success(&served),
        "merged_successes": success(&merged_run),
        "run_end_successes": run_end,
        "first_differences": first_differences,
    });
    std::fs::write(
        check.join("export-check.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(summary)
}
