//! Step-level credit (docs/algorithms.md §2): how much each assistant turn moved its session toward
//! success, written to `annotations` so that it is a queryable fact (`turn_credit` view) and the
//! process signal of A²TGPO.
//!
//! - success contribution: `c_t = V(s_{t+1}) − V(s_t)` with the value head, `V(s_{T+1})` the
//!   outcome (in [0, 1]) of a finished session;
//! - information gain, when a ground truth exists: `ig_t = p_t − p_{t−1}` with `p_t` the
//!   teacher-forced mean log-prob of the reference after turn `t` under the frozen policy —
//!   by default after the turn's reply *and* the observation it brought back ([`IgContext`]).

use serde::{Deserialize, Serialize};

use crate::adapter::Adapter;
use crate::error::{Error, Result};
use crate::policy::Engine;
use crate::store::{AnnotationKind, NewAnnotation, Store, TurnRecord};
use crate::Role;

/// `p_t` in log-prob space (default, as the released code) or probability space (the paper).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IgSpace {
    /// mean log-prob
    Logprob,
    /// `exp` of the mean log-prob
    Prob,
}

/// What the first turn's gain is measured against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum IgBaseline {
    /// `p_0` scored on the opening context (paper)
    Opening,
    /// the first turn gets 0 (released code)
    FirstTurn,
}

/// Where `p_t`, the reference's score after turn `t`, is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IgContext {
    /// after the turn's reply and what it brought back — the tool's result or the customer's
    /// answer, i.e. right before the next assistant turn; the last turn, after which nothing
    /// comes back, after its reply. IGPO's and A²TGPO's interaction turn is the call with its
    /// result: a question for the order number gains when the customer answers with it, a
    /// lookup when the back office says what state the order is in.
    Observation,
    /// right after the turn's reply, before its observation (this project's first version: a
    /// reply gains by writing the reference itself, an information-seeking question gets ~0)
    Reply,
}

/// Which policy scores the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum IgPolicy {
    /// the base model, adapter off (this project's reading of docs/algorithms.md's "frozen
    /// policy")
    Frozen,
    /// the policy with the engine's current adapter — in the demo the active adapter that
    /// sampled the rollout, i.e. π_old, frozen during the update (IGPO's "the model's own
    /// belief"): the base model assigns an `ACTION` line about e^−10.7 whatever the context, the
    /// warm-started policy does not
    Sampling,
}

/// The scores of `reference` along a logged session by `policy`: `p[0]` on the context
/// before the first assistant turn, then `p[t]` after each assistant turn `t` as `ctx` says
/// ([`IgContext`]); `T + 1` numbers for `T` assistant turns (none without one).
///
/// # Errors
/// Engine errors.
pub fn reference_scores(
    engine: &Engine,
    turns: &[TurnRecord],
    reference: &str,
    ctx: IgContext,
    policy: IgPolicy,
) -> Result<Vec<f64>> {
    let adapted = policy == IgPolicy::Sampling;
    let mut context: Vec<i32> = Vec::new();
    let mut p = Vec::new();
    let mut after_last = None;
    for t in turns {
        let assistant = t.role == Role::Assistant;
        if assistant && (p.is_empty() || ctx == IgContext::Observation) {
            // the context ends with the assistant opening of this turn
            p.push(engine.score_reference_by(context.clone(), false, reference, adapted)?);
        }
        context.extend_from_slice(&t.token_ids);
        if assistant {
            match ctx {
                IgContext::Reply => {
                    p.push(engine.score_reference_by(context.clone(), true, reference, adapted)?);
                }
                IgContext::Observation => after_last = Some(context.clone()),
            }
        }
    }
    if let Some(c) = after_last {
        p.push(engine.score_reference_by(c, true, reference, adapted)?);
    }
    Ok(p)
}

/// The one mapping of an outcome reward `R` to the value head's success scale `[0, 1]`, used
/// for its training targets, for `V(s_{T+1})` at the end of a finished session and for the
/// value baseline of fallback groups: `R` clamped to `[0, 1]` (a reward with a format penalty
/// below 0 is a failure, a bonus above 1 a success), NaN as 0. It does not depend on the batch.
pub fn success_target(r: f64) -> f64 {
    if r.is_nan() {
        0.0
    } else {
        r.clamp(0.0, 1.0)
    }
}

/// `(value_before, value_after, contribution)` per assistant turn. `values[t] = V(s_t)`;
/// after the last turn the outcome (clamped to [0, 1]) when the session is finished, else the
/// last turn has no `value_after`.
pub fn success_contribution(
    values: &[f64],
    outcome: Option<f64>,
) -> Vec<(f64, Option<f64>, Option<f64>)> {
    (0..values.len())
        .map(|t| {
            let after = if t + 1 < values.len() {
                Some(values[t + 1])
            } else {
                outcome.map(success_target)
            };
            (values[t], after, after.map(|a| a - values[t]))
        })
        .collect()
}

