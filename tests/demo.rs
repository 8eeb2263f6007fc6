//! `turnwise demo --quick` end to end with the real binary: the plumbing of the loop, not a
//! learning result.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Output;
use turnwise::AdapterStatus;

use turnwise::store::Store;

use crate::common::{show, tempdir, turnwise};

fn assistant_turns(store: &Store, session: i64) -> usize {
    store
        .turns(session)
        .unwrap()
        .iter()
        .filter(|t| t.role == turnwise::Role::Assistant)
        .count()
}

/// The first column of every row `sql` selects.
fn column<T: rusqlite::types::FromSql>(store: &Store, sql: &str) -> Vec<T> {
    store
        .connection()
        .prepare(sql)
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap()
}

/// The customers' answers that give an order id when asked ("It's order …"); at least one.
fn id_answers(store: &Store) -> Vec<String> {
    let answers: Vec<String> = column(
        store,
        "SELECT text FROM turns WHERE role = 'user' AND text LIKE 'It''s order %'",
    );
    assert!(!answers.is_empty(), "no customer gave an id when asked");
    answers
}

/// Runs `turnwise demo --quick` with `args` into a fresh run directory and returns the
/// directory (kept alive by the returned guard), the command's output and `result.json`.
/// `--gate-kl 100` keeps the KL bound out of the way, and the 60-minute budget is one no machine
/// reaches, so the iterations asked for always run.
pub(crate) fn quick_demo(args: &[&str]) -> (tempfile::TempDir, PathBuf, Output, serde_json::Value) {
    let dir = tempdir();
    let out = dir.path().join("run");
    // the --db of the command line is not used: the run keeps its own log in its directory
    let o = turnwise(&dir.path().join("unused.db"))
        .args(["demo", "--quick", "--gate-kl", "100"])
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", show(&o));
    let result = serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap();
    (dir, out, o, result)
}

/// `v` without the fields that measure time (wall clock, phases, seconds, throughput, the run
/// directory's paths).
fn without_times(v: &serde_json::Value) -> serde_json::Value {
    match v {
        serde_json::Value::Object(m) => m
            .iter()
            .filter(|(k, _)| {
                !(k.ends_with("_s")
                    || k.ends_with("_ms")
                    || k.ends_with("seconds")
                    || k.ends_with("per_s")
                    || k.ends_with("_mib")
                    || k.as_str() == "out")
            })
            .map(|(k, x)| (k.clone(), without_times(x)))
            .collect(),
        serde_json::Value::Array(a) => a.iter().map(without_times).collect(),
        x => x.clone(),
    }
}

/// The JSON paths where `a` and `b` differ, with both values.
fn differences(a: &serde_json::Value, b: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    use serde_json::Value::{Array, Object};
    match (a, b) {
        (Object(x), Object(y)) => {
            for k in x.keys().chain(y.keys().filter(|k| !x.contains_key(*k))) {
                let (u, v) = (&x.get(k).cloned(), &y.get(k).cloned());
                let null = serde_json::Value::Null;
                let (u, v) = (u.as_ref().unwrap_or(&null), v.as_ref().unwrap_or(&null));
                differences(u, v, &format!("{at}.{k}"), out);
            }
        }
        (Array(x), Array(y)) if x.len() == y.len() => {
            for (i, (u, v)) in x.iter().zip(y).enumerate() {
                differences(u, v, &format!("{at}[{i}]"), out);
            }
        }
        _ if a != b => out.push(format!("{at}: {a} vs {b}")),
        _ => {}
    }
}

