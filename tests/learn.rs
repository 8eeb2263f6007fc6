//! The learner on the real model: on-policy consistency with a non-zero adapter, the supervised
//! warm start, and an RL update that moves probability towards rewarded behaviour.

use std::sync::Arc;
use turnwise::AdapterStatus;

use ndarray::Array2;
use turnwise::adapter::{adapter_dir, Adapter};
use turnwise::learn::{run_update, Algo, Selection, TrainConfig};
use turnwise::policy::sampler::{self, Rng};
use turnwise::session::turns_from_generation;
use turnwise::store::{NewSession, Source, Store};
use turnwise::{Engine, Message, Role, SamplerParams};

use crate::common::{fresh_engine, head, tempdir};

/// One update over every finished session of the store.
fn train(
    store: &mut Store,
    db: &std::path::Path,
    parent: Option<(i64, Arc<Adapter>)>,
    cfg: &TrainConfig,
) -> turnwise::Result<turnwise::learn::UpdateReport> {
    let sel = Selection {
        limit: 100,
        ..Default::default()
    };
    run_update(store, db, head(), parent, cfg, &sel, |_, _, _| {})
}

/// Rolls out `n` replies to `prompt` and logs each as a finished session with `reward(text)`.
fn rollouts(
    engine: &Engine,
    store: &mut Store,
    group: &str,
    prompt: &str,
    n: usize,
    seed0: u64,
    reward: impl Fn(&str) -> f64,
) -> Vec<(i64, f64)> {
    let mut out = Vec::new();
    for i in 0..n {
        let mut s = NewSession::new(Source::Demo);
        s.group_key = Some(group.into());
        let sid = store.create_session(&s).unwrap();
        let p = SamplerParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 12,
            seed: seed0 + i as u64,
            ..Default::default()
        };
        let g = engine
            .generate(
                sid as u64,
                vec![Message::new(Role::User, prompt)],
                p.clone(),
                None,
            )
            .unwrap();
        engine.close(sid as u64);
        store
            .append_turns(sid, &turns_from_generation(&g, &p, engine.info()))
            .unwrap();
        let r = reward(&g.reply.text);
        store
            .add_feedback(sid, None, turnwise::FeedbackKind::Outcome, Some(r), None)
            .unwrap();
        store.end_session(sid).unwrap();
        out.push((sid, r));
    }
    out
}

/// A fresh store `name` in a temporary directory with four rollouts of each prompt, one group per
/// prompt (`p0`, `p1`, …), the first seed of group `g` being `seed(g)`.
fn groups_of_four(
    name: &str,
    prompts: &[&str],
    seed: impl Fn(u64) -> u64,
    reward: impl Fn(&str) -> f64 + Copy,
) -> (tempfile::TempDir, std::path::PathBuf, Store) {
    let dir = tempdir();
    let engine = fresh_engine();
    let db = dir.path().join(name);
    let mut store = Store::open(&db).unwrap();
    for (g, p) in prompts.iter().enumerate() {
        rollouts(
            &engine,
            &mut store,
            &format!("p{g}"),
            p,
            4,
            seed(g as u64),
            reward,
        );
    }
    (dir, db, store)
}

#[test]
fn a_trained_adapter_is_reproduced_from_stored_features() {
    let dir = tempdir();
    let db = dir.path().join("l.db");
    let mut store = Store::open(&db).unwrap();
    let h = head();
    // a non-zero adapter: random B
    let mut ad = Adapter::fresh(h.n_embd(), h.n_vocab(), 8, 16.0, 5, "test");
    let mut rng = Rng::new(9);
    ad.b.mapv_inplace(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.05) as f32);
    let id = store
        .register_adapter(None, |id| {
            adapter_dir(&db, id).to_string_lossy().into_owned()
        })
        .unwrap();
    ad.save(&adapter_dir(&db, id)).unwrap();
    store
        .set_adapter_status(id, AdapterStatus::Candidate, None)
        .unwrap();
    store.activate_adapter(id).unwrap();
    let engine = fresh_engine();
    engine
        .set_adapter(Some((id, Arc::new(ad.clone()))))
        .unwrap();

    let p = SamplerParams {
        seed: 3,
        max_tokens: 24,
        ..Default::default()
    };
    let mut gaps = Vec::new();
    for seed in 0..3 {
        let sid = store
            .create_session(&NewSession::new(Source::Chat))
            .unwrap();
        let p = SamplerParams { seed, ..p.clone() };
        let g = engine
            .generate(
                sid as u64,
                vec![Message::new(Role::User, "Where is my order 77120?")],
                p.clone(),
                None,
            )
            .unwrap();
        assert_eq!(g.reply.adapter_id, Some(id));
        let ids = store
            .append_turns(sid, &turns_from_generation(&g, &p, engine.info()))
            .unwrap();
        store
            .add_feedback(
                sid,
                None,
                turnwise::FeedbackKind::Outcome,
                Some(seed as f64 / 2.0),
                None,
            )
            .unwrap();
        store.end_session(sid).unwrap();
        // recompute the sampler's own distribution from the stored features
        let t = *ids.last().unwrap();
        let f = store.features(t).unwrap().unwrap();
        let lp = store.token_logprobs(t).unwrap().unwrap();
        let hs = Array2::from_shape_vec((f.values.len() / f.n_embd, f.n_embd), f.values).unwrap();
        let base = h.base_logits(hs.view()).unwrap();
        for (i, tok) in g.reply.tokens.iter().enumerate() {
            let mut row = base.row(i).to_vec();
            ad.apply(hs.row(i).as_slice().unwrap(), &mut row);
            let b = sampler::behavior_logprob(&row, &p, *tok).unwrap();
            gaps.push((b - lp.logp_behavior[i] as f64).abs());
        }
    }
    let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
    let max = gaps.iter().cloned().fold(0.0, f64::max);
    eprintln!(
        "on-policy gap with a non-zero adapter over {} tokens: mean {mean:.2e} max {max:.2e}",
        gaps.len()
    );
    assert!(mean < 1e-3 && max < 1e-2, "mean {mean} max {max}");

    // the learner sees the same numbers: logp_old (recomputed with the generating adapter) vs the
    // sampler's full-softmax log-probs, and the first ratio of the update is exactly 1
    let parent = Some((id, Arc::new(ad)));
    let mut cfg = TrainConfig::preset(Algo::A2tgpo);
    cfg.epochs = 1;
    let r = run_update(
        &mut store,
        &db,
        h,
        parent,
        &cfg,
        &Selection {
            limit: 100,
            ..Default::default()
        },
        |_, _, _| {},
    )
    .unwrap();
    let d = &r.diagnostics;
    eprintln!("update diagnostics: {d}");
    // top-k 40 / top-p 0.95 at temperature 0.8: the learner renormalises over the kept set
    assert!(d.logp_old_vs_behavior_mean < 1e-3, "{d}");
    assert_eq!(d.first_ratio_max_dev, Some(0.0), "{d}");
    assert_eq!(
        d.grouping, "opening_clusters",
        "chat sessions have no group key: {d}"
    );
    let keys: Vec<Option<String>> = store
        .sessions(None, 10)
        .unwrap()
        .into_iter()
        .map(|s| s.group_key)
        .collect();
    assert!(
        keys.iter()
            .all(|k| k.as_deref().is_some_and(|k| k.starts_with("cluster:"))),
        "{keys:?}"
    );
    assert_eq!(
        store.adapter(r.adapter_id.unwrap()).unwrap().status,
        AdapterStatus::Candidate
    );
}