/// Information gain per turn from `p[0..=T]` (`p[0]` on the opening context, `p[t]` after turn
/// `t`).
pub fn information_gain(p: &[f64], space: IgSpace, baseline: IgBaseline) -> Vec<f64> {
    let q: Vec<f64> = match space {
        IgSpace::Logprob => p.to_vec(),
        IgSpace::Prob => p.iter().map(|x| x.exp()).collect(),
    };
    (1..q.len())
        .map(|t| {
            if t == 1 && baseline == IgBaseline::FirstTurn {
                0.0
            } else {
                q[t] - q[t - 1]
            }
        })
        .collect()
}

/// Settings of an annotation pass.
#[derive(Debug, Clone)]
pub struct AnnotateConfig {
    /// information-gain space
    pub ig_space: IgSpace,
    /// information-gain baseline
    pub ig_baseline: IgBaseline,
    /// where each turn's reference score is measured
    pub ig_context: IgContext,
    /// which policy scores it (with [`IgPolicy::Sampling`], `annotate_sessions` uses the
    /// engine's current adapter)
    pub ig_policy: IgPolicy,
    /// with [`IgPolicy::Sampling`]: the id of the adapter that scored (None: no adapter was
    /// active, the base model scored); named in every information-gain annotation's producer
    pub ig_scorer: Option<i64>,
}

impl AnnotateConfig {
    /// The producer recorded with an information-gain annotation: `policy-frozen` (the base
    /// model) or `policy-adapter:<id>` for the sampling adapter that scored it.
    pub fn ig_producer(&self) -> String {
        match (self.ig_policy, self.ig_scorer) {
            (IgPolicy::Sampling, Some(id)) => format!("policy-adapter:{id}"),
            _ => "policy-frozen".into(),
        }
    }
}

impl Default for AnnotateConfig {
    fn default() -> Self {
        AnnotateConfig {
            ig_space: IgSpace::Logprob,
            ig_baseline: IgBaseline::Opening,
            ig_context: IgContext::Observation,
            ig_policy: IgPolicy::Frozen,
            ig_scorer: None,
        }
    }
}

/// What an annotation pass wrote.
#[derive(Debug, Clone, Default, Serialize)]
pub struct AnnotateSummary {
    /// sessions annotated
    pub sessions: usize,
    /// assistant turns that got a success contribution
    pub turns: usize,
    /// assistant turns that got an information gain
    pub info_gain_turns: usize,
}

/// Annotates sessions: value head `value_head` (its id in `producer_id`) for the success
/// contribution, and, when `engine` is given, the frozen policy for the information gain of
/// sessions with a reference.
///
/// # Errors
/// Store and engine errors; annotations of a session are written in one transaction.
pub fn annotate_sessions(
    store: &mut Store,
    session_ids: &[i64],
    value_head: &Adapter,
    producer_id: Option<i64>,
    engine: Option<&Engine>,
    cfg: &AnnotateConfig,
) -> Result<AnnotateSummary> {
    let info_gain = engine.map_or(InfoGainSource::Off, InfoGainSource::Engine);
    annotate_sessions_with(
        store,
        session_ids,
        Some(value_head),
        producer_id,
        info_gain,
        cfg,
    )
}

