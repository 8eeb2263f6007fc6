//! `--export-check`: is the adapter a run ended with the same policy once it leaves Turnwise?
//!
//! The run's final adapter is exported with `turnwise adapters export --format merged` (the
//! output LoRA folded into a copy of the model file). Two servers then play the run's held-out
//! customers greedily, one after the other and alone: `turnwise serve` on a copy of the run's
//! database (the adapter active, its output LoRA applied by Turnwise on top of llama.cpp's
//! logits), and `turnwise serve --model model.gguf` on a fresh database (no adapter: llama.cpp
//! computes everything from the merged file). The check counts the sessions whose transcripts
//! are identical, the first reply where the others part, and each server's held-out success.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use serde_json::{json, Value};
use turnwise::store::Store;

use super::{common, held_out_scenarios, play_on, Api, Opts, Shared};

/// Plays every held-out scenario greedily against the server at `addr` and returns, per
/// scenario, (success, the agent's replies).
fn play_all(
    o: &Opts,
    addr: &str,
    api: Api,
    label: &str,
) -> anyhow::Result<Vec<(bool, Vec<String>)>> {
    let sh = Shared::default();
    let mut out = Vec::new();
    for (i, s) in held_out_scenarios(o).iter().enumerate() {
        let sid = format!("export-check-{label}-{i}");
        let before = super::lock(&sh.acknowledged).len();
        let p = play_on(addr, &sid, s, None, false, api, &sh)?;
        let replies = super::lock(&sh.acknowledged)[before..]
            .iter()
            .map(|(_, r)| r.clone())
            .collect();
        out.push((p.success, replies));
    }
    Ok(out)
}

/// [`play_all`] on a new `turnwise serve` on `db` with `args`, stopped afterwards.
fn play_turnwise(
    o: &Opts,
    db: &Path,
    args: &[String],
    api: Api,
    label: &str,
) -> anyhow::Result<Vec<(bool, Vec<String>)>> {
    let (mut child, addr) = common::start_server(&o.bin, db, args)?;
    let result = play_all(o, &addr, api, label);
    let _ = child.kill();
    let _ = child.wait();
    result
}

/// Starts llama.cpp's own server on `model` (with `lora` on top when given), greedy decoding
/// as Turnwise's defaults (two threads, one slot, the model's built-in chat template without
/// Jinja, as Turnwise renders it), and waits until it answers `/health`. Its output goes to
/// `log`.
fn start_llama_server(
    bin: &Path,
    model: &Path,
    lora: Option<&Path>,
    log: &Path,
) -> anyhow::Result<(Child, String)> {
    let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(bin);
    cmd.arg("-m")
        .arg(model)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["-t", &turnwise::config::DEFAULT_THREADS.to_string()])
        .args(["-c", "4096", "-np", "1", "-b", "512", "-ub", "512"])
        .args(["--no-jinja", "--no-webui", "--temp", "0"]);
    if let Some(l) = lora {
        cmd.arg("--lora").arg(l);
    }
    let out = std::fs::File::create(log)?;
    let mut child = cmd
        .stdout(out.try_clone()?)
        .stderr(out)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    let t = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            bail!(
                "{} exited ({status}) before it answered; its log: {}",
                bin.display(),
                log.display()
            );
        }
        if matches!(
            common::request(&addr, "GET", "/health", &Value::Null),
            Ok((200, _))
        ) {
            return Ok((child, addr));
        }
        if t.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "{} did not answer /health in 120 s; its log: {}",
                bin.display(),
                log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// Per-scenario comparison of two servers' greedy transcripts.
