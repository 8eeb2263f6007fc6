//! The last two stages of the learning pipeline: the gate a candidate adapter must pass, and
//! the one way an adapter becomes active.
//!
//! Every path that activates an adapter — the server's background learner and its admin API,
//! the demo, `turnwise train --activate` and `turnwise adapters activate` — goes through
//! [`activate`]: the adapter is loaded from its directory, handed to whatever will serve it
//! (the engine checks its shapes against the model), and only then written `active` in the
//! store; if that write fails, the server is put back on the previous adapter. The gate is
//! [`judge`]: a bound on the update's approximate KL to its parent, plus, where the caller
//! measured them, the value head's estimate of success on logged sessions and greedy success
//! on fresh validation scenarios (docs/learning.md, "The gate").

use std::cmp::Ordering::{Equal, Less};
use std::path::Path;
use std::sync::Arc;

use serde::Serialize;

use crate::adapter::Adapter;
use crate::error::{Error, Result};
use crate::policy::Role;
use crate::store::{AdapterStatus, Source, Store};

/// The bound on |approx KL| of a candidate to its parent that `serve`, `train --activate` and
/// the demo apply unless told otherwise. The KL is the candidate's, over the whole batch after
/// the last step; on the desk's replayed batches an A²TGPO update measured 0.03–0.12 and GRPO
/// 0.007–0.03 (docs/results.md, "Offline replay").
pub const DEFAULT_KL_BOUND: f64 = 0.2;

/// How much worse the value head may get before a candidate is refused: its Brier score on
/// sessions with an outcome may rise by this much, or, where no read session has an outcome,
/// its mean estimate may fall by this much.
pub const VALUE_TOLERANCE: f64 = 0.02;

/// Logged sessions whose assistant turns the value check reads.
pub const VALUE_SESSIONS: usize = 50;

/// Greedy success and mean reward of one adapter on the validation scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Score {
    /// share of scenarios solved
    pub success: f64,
    /// mean reward
    pub reward: f64,
}

/// The candidate and the active adapter on the same fresh validation scenarios.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Validation {
    /// the candidate
    pub candidate: Score,
    /// the active adapter
    pub active: Score,
    /// how many scenarios
    pub scenarios: usize,
}

/// The value head on logged assistant turns, for the candidate and for its parent (0.5 for no
/// parent: an untrained head's prior): the mean success estimate over every turn read, and the
/// Brier score — mean of (estimate − outcome)², the outcome clamped to [0, 1] as the head is
/// trained — over the turns of sessions whose outcome is known.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct ValueCheck {
    /// candidate's mean estimate
    pub value_new: f64,
    /// parent's mean estimate
    pub value_old: f64,
    /// turns read
    pub turns: usize,
    /// candidate's Brier score on the labelled turns (0 when there are none)
    pub brier_new: f64,
    /// parent's Brier score on the labelled turns (0 when there are none)
    pub brier_old: f64,
    /// turns of sessions with an outcome
    pub labelled_turns: usize,
}

impl ValueCheck {
    /// Why the candidate's head is worse than its parent's, if it is: on labelled turns the
    /// Brier score may rise by at most [`VALUE_TOLERANCE`]; with none, the mean estimate may
    /// fall by at most as much. A head that learns the real success rate lowers its mean
    /// estimate and its Brier score together: judged by calibration it passes, judged by the
    /// mean it would be refused.
    pub fn regression(&self) -> Option<String> {
        // written so that a NaN on either side counts as a regression
        let within = |a: f64, b: f64| matches!(a.partial_cmp(&b), Some(Less | Equal));
        if self.labelled_turns > 0 {
            (!within(self.brier_new, self.brier_old + VALUE_TOLERANCE)).then(|| {
                format!(
                    "value head's Brier score {:.4} > parent's {:.4} + {VALUE_TOLERANCE} on {} labelled turns",
                    self.brier_new, self.brier_old, self.labelled_turns
                )
            })
        } else {
            (!within(self.value_old - VALUE_TOLERANCE, self.value_new)).then(|| {
                format!(
                    "value estimate {:.3} < parent's {:.3} − {VALUE_TOLERANCE} (no labelled turns)",
                    self.value_new, self.value_old
                )
            })
        }
    }
}