/// Where the information gain's reference log-probs come from.
#[derive(Clone, Copy)]
pub enum InfoGainSource<'a> {
    /// no information gain
    Off,
    /// the frozen policy rescores each logged session
    Engine(&'a Engine),
    /// already scored while the sessions were played (per session id: before the first
    /// assistant turn, then after each; see [`crate::demo::PlaySettings::score_reference`]);
    /// sessions missing here get no information gain
    Scored(&'a std::collections::HashMap<i64, Vec<f64>>),
}

/// [`annotate_sessions`] with the reference log-probs from `info_gain`; without a value head
/// only information gain is written (an update computes the success contribution of its
/// parent's value head itself and writes it then: one writer of each annotation).
///
/// # Errors
/// Store and engine errors; a scored session whose log-probs do not match its assistant turns.
pub fn annotate_sessions_with(
    store: &mut Store,
    session_ids: &[i64],
    value_head: Option<&Adapter>,
    producer_id: Option<i64>,
    info_gain: InfoGainSource<'_>,
    cfg: &AnnotateConfig,
) -> Result<AnnotateSummary> {
    let producer = format!(
        "value-head:{}",
        producer_id
            .map(|i| i.to_string())
            .unwrap_or_else(|| "fresh".into())
    );
    let mut sum = AnnotateSummary::default();
    for &sid in session_ids {
        let s = store.session(sid)?;
        let turns = store.turns(sid)?;
        let mut rows = Vec::new();
        // value of the state before each assistant turn: its first sampling position
        let mut states = Vec::new();
        if let Some(value_head) = value_head {
            for t in turns.iter().filter(|t| t.role == Role::Assistant) {
                if let Some(f) = store.features(t.id)? {
                    states.push((t.id, value_head.value(&f.values[..f.n_embd]) as f64));
                }
            }
        }
        let outcome = s.ended_at.as_ref().and(s.outcome_reward);
        let values: Vec<f64> = states.iter().map(|s| s.1).collect();
        for ((turn_id, _), (before, after, c)) in
            states.iter().zip(success_contribution(&values, outcome))
        {
            let mut push = |kind: AnnotationKind, v: f64| {
                rows.push(NewAnnotation {
                    turn_id: *turn_id,
                    kind,
                    value: v,
                    producer: producer.clone(),
                })
            };
            push(AnnotationKind::ValueBefore, before);
            if let (Some(a), Some(c)) = (after, c) {
                push(AnnotationKind::ValueAfter, a);
                push(AnnotationKind::SuccessContribution, c);
            }
        }
        sum.turns += states.len();
        let reference = s.reference.as_deref().filter(|r| !r.trim().is_empty());
        let assistant: Vec<i64> = turns
            .iter()
            .filter(|t| t.role == Role::Assistant)
            .map(|t| t.id)
            .collect();
        let p = match (info_gain, reference) {
            (InfoGainSource::Engine(engine), Some(reference)) => Some(reference_scores(
                engine,
                &turns,
                reference,
                cfg.ig_context,
                cfg.ig_policy,
            )?),
            (InfoGainSource::Scored(m), Some(_)) => match m.get(&sid) {
                Some(p) if p.len() == assistant.len() + 1 => Some(p.clone()),
                Some(p) => {
                    return Err(Error::Invalid(format!(
                        "session {sid}: {} reference log-probs for {} assistant turns",
                        p.len(),
                        assistant.len()
                    )))
                }
                None => None,
            },
            _ => None,
        };
        if let Some(p) = p.filter(|p| p.len() > 1) {
            let ids = assistant;
            for (id, ig) in ids
                .iter()
                .zip(information_gain(&p, cfg.ig_space, cfg.ig_baseline))
            {
                rows.push(NewAnnotation {
                    turn_id: *id,
                    kind: AnnotationKind::InfoGain,
                    value: ig,
                    producer: cfg.ig_producer(),
                });
            }
            sum.info_gain_turns += ids.len();
        }
        store.add_annotations(&rows)?;
        sum.sessions += 1;
    }
    Ok(sum)
}

/// Brier score and ROC AUC of probabilities `p` against binary labels `y` (AUC by ranks, ties
/// counted half; `None` when one class is missing).
pub fn calibration(p: &[f64], y: &[bool]) -> (f64, Option<f64>) {
    let brier = p
        .iter()
        .zip(y)
        .map(|(p, &y)| (p - f64::from(u8::from(y))).powi(2))
        .sum::<f64>()
        / p.len().max(1) as f64;
    let pos: Vec<f64> = p
        .iter()
        .zip(y)
        .filter(|(_, &y)| y)
        .map(|(p, _)| *p)
        .collect();
    let neg: Vec<f64> = p
        .iter()
        .zip(y)
        .filter(|(_, &y)| !y)
        .map(|(p, _)| *p)
        .collect();
    if pos.is_empty() || neg.is_empty() {
        return (brier, None);
    }
    let mut wins = 0.0;
    for a in &pos {
        for b in &neg {
            wins += if a > b {
                1.0
            } else if a == b {
                0.5
            } else {
                0.0
            };
        }
    }
    (brier, Some(wins / (pos.len() * neg.len()) as f64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_contribution_by_hand() {
        let c = success_contribution(&[0.2, 0.5, 0.4], Some(1.0));
        assert_eq!(c[0], (0.2, Some(0.5), Some(0.3)));
        assert!((c[1].2.unwrap() + 0.1).abs() < 1e-12);
        assert!(
            (c[2].2.unwrap() - 0.6).abs() < 1e-12,
            "the last turn is measured against the outcome"
        );
        let open = success_contribution(&[0.2, 0.5], None);
        assert_eq!(
            open[1],
            (0.5, None, None),
            "an unfinished session has no final contribution"
        );
        assert_eq!(
            success_contribution(&[0.5], Some(7.0))[0].1,
            Some(1.0),
            "outcomes are clamped to [0, 1]"
        );
    }

    #[test]
    fn information_gain_by_hand() {
        let p = [-3.0, -2.0, -2.5];
        assert_eq!(
            information_gain(&p, IgSpace::Logprob, IgBaseline::Opening),
            vec![1.0, -0.5]
        );
        assert_eq!(
            information_gain(&p, IgSpace::Logprob, IgBaseline::FirstTurn),
            vec![0.0, -0.5]
        );
        let q = information_gain(&p, IgSpace::Prob, IgBaseline::Opening);
        assert!((q[0] - ((-2f64).exp() - (-3f64).exp())).abs() < 1e-12);
    }

    #[test]
    fn calibration_by_hand() {
        let (brier, auc) = calibration(&[0.9, 0.6, 0.4, 0.1], &[true, false, true, false]);
        // (0.01 + 0.36 + 0.36 + 0.01) / 4; pairs (pos, neg): 0.9>0.6, 0.9>0.1, 0.4<0.6, 0.4>0.1 -> 3/4
        assert!((brier - 0.185).abs() < 1e-12);
        assert_eq!(auc, Some(0.75));
        assert_eq!(calibration(&[0.3], &[true]).1, None);
    }
}

/// What a standalone value-head fit measured.
#[derive(Debug, Clone, Serialize)]
pub struct ValueFit {
    /// states (assistant turns) trained on
    pub train_states: usize,
    /// held-out states (every fifth session)
    pub heldout_states: usize,
    /// Brier score on held-out states before and after
    pub brier_before: f64,
    /// after
    pub brier_after: f64,
    /// AUC on held-out states before and after (None: one class only)
    pub auc_before: Option<f64>,
    /// after
    pub auc_after: Option<f64>,
}

/// Fits the value head of `adapter` (BCE on the outcome, mapped to success ≥ 0.5, full-batch
/// Adam) on the states of finished sessions, holding out every fifth session for the report.
/// Only the value head changes.
///
/// # Errors
/// Store errors; [`crate::Error::Invalid`] without usable sessions.
pub fn fit_value_head(
    store: &Store,
    session_ids: &[i64],
    adapter: &mut Adapter,
    epochs: usize,
    lr: f64,
) -> Result<ValueFit> {
    let (mut train, mut held) = (Vec::new(), Vec::new());
    for (k, &sid) in session_ids.iter().enumerate() {
        let s = store.session(sid)?;
        let Some(o) = s.outcome_reward.filter(|_| s.ended_at.is_some()) else {
            continue;
        };
        let y = o >= 0.5;
        for t in store
            .turns(sid)?
            .into_iter()
            .filter(|t| t.role == Role::Assistant)
        {
            if let Some(f) = store.features(t.id)? {
                let h = f.values[..f.n_embd].to_vec();
                if k % 5 == 4 {
                    held.push((h, y))
                } else {
                    train.push((h, y))
                }
            }
        }
    }
    if train.is_empty() {
        return Err(crate::Error::Invalid(
            "no finished sessions with an outcome and features".into(),
        ));
    }
    let eval = |a: &Adapter| {
        let p: Vec<f64> = held.iter().map(|(h, _)| a.value(h) as f64).collect();
        let y: Vec<bool> = held.iter().map(|(_, y)| *y).collect();
        calibration(&p, &y)
    };
    let (brier_before, auc_before) = eval(adapter);
    let d = adapter.n_embd();
    let (mut m, mut v) = (vec![0f64; d + 1], vec![0f64; d + 1]);
    for step in 1..=epochs.max(1) {
        let mut g = vec![0f64; d + 1];
        for (h, y) in &train {
            let e = adapter.value(h) as f64 - f64::from(u8::from(*y));
            for (gi, x) in g.iter_mut().zip(h) {
                *gi += e * *x as f64;
            }
            g[d] += e;
        }
        for (i, gi) in g.iter().enumerate() {
            let gi = gi / train.len() as f64;
            m[i] = 0.9 * m[i] + 0.1 * gi;
            v[i] = 0.999 * v[i] + 0.001 * gi * gi;
            let upd = lr * (m[i] / (1.0 - 0.9f64.powi(step as i32)))
                / ((v[i] / (1.0 - 0.999f64.powi(step as i32))).sqrt() + 1e-8);
            if i < d {
                adapter.value_w[i] -= upd as f32;
            } else {
                adapter.value_b -= upd as f32;
            }
        }
    }
    let (brier_after, auc_after) = eval(adapter);
    Ok(ValueFit {
        train_states: train.len(),
        heldout_states: held.len(),
        brier_before,
        brier_after,
        auc_before,
        auc_after,
    })
}
