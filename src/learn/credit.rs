//! The second stage of an update: credit. The outcome is normalised within each group (or
//! against the value head in the fallback group), each turn gets its process signal —
//! information gain where its whole group has it, else the value head's success contribution
//! — and the advantage estimator (A²TGPO, outcome, GiGPO, windowed GAE) turns both into one
//! advantage per turn. This stage is the one writer of the value head's credit annotations
//! (docs/learning.md, "Credit").

use std::collections::HashMap;

use super::advantages::{
    a2tgpo, advantage_balance, baseline_advantage, gigpo, group_normalize, informative_groups,
    observation_groups, windowed_gae,
};
use super::batch::SessionData;
use super::config::{AdvantageMode, TrainConfig};
use super::diagnostics::{AdvantageBalance, ProcessSignalGroups};
use crate::adapter::Adapter;
use crate::error::Result;
use crate::learn::Algo;
use crate::store::{AnnotationKind, NewAnnotation, Store};

/// What credit assignment produced for a batch.
pub(super) struct Credit {
    /// how outcome and process signal share the advantages of the kept sessions
    pub(super) balance: AdvantageBalance,
    /// sessions the update keeps (DAPO's filter drops groups with equal outcomes)
    pub(super) keep: Vec<bool>,
    /// advantage per session and turn
    pub(super) turn_adv: Vec<Vec<f64>>,
    /// normalised process signal per session and turn (A²TGPO's adaptive clip)
    pub(super) ig_hat: Vec<Vec<f64>>,
    /// process signal per turn group
    pub(super) process_signal: ProcessSignalGroups,
    /// the parent value head's Brier score on sessions no update used
    pub(super) value_brier: f64,
    /// … and its AUC
    pub(super) value_auc: Option<f64>,
    /// states that calibration was measured on
    pub(super) value_states: usize,
    /// sessions in the fallback group
    pub(super) fallback: Vec<usize>,
}