fn compare(a: &[(bool, Vec<String>)], b: &[(bool, Vec<String>)], names: (&str, &str)) -> Value {
    let mut identical = 0usize;
    let mut replies = 0usize;
    let mut same_replies = 0usize;
    let mut first_differences = Vec::new();
    for (i, ((_, x), (_, y))) in a.iter().zip(b).enumerate() {
        if x == y {
            identical += 1;
        } else if let Some(k) = x.iter().zip(y).position(|(p, q)| p != q) {
            first_differences.push(json!({
                "scenario": i, "reply": k, names.0: x[k], names.1: y[k],
            }));
        } else {
            first_differences.push(json!({
                "scenario": i, "reply": x.len().min(y.len()),
                names.0: x.len(), names.1: y.len(),
            }));
        }
        for (p, q) in x.iter().zip(y) {
            replies += 1;
            same_replies += usize::from(p == q);
        }
    }
    let success = |v: &[(bool, Vec<String>)]| v.iter().filter(|(s, _)| *s).count();
    json!({
        "scenarios": a.len(),
        "identical_transcripts": identical,
        "replies_compared": replies,
        "identical_replies": same_replies,
        format!("{}_successes", names.0): success(a),
        format!("{}_successes", names.1): success(b),
        "first_differences": first_differences,
    })
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
    let t = Instant::now();
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
    let block = check.join("adapter.gguf");
    let block = block.exists().then_some(block);
    let no_learn = vec!["--no-learn".to_string()];
    let mut summary = json!({
        "adapter": id,
        "merged_model": merged.display().to_string(),
        "merged_bytes": std::fs::metadata(&merged)?.len(),
        "block_lora": block.as_ref().map(|b| b.display().to_string()),
        "export_s": export_s,
        "run_end_successes": run_end,
    });
    // `turnwise serve --model model.gguf` on a fresh database: llama.cpp computes every logit
    // from the merged file
    let play_merged = |api: Api| {
        let mut args = no_learn.clone();
        args.extend(["--model".to_string(), merged.display().to_string()]);
        play_turnwise(o, &check.join("merged.db"), &args, api, "merged")
    };
    if let Some(server) = &o.llama_server {
        // llama.cpp's own server on the exported files, against Turnwise's server without
        // its slot filling (llama-server has none): both answer the same plain requests
        println!(
            "adapter {id} exported as {}{} in {export_s:.1} s; playing {} held-out customers on \
             turnwise serve and on {}",
            merged.display(),
            block
                .as_ref()
                .map(|b| format!(" + {}", b.display()))
                .unwrap_or_default(),
            o.eval,
            server.display()
        );
        let served = play_turnwise(o, &served_db, &no_learn, Api::TurnwisePlain, "served")?;
        let log = check.join("llama-server.log");
        let (mut child, addr) = start_llama_server(server, &merged, block.as_deref(), &log)?;
        let llama = play_all(
            o,
            &addr,
            Api::LlamaServer {
                cache_prompt: o.llama_cache_prompt,
            },
            "llama-server",
        );
        let _ = child.kill();
        let _ = child.wait();
        let llama = llama?;
        let version = Command::new(server)
            .arg("--version")
            .output()
            .map(|out| {
                let text = String::from_utf8_lossy(&out.stdout).to_string()
                    + &String::from_utf8_lossy(&out.stderr);
                text.lines()
                    .find(|l| l.starts_with("version"))
                    .unwrap_or_default()
                    .to_string()
            })
            .unwrap_or_default();
        summary["llama_server"] = json!(server.display().to_string());
        summary["llama_server_version"] = json!(version);
        summary["requests"] = json!("plain OpenAI chat requests, temperature 0, no id_slot");
        summary["llama_cache_prompt"] = json!(o.llama_cache_prompt);
        let c = compare(&served, &llama, ("served", "llama_server"));
        merge(&mut summary, c);
        // the same merged file on Turnwise's own engine: what of the difference is the fold's
        // rounding (served vs merged) and what is the other llama.cpp build and its prompt
        // handling (merged vs llama-server); Turnwise serves a merged file without a block LoRA
        if block.is_none() {
            let merged_run = play_merged(Api::TurnwisePlain)?;
            summary["merged_vs_llama_server"] =
                compare(&merged_run, &llama, ("merged", "llama_server"));
            summary["served_vs_merged"] = compare(&served, &merged_run, ("served", "merged"));
        }
    } else {
        if block.is_some() {
            bail!("adapter {id} has a block LoRA: this check serves the merged file alone (pass --llama-server to serve both with llama.cpp's server)");
        }
        println!(
            "adapter {id} exported as {} in {export_s:.1} s; playing {} held-out customers on each server",
            merged.display(),
            o.eval
        );
        let served = play_turnwise(o, &served_db, &no_learn, Api::Turnwise, "served")?;
        let merged_run = play_merged(Api::Turnwise)?;
        merge(
            &mut summary,
            compare(&served, &merged_run, ("served", "merged")),
        );
    }
    std::fs::write(
        check.join("export-check.json"),
        serde_json::to_string_pretty(&summary)?,
    )?;
    Ok(summary)
}

/// Adds the fields of the object `b` to the object `a`.
fn merge(a: &mut Value, b: Value) {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
}