/// What the gate measured and decided.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GateReport {
    /// |approx KL| of the update to its parent on its batch
    pub kl: f64,
    /// the bound on it
    pub kl_bound: f64,
    /// the value check, where it was run
    #[serde(skip_serializing_if = "Option::is_none")]
    pub value: Option<ValueCheck>,
    /// the validation comparison, where it was run
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation: Option<Validation>,
    /// the verdict
    pub passed: bool,
    /// why it failed (None when it passed)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The KL check alone: |kl| must be finite and at most `bound`. Callers run it first, because
/// it costs nothing and the other checks do.
pub fn kl_passes(kl: f64, bound: f64) -> bool {
    kl.abs().is_finite() && kl.abs() <= bound
}

/// The verdict from what was measured: the KL bound, then the value check
/// ([`ValueCheck::regression`]), then validation
/// (the candidate's greedy success must beat the active adapter's, or tie it with a reward at
/// least as high).
pub fn judge(
    kl: f64,
    kl_bound: f64,
    value: Option<ValueCheck>,
    validation: Option<Validation>,
) -> GateReport {
    let kl = kl.abs();
    let reason = if !kl_passes(kl, kl_bound) {
        Some(format!("|approx KL| {kl:.4} > {kl_bound}"))
    } else if let Some(why) = value.and_then(|v| v.regression()) {
        Some(why)
    } else {
        validation
            .filter(|v| {
                let (c, a) = (v.candidate, v.active);
                !(c.success > a.success || c.success == a.success && c.reward >= a.reward)
            })
            .map(|v| {
                format!(
                    "validation success {:.0} % < active {:.0} % (or equal, reward {:.3} < {:.3})",
                    v.candidate.success * 100.0,
                    v.active.success * 100.0,
                    v.candidate.reward,
                    v.active.reward
                )
            })
    };
    GateReport {
        kl,
        kl_bound,
        value,
        validation,
        passed: reason.is_none(),
        reason,
    }
}

/// The gate's sequence, written once: the KL bound first (free), and only when it holds the
/// measured checks — `value` (the value head against the parent's, serve and train) and
/// `validation` (played scenarios, the demo) — each where the caller has one; then the verdict.
///
/// # Errors
/// The checks' errors.
pub fn decide(
    kl: f64,
    kl_bound: f64,
    value: impl FnOnce() -> Result<Option<ValueCheck>>,
    validation: impl FnOnce() -> Result<Option<Validation>>,
) -> Result<GateReport> {
    if !kl_passes(kl, kl_bound) {
        return Ok(judge(kl, kl_bound, None, None));
    }
    let v = value()?;
    let val = validation()?;
    Ok(judge(kl, kl_bound, v, val))
}

/// The value check over the assistant turns of the newest `sessions` finished sessions of
/// `source` that have features.
///
/// # Errors
/// Store errors.
pub fn value_check(
    store: &Store,
    candidate: &Adapter,
    parent: Option<&Adapter>,
    source: Option<Source>,
    sessions: usize,
) -> Result<ValueCheck> {
    let (mut v_new, mut v_old, mut n) = (0.0, 0.0, 0usize);
    let (mut b_new, mut b_old, mut labelled) = (0.0, 0.0, 0usize);
    for s in store.training_sessions(source, None, false, sessions)? {
        let target = s
            .outcome_reward
            .filter(|r| r.is_finite())
            .map(super::annotate::success_target);
        for t in store
            .turns(s.id)?
            .into_iter()
            .filter(|t| t.role == Role::Assistant)
        {
            if let Some(f) = store.features(t.id)? {
                let Some(h) = f.values.get(..f.n_embd) else {
                    continue;
                };
                let new = f64::from(candidate.value(h));
                let old = parent.map_or(0.5, |p| f64::from(p.value(h)));
                v_new += new;
                v_old += old;
                n += 1;
                if let Some(y) = target {
                    b_new += (new - y).powi(2);
                    b_old += (old - y).powi(2);
                    labelled += 1;
                }
            }
        }
    }
    let d = n.max(1) as f64;
    let dl = labelled.max(1) as f64;
    Ok(ValueCheck {
        value_new: v_new / d,
        value_old: v_old / d,
        turns: n,
        brier_new: b_new / dl,
        brier_old: b_old / dl,
        labelled_turns: labelled,
    })
}