#[test]
fn supervised_warm_start_teaches_a_reply_format() {
    let dir = tempdir();
    let db = dir.path().join("sft.db");
    let mut store = Store::open(&db).unwrap();
    let engine = fresh_engine();
    let phrasings = [
        "Please refund order {}.",
        "I want my money back for order {}.",
        "Refund {} please, it arrived broken.",
        "Can you refund my order number {}?",
        "Order {} was wrong. Refund it.",
        "Hi, I'd like a refund for {}.",
    ];
    let held_out = [
        "Could I get a refund on order {}?",
        "My order {} is damaged, refund please.",
    ];
    let mut rng = Rng::new(1);
    let mut id = || 10000 + (rng.next_u64() % 90000);
    let mut lines = String::new();
    for i in 0..48 {
        let oid = id();
        let msg = phrasings[i % phrasings.len()].replace("{}", &oid.to_string());
        lines.push_str(
            &serde_json::json!({"messages": [
            {"role": "system", "content": "Reply with one action line."},
            {"role": "user", "content": msg},
            {"role": "assistant", "content": format!("ACTION refund {oid}")}], "outcome": 1})
            .to_string(),
        );
        lines.push('\n');
    }
    let sum =
        turnwise::replay::import_jsonl(&engine, &mut store, lines.as_bytes(), |_, _| {}).unwrap();
    assert_eq!(sum.imported, 48, "{:?}", sum.skipped);

    // greedy replies to the held-out phrasings: (order id, reply)
    let play = |slot: &dyn Fn(u64) -> Option<Vec<String>>| {
        let mut rng = Rng::new(77);
        (0..20)
            .map(|i| {
                let oid = 10000 + (rng.next_u64() % 90000);
                let msg = held_out[i % 2].replace("{}", &oid.to_string());
                let k = 5_000_000 + i as u64;
                let g = engine
                    .generate(
                        k,
                        vec![
                            Message::new(Role::System, "Reply with one action line."),
                            Message::new(Role::User, msg),
                        ],
                        SamplerParams {
                            temperature: 0.0,
                            max_tokens: 12,
                            id_slot: slot(oid),
                            ..Default::default()
                        },
                        None,
                    )
                    .unwrap();
                engine.close(k);
                (oid, g.reply)
            })
            .collect::<Vec<_>>()
    };
    let hits = |replies: &[(u64, turnwise::policy::Reply)]| {
        replies
            .iter()
            .filter(|(oid, r)| r.text.trim() == format!("ACTION refund {oid}"))
            .count()
    };
    engine.set_adapter(None::<(i64, Arc<Adapter>)>).unwrap();
    let before = hits(&play(&|_| None));
    let mut cfg = TrainConfig::preset(Algo::Sft);
    cfg.epochs = 40;
    let r = train(&mut store, &db, None, &cfg).unwrap();
    let id = r.adapter_id.unwrap();
    let ad = Arc::new(Adapter::load(&adapter_dir(&db, id)).unwrap());
    // imitation trains the policy, not the value head: the demonstrations all succeed, and a
    // head fitted on them would call every state a success (a fresh head: 0.5 everywhere)
    assert!(ad.value_w.iter().all(|&w| w == 0.0) && ad.value_b == 0.0);
    engine.set_adapter(Some((id, ad.clone()))).unwrap();
    let after = hits(&play(&|_| None));
    eprintln!(
        "held-out greedy exact match: base {before}/20, after SFT {after}/20; diagnostics {}",
        r.diagnostics
    );
    assert_eq!(before, 0);
    assert!(after >= 18, "after SFT {after}/20");

    // The id slot with the trained adapter: with the shown id as the only candidate every
    // reply is still the exact action line; with a wrong candidate the model cannot write the
    // id it was shown — the slot holds a prefix of the candidate or no digit at all.
    assert!(hits(&play(&|oid| Some(vec![oid.to_string()]))) >= after);
    let wrong = vec!["99999".to_string()];
    let replies = play(&|_| Some(wrong.clone()));
    let n_embd = engine.info().n_embd;
    let reached = replies
        .iter()
        .filter(|(_, r)| r.text.starts_with("ACTION refund"))
        .count();
    assert!(
        reached >= 18,
        "only {reached}/20 replies reached the id slot"
    );
    for (oid, r) in &replies {
        assert!(!r.text.contains(&oid.to_string()), "{:?}", r.text);
        assert!(sampler::id_slot_allows(&r.text, &wrong), "{:?}", r.text);
        // the full log-prob is the unconstrained softmax of base + adapter, recomputed from
        // the stored hidden states; the behaviour log-prob (greedy: 0) is the constrained one
        let base = head()
            .base_logits(
                Array2::from_shape_vec((r.tokens.len(), n_embd), r.hidden.clone())
                    .unwrap()
                    .view(),
            )
            .unwrap();
        for (i, &tok) in r.tokens.iter().enumerate() {
            let mut row: Vec<f32> = base.row(i).to_vec();
            ad.apply(&r.hidden[i * n_embd..(i + 1) * n_embd], &mut row);
            let full = row[tok as usize] as f64 - sampler::logsumexp(&row);
            assert!(
                (full - r.logp_full[i] as f64).abs() < 2e-3,
                "{full} {}",
                r.logp_full[i]
            );
            assert_eq!(r.logp_behavior[i], 0.0);
        }
    }
}