/// Assigns credit to every turn of the batch with `current` (the parent adapter, or a fresh
/// one) as the value head, and writes its value-head annotations (not for SFT).
///
/// # Errors
/// Store errors; a non-finite annotation.
pub(super) fn assign(
    store: &mut Store,
    sessions: &[SessionData],
    groups: &[String],
    fell_back: &[bool],
    current: &Adapter,
    parent: Option<i64>,
    cfg: &TrainConfig,
) -> Result<Credit> {
    let sft = cfg.algo == Algo::Sft;
    // ---- advantages (outcome, then per turn) -------------------------------------------------
    let rewards: Vec<f64> = sessions.iter().map(|s| s.outcome).collect();
    let keep = if cfg.drop_uninformative && !sft {
        informative_groups(&rewards, groups)
    } else {
        vec![true; sessions.len()]
    };
    let success = super::annotate::success_target;

    // ---- step-level credit: the process signal of A²TGPO ------------------------------------------
    // information gain when every turn of the session has one (`turnwise annotate` with a
    // reference), else the success contribution of the parent's value head
    let state_values: Vec<Vec<f64>> = sessions
        .iter()
        .map(|s| {
            s.turns
                .iter()
                .map(|t| current.value(&t.h.row(0).to_vec()) as f64)
                .collect()
        })
        .collect();
    let mut r_hat = group_normalize(&rewards, groups, !cfg.dr_grpo);
    let fallback: Vec<usize> = (0..sessions.len()).filter(|&i| fell_back[i]).collect();
    if !fallback.is_empty() {
        let succ: Vec<f64> = fallback.iter().map(|&i| success(rewards[i])).collect();
        let v0: Vec<f64> = fallback.iter().map(|&i| state_values[i][0]).collect();
        for (&i, a) in fallback
            .iter()
            .zip(baseline_advantage(&succ, &v0, !cfg.dr_grpo))
        {
            r_hat[i] = a;
        }
    }
    let mut signal: Vec<Vec<f64>> = Vec::with_capacity(sessions.len());
    let mut session_ig: Vec<Option<Vec<f64>>> = Vec::with_capacity(sessions.len());
    let mut credit_rows = Vec::new();
    let value_producer = format!(
        "value-head:{}",
        parent
            .map(|p| p.to_string())
            .unwrap_or_else(|| "fresh".into())
    );
    for (s, values) in sessions.iter().zip(&state_values) {
        let ig: Option<Vec<f64>> = s
            .turns
            .iter()
            .map(|t| {
                store
                    .latest_annotation(t.turn_id, AnnotationKind::InfoGain)
                    .map(|a| a.map(|x| x.0))
            })
            .collect::<Result<Option<Vec<f64>>>>()?;
        let contrib = super::annotate::success_contribution(values, Some(success(s.outcome)));
        for (t, (before, after, c)) in s.turns.iter().zip(&contrib) {
            credit_rows.push(NewAnnotation {
                turn_id: t.turn_id,
                kind: AnnotationKind::ValueBefore,
                value: *before,
                producer: value_producer.clone(),
            });
            if let (Some(a), Some(c)) = (after, c) {
                credit_rows.push(NewAnnotation {
                    turn_id: t.turn_id,
                    kind: AnnotationKind::ValueAfter,
                    value: *a,
                    producer: value_producer.clone(),
                });
                credit_rows.push(NewAnnotation {
                    turn_id: t.turn_id,
                    kind: AnnotationKind::SuccessContribution,
                    value: *c,
                    producer: value_producer.clone(),
                });
            }
        }
        session_ig.push(ig);
        signal.push(contrib.iter().map(|c| c.2.unwrap_or(0.0)).collect());
    }
    if !sft && !cfg.dry_run {
        store.add_annotations(&credit_rows)?;
    }
    // one process signal per group: information gain where every session of the group has it
    // on every turn, else the value head's success contribution for the whole group (the two
    // live on different scales and never share a turn group)
    let mut group_has_ig: HashMap<&str, bool> = HashMap::new();
    for (g, ig) in groups.iter().zip(&session_ig) {
        *group_has_ig.entry(g.as_str()).or_insert(true) &= ig.is_some();
    }
    for ((sig, ig), g) in signal.iter_mut().zip(&mut session_ig).zip(groups) {
        if group_has_ig[g.as_str()] {
            if let Some(ig) = ig.take() {
                *sig = ig;
            }
        }
    }
    let ig_groups = group_has_ig.values().filter(|&&v| v).count();
    let process_signal = ProcessSignalGroups {
        info_gain_groups: ig_groups,
        success_contribution_groups: group_has_ig.len() - ig_groups,
    };
    let (a2, ig_hat) = a2tgpo(
        &signal,
        groups,
        &r_hat,
        cfg.gamma,
        cfg.alpha,
        cfg.process_scale.divides(cfg.dr_grpo),
    );
    let signal_kind: Vec<&str> = groups
        .iter()
        .map(|g| {
            if group_has_ig[g.as_str()] {
                "info gain"
            } else {
                "success contribution"
            }
        })
        .collect();
    // the value head's calibration on sessions no update has seen (held out from the parent)
    let (mut vp, mut vy) = (Vec::new(), Vec::new());
    for (s, values) in sessions.iter().zip(&state_values).filter(|(s, _)| s.unseen) {
        for v in values {
            vp.push(*v);
            vy.push(success(s.outcome) >= 0.5);
        }
    }
    let (value_brier, value_auc) = super::annotate::calibration(&vp, &vy);
    let turn_adv: Vec<Vec<f64>> = match cfg.advantage {
        AdvantageMode::A2tgpo => a2,
        AdvantageMode::Outcome => sessions
            .iter()
            .zip(&r_hat)
            .map(|(s, r)| vec![*r; s.turns.len()])
            .collect(),
        AdvantageMode::Gigpo => {
            let rew: Vec<Vec<f64>> = sessions
                .iter()
                .map(|s| {
                    (0..s.turns.len())
                        .map(|t| {
                            if t + 1 == s.turns.len() {
                                s.outcome
                            } else {
                                0.0
                            }
                        })
                        .collect()
                })
                .collect();
            let obs: Vec<Vec<Vec<i32>>> = sessions
                .iter()
                .map(|s| s.turns.iter().map(|t| t.observation.clone()).collect())
                .collect();
            let keys = observation_groups(&obs, groups, cfg.gigpo_similarity);
            gigpo(&rew, &keys, groups, &r_hat, cfg.gamma, cfg.gigpo_omega)
        }
        AdvantageMode::WindowedGae => sessions
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n = s.turns.len();
                let rew: Vec<f64> = (0..n)
                    .map(|t| if t + 1 == n { success(s.outcome) } else { 0.0 })
                    .collect();
                let v = &state_values[i];
                windowed_gae(&rew, v, cfg.gae_window, 1.0, cfg.gae_lambda)
            })
            .collect(),
    };
    let kept_adv: Vec<Vec<f64>> = (0..sessions.len())
        .map(|i| {
            if keep[i] {
                turn_adv[i].clone()
            } else {
                Vec::new()
            }
        })
        .collect();
    let balance = advantage_balance(&kept_adv, &r_hat, |i, t| {
        let pos = if t < 2 {
            format!("turn {}", t + 1)
        } else {
            "turn 3+".into()
        };
        format!("{}, {pos}", signal_kind[i])
    });
    Ok(Credit {
        balance,
        keep,
        turn_adv,
        ig_hat,
        process_signal,
        value_brier,
        value_auc,
        value_states: vp.len(),
        fallback,
    })
}