/// Records the gate's verdict with the adapter: its metrics gain `gate`, its status stays
/// `candidate` when it passed (the caller activates it) and becomes `rejected` when it failed.
///
/// # Errors
/// Store errors.
pub fn record(store: &Store, id: i64, report: &GateReport) -> Result<()> {
    let mut metrics = store.adapter(id)?.metrics;
    if !metrics.is_object() {
        metrics = serde_json::json!({});
    }
    metrics["gate"] = serde_json::to_value(report)?;
    let status = if report.passed {
        AdapterStatus::Candidate
    } else {
        AdapterStatus::Rejected
    };
    store.set_adapter_status(id, status, Some(&metrics))
}

/// Whether an adapter's metrics record a gate verdict that passed.
pub fn passed(metrics: &serde_json::Value) -> bool {
    metrics["gate"]["passed"] == serde_json::Value::Bool(true)
}

/// Gives every `candidate` that has no gate verdict one: a process that died between writing
/// a candidate and judging it (or `turnwise train` without `--activate`) leaves such rows, and
/// none may become active unjudged. Each is judged as the server's learner judges: the KL bound
/// on the update's recorded approximate KL, then the value check against its parent on
/// `value_source`'s logged sessions. One that cannot be loaded is rejected. Returns each id
/// with whether it passed.
///
/// # Errors
/// Store errors.
pub fn regate_unjudged(
    store: &Store,
    kl_bound: f64,
    value_source: Option<Source>,
) -> Result<Vec<(i64, bool)>> {
    let mut out = Vec::new();
    for rec in store.adapters()? {
        if rec.status != AdapterStatus::Candidate || !rec.metrics["gate"].is_null() {
            continue;
        }
        let kl = rec.metrics["approx_kl"].as_f64().unwrap_or(f64::NAN);
        let loaded = Adapter::load(Path::new(&rec.path)).and_then(|cand| {
            let parent = match rec.parent_id {
                Some(p) => Some(Adapter::load(Path::new(&store.adapter(p)?.path))?),
                None => None,
            };
            Ok((cand, parent))
        });
        let report = match loaded {
            Ok((cand, parent)) => decide(
                kl,
                kl_bound,
                || {
                    value_check(store, &cand, parent.as_ref(), value_source, VALUE_SESSIONS)
                        .map(Some)
                },
                || Ok(None),
            )?,
            Err(e) => {
                let mut r = judge(f64::NAN, kl_bound, None, None);
                r.reason = Some(format!("re-gated at start-up: not loadable ({e})"));
                r
            }
        };
        record(store, rec.id, &report)?;
        out.push((rec.id, report.passed));
    }
    Ok(out)
}