/// Mean change of the log-prob of logged replies (teacher-forced from features) under the new
/// adapter, for rewarded and unrewarded replies.
fn shift(store: &Store, adapter: &Adapter, sessions: &[(i64, f64)]) -> (f64, f64) {
    let h = head();
    let (mut good, mut bad) = (Vec::new(), Vec::new());
    for &(sid, r) in sessions {
        let t = store
            .turns(sid)
            .unwrap()
            .into_iter()
            .find(|t| t.role == Role::Assistant)
            .unwrap();
        let f = store.features(t.id).unwrap().unwrap();
        let lp = store.token_logprobs(t.id).unwrap().unwrap();
        let hs = Array2::from_shape_vec((t.token_ids.len(), f.n_embd), f.values).unwrap();
        let base = h.base_logits(hs.view()).unwrap();
        let mut delta = 0.0;
        for (i, &tok) in t.token_ids.iter().enumerate() {
            let mut row = base.row(i).to_vec();
            adapter.apply(hs.row(i).as_slice().unwrap(), &mut row);
            delta += row[tok as usize] as f64 - sampler::logsumexp(&row) - lp.logp_full[i] as f64;
        }
        if r > 0.5 {
            good.push(delta)
        } else {
            bad.push(delta)
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    assert!(
        !good.is_empty() && !bad.is_empty(),
        "both behaviours must occur"
    );
    (mean(&good), mean(&bad))
}

#[test]
fn rl_updates_raise_the_rewarded_behaviour_and_a_flipped_sign_lowers_it() {
    let dir = tempdir();
    let engine = fresh_engine();
    let reward = |t: &str| f64::from(t.to_lowercase().contains("help"));
    let prompts = [
        "Hi there!",
        "Hello, I have a question.",
        "Good morning.",
        "Hey, are you there?",
    ];
    let mut results = Vec::new();
    for flipped in [false, true] {
        let db = dir.path().join(format!("rl{flipped}.db"));
        let mut store = Store::open(&db).unwrap();
        let mut sessions = Vec::new();
        for (g, p) in prompts.iter().enumerate() {
            let rew = |t: &str| if flipped { 1.0 - reward(t) } else { reward(t) };
            sessions.extend(rollouts(
                &engine,
                &mut store,
                &format!("p{g}"),
                p,
                8,
                100 * g as u64,
                rew,
            ));
        }
        let mut cfg = TrainConfig::preset(Algo::Grpo);
        cfg.lr = 3e-3;
        cfg.epochs = 4;
        let r = train(&mut store, &db, None, &cfg).unwrap();
        let ad = Adapter::load(&adapter_dir(&db, r.adapter_id.unwrap())).unwrap();
        // judged by the true reward, whatever the training signal was
        let truth: Vec<(i64, f64)> = sessions
            .iter()
            .map(|&(s, r)| (s, if flipped { 1.0 - r } else { r }))
            .collect();
        let (good, bad) = shift(&store, &ad, &truth);
        eprintln!("flipped={flipped}: mean Δlogp rewarded {good:.3}, unrewarded {bad:.3}");
        results.push(good - bad);
    }
    assert!(
        results[0] > 0.0,
        "the update must favour rewarded replies: {results:?}"
    );
    assert!(
        results[1] < 0.0,
        "with the advantage sign flipped the same measure goes the other way: {results:?}"
    );
}

#[test]
fn every_preset_runs_an_update_on_both_backends() {
    use turnwise::learn::Backend;
    let (_dir, db, mut store) = groups_of_four(
        "presets.db",
        &["Hello!", "Where is my parcel?"],
        |g| 10 * g,
        |t| (t.len() % 3) as f64 / 2.0,
    );
    let algos = [
        Algo::A2tgpo,
        Algo::Atpo,
        Algo::Gspo,
        Algo::Grpo,
        Algo::Gigpo,
        Algo::PpoToken,
        Algo::Sft,
    ];
    // (algo, backend, loss of the last step, the candidate's LoRA B and value weights)
    let mut out: Vec<(Algo, Backend, f64, Vec<f32>)> = Vec::new();
    for algo in algos {
        for backend in [Backend::Ort, Backend::Ndarray] {
            let mut cfg = TrainConfig::preset(algo);
            // two passes: the second sees ratios away from 1, where the granularity, the clip and
            // the aggregation of a preset act
            cfg.epochs = 2;
            cfg.backend = backend;
            let r = train(&mut store, &db, None, &cfg)
                .unwrap_or_else(|e| panic!("{algo:?} {backend:?}: {e}"));
            let d = &r.diagnostics;
            assert!(d.loss.is_finite(), "{algo:?} {backend:?}: {d}");
            if algo != Algo::Sft {
                assert!(
                    d.first_ratio_max_dev.is_some_and(|x| x < 1e-6),
                    "{algo:?} {backend:?}: {d}"
                );
            }
            let id = r.adapter_id.unwrap();
            let ad = Adapter::load(&adapter_dir(&db, id)).unwrap();
            assert!(ad.is_finite());
            let w: Vec<f32> = ad.b.iter().chain(ad.value_w.iter()).copied().collect();
            out.push((algo, backend, d.loss, w));
        }
    }
    // the presets' switches act: on this batch every preset's candidate differs from every
    // other's — except ATPO from A2TGPO, which differ only in the clip of non-final turns
    // (these sessions have one turn each; the adaptive clip is unit-tested in learn::objective)
    let distance = |a: &(Algo, Backend, f64, Vec<f32>), b: &(Algo, Backend, f64, Vec<f32>)| {
        let dw =
            a.3.iter()
                .zip(&b.3)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
        ((a.2 - b.2).abs(), f64::from(dw))
    };
    for a in &out {
        for b in &out {
            if a.1 != b.1 || a.0 == b.0 {
                continue;
            }
            let same_clip_here = [a.0, b.0] == [Algo::A2tgpo, Algo::Atpo]
                || [a.0, b.0] == [Algo::Atpo, Algo::A2tgpo];
            let (dl, dw) = distance(a, b);
            eprintln!(
                "{:?} vs {:?} ({:?}): loss {dl:.2e}, weights {dw:.2e}",
                a.0, b.0, a.1
            );
            if !same_clip_here {
                assert!(
                    dl > 1e-6 || dw > 1e-6,
                    "{:?} and {:?} ({:?}) trained the same candidate",
                    a.0,
                    b.0,
                    a.1
                );
            }
        }
    }
    // and the two backends run the same preset: equal losses up to f32 rounding
    for pair in out.chunks(2) {
        let (dl, _) = distance(&pair[0], &pair[1]);
        assert!(
            dl < 1e-3 * (1.0 + pair[0].2.abs()),
            "{:?}: ort loss {} vs ndarray {}",
            pair[0].0,
            pair[0].2,
            pair[1].2
        );
    }
    // the optional terms together: KL to base, entropy bonus, TIS and MIS
    for backend in [Backend::Ort, Backend::Ndarray] {
        let mut cfg = TrainConfig::preset(Algo::A2tgpo);
        cfg.epochs = 1;
        cfg.backend = backend;
        cfg.objective.kl_coef = 0.05;
        cfg.objective.entropy_coef = 0.01;
        cfg.objective.tis_cap = Some(2.0);
        cfg.objective.mis = true;
        let r = train(&mut store, &db, None, &cfg)
            .unwrap_or_else(|e| panic!("optional terms {backend:?}: {e}"));
        assert!(r.diagnostics.loss.is_finite());
    }
    let n: i64 = store
        .connection()
        .query_row(
            "SELECT COUNT(*) FROM updates WHERE status = 'ok'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(n, 16);
}

#[test]
fn a_non_finite_update_is_rejected_and_nothing_is_activated() {
    let dir = tempdir();
    let engine = fresh_engine();
    let db = dir.path().join("nan.db");
    let mut store = Store::open(&db).unwrap();
    rollouts(&engine, &mut store, "g", "Hello!", 4, 1, |t| {
        (t.len() % 2) as f64
    });
    let mut cfg = TrainConfig::preset(Algo::Grpo);
    // a NaN learning rate is refused before anything runs
    cfg.lr = f64::NAN;
    let e = train(&mut store, &db, None, &cfg).unwrap_err();
    assert!(e.to_string().contains("learning rate"), "{e}");
    // a finite one beyond f32: the parameters (f32) overflow at the first step, the second
    // minibatch pass sees a non-finite loss, and the update is rejected whole
    cfg.lr = f64::MAX;
    cfg.epochs = 2;
    let e = train(&mut store, &db, None, &cfg).unwrap_err();
    assert!(
        e.to_string().contains("rejected") || e.to_string().contains("not finite"),
        "{e}"
    );
    assert!(store.active_adapter().unwrap().is_none());
    assert!(store
        .adapters()
        .unwrap()
        .iter()
        .all(|a| a.status != AdapterStatus::Candidate && a.status != AdapterStatus::Active));
}

#[test]
fn step_level_credit_is_annotated_queryable_and_feeds_a2tgpo() {
    use turnwise::learn::annotate::{annotate_sessions, AnnotateConfig};
    let dir = tempdir();
    let engine = fresh_engine();
    let db = dir.path().join("credit.db");
    let mut store = Store::open(&db).unwrap();
    let mut ids = Vec::new();
    for i in 0..4u64 {
        let mut s = NewSession::new(Source::Demo);
        s.group_key = Some("refund".into());
        s.reference = Some("I have refunded order 48213.".into());
        let sid = store.create_session(&s).unwrap();
        let p = SamplerParams {
            max_tokens: 10,
            seed: i,
            ..Default::default()
        };
        for msg in ["I want a refund.", "The order is 48213."] {
            let g = engine
                .generate(
                    sid as u64,
                    vec![Message::new(Role::User, msg)],
                    p.clone(),
                    None,
                )
                .unwrap();
            store
                .append_turns(sid, &turns_from_generation(&g, &p, engine.info()))
                .unwrap();
        }
        engine.close(sid as u64);
        store
            .add_feedback(
                sid,
                None,
                turnwise::FeedbackKind::Outcome,
                Some((i % 2) as f64),
                None,
            )
            .unwrap();
        store.end_session(sid).unwrap();
        ids.push(sid);
    }
    let h = head();
    let value = Adapter::fresh(h.n_embd(), h.n_vocab(), 8, 16.0, 0, "");
    let sum = annotate_sessions(
        &mut store,
        &ids,
        &value,
        None,
        Some(&engine),
        &AnnotateConfig::default(),
    )
    .unwrap();
    assert_eq!((sum.sessions, sum.turns, sum.info_gain_turns), (4, 8, 8));
    for &sid in &ids {
        let rows = store.turn_credit(sid).unwrap();
        assert_eq!(rows.len(), 2, "one row per assistant turn");
        for r in &rows {
            assert_eq!(r.value_before, Some(0.5), "a fresh value head says 0.5");
            assert!(
                r.contribution.is_some() && r.info_gain.is_some(),
                "contribution and information gain: {r:?}"
            );
        }
        let last = rows.last().unwrap();
        let outcome = store.session(sid).unwrap().outcome_reward.unwrap();
        assert!(
            (last.contribution.unwrap() - (outcome - 0.5)).abs() < 1e-6,
            "last turn: outcome − V"
        );
    }
    let summary: i64 = store
        .connection()
        .query_row(
            "SELECT SUM(assistant_turns) FROM session_summary",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(summary, 8);
    let mut cfg = TrainConfig::preset(Algo::A2tgpo);
    cfg.epochs = 1;
    let r = train(&mut store, &db, None, &cfg).unwrap();
    let ps = &r.diagnostics.process_signal;
    assert!(
        ps.success_contribution_groups == 0 && ps.info_gain_groups >= 1,
        "every group uses the information gain: {}",
        r.diagnostics
    );
    for &sid in &ids {
        assert!(
            store
                .turn_credit(sid)
                .unwrap()
                .iter()
                .all(|r| r.advantage.is_some()),
            "every turn records its advantage"
        );
    }
    // the CLI renders the credit
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_turnwise"))
        .env("TURNWISE_DB", &db)
        .args(["sessions", "show", &ids[1].to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("credit:") && text.contains("advantage"),
        "{text}"
    );
}

/// Two greeting prompts, four rollouts each, rewarded for an even reply length (`seed0 + g` is
/// group `g`'s first seed).
fn greetings(name: &str, seed0: u64) -> (tempfile::TempDir, std::path::PathBuf, Store) {
    groups_of_four(
        name,
        &["Hi there!", "Good morning."],
        |g| seed0 + g,
        |t| f64::from(t.len() % 2 == 0),
    )
}

/// `keep_optimizer`: the AdamW moments travel with the adapter, so the next update continues
/// them (step count included) instead of restarting a fresh optimizer; without the switch no
/// optimizer file is written.
#[test]
fn the_optimizer_state_is_carried_from_update_to_update() {
    use turnwise::learn::OPTIMIZER_FILE;
    let (_dir, db, mut store) = greetings("opt.db", 7);
    let step_of = |id: i64| -> Option<i32> {
        let blob = std::fs::read(adapter_dir(&db, id).join(OPTIMIZER_FILE)).ok()?;
        let (_, meta) = safetensors::SafeTensors::read_metadata(&blob).unwrap();
        meta.metadata().as_ref()?.get("step")?.parse().ok()
    };
    let mut cfg = TrainConfig::preset(Algo::Grpo);
    cfg.keep_optimizer = true;
    let first = train(&mut store, &db, None, &cfg).unwrap();
    let id1 = first.adapter_id.unwrap();
    assert!(!first.diagnostics.optimizer_from_parent);
    let steps = first.diagnostics.steps as i32;
    assert!(steps > 0);
    assert_eq!(step_of(id1), Some(steps));
    let parent = Some((
        id1,
        Arc::new(Adapter::load(&adapter_dir(&db, id1)).unwrap()),
    ));
    let second = train(&mut store, &db, parent.clone(), &cfg).unwrap();
    assert!(second.diagnostics.optimizer_from_parent);
    assert_eq!(step_of(second.adapter_id.unwrap()), Some(2 * steps));
    cfg.keep_optimizer = false;
    let third = train(&mut store, &db, parent, &cfg).unwrap();
    assert!(!third.diagnostics.optimizer_from_parent);
    assert_eq!(step_of(third.adapter_id.unwrap()), None);
}

/// The KL term's reference can be a stored adapter (the demo's warm start): an update that
/// starts from that adapter and does not move (lr 0) is at KL 0 from it, and at a positive KL
/// from the base policy it would otherwise be compared with.
#[test]
fn the_kl_reference_can_be_a_stored_adapter() {
    let (_dir, db, mut store) = greetings("klref.db", 11);
    let first = train(&mut store, &db, None, &TrainConfig::preset(Algo::Grpo)).unwrap();
    let id1 = first.adapter_id.unwrap();
    let parent = Some((
        id1,
        Arc::new(Adapter::load(&adapter_dir(&db, id1)).unwrap()),
    ));
    let mut cfg = TrainConfig::preset(Algo::Grpo);
    cfg.lr = 0.0;
    cfg.objective.kl_coef = 0.1;
    let to_base = train(&mut store, &db, parent.clone(), &cfg).unwrap();
    assert_eq!(to_base.diagnostics.kl_reference, None);
    let kl_base = to_base.diagnostics.kl_ref_k3;
    assert!(kl_base > 1e-6, "{kl_base}");
    cfg.kl_ref_adapter = Some(id1);
    let to_warm = train(&mut store, &db, parent, &cfg).unwrap();
    assert_eq!(to_warm.diagnostics.kl_reference, Some(id1));
    let kl_warm = to_warm.diagnostics.kl_ref_k3;
    assert!(kl_warm.abs() < 1e-9, "{kl_warm}");
    // an unknown reference is an error before anything is written
    let adapters = store.adapters().unwrap().len();
    cfg.kl_ref_adapter = Some(999);
    assert!(train(&mut store, &db, None, &cfg).is_err());
    assert_eq!(store.adapters().unwrap().len(), adapters);
}

/// The shadow check of the validation gate, on the real model: with a shadow adapter set, a
/// greedy reply says whether the shadow's own arg-max was the token taken at every position.
/// Checked against the shadow playing the same prompt itself: where it agreed it writes the
/// very same tokens; a shadow that prefers other tokens disagrees and writes another reply.
/// Sampled replies and engines without a shadow report nothing.
#[test]
fn a_shadow_adapter_knows_whether_it_would_have_written_the_same_reply() {
    let engine = fresh_engine();
    let h = head();
    let fresh = |seed| Adapter::fresh(h.n_embd(), h.n_vocab(), 8, 16.0, seed, "test");
    let base = fresh(0); // B = 0: the base model's logits
    let mut rng = Rng::new(4);
    let mut tiny = fresh(1);
    tiny.b
        .mapv_inplace(|_| ((rng.next_f64() * 2.0 - 1.0) * 1e-6) as f32);
    let mut large = fresh(2);
    large
        .b
        .mapv_inplace(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.5) as f32);
    let greedy = SamplerParams {
        temperature: 0.0,
        max_tokens: 24,
        ..Default::default()
    };
    let reply = |primary: &Adapter, shadow: Option<&Adapter>, p: &SamplerParams| {
        engine
            .set_adapter(Some((1, Arc::new(primary.clone()))))
            .unwrap();
        engine
            .set_shadow(shadow.map(|s| Arc::new(s.clone())))
            .unwrap();
        let msgs = vec![
            Message::new(Role::System, "You are a support agent."),
            Message::new(Role::User, "Where is my order 48213? It was due last week."),
        ];
        let g = engine.generate(7, msgs, p.clone(), None).unwrap();
        engine.close(7);
        g.reply
    };
    let own = reply(&base, None, &greedy);
    assert_eq!(own.shadow_agrees, None);
    assert!(own.tokens.len() > 3, "{:?}", own.text);
    assert_eq!(reply(&base, Some(&base), &greedy).shadow_agrees, Some(true));
    // a change far below every margin of this reply: it agrees, and plays the same reply
    let r = reply(&base, Some(&tiny), &greedy);
    assert_eq!(r.tokens, own.tokens);
    assert_eq!(r.shadow_agrees, Some(true));
    assert_eq!(reply(&tiny, None, &greedy).tokens, own.tokens);
    // a change that moves the arg-max: it disagrees, and its own reply is another one
    assert_eq!(
        reply(&base, Some(&large), &greedy).shadow_agrees,
        Some(false)
    );
    assert_ne!(reply(&large, None, &greedy).tokens, own.tokens);
    // the other way round: the large adapter writes, the base shadows
    assert_eq!(
        reply(&large, Some(&base), &greedy).shadow_agrees,
        Some(false)
    );
    // sampled replies are not checked
    let sampled = SamplerParams {
        temperature: 0.7,
        seed: 3,
        ..greedy.clone()
    };
    assert_eq!(reply(&base, Some(&base), &sampled).shadow_agrees, None);
    // an adapter of another model's shapes is refused as a shadow
    let wrong = Adapter::fresh(h.n_embd() + 1, h.n_vocab(), 8, 16.0, 0, "other");
    assert!(engine.set_shadow(Some(Arc::new(wrong.clone()))).is_err());
    // one reply on another adapter than the engine's (`generate_with`): the reply that adapter
    // writes when it is the engine's, and the next reply is on the engine's own again
    let large_own = reply(&large, None, &greedy);
    engine
        .set_adapter(Some((1, Arc::new(base.clone()))))
        .unwrap();
    engine.set_shadow::<Adapter>(None).unwrap();
    let msgs = vec![
        Message::new(Role::System, "You are a support agent."),
        Message::new(Role::User, "Where is my order 48213? It was due last week."),
    ];
    let g = engine
        .generate_with(
            8,
            msgs.clone(),
            greedy.clone(),
            (2, Arc::new(large.clone())),
        )
        .unwrap();
    engine.close(8);
    assert_eq!(g.reply.tokens, large_own.tokens);
    let g = engine
        .generate(9, msgs.clone(), greedy.clone(), None)
        .unwrap();
    engine.close(9);
    assert_eq!(g.reply.tokens, own.tokens);
    assert!(engine
        .generate_with(10, msgs, greedy, (3, Arc::new(wrong)))
        .is_err());
}

/// Information gain scored by the policy that samples (`IgPolicy::Sampling`): the engine adds
/// its adapter's low-rank term to every scored row, exactly as a hand computation from the
/// rescored hidden states does (base logits from the dequantised head, the adapter, a
/// log-softmax, the mean over the reference's tokens); the frozen score is the base model's.
#[test]
fn a_reference_is_scored_by_the_frozen_policy_or_with_the_adapter() {
    let engine = fresh_engine();
    let h = head();
    let mut ad = Adapter::fresh(h.n_embd(), h.n_vocab(), 8, 16.0, 3, "test");
    let mut rng = Rng::new(8);
    ad.b.mapv_inplace(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.05) as f32);
    engine.set_adapter(Some((1, Arc::new(ad.clone())))).unwrap();
    let msgs = vec![
        Message::new(Role::System, "You are a support agent."),
        Message::new(Role::User, "Please refund order 48213."),
    ];
    engine.append(5, msgs).unwrap();
    let prefix = engine.session_tokens(5).unwrap();
    engine.close(5);
    let reference = "ACTION refund 48213";
    let frozen = engine
        .score_reference_by(prefix.clone(), false, reference, false)
        .unwrap();
    let adapted = engine
        .score_reference_by(prefix.clone(), false, reference, true)
        .unwrap();
    // the same scoring through the older call; the second one finds the prefix cached and
    // decodes only the reference, which the batched kernels group differently (last bits)
    let again = engine
        .score_reference(prefix.clone(), false, reference)
        .unwrap();
    assert!((frozen - again).abs() < 1e-3, "{frozen} {again}");
    // by hand from one prefill of the same tokens
    let ref_tokens = engine.tokenize(reference).unwrap();
    let mut tokens = prefix.clone();
    tokens.extend(&ref_tokens);
    let positions: Vec<usize> = (prefix.len()..tokens.len()).collect();
    let r = engine.rescore(tokens.clone(), positions.clone()).unwrap();
    let hid = Array2::from_shape_vec((positions.len(), h.n_embd()), r.hidden).unwrap();
    let base = h.base_logits(hid.view()).unwrap();
    let (mut by_hand, mut by_hand_base) = (0.0, 0.0);
    for (k, &j) in positions.iter().enumerate() {
        let mut row = base.row(k).to_vec();
        let t = tokens[j] as usize;
        by_hand_base += row[t] as f64 - sampler::logsumexp(&row);
        ad.apply(hid.row(k).as_slice().unwrap(), &mut row);
        by_hand += row[t] as f64 - sampler::logsumexp(&row);
    }
    let n = positions.len() as f64;
    let (by_hand, by_hand_base) = (by_hand / n, by_hand_base / n);
    eprintln!("frozen {frozen} (by hand {by_hand_base}), adapted {adapted} (by hand {by_hand})");
    assert!(
        (frozen - by_hand_base).abs() < 1e-3,
        "{frozen} {by_hand_base}"
    );
    assert!((adapted - by_hand).abs() < 1e-3, "{adapted} {by_hand}");
    assert!((adapted - frozen).abs() > 1e-2, "{adapted} {frozen}");
}

/// The learner optimises the policy the rollouts were sampled from: at temperature 0.7 (top-p
/// 1, top-k off, digits taken greedily where the arg-max is one, as the demo samples) the
/// learner's `logp_old` — recomputed from the stored features, divided by the turn's
/// temperature, over the sampler's support — is the behaviour log-prob to within 1e-3 nats,
/// where the temperature-1 softmax the learner used before is ~0.16 nats away; and the first
/// ratio of the update is exactly 1.
#[test]
fn rollouts_at_temperature_07_are_the_policy_the_learner_optimises() {
    let dir = tempdir();
    let db = dir.path().join("t.db");
    let mut store = Store::open(&db).unwrap();
    let engine = fresh_engine();
    let mut full_gap = Vec::new();
    for i in 0..6u64 {
        let mut s = NewSession::new(Source::Demo);
        s.group_key = Some("status".into());
        let sid = store.create_session(&s).unwrap();
        let p = SamplerParams {
            temperature: 0.7,
            top_p: 1.0,
            top_k: 0,
            max_tokens: 24,
            seed: 40 + i,
            greedy_digits: true,
            ..Default::default()
        };
        let g = engine
            .generate(
                sid as u64,
                vec![Message::new(
                    Role::User,
                    "Where is my order 77120? It was due Monday.",
                )],
                p.clone(),
                None,
            )
            .unwrap();
        full_gap.extend(
            g.reply
                .logp_full
                .iter()
                .zip(&g.reply.logp_behavior)
                .map(|(f, b)| f64::from((f - b).abs())),
        );
        store
            .append_turns(sid, &turns_from_generation(&g, &p, engine.info()))
            .unwrap();
        store
            .add_feedback(
                sid,
                None,
                turnwise::FeedbackKind::Outcome,
                Some((i % 2) as f64),
                None,
            )
            .unwrap();
        store.end_session(sid).unwrap();
    }
    let full = full_gap.iter().sum::<f64>() / full_gap.len() as f64;
    let r = train(&mut store, &db, None, &TrainConfig::preset(Algo::A2tgpo)).unwrap();
    let d = &r.diagnostics;
    let gap = d.logp_old_vs_behavior_mean;
    eprintln!(
        "temperature 0.7 over {} tokens: |logp_old - logp_behavior| mean {gap:.2e} (max {}); \
         the temperature-1 softmax was {full:.3} nats away",
        full_gap.len(),
        d.logp_old_vs_behavior_max
    );
    assert!(gap <= 1e-3, "{d}");
    assert!(
        full > 0.05,
        "the tempered policy differs from the softmax: {full}"
    );
    assert_eq!(d.first_ratio_max_dev, Some(0.0), "{d}");
    assert_eq!(d.sampling_temperatures, vec![0.7f32], "{d}");
}

/// Live sessions are grouped by their opening state. On the default model the raw states of
/// any two desk openings are nearly parallel (one shared direction dominates), so clustering
/// must compare them relative to their mean: then openings of one request land together and
/// requests do not mix.
#[test]
fn opening_states_cluster_by_request_once_centred() {
    use turnwise::env::{self, Split, INTENTS};
    use turnwise::learn::groups::{centre, cosine, leader_assign};
    let engine = fresh_engine();
    let mut rng = Rng::new(11);
    let p = SamplerParams {
        max_tokens: 1,
        seed: 0,
        ..Default::default()
    };
    let (mut states, mut intents) = (Vec::new(), Vec::new());
    for (k, &intent) in INTENTS.iter().enumerate() {
        for i in 0..4 {
            let s = env::scenario_for(&mut rng, Split::Train, intent);
            let g = engine
                .generate(
                    (10 * k + i) as u64,
                    vec![
                        Message::new(Role::System, env::SYSTEM_PROMPT),
                        Message::new(Role::User, s.opening()),
                    ],
                    p.clone(),
                    None,
                )
                .unwrap();
            let width = g.reply.hidden.len() / g.reply.tokens.len();
            states.push(g.reply.hidden[..width].to_vec());
            intents.push(k);
        }
    }
    let pairs = |f: &dyn Fn(&[f32], &[f32]) -> f64| {
        let (mut same, mut other) = (Vec::new(), Vec::new());
        for i in 0..states.len() {
            for j in i + 1..states.len() {
                let c = f(&states[i], &states[j]);
                if intents[i] == intents[j] {
                    same.push(c)
                } else {
                    other.push(c)
                }
            }
        }
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let min = other.iter().cloned().fold(f64::INFINITY, f64::min);
        (mean(&same), mean(&other), min)
    };
    let raw = pairs(&|a, b| cosine(a, b));
    let c = centre(&[], &states);
    let sub = |v: &[f32]| -> Vec<f32> { v.iter().zip(&c).map(|(x, m)| x - m).collect() };
    let centred = pairs(&|a, b| cosine(&sub(a), &sub(b)));
    eprintln!(
        "raw cosine: same request {:.3}, other {:.3} (min {:.3}); centred: {:.3}, {:.3}",
        raw.0, raw.1, raw.2, centred.0, centred.1
    );
    // the raw states are nearly parallel across requests: a threshold on them cannot separate
    assert!(raw.2 > 0.8, "{raw:?}");
    // centred, the request is what the states share
    assert!(centred.0 > centred.1 + 0.3, "{centred:?}");
    let idx = leader_assign(
        &mut Vec::new(),
        &states,
        TrainConfig::preset(Algo::A2tgpo).cluster_threshold.unwrap(),
    );
    let clusters = idx.iter().max().unwrap() + 1;
    let mixed = (0..clusters)
        .filter(|&k| {
            let mut kinds: Vec<usize> = (0..idx.len())
                .filter(|&i| idx[i] == k)
                .map(|i| intents[i])
                .collect();
            kinds.sort_unstable();
            kinds.dedup();
            kinds.len() > 1
        })
        .count();
    eprintln!(
        "{} openings → {clusters} clusters {idx:?}, {mixed} mixing requests",
        idx.len()
    );
    assert!(
        clusters < states.len() && clusters >= INTENTS.len() - 1,
        "{idx:?}"
    );
    assert!(mixed <= 1, "{idx:?} {intents:?}");
}

/// An imported log carries the base model's rescoring as its log-probs, not the policy being
/// updated: trained on a warm-started adapter, the update's ratio starts at 1 (the old policy is
/// the parent), and the base log-probs stay behind as the behaviour policy.
#[test]
fn an_imported_log_trained_on_a_warm_start_starts_at_ratio_one() {
    let dir = tempdir();
    let db = dir.path().join("imported.db");
    let mut store = Store::open(&db).unwrap();
    let engine = fresh_engine();
    let mut lines = String::new();
    for i in 0..16u64 {
        let oid = 20000 + 37 * i;
        let (action, outcome) = if i % 2 == 0 {
            ("refund", 1)
        } else {
            ("cancel", 0)
        };
        let chat = serde_json::json!({"group": format!("g{}", i / 4), "messages": [
            {"role": "system", "content": "Reply with one action line."},
            {"role": "user", "content": format!("Please refund order {oid}.")},
            {"role": "assistant", "content": format!("ACTION {action} {oid}")}],
            "outcome": outcome});
        lines.push_str(&chat.to_string());
        lines.push('\n');
    }
    let sum =
        turnwise::replay::import_jsonl(&engine, &mut store, lines.as_bytes(), |_, _| {}).unwrap();
    assert_eq!(sum.imported, 16, "{:?}", sum.skipped);
    drop(engine);

    let mut sft = TrainConfig::preset(Algo::Sft);
    sft.epochs = 10;
    let w = train(&mut store, &db, None, &sft).unwrap();
    let wid = w.adapter_id.unwrap();
    let warm = Arc::new(Adapter::load(&adapter_dir(&db, wid)).unwrap());
    let r = train(
        &mut store,
        &db,
        Some((wid, warm)),
        &TrainConfig::preset(Algo::A2tgpo),
    )
    .unwrap();
    let d = &r.diagnostics;
    eprintln!("{d}");
    assert!(d.first_ratio_max_dev.is_some_and(|x| x < 1e-6), "{d}");
    // a small step from the parent, inside the gate's default bound (with the base model as
    // the old policy the candidate's approx KL was -3.2 and its k3 1e5)
    assert!(d.approx_kl.abs() < 0.2, "{d}");
    // the warm start moved the policy away from the base model's rescoring: the stored
    // behaviour log-probs are not the old policy's
    assert!(d.logp_old_vs_behavior_mean > 0.05, "{d}");
}