#[test]
fn quick_demo_runs_the_whole_loop_and_writes_its_report() {
    let (_dir, out, o, result) = quick_demo(&["--seed", "2", "--val", "0"]);
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(
        stdout.contains("warm start") && stdout.contains("final"),
        "{stdout}"
    );
    // without a terminal, each phase still says when it starts and ends
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(
        stderr.contains("] demonstrations:") && stderr.contains(": done in "),
        "{stderr}"
    );

    // report files
    for f in [
        "report.md",
        "result.json",
        "heldout_success.png",
        "training.png",
    ] {
        let p = out.join(f);
        let bytes = std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(bytes.len() > 100, "{f} is too small");
        if f.ends_with(".png") {
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{f} is not a PNG");
        }
    }
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(report.contains("| final |"), "{report}");
    let labels: Vec<&str> = result["evals"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["label"].as_str().unwrap())
        .collect();
    assert_eq!(labels, ["base", "warm start", "iteration 1", "final"]);
    let iterations = result["iterations"].as_array().unwrap();
    assert_eq!(iterations.len(), 2);

    // the turn log
    let store = Store::open(&out.join("turnwise.db")).unwrap();
    let conn = store.connection();
    let warm: i64 = result["warm_adapter"].as_i64().unwrap();
    // every RL rollout turn of the agent is stamped with the adapter it was sampled with, and the
    // adapter advances from iteration to iteration: warm start → candidate 1 → candidate 2
    let mut by_iteration: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    let mut st = conn
        .prepare(
            "SELECT json_extract(s.metadata, '$.iteration'), t.adapter_id FROM turns t
             JOIN sessions s ON s.id = t.session_id
             WHERE s.source = 'demo' AND t.role = 'assistant'",
        )
        .unwrap();
    let rows = st
        .query_map([], |r| {
            Ok((r.get::<_, i64>(0)?, r.get::<_, Option<i64>>(1)?))
        })
        .unwrap();
    for row in rows {
        let (it, adapter) = row.unwrap();
        by_iteration
            .entry(it)
            .or_default()
            .push(adapter.expect("every sampled agent turn has an adapter id"));
    }
    assert_eq!(by_iteration.len(), 2);
    assert!(by_iteration[&1].iter().all(|&a| a == warm));
    let first_candidate = iterations[0]["candidate"].as_i64().unwrap();
    assert!(first_candidate > warm);
    assert!(by_iteration[&2].iter().all(|&a| a == first_candidate));
    let last = iterations[1]["candidate"].as_i64().unwrap();
    assert_eq!(store.active_adapter().unwrap().map(|a| a.id), Some(last));
    assert_eq!(
        store.adapter(last).unwrap().parent_id,
        Some(first_candidate)
    );

    // one updates row for the warm start and one per iteration
    let updates: Vec<(String, String)> = conn
        .prepare("SELECT algo, status FROM updates ORDER BY id")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(
        updates,
        [("sft", "ok"), ("a2tgpo", "ok"), ("a2tgpo", "ok")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    // step-level credit: one turn_credit row per agent turn, with an information gain
    let sessions: Vec<i64> = column(&store, "SELECT id FROM sessions WHERE source = 'demo'");
    assert_eq!(sessions.len(), 8, "2 iterations × 2 scenarios × 2 rollouts");
    // the customer repeats the request with the order id (`--restate on`, the default), in the
    // demonstrations and the rollouts alike
    let restated: Vec<&str> = turnwise::env::INTENTS
        .iter()
        .map(|i| i.restated())
        .collect();
    let answers = id_answers(&store);
    for a in &answers {
        assert!(
            restated.iter().any(|r| a.ends_with(&format!(". {r}"))),
            "{a}"
        );
    }
    assert!(report.contains("Customers repeat their request when they give the order id: on."));
    for sid in sessions {
        let credit = store.turn_credit(sid).unwrap();
        assert_eq!(credit.len(), assistant_turns(&store, sid));
        assert!(credit.iter().all(|c| c.info_gain.is_some()), "{credit:?}");
    }
}

/// Two engines playing side by side (`--engines 2`, one thread each): every rollout is logged,
/// and the run is reproducible — each engine plays a fixed share of the sessions in a fixed order,
/// so a second run from the same seed plays the same sessions word for word. More engines than
/// threads is a clear error.
/// Presets are compared on the same footing: two presets of one seed in the default
/// configuration (stopped after the evaluations they share: `--iterations 0`) play identical
/// base-model and warm-start evaluations — every transcript the same — because evaluations are
/// played canonically (an engine reset before each session, no session beside it). Before
/// that, whatever a preset had decoded before (and when a lane's queued close was stepped)
/// could flip a greedy reply near a tie: seed 7 once gave 8 of 20 base and 35 of 50
/// warm-start transcripts different between a2tgpo and grpo. Without an activation, the final
/// evaluation repeats the warm start's play instead of playing it again.
#[test]
fn presets_of_a_seed_play_the_same_base_and_warm_start_evaluations() {
    let run = |algo: &str| {
        let dir = tempdir();
        let out = dir.path().join(algo);
        let o = turnwise(&dir.path().join("unused.db"))
            .args([
                "demo",
                "--seed",
                "7",
                "--iterations",
                "0",
                "--algo",
                algo,
                "--out",
            ])
            .arg(&out)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", show(&o));
        let r: serde_json::Value =
            serde_json::from_slice(&std::fs::read(out.join("result.json")).unwrap()).unwrap();
        (dir, r)
    };
    let (_a, a) = run("a2tgpo");
    let (_g, g) = run("grpo");
    let eval = |r: &serde_json::Value, label: &str| -> serde_json::Value {
        r["evals"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["label"] == label)
            .unwrap_or_else(|| panic!("no {label} evaluation"))
            .clone()
    };
    for label in ["base", "warm start"] {
        let (x, y) = (eval(&a, label), eval(&g, label));
        let (tx, ty) = (
            x["transcripts"].as_array().unwrap(),
            y["transcripts"].as_array().unwrap(),
        );
        assert!(!tx.is_empty() && tx.len() == ty.len());
        let differ: Vec<usize> = (0..tx.len()).filter(|&i| tx[i] != ty[i]).collect();
        assert!(
            differ.is_empty(),
            "{label}: transcripts {differ:?} differ between presets"
        );
        assert_eq!(x["success"], y["success"]);
    }
    assert_eq!(
        eval(&a, "warm start")["transcripts"]
            .as_array()
            .unwrap()
            .len(),
        50
    );
    let fin = eval(&a, "final");
    assert_eq!(fin["same_as"], "warm start");
    assert_eq!(fin["transcripts"], eval(&a, "warm start")["transcripts"]);
}

#[test]
fn two_engines_log_every_session_and_reproduce_a_seeded_run() {
    let args = [
        "--seed",
        "3",
        "--engines",
        "2",
        "--no-base-eval",
        "--eval-every",
        "0",
        "--val",
        "2",
    ];
    let (_d1, out, _, first) = quick_demo(&args);
    let (_d2, _, _, second) = quick_demo(&args);
    assert_eq!(first["config"]["engines"].as_u64(), Some(2));
    let transcripts = |r: &serde_json::Value| -> Vec<serde_json::Value> {
        r["evals"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["transcripts"].clone())
            .collect()
    };
    assert_eq!(transcripts(&first), transcripts(&second));
    let rollouts = |r: &serde_json::Value| -> Vec<(String, String)> {
        r["iterations"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| (i["train_reward"].to_string(), i["validation"].to_string()))
            .collect()
    };
    assert_eq!(rollouts(&first), rollouts(&second));
    // the whole result, updates included, apart from how long things took: the update reads its
    // batch in an order that does not depend on which engine logged a session first
    let (a, b) = (without_times(&first), without_times(&second));
    let mut diff = Vec::new();
    differences(&a, &b, "", &mut diff);
    assert!(diff.is_empty(), "two runs of one seed differ at: {diff:?}");
    let store = Store::open(&out.join("turnwise.db")).unwrap();
    let conn = store.connection();
    let (sessions, ended, with_outcome): (i64, i64, i64) = conn
        .query_row(
            "SELECT count(*), count(ended_at), count(outcome_reward) FROM sessions WHERE source = 'demo'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .unwrap();
    assert_eq!(sessions, 8, "2 iterations × 2 scenarios × 2 rollouts");
    assert_eq!((ended, with_outcome), (8, 8));

    // settings that cannot run are refused with a clear error before a run directory exists
    let refused = |args: &[&str], message: &str| {
        let dir = tempdir();
        let o = turnwise(&dir.path().join("unused.db"))
            .args(["demo", "--quick"])
            .args(args)
            .arg("--out")
            .arg(dir.path().join("run"))
            .output()
            .unwrap();
        assert!(!o.status.success());
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(message),
            "{}",
            show(&o)
        );
        assert!(!dir.path().join("run").exists());
    };
    refused(
        &["--engines", "3", "--threads", "2"],
        "--engines must be between 1 and --threads",
    );
    refused(&["--eps-low", "1.5"], "0 < eps_low < 1");
    // the global --db does not apply to a demo, which keeps its log in its run directory
    refused(&["--db", "elsewhere.db"], "--db does not apply");
}

/// The validation gate: a candidate is activated exactly when its greedy validation success
/// (then reward) is at least the active adapter's; a rejected one is marked so, the next rollouts
/// come from the unchanged adapter, and its sessions are kept for the next update.
#[test]
fn the_validation_gate_activates_only_candidates_that_do_not_lose_on_validation() {
    let (_dir, out, _, result) = quick_demo(&[
        "--no-base-eval",
        "--eval-every",
        "0",
        "--val",
        "3",
        "--iterations",
        "3",
        "--scenarios",
        "5",
        "--stratify",
        "on",
        "--paraphrase",
        "on",
        "--restate",
        "off",
        "--eps-low",
        "0.05",
        "--eps-high",
        "0.07",
    ]);
    let store = Store::open(&out.join("turnwise.db")).unwrap();
    // --stratify: the five scenarios of an iteration ask for the five intents (drawn at random,
    // all five differ in 4 % of iterations); --eps-*: every RL update ran with the clip range
    // asked for
    let intents: Vec<(i64, String, i64)> = store
        .connection()
        .prepare(
            "SELECT json_extract(metadata, '$.iteration') AS it,
                    json_extract(metadata, '$.intent'), count(*)
             FROM sessions WHERE source = 'demo' GROUP BY 1, 2 ORDER BY 1",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(intents.len(), 3 * 5, "{intents:?}");
    // --paraphrase: rollout openings carry greetings, closings or lower case; the
    // demonstrations' stay as their templates write them
    let openings: Vec<(bool, String)> = store
        .connection()
        .prepare(
            "SELECT s.group_key LIKE 'it%', t.text FROM sessions s JOIN turns t
             ON t.session_id = s.id AND t.idx = 1 WHERE s.source = 'demo'",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let dressed = |t: &str| {
        let t = t.to_lowercase();
        turnwise::env::GREETINGS
            .iter()
            .any(|g| t.starts_with(&g.to_lowercase()))
            || turnwise::env::CLOSINGS
                .iter()
                .any(|c| t.ends_with(&c.to_lowercase()))
    };
    assert!(
        openings.iter().any(|(r, t)| *r && dressed(t)),
        "{openings:?}"
    );
    assert!(
        openings
            .iter()
            .filter(|(r, _)| !r)
            .all(|(_, t)| !dressed(t)),
        "{openings:?}"
    );
    assert!(intents.iter().all(|i| i.2 == 2), "{intents:?}");
    // --restate off: a customer asked for the id gives the id alone
    let answers = id_answers(&store);
    assert!(
        answers
            .iter()
            .all(|a| a.len() == "It's order 12345.".len() && a.ends_with('.')),
        "{answers:?}"
    );
    let eps: Vec<(String, f64, f64)> = store
        .connection()
        .prepare(
            "SELECT algo, json_extract(config, '$.objective.eps_low'),
                    json_extract(config, '$.objective.eps_high') FROM updates ORDER BY id",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(eps.len(), 4, "{eps:?}");
    assert!(
        eps[1..]
            .iter()
            .all(|e| e.0 == "a2tgpo" && e.1 == 0.05 && e.2 == 0.07),
        "{eps:?}"
    );
    let iterations = result["iterations"].as_array().unwrap();
    assert_eq!(iterations.len(), 3);
    let per_iteration = 5 * 2; // 5 scenarios × 2 rollouts (--quick)
    let mut active = result["warm_adapter"].as_i64().unwrap();
    let mut kept = 0;
    for it in iterations {
        assert_eq!(it["sampled_with"].as_i64(), Some(active), "{it}");
        kept = (kept + per_iteration).min(3 * per_iteration);
        assert_eq!(it["trained_on"].as_u64(), Some(kept as u64), "{it}");
        let candidate = it["candidate"].as_i64().expect("a candidate");
        let v = &it["validation"];
        let pair = |k: usize| (v[k][0].as_f64().unwrap(), v[k][1].as_f64().unwrap());
        let (cand, act) = (pair(0), pair(1));
        let passes = cand.0 > act.0 || cand.0 == act.0 && cand.1 >= act.1;
        assert_eq!(it["activated"].as_bool(), Some(passes), "{it}");
        // the shadow check (on by default): the active adapter replayed at most every gate
        // scenario; where it replayed none, it would have played the candidate's sessions
        let (replayed, of) = (
            it["gate_replayed"][0].as_u64().unwrap(),
            it["gate_replayed"][1].as_u64().unwrap(),
        );
        assert_eq!(of, 3, "{it}");
        assert!(replayed <= of, "{it}");
        if replayed == 0 {
            assert_eq!(cand, act, "{it}");
        }
        let status = store.adapter(candidate).unwrap().status;
        if passes {
            assert_ne!(status, AdapterStatus::Rejected, "{it}");
            active = candidate;
            kept = 0;
        } else {
            assert_eq!(status, AdapterStatus::Rejected, "{it}");
            assert!(it["note"].as_str().unwrap().contains("validation"), "{it}");
        }
    }
    assert_eq!(store.active_adapter().unwrap().map(|a| a.id), Some(active));
    let report = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(
        report.contains("validation (candidate / active)"),
        "{report}"
    );
    assert!(
        report.contains("5 scenarios (intents balanced, openings paraphrased) × 2 rollouts")
            && report.contains("clip range [1 − 0.05, 1 + 0.07]")
            && report.contains("Customers repeat their request when they give the order id: off."),
        "{report}"
    );
}

/// Step-level credit on desk sessions: a value head fitted on sessions of the expert and of a
/// careless agent (it refunds whatever the request, so it succeeds on refunds only) ranks held-out
/// successes above failures, and every agent turn gets one `turn_credit` row.
#[test]
fn the_value_head_separates_desk_successes_from_failures() {
    use turnwise::adapter::Adapter;
    use turnwise::demo::{expert_conversation, scripted_conversation};
    use turnwise::env::{self, Action, Split};
    use turnwise::learn::annotate::{annotate_sessions, fit_value_head, AnnotateConfig};
    use turnwise::policy::sampler::Rng;
    use turnwise::replay::import_conversation;

    let dir = tempdir();
    let mut store = Store::open(&dir.path().join("credit.db")).unwrap();
    let engine = crate::common::engine();
    let careless = |d: &env::Desk, seen: &[env::Observation]| {
        if seen.is_empty() {
            env::action_line(&Action::Refund(d.scenario.order.id))
        } else {
            "Done, thank you for your patience.".to_string()
        }
    };
    let mut rng = Rng::new(5);
    let mut ids = Vec::new();
    for k in 0..30 {
        let s = env::scenario(
            &mut rng,
            if k % 5 == 4 {
                Split::HeldOut
            } else {
                Split::Train
            },
        );
        let c = if k % 2 == 0 {
            expert_conversation(&s, 5)
        } else {
            scripted_conversation(&s, 3, careless)
        };
        ids.push(
            import_conversation(engine, &mut store, &c)
                .unwrap()
                .unwrap(),
        );
    }
    let outcomes: Vec<f64> = ids
        .iter()
        .map(|&i| store.session(i).unwrap().outcome_reward.unwrap())
        .collect();
    assert!(outcomes.iter().any(|&o| o >= 1.0) && outcomes.iter().any(|&o| o < 0.5));
    let info = engine.info();
    let mut adapter = Adapter::fresh(info.n_embd, info.n_vocab, 8, 16.0, 0, &info.name);
    let fit = fit_value_head(&store, &ids, &mut adapter, 300, 0.05).unwrap();
    eprintln!("value head on desk sessions: {fit:?}");
    let auc = fit.auc_after.expect("both classes among held-out sessions");
    assert!(auc > 0.7, "held-out AUC {auc}");
    assert!(fit.brier_after < fit.brier_before, "{fit:?}");
    annotate_sessions(
        &mut store,
        &ids,
        &adapter,
        None,
        None,
        &AnnotateConfig::default(),
    )
    .unwrap();
    for &sid in &ids {
        let credit = store.turn_credit(sid).unwrap();
        assert_eq!(credit.len(), assistant_turns(&store, sid));
        assert!(credit.iter().all(|c| c.contribution.is_some()));
    }
}

/// The demo scores the ground truth's action line while a rollout is still in the KV cache;
/// those log-probs must be the ones `turnwise annotate` computes from the logged session
/// ([`reference_scores`]), one before the first agent reply and one per reply, with either
/// [`IgContext`].
#[test]
fn information_gain_scored_while_playing_matches_rescoring_the_log() {
    use std::collections::HashMap;
    use turnwise::adapter::Adapter;
    use turnwise::demo::{play, LogMeta, PlaySettings};
    use turnwise::env::{self, Split};
    use turnwise::learn::annotate::{
        annotate_sessions_with, reference_scores, AnnotateConfig, IgContext, IgPolicy,
        InfoGainSource,
    };
    use turnwise::policy::sampler::{Rng, SamplerParams};

    let dir = tempdir();
    let mut store = Store::open(&dir.path().join("ig.db")).unwrap();
    let engine = crate::common::engine();
    let mut rng = Rng::new(11);
    for ctx in [IgContext::Observation, IgContext::Reply] {
        let mut scored = HashMap::new();
        for k in 0..3u64 {
            let s = env::scenario(&mut rng, Split::Train);
            let how = PlaySettings {
                patience: 3,
                params: SamplerParams {
                    seed: 40 + k,
                    max_tokens: 24,
                    ..Default::default()
                },
                key: crate::common::session_key(),
                score_reference: true,
                ig_context: ctx,
                ig_policy: IgPolicy::Frozen,
                id_slot: false,
                canonical: false,
                adapter: None,
            };
            let log = LogMeta {
                group: format!("{ctx:?}{k}"),
                metadata: serde_json::json!({}),
            };
            let played = play(engine, &mut store, &s, &how, Some(log), None).unwrap();
            let sid = played.session_id.unwrap();
            let p = played.reference_logp.unwrap();
            // the same numbers from the log, as annotating it afterwards computes them
            let reference = store.session(sid).unwrap().reference.unwrap();
            let turns = store.turns(sid).unwrap();
            let q = reference_scores(engine, &turns, &reference, ctx, IgPolicy::Frozen).unwrap();
            assert_eq!(p.len(), assistant_turns(&store, sid) + 1);
            assert_eq!(p.len(), q.len());
            // llama.cpp's numbers depend on how the context was batched (generated token by
            // token or prefilled), by a few hundredths of a nat
            for (a, b) in p.iter().zip(&q) {
                assert!(
                    (a - b).abs() < 0.25,
                    "{ctx:?}: played {p:?}, rescored {q:?}"
                );
            }
            scored.insert(sid, p);
        }
        let ids: Vec<i64> = scored.keys().copied().collect();
        let info = engine.info();
        let head = Adapter::fresh(info.n_embd, info.n_vocab, 8, 16.0, 0, &info.name);
        let cfg = AnnotateConfig {
            ig_context: ctx,
            ..AnnotateConfig::default()
        };
        let src = InfoGainSource::Scored(&scored);
        let sum = annotate_sessions_with(&mut store, &ids, Some(&head), None, src, &cfg).unwrap();
        assert_eq!(sum.info_gain_turns, sum.turns);
        for &sid in &ids {
            let credit = store.turn_credit(sid).unwrap();
            assert!(credit.iter().all(|c| c.info_gain.is_some()), "{credit:?}");
        }
        // log-probs that do not match the session's turns are a clear error, not a silent shift
        let mut wrong = scored.clone();
        wrong.get_mut(&ids[0]).unwrap().pop();
        let src = InfoGainSource::Scored(&wrong);
        let e = annotate_sessions_with(&mut store, &ids[..1], Some(&head), None, src, &cfg)
            .unwrap_err();
        assert!(e.to_string().contains("reference log-probs"), "{e}");
    }
}

/// Where information gain is scored, on the real model and a scripted refund without an id:
/// after a turn's observation (the default), the question for the order number gains when the
/// customer answers with it, and the lookup when the back office says the order was lost;
/// scored right after the reply, the question gains next to nothing and the turn that writes
/// the id gets the credit instead. The opening score is the same either way.
#[test]
fn information_gain_after_the_observation_credits_the_question_that_brought_the_id() {
    use turnwise::demo::expert_conversation;
    use turnwise::env::{self, Intent, Split};
    use turnwise::learn::annotate::{
        information_gain, reference_scores, IgBaseline, IgContext, IgPolicy, IgSpace,
    };
    use turnwise::policy::sampler::Rng;
    use turnwise::replay::{rescore_conversation, store_rescored};

    let engine = crate::common::engine();
    let mut rng = Rng::new(3);
    let s = loop {
        let s = env::scenario_for(&mut rng, Split::Train, Intent::Refund);
        if !s.gives_id {
            break s;
        }
    };
    let dir = tempdir();
    let mut store = Store::open(&dir.path().join("ig2.db")).unwrap();
    let conv = expert_conversation(&s, 5);
    let r = rescore_conversation(engine, &conv).unwrap();
    let sid = store_rescored(&mut store, &r).unwrap().unwrap();
    let turns = store.turns(sid).unwrap();
    let texts: Vec<&str> = turns
        .iter()
        .filter(|t| t.role == turnwise::Role::Assistant)
        .map(|t| t.text.as_str())
        .collect();
    assert!(texts[0].contains("order number"), "{texts:?}");
    assert!(texts[1].starts_with("ACTION status"), "{texts:?}");
    let reference = env::action_line(&s.ground_truth);
    let ig = |ctx| {
        let p = reference_scores(engine, &turns, &reference, ctx, IgPolicy::Frozen).unwrap();
        assert_eq!(p.len(), texts.len() + 1);
        (
            p[0],
            information_gain(&p, IgSpace::Logprob, IgBaseline::Opening),
        )
    };
    let (p0_obs, obs) = ig(IgContext::Observation);
    let (p0_rep, rep) = ig(IgContext::Reply);
    eprintln!("after the observation {obs:?}\nafter the reply {rep:?}");
    assert!((p0_obs - p0_rep).abs() < 0.05, "{p0_obs} {p0_rep}");
    // the question brought the id: a large gain once the answer is in
    assert!(obs[0] > 0.5, "{obs:?}");
    assert!(obs[0] > rep[0] + 0.5, "{obs:?} / {rep:?}");
}

/// The demo rescores its demonstrations on several one-thread engines and stores them in the
/// order they were drawn: a conversation's rescoring (tokens, log-probs, hidden states) must
/// not depend on which engine did it or on what that engine rescored before.
#[test]
fn rescoring_does_not_depend_on_the_engine_or_its_history() {
    use turnwise::demo::expert_conversation;
    use turnwise::env::{self, Split};
    use turnwise::policy::sampler::Rng;
    use turnwise::policy::{Engine, EngineConfig};
    use turnwise::replay::rescore_conversation;

    let mut rng = Rng::new(9);
    let convs: Vec<_> = (0..4)
        .map(|_| expert_conversation(&env::scenario(&mut rng, Split::Train), 5))
        .collect();
    let rescore_in = |order: &[usize]| {
        let mut cfg = EngineConfig::new(crate::common::model_path());
        cfg.n_threads = 1;
        let engine = Engine::start(cfg).unwrap();
        let mut out = vec![None; convs.len()];
        for &i in order {
            out[i] = Some(rescore_conversation(&engine, &convs[i]).unwrap());
        }
        out
    };
    let first = rescore_in(&[0, 1, 2, 3]);
    let second = rescore_in(&[3, 1, 0, 2]);
    // four different conversations rescore to four different results: the comparison below
    // is not one of empty or constant results
    for i in 0..first.len() {
        for j in i + 1..first.len() {
            assert!(
                first[i] != first[j],
                "conversations {i} and {j} rescored alike"
            );
        }
    }
    assert!(
        first == second,
        "rescoring differs between engines or orders"
    );
}