/// Makes adapter `id` the active one: loads it from its directory, refuses it when it is not
/// finite, hands it to `serve` (an engine's `set_adapter`, which checks its shapes against the
/// model; a closure that only checks, for a process that serves nothing), and only then writes
/// it `active`. When that write fails, `restore` puts the server back on what it served before.
/// Returns the loaded adapter.
///
/// # Errors
/// [`Error::NotFound`] for an unknown id; [`Error::NotActivatable`] for an adapter that is not
/// fully written, rejected, not loadable, not finite or refused by `serve`; store errors (after
/// `restore`).
pub fn activate(
    store: &mut Store,
    id: i64,
    serve: impl FnOnce(Arc<Adapter>) -> Result<()>,
    restore: impl FnOnce() -> Result<()>,
) -> Result<Arc<Adapter>> {
    let rec = store.adapter(id)?;
    let refused = |reason: String| Error::NotActivatable { id, reason };
    match rec.status {
        AdapterStatus::Writing => {
            return Err(refused(
                "it is still being written (or a crash interrupted it)".into(),
            ))
        }
        AdapterStatus::Rejected => {
            return Err(refused(format!(
                "it was rejected (see `turnwise adapters show {id}`)"
            )))
        }
        AdapterStatus::Candidate | AdapterStatus::Active | AdapterStatus::Retired => {}
    }
    let adapter = Adapter::load(Path::new(&rec.path))
        .map_err(|e| refused(format!("it is not loadable: {e}")))?;
    if !adapter.is_finite() {
        return Err(refused("it holds non-finite weights".into()));
    }
    let adapter = Arc::new(adapter);
    serve(adapter.clone()).map_err(|e| refused(format!("it does not fit the model: {e}")))?;
    if let Err(e) = store.activate_adapter(id) {
        restore()?;
        return Err(e);
    }
    Ok(adapter)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(success: f64, reward: f64) -> Score {
        Score { success, reward }
    }

    #[test]
    fn the_gate_checks_kl_then_value_then_validation() {
        // KL: |−0.1| ≤ 0.2 passes, 0.3 and NaN fail
        assert!(judge(-0.1, 0.2, None, None).passed);
        let r = judge(0.3, 0.2, None, None);
        assert!(!r.passed && r.reason.as_deref().unwrap_or("").contains("KL"));
        assert!(!judge(f64::NAN, 0.2, None, None).passed);
        // value, no labelled turns: 0.485 against 0.5 is within the 0.02 tolerance, 0.47 is not
        let v = |new, old| ValueCheck {
            value_new: new,
            value_old: old,
            turns: 10,
            brier_new: 0.0,
            brier_old: 0.0,
            labelled_turns: 0,
        };
        assert!(judge(0.0, 0.2, Some(v(0.485, 0.5)), None).passed);
        let r = judge(0.0, 0.2, Some(v(0.47, 0.5)), None);
        assert!(!r.passed && r.reason.as_deref().unwrap_or("").contains("value"));
        // value, labelled turns: the Brier score decides, not the mean — a head that falls
        // from 0.99 to 0.3 passes when it is better calibrated; a Brier score 0.03 worse fails,
        // 0.015 worse passes; a NaN Brier score fails
        let b = |new, old| ValueCheck {
            value_new: 0.3,
            value_old: 0.99,
            turns: 10,
            brier_new: new,
            brier_old: old,
            labelled_turns: 8,
        };
        assert!(judge(0.0, 0.2, Some(b(0.20, 0.60)), None).passed);
        assert!(judge(0.0, 0.2, Some(b(0.215, 0.20)), None).passed);
        let r = judge(0.0, 0.2, Some(b(0.23, 0.20)), None);
        assert!(!r.passed && r.reason.as_deref().unwrap_or("").contains("Brier"));
        assert!(!judge(0.0, 0.2, Some(b(f64::NAN, 0.20)), None).passed);
        // validation: more success passes; equal success needs reward at least as high
        let val = |c: Score, a: Score| Validation {
            candidate: c,
            active: a,
            scenarios: 32,
        };
        assert!(judge(0.0, 0.2, None, Some(val(score(0.5, 0.1), score(0.4, 0.9)))).passed);
        assert!(judge(0.0, 0.2, None, Some(val(score(0.5, 0.3), score(0.5, 0.3)))).passed);
        assert!(!judge(0.0, 0.2, None, Some(val(score(0.5, 0.2), score(0.5, 0.3)))).passed);
        assert!(!judge(0.0, 0.2, None, Some(val(score(0.4, 0.9), score(0.5, 0.1)))).passed);
        // the KL failure is reported even when validation would pass
        let r = judge(1.0, 0.2, None, Some(val(score(1.0, 1.0), score(0.0, 0.0))));
        assert!(r.reason.as_deref().unwrap_or("").contains("KL"));
    }

    #[test]
    fn the_value_check_judges_calibration_not_the_mean_estimate() {
        use crate::policy::{FeatureDtype, SamplerParams};
        use crate::store::{Behavior, Features, NewSession, NewTurn, TokenLogprobs};
        // five finished live sessions, one assistant turn each, every hidden state 0.5 in all
        // 4 dimensions; outcomes 1, 0, 0, 0 and one without an outcome
        let mut store = Store::in_memory().unwrap();
        for outcome in [Some(1.0), Some(0.0), Some(0.0), Some(0.0), None] {
            let turn = NewTurn {
                behavior: Some(Behavior::Sampled),
                sampler: Some(SamplerParams::default()),
                logprobs: Some(TokenLogprobs {
                    logp_behavior: vec![-0.5],
                    logp_full: vec![-0.5],
                    support: Vec::new(),
                }),
                hidden: Some(Features {
                    n_embd: 4,
                    dtype: FeatureDtype::F32,
                    values: vec![0.5; 4],
                }),
                ..NewTurn::message(Role::Assistant, "ok", vec![7], 3)
            };
            let sid = store
                .create_session(&NewSession::new(Source::Live))
                .unwrap();
            store.append_turns(sid, &[turn]).unwrap();
            if let Some(o) = outcome {
                store
                    .add_feedback(
                        sid,
                        None,
                        crate::store::FeedbackKind::Outcome,
                        Some(o),
                        None,
                    )
                    .unwrap();
            }
            store.end_session(sid).unwrap();
        }
        let head = |b: f32| {
            let mut a = Adapter::fresh(4, 8, 2, 4.0, 1, "test");
            a.value_b = b;
            a
        };
        // the parent says σ(6) = 0.99753 everywhere (a warm start on successes only); the
        // candidate says 1/4, the real rate: z = ln(1/3)
        let parent = head(6.0);
        let candidate = head((1.0f32 / 3.0).ln());
        let v = value_check(&store, &candidate, Some(&parent), Some(Source::Live), 50).unwrap();
        assert_eq!((v.turns, v.labelled_turns), (5, 4));
        let p = 1.0 / (1.0 + (-6.0f64).exp());
        // by hand: candidate (0.75² + 3·0.25²)/4 = 0.1875; parent ((1−p)² + 3p²)/4
        assert!((v.brier_new - 0.1875).abs() < 1e-6, "{v:?}");
        let brier_old = ((1.0 - p).powi(2) + 3.0 * p * p) / 4.0;
        assert!((v.brier_old - brier_old).abs() < 1e-5, "{v:?}");
        assert!((v.value_new - 0.25).abs() < 1e-6 && (v.value_old - p).abs() < 1e-5);
        // the mean estimate fell by 0.75, the Brier score improved: the candidate passes
        assert!(judge(0.0, 0.2, Some(v), None).passed);
        // the other way round the parent is the better head: refused, and the reason says why
        let back = value_check(&store, &parent, Some(&candidate), Some(Source::Live), 50).unwrap();
        let r = judge(0.0, 0.2, Some(back), None);
        assert!(!r.passed && r.reason.as_deref().unwrap_or("").contains("Brier"));
        // without a parent the reference is 0.5 everywhere: Brier 0.25
        let mut fresh = value_check(&store, &candidate, None, Some(Source::Live), 50).unwrap();
        assert!((fresh.brier_old - 0.25).abs() < 1e-12);
        assert!(fresh.regression().is_none());
        // a NaN score is a regression, never a pass; so is a NaN mean estimate
        fresh.brier_new = f64::NAN;
        assert!(fresh.regression().is_some());
        fresh.labelled_turns = 0;
        fresh.value_new = f64::NAN;
        assert!(fresh.regression().is_some());
        fresh.value_new = fresh.value_old;
        assert!(fresh.regression().is_none());
    }

    #[test]
    fn activation_writes_active_only_after_the_adapter_is_served() {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("t.db");
        let mut store = Store::open(&db).unwrap();
        let write = |store: &mut Store, a: &Adapter| {
            let id = store
                .register_adapter(None, |id| {
                    crate::adapter::adapter_dir(&db, id)
                        .to_string_lossy()
                        .into_owned()
                })
                .unwrap();
            a.save(&crate::adapter::adapter_dir(&db, id)).unwrap();
            store
                .set_adapter_status(id, AdapterStatus::Candidate, None)
                .unwrap();
            id
        };
        let a = Adapter::fresh(8, 16, 2, 4.0, 1, "m");
        let first = write(&mut store, &a);
        // refused by the server: nothing is written active
        let e = activate(
            &mut store,
            first,
            |_| Err(Error::Invalid("shape".into())),
            || Ok(()),
        )
        .unwrap_err();
        assert!(e.to_string().contains("does not fit"), "{e}");
        assert!(store.active_adapter().unwrap().is_none());
        // accepted: active, and the served adapter is the loaded one
        let mut served = None;
        activate(
            &mut store,
            first,
            |x| {
                served = Some(x);
                Ok(())
            },
            || Ok(()),
        )
        .unwrap();
        assert_eq!(store.active_adapter().unwrap().map(|r| r.id), Some(first));
        assert_eq!(served.map(|x| x.n_embd()), Some(8));
        // a row still `writing` is refused before anything is loaded
        let writing = store.register_adapter(None, |_| String::new()).unwrap();
        let e = activate(&mut store, writing, |_| Ok(()), || Ok(())).unwrap_err();
        assert!(e.to_string().contains("being written"), "{e}");
        assert_eq!(store.active_adapter().unwrap().map(|r| r.id), Some(first));
        // the gate's verdict is recorded with the adapter
        let second = write(&mut store, &a);
        record(&store, second, &judge(0.5, 0.2, None, None)).unwrap();
        let rec = store.adapter(second).unwrap();
        assert_eq!(rec.status, AdapterStatus::Rejected);
        assert_eq!(rec.metrics["gate"]["passed"], false);
        assert_eq!(rec.metrics["gate"]["kl_bound"], 0.2);
    }
}
