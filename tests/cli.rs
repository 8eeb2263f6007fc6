//! The real binary: piped chat, durability under kill -9, import/export, bad model files.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use turnwise::store::{Behavior, Store};

use crate::common::{model_path, show, tempdir, turnwise};

#[test]
fn piped_chat_logs_every_turn_and_feedback() {
    let dir = tempdir();
    let db = dir.path().join("chat.db");
    let mut child = turnwise(&db)
        .args(["chat", "--seed", "3", "--max-tokens", "24"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"Hi, I need help with order 10442.\n/good\nIt is late.\n\xff\xfe\n/unresolved\nNew question here.\n/quit\n")
        .unwrap();
    drop(stdin);
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not valid UTF-8"), "{}", show(&out));
    let store = Store::open(&db).unwrap();
    let sessions = store.sessions(None, 10).unwrap();
    assert_eq!(sessions.len(), 2, "/unresolved ends the first session");
    let first = sessions
        .iter()
        .find(|s| s.outcome_reward.is_some())
        .unwrap();
    assert_eq!(first.outcome_reward, Some(0.0));
    assert!(first.ended_at.is_some());
    let turns = store.turns(first.id).unwrap();
    let roles: Vec<&str> = turns.iter().map(|t| t.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "user", "assistant"]);
    let fb = store.feedback(first.id).unwrap();
    assert_eq!(fb[0].kind, turnwise::FeedbackKind::Thumb);
    assert_eq!(fb[0].turn_idx, Some(2));
    for t in turns.iter().filter(|t| t.role == turnwise::Role::Assistant) {
        assert_eq!(t.behavior, Some(Behavior::Sampled));
        assert!(store.features(t.id).unwrap().is_some());
    }
    // same seed, same input -> same first reply
    let db2 = dir.path().join("chat2.db");
    let mut child = turnwise(&db2)
        .args(["chat", "--seed", "3", "--max-tokens", "24"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Hi, I need help with order 10442.\n")
        .unwrap();
    let out2 = child.wait_with_output().unwrap();
    let s2 = Store::open(&db2).unwrap();
    let id2 = s2.sessions(None, 1).unwrap()[0].id;
    assert_eq!(
        s2.turns(id2).unwrap()[2].token_ids,
        turns[2].token_ids,
        "{}",
        show(&out2)
    );
}

#[test]
fn a_turn_answered_is_in_the_database_when_the_process_is_killed_right_after() {
    let dir = tempdir();
    let db = dir.path().join("kill.db");
    let mut child = turnwise(&db)
        .args(["chat", "--seed", "1", "--max-tokens", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    stdin
        .write_all(b"Hello there, where is my order 99120?\n")
        .unwrap();
    stdin.flush().unwrap();
    // the reply line ends with a newline once the turn is committed: kill the instant it appears
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    reader.read_line(&mut line).unwrap();
    child.kill().unwrap(); // SIGKILL: no destructor, no clean shutdown
    child.wait().unwrap();
    let store = Store::open(&db).unwrap();
    let s = store.sessions(None, 1).unwrap();
    assert_eq!(s.len(), 1);
    let turns = store.turns(s[0].id).unwrap();
    assert_eq!(turns.last().unwrap().role, turnwise::Role::Assistant);
    assert_eq!(turns.last().unwrap().text.trim(), line.trim());
    assert!(store
        .token_logprobs(turns.last().unwrap().id)
        .unwrap()
        .is_some());
}

#[test]
fn import_reports_bad_lines_keeps_good_ones_and_does_not_duplicate() {
    let dir = tempdir();
    let db = dir.path().join("import.db");
    let file = dir.path().join("chats.jsonl");
    let huge = "please ".repeat(4000);
    let mut data = Vec::new();
    data.extend_from_slice(br#"{"messages":[{"role":"system","content":"You are a support agent."},{"role":"user","content":"Refund order 12345 please."},{"role":"assistant","content":"I have refunded order 12345."}],"outcome":"resolved","reference":"ACTION refund 12345","group":"refund"}"#);
    data.push(b'\n');
    data.extend_from_slice(b"{not json\n");
    data.extend_from_slice(br#"{"messages":[{"role":"wizard","content":"x"}]}"#);
    data.push(b'\n');
    data.extend_from_slice(b"{\"messages\":[{\"role\":\"user\",\"content\":\"caf\xe9\"},{\"role\":\"assistant\",\"content\":\"x\"}]}\n");
    data.extend_from_slice(format!(r#"{{"messages":[{{"role":"user","content":"{huge}"}},{{"role":"assistant","content":"ok"}}]}}"#).as_bytes());
    data.push(b'\n');
    data.extend_from_slice(br#"{"messages":[{"role":"user","content":"Where is 777?"},{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"lookup","arguments":"{\"id\":777}"}}]},{"role":"tool","content":"shipped"},{"role":"assistant","content":"It has shipped."}],"outcome":0.5}"#);
    data.push(b'\n');
    // a policy that ended its turn at once left an empty reply: a chat (and what export writes)
    data.extend_from_slice(br#"{"messages":[{"role":"user","content":"Cancel order 4242."},{"role":"assistant","content":""}],"outcome":0,"group":"empty"}"#);
    data.push(b'\n');
    // an empty customer message is not
    data.extend_from_slice(
        br#"{"messages":[{"role":"user","content":"  "},{"role":"assistant","content":"Hello?"}]}"#,
    );
    data.push(b'\n');
    std::fs::write(&file, &data).unwrap();

    let out = turnwise(&db).arg("import").arg(&file).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(1),
        "skipped lines give a non-zero exit\n{}",
        show(&out)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    for (line, why) in [
        (2, "not a JSON"),
        (3, "unknown role"),
        (4, "UTF-8"),
        (5, "context"),
        (8, "empty user message"),
    ] {
        assert!(
            stderr.contains(&format!("line {line}: skipped")) && stderr.contains(why),
            "line {line} ({why})\n{}",
            show(&out)
        );
    }
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("imported 3 sessions, 0 already present, 5 lines skipped"),
        "{}",
        show(&out)
    );

    let store = Store::open(&db).unwrap();
    let sessions = store.sessions(None, 10).unwrap();
    assert_eq!(sessions.len(), 3);
    let refund = sessions
        .iter()
        .find(|s| s.group_key.as_deref() == Some("refund"))
        .unwrap();
    assert_eq!(refund.outcome_reward, Some(1.0));
    assert_eq!(refund.reference.as_deref(), Some("ACTION refund 12345"));
    let turns = store.turns(refund.id).unwrap();
    let a = &turns[2];
    assert_eq!(a.behavior, Some(Behavior::Rescored));
    let lp = store.token_logprobs(a.id).unwrap().unwrap();
    assert_eq!(lp.logp_full.len(), a.token_ids.len());
    assert!(lp.logp_full.iter().all(|x| x.is_finite() && *x <= 0.0));
    assert!(store.features(a.id).unwrap().is_some());
    let tool = store
        .turns(sessions.iter().find(|s| s.group_key.is_none()).unwrap().id)
        .unwrap();
    assert!(tool[1].text.contains("<tool_call>"));
    // the empty reply is rescored like any other: its end-of-turn token has a log-prob
    let empty = sessions
        .iter()
        .find(|s| s.group_key.as_deref() == Some("empty"))
        .unwrap();
    let reply = &store.turns(empty.id).unwrap()[1];
    assert_eq!(
        (reply.text.as_str(), reply.behavior),
        ("", Some(Behavior::Rescored))
    );
    let lp = store.token_logprobs(reply.id).unwrap().unwrap();
    assert!(!lp.logp_full.is_empty() && lp.logp_full.iter().all(|x| x.is_finite()));
    drop(store);

    // importing the same file again adds nothing
    let again = turnwise(&db).arg("import").arg(&file).output().unwrap();
    assert!(
        String::from_utf8_lossy(&again.stdout).contains("imported 0 sessions, 3 already present"),
        "{}",
        show(&again)
    );
    assert_eq!(
        Store::open(&db).unwrap().sessions(None, 10).unwrap().len(),
        3
    );

    // export writes the import format back; re-importing the export finds duplicates only
    let exported = dir.path().join("out.jsonl");
    let ex = turnwise(&db)
        .args(["export", "--out"])
        .arg(&exported)
        .output()
        .unwrap();
    assert!(ex.status.success(), "{}", show(&ex));
    let text = std::fs::read_to_string(&exported).unwrap();
    assert_eq!(text.lines().count(), 3);
    let back = turnwise(&db).arg("import").arg(&exported).output().unwrap();
    assert!(back.status.success(), "{}", show(&back));
    assert!(
        String::from_utf8_lossy(&back.stdout).contains("imported 0 sessions, 3 already present"),
        "{}",
        show(&back)
    );
}

#[test]
fn a_file_that_is_not_a_gguf_model_is_a_clear_error() {
    let dir = tempdir();
    let bad = dir.path().join("model.gguf");
    std::fs::write(&bad, b"this is not a model").unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .env("TURNWISE_DB", dir.path().join("x.db"))
        .args(["chat", "--model"])
        .arg(&bad)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("not a GGUF model"), "{}", show(&out));
    let missing = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(["chat", "--model", "/nonexistent.gguf"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        String::from_utf8_lossy(&missing.stderr).contains("no such file"),
        "{}",
        show(&missing)
    );
    // a truncated copy of the real model: GGUF magic, but not loadable
    let real = std::fs::read(model_path()).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &real[..4096]).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .env("TURNWISE_DB", dir.path().join("x.db"))
        .args(["chat", "--model"])
        .arg(&cut)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("bad model file"),
        "{}",
        show(&out)
    );
}

/// The offline-replay workflow through the binary: import → train (SFT) → activate → chat with
/// the adapter → annotate → train (RL) → rollback.
#[test]
fn import_train_activate_chat_and_roll_back_through_the_cli() {
    let dir = tempdir();
    let db = dir.path().join("flow.db");
    let file = dir.path().join("demos.jsonl");
    let mut lines = String::new();
    for i in 0..12 {
        let id = 20000 + i * 7;
        lines.push_str(&format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"Refund order {id} please.\"}},{{\"role\":\"assistant\",\"content\":\"ACTION refund {id}\"}}],\"outcome\":{},\"reference\":\"ACTION refund {id}\"}}\n",
            i % 2
        ));
    }
    std::fs::write(&file, lines).unwrap();
    let run = |args: &[&str]| {
        let out = turnwise(&db)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(out.status.success(), "turnwise {args:?}\n{}", show(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    run(&["import", file.to_str().unwrap()]);
    // `--activate` runs the gate: a refused update stays inactive, is recorded rejected, and
    // cannot be activated by hand either. A supervised update has no KL bound unless one is
    // given: a negative bound refuses any candidate
    let sft = [
        "train",
        "--algo",
        "sft",
        "--epochs",
        "3",
        "--activate",
        "--gate-kl=-1",
    ];
    let refused = turnwise(&db)
        .args(sft)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(3), "{}", show(&refused));
    assert!(show(&refused).contains("--force"), "{}", show(&refused));
    assert!(Store::open(&db)
        .unwrap()
        .active_adapter()
        .unwrap()
        .is_none());
    let again = turnwise(&db)
        .args(["adapters", "activate", "1"])
        .output()
        .unwrap();
    assert!(
        !again.status.success() && show(&again).contains("rejected"),
        "{}",
        show(&again)
    );
    let out = run(&[&sft[..], &["--force"]].concat());
    assert!(
        out.contains("adapter 2 is active (forced past the gate)"),
        "{out}"
    );
    assert!(run(&["adapters", "list"]).contains("active"));
    // chat samples with the active adapter and stamps it on the turn
    let mut child = turnwise(&db)
        .args(["chat", "--max-tokens", "8", "--seed", "2"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"Refund order 31337 please.\n/resolved\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let store = Store::open(&db).unwrap();
    let chat = store
        .sessions(Some(turnwise::store::Source::Chat), 1)
        .unwrap()[0]
        .id;
    let reply = store
        .turns(chat)
        .unwrap()
        .into_iter()
        .find(|t| t.role == turnwise::Role::Assistant)
        .unwrap();
    assert_eq!(reply.adapter_id, Some(2), "{}", show(&out));
    drop(store);
    let out = run(&["annotate", "--fit-value", "--value-steps", "50"]);
    assert!(
        out.contains("with information gain") && out.contains("value head fitted"),
        "{out}"
    );
    let out = run(&[
        "train", "--algo", "grpo", "--epochs", "1", "--source", "import",
    ]);
    assert!(out.contains("\"process_signal\""), "{out}");
    assert!(run(&["adapters", "rollback"]).contains("no adapter is active"));
    // without a bound given, a supervised fit's gate is the value check alone: a warm start
    // from the base model moves far by design (|approx KL| 0.64 here), and the KL is not what
    // judges it (here the fresh value head's estimate refuses it)
    let out = turnwise(&db)
        .args(["train", "--algo", "sft", "--epochs", "3", "--activate"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let text = show(&out);
    assert!(
        text.contains("\"kl_bound\":null") && !text.contains("|approx KL|"),
        "{text}"
    );
    // nothing was lost on the way
    let store = Store::open(&db).unwrap();
    assert_eq!(store.sessions(None, 100).unwrap().len(), 13);
    assert_eq!(
        store.adapters().unwrap().len(),
        5,
        "sft refused, sft forced, value fit, grpo, sft"
    );
}

/// `turnwise compare` on hand-made results: per-run gains, per-seed and pooled gains (seeds and
/// scenarios resampled) and the pooled difference between presets, checked by hand; a
/// directory without a result is an error.
#[test]
fn compare_pools_seeds_and_pairs_presets() {
    let dir = tempdir();
    let write = |name: &str, algo: &str, seed: u64, warm: &[bool], fin: &[bool]| {
        let d = dir.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        let r = serde_json::json!({
            "config": {"seed": seed, "rl": {"algo": algo}},
            "evals": [{"label": "warm start", "success": warm}, {"label": "final", "success": fin}],
            "rl_gain": [0.25, 0.0, 0.5],
            "iterations": [{"activated": true}, {"activated": false}],
            "wall_s": 600.0
        });
        std::fs::write(d.join("result.json"), r.to_string()).unwrap();
        d
    };
    let (t, f) = (true, false);
    let runs = [
        write("a1", "a2tgpo", 1, &[t, f, f, f], &[t, t, f, f]),
        write("g1", "grpo", 1, &[t, f, f, f], &[t, t, t, f]),
        write("a2", "a2tgpo", 2, &[f, f, f, f], &[f, f, f, f]),
        write("g2", "grpo", 2, &[f, f, f, f], &[t, f, f, f]),
    ];
    let out = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .arg("compare")
        .args(&runs)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    // a2tgpo: (+1 on seed 1, 0 on seed 2) over 8 scenarios = +12.5; grpo: (2 + 1) / 8 = +37.5
    // with the gain of each seed listed: a2tgpo +25 and 0, grpo +50 and +25
    assert!(
        text.contains("| a2tgpo | 1, 2 | +25, +0 | +12.5 ["),
        "{text}"
    );
    assert!(
        text.contains("| grpo | 1, 2 | +50, +25 | +37.5 ["),
        "{text}"
    );
    // final grpo − a2tgpo scenario by scenario: seed 1 (0, 0, +1, 0), seed 2 (+1, 0, 0, 0)
    assert!(
        text.contains("| grpo − a2tgpo | 1, 2 | +25, +25 | +25.0 ["),
        "{text}"
    );
    assert!(text.contains("hierarchical bootstrap"), "{text}");
    assert!(
        text.contains("| a2tgpo | 1 | 1/4 (25 %) → 2/4 (50 %) |"),
        "{text}"
    );
    // a directory without result.json
    let empty = dir.path().join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    let bad = Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .args(["compare", empty.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(bad.status.code(), Some(1), "{}", show(&bad));
    assert!(show(&bad).contains("result.json"), "{}", show(&bad));
}

/// One client (or an old database) cannot stop learning for good: sessions whose outcome is
/// beyond any real reward (±1.7e308, as a hostile client once sent) are left out of the update
/// and named in its diagnostics, and the update over the others succeeds.
#[test]
fn sessions_with_unusable_rewards_are_left_out_and_the_update_succeeds() {
    let dir = tempdir();
    let db = dir.path().join("poison.db");
    let file = dir.path().join("chats.jsonl");
    let mut lines = String::new();
    for i in 0..8 {
        let id = 30000 + i * 11;
        lines.push_str(&format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"Where is order {id}?\"}},{{\"role\":\"assistant\",\"content\":\"ACTION status {id}\"}}],\"outcome\":{}}}\n",
            i % 2
        ));
    }
    std::fs::write(&file, lines).unwrap();
    let out = turnwise(&db)
        .args(["import", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    // three sessions poisoned the way the server once let a client do it
    let store = Store::open(&db).unwrap();
    let poisoned = store
        .connection()
        .execute(
            "UPDATE sessions SET outcome_reward = CASE id % 2 WHEN 0 THEN 1.7e308 ELSE -1.7e308 END
             WHERE id IN (SELECT id FROM sessions ORDER BY id LIMIT 3)",
            [],
        )
        .unwrap();
    assert_eq!(poisoned, 3);
    drop(store);
    let out = turnwise(&db)
        .args([
            "train",
            "--algo",
            "grpo",
            "--epochs",
            "1",
            "--min-group-size",
            "1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let store = Store::open(&db).unwrap();
    let diag: String = store
        .connection()
        .query_row(
            "SELECT diagnostics FROM updates ORDER BY id DESC LIMIT 1",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let diag: serde_json::Value = serde_json::from_str(&diag).unwrap();
    let left_out = diag["unusable_sessions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(left_out.len(), 3, "{diag}");
    assert!(diag["loss"].as_f64().is_some_and(f64::is_finite), "{diag}");
    let rec = store.adapters().unwrap();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].status, turnwise::AdapterStatus::Candidate);
}

/// `train --replay N` runs update N again on the sessions it saw, with its recorded settings
/// except those given, and writes nothing: no update row, no adapter, no annotation. Its
/// numbers are the update's own when nothing is changed (the same batch, the same parent, the
/// same steps), and it prints the advantage balance and the trust region of every step.
#[test]
fn a_replayed_update_measures_again_and_writes_nothing() {
    let dir = tempdir();
    let db = dir.path().join("replay.db");
    let file = dir.path().join("chats.jsonl");
    let mut lines = String::new();
    for i in 0..8 {
        let id = 30000 + i * 11;
        lines.push_str(&format!(
            "{{\"messages\":[{{\"role\":\"user\",\"content\":\"Where is order {id}?\"}},{{\"role\":\"assistant\",\"content\":\"Let me check.\"}},{{\"role\":\"user\",\"content\":\"Thanks.\"}},{{\"role\":\"assistant\",\"content\":\"ACTION status {id}\"}}],\"outcome\":{},\"group\":\"status\"}}\n",
            i % 2
        ));
    }
    std::fs::write(&file, lines).unwrap();
    let out = turnwise(&db)
        .args(["import", file.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let out = turnwise(&db)
        .args(["train", "--algo", "a2tgpo", "--epochs", "1"])
        .args(["--min-group-size", "1"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let counts = || -> (i64, i64, i64) {
        let store = Store::open(&db).unwrap();
        let c = store.connection();
        let n = |t: &str| -> i64 {
            c.query_row(&format!("SELECT count(*) FROM {t}"), [], |r| r.get(0))
                .unwrap()
        };
        (n("updates"), n("adapters"), n("annotations"))
    };
    let before = counts();
    assert_eq!((before.0, before.1), (1, 1));
    let recorded: serde_json::Value = {
        let store = Store::open(&db).unwrap();
        serde_json::from_str(
            &store
                .connection()
                .query_row("SELECT diagnostics FROM updates", [], |r| {
                    r.get::<_, String>(0)
                })
                .unwrap(),
        )
        .unwrap()
    };
    let json = dir.path().join("replay.json");
    let out = turnwise(&db)
        .args(["train", "--replay", "1", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("advantages: outcome share"), "{text}");
    assert!(text.contains("final"), "{text}");
    assert_eq!(counts(), before, "a replay writes nothing");
    let replayed: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    for k in ["sessions", "tokens", "steps"] {
        assert_eq!(replayed[k], recorded[k], "{k}");
    }
    let (a, b) = (
        replayed["approx_kl"].as_f64().unwrap(),
        recorded["approx_kl"].as_f64().unwrap(),
    );
    assert!(
        (a - b).abs() < 1e-6,
        "the same update measures the same: {a} vs {b}"
    );
    assert_eq!(
        replayed["trust_region_steps"].as_array().unwrap().len(),
        replayed["steps"].as_u64().unwrap() as usize + 1
    );
    // a changed setting changes what is measured, and is said
    let out = turnwise(&db)
        .args(["train", "--replay", "1", "--alpha", "0", "--json"])
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", show(&out));
    assert!(String::from_utf8_lossy(&out.stdout).contains("alpha 0,"));
    let zero: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(
        zero["advantage_balance"]["outcome_share"].as_f64(),
        Some(1.0),
        "alpha 0: the outcome is the whole advantage"
    );
    assert_eq!(counts(), before);
    // another preset on the same batch: its own ratio, clip and aggregation, the rest as
    // recorded. Three epochs each: AdamW's first step is sign(g)·lr whatever the weighting, so
    // the presets part from the second step on
    let replay = |extra: &[&str]| -> (String, serde_json::Value) {
        let out = turnwise(&db)
            .args(["train", "--replay", "1", "--epochs", "3", "--json"])
            .arg(&json)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", show(&out));
        let v = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
        (String::from_utf8_lossy(&out.stdout).into_owned(), v)
    };
    let (said, a2) = replay(&[]);
    assert!(said.contains("(a2tgpo, alpha 0.3,"), "{said}");
    let (said, grpo) = replay(&["--algo", "grpo"]);
    assert!(
        said.contains("(grpo instead of the recorded a2tgpo, alpha 0.3,"),
        "{said}"
    );
    assert!(said.contains("epochs 3)"), "{said}");
    assert_eq!(grpo["sessions"], recorded["sessions"]);
    assert_eq!(
        grpo["advantage_balance"]["outcome_share"].as_f64(),
        Some(1.0),
        "grpo's advantage is the outcome alone"
    );
    let (ka, kg) = (
        a2["approx_kl"].as_f64().unwrap(),
        grpo["approx_kl"].as_f64().unwrap(),
    );
    assert!(
        (ka - kg).abs() > 1e-6,
        "a token ratio moves the adapter elsewhere than a turn ratio: {ka} vs {kg}"
    );
    // a tight token guard inside the turn ratio stops tokens that the turn clip lets through
    let (said, guarded) = replay(&["--token-guard", "0.01,0.01"]);
    assert!(
        said.contains("Turn ratios") && said.contains("token guard 0.01/0.01"),
        "{said}"
    );
    let clipped = |v: &serde_json::Value| {
        v["candidate"]["clip_frac_low"].as_f64().unwrap()
            + v["candidate"]["clip_frac_high"].as_f64().unwrap()
    };
    assert!(
        clipped(&guarded) > clipped(&a2),
        "{} vs {}",
        clipped(&guarded),
        clipped(&a2)
    );
    for (bad, says) in [("0.2", "LOW,HIGH"), ("1.5,0.2", "token guard")] {
        let out = turnwise(&db)
            .args(["train", "--replay", "1", "--token-guard", bad])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad}");
        assert!(show(&out).contains(says), "{bad}: {}", show(&out));
    }
    assert_eq!(counts(), before);
    // an update that does not exist
    let out = turnwise(&db)
        .args(["train", "--replay", "99"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(show(&out).contains("update 99"), "{}", show(&out));
}
