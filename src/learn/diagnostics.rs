//! What an update measured, as one typed record: the learner fills it, the store keeps it as
//! JSON (`updates.diagnostics`, `adapters.metrics`), and the gate, the server's `/metrics`, the
//! demo's report and `turnwise train` read its fields (docs/learning.md, "Diagnostics").

use serde::Serialize;

/// Turn groups by the process signal A²TGPO / ATPO used for them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ProcessSignalGroups {
    /// groups whose every session had information gain on every turn
    pub info_gain_groups: usize,
    /// groups that used the value head's success contribution
    pub success_contribution_groups: usize,
}

impl ProcessSignalGroups {
    /// `info gain`, `success contribution`, both with their group counts, or `–` (none).
    pub fn describe(&self) -> String {
        match (self.info_gain_groups, self.success_contribution_groups) {
            (0, 0) => "–".into(),
            (_, 0) => "info gain".into(),
            (0, _) => "success contribution".into(),
            (ig, sc) => format!("info gain ({ig} groups), success contribution ({sc})"),
        }
    }
}

/// Process turns of one kind (their signal and position) in [`AdvantageBalance`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct KindBalance {
    /// e.g. `info gain, turn 1`
    pub kind: String,
    /// process turns of this kind in sessions with a non-zero outcome advantage
    pub turns: usize,
    /// of them, those whose advantage has the other sign than their session's outcome
    pub contradicting: usize,
}

/// How the outcome and the process signal share a batch's advantages
/// (`learn::advantages::advantage_balance`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct AdvantageBalance {
    /// `Σ|R̂| / Σ(|R̂| + |Â − R̂|)` over every turn (1: the process term moves nothing)
    pub outcome_share: f64,
    /// process turns of sessions with a non-zero outcome advantage
    pub process_turns: usize,
    /// of them, those pushed against their session's outcome
    pub contradicting: usize,
    /// the same per kind of turn
    pub by_kind: Vec<KindBalance>,
}

impl AdvantageBalance {
    /// Share of process turns pushed against their session's outcome.
    pub fn contradiction_rate(&self) -> f64 {
        self.contradicting as f64 / self.process_turns.max(1) as f64
    }
}

/// Median, 90th percentile and largest of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Quantiles {
    /// median
    pub p50: f64,
    /// 90th percentile
    pub p90: f64,
    /// largest
    pub max: f64,
}

impl Quantiles {
    /// Nearest-rank quantiles of `x` (all 0 when empty); NaNs sort last.
    pub fn of(mut x: Vec<f64>) -> Self {
        if x.is_empty() {
            return Quantiles::default();
        }
        x.sort_by(f64::total_cmp);
        let at = |q: f64| x[((q * x.len() as f64).ceil() as usize).clamp(1, x.len()) - 1];
        Quantiles {
            p50: at(0.5),
            p90: at(0.9),
            max: x[x.len() - 1],
        }
    }
}

/// How far a policy has moved from the one that sampled a batch, measured on the batch's
/// tokens: the trust region's view (docs/learning.md, "Trust region").
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct TrustRegion {
    /// tokens measured
    pub tokens: usize,
    /// `mean(−lr)` with `lr = log π_new − log π_old` per token
    pub approx_kl: f64,
    /// k3 estimate of KL(old ‖ new): `mean(e^lr − 1 − lr)` (never negative)
    pub k3: f64,
    /// share of tokens whose (token, sequence or turn) ratio is clipped below
    pub clip_frac_low: f64,
    /// … above
    pub clip_frac_high: f64,
    /// |lr| per token
    pub token_log_ratio: Quantiles,
    /// |mean lr| per turn (the turn ratio's log)
    pub turn_log_ratio: Quantiles,
}

impl TrustRegion {
    /// Measures `logp_new` against the batches' `logp_old`; `clip` gives the share of each
    /// part's tokens clipped (low, high) under the objective's own bounds.
    pub fn measure<'a>(
        parts: impl IntoIterator<Item = (&'a super::objective::TokenBatch, &'a [f64], (f64, f64))>,
    ) -> Self {
        let mut t = TrustRegion::default();
        let (mut tok, mut turns) = (Vec::new(), Vec::new());
        for (b, new, (lo, hi)) in parts {
            let n = new.len();
            t.clip_frac_low += lo * n as f64;
            t.clip_frac_high += hi * n as f64;
            let mut per_turn: std::collections::BTreeMap<usize, (f64, usize)> = Default::default();
            for (k, (n, o)) in new.iter().zip(&b.logp_old).enumerate() {
                let lr = n - o;
                t.approx_kl -= lr;
                t.k3 += lr.exp() - 1.0 - lr;
                tok.push(lr.abs());
                let e = per_turn.entry(b.turn[k]).or_default();
                e.0 += lr;
                e.1 += 1;
            }
            turns.extend(per_turn.values().map(|(s, c)| (s / *c as f64).abs()));
            t.tokens += n;
        }
        let nf = t.tokens.max(1) as f64;
        t.approx_kl /= nf;
        t.k3 /= nf;
        t.clip_frac_low /= nf;
        t.clip_frac_high /= nf;
        t.token_log_ratio = Quantiles::of(tok);
        t.turn_log_ratio = Quantiles::of(turns);
        t
    }
}

/// Every diagnostic of one update (docs/algorithms.md, "Diagnostics"). KL and clip fractions are
/// the candidate's (the final adapter over the whole batch); ratios those of the last optimizer
/// step; calibration is measured on sessions no earlier
/// update used.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Diagnostics {
    /// sessions trained on
    pub sessions: usize,
    /// sampled tokens in the batch
    pub tokens: usize,
    /// tokens with no gradient (greedy, forced, masked)
    pub untrainable_tokens: usize,
    /// optimizer steps
    pub steps: usize,
    /// total loss of the last step
    pub loss: f64,
    /// policy part of it
    pub policy_loss: f64,
    /// value-head part of it
    pub value_loss: f64,
    /// `mean(−log ratio)` of the candidate that is gated — the final adapter over the whole
    /// batch (`candidate.approx_kl`): the gate bounds its magnitude
    pub approx_kl: f64,
    /// `mean(−log ratio)` of the last minibatch before the last optimizer step (what the gate
    /// read before it read the candidate's)
    pub last_step_approx_kl: f64,
    /// the final adapter against the sampling adapters over the whole batch
    pub candidate: TrustRegion,
    /// every optimizer step's minibatch before the step, and the candidate after the last
    pub trust_region_steps: Vec<TrustRegion>,
    /// how the outcome and the process signal share the advantages
    pub advantage_balance: AdvantageBalance,
    /// k3 KL to the reference policy
    pub kl_ref_k3: f64,
    /// the KL reference adapter (None: the base model)
    pub kl_reference: Option<i64>,
    /// share of tokens the candidate has clipped below, over the whole batch
    pub clip_frac_low: f64,
    /// … above
    pub clip_frac_high: f64,
    /// mean clip scale used
    pub clip_scale_mean: f64,
    /// mean importance ratio
    pub ratio_mean: f64,
    /// largest |ratio − 1|
    pub ratio_max_dev: f64,
    /// largest |ratio − 1| at the first step (0 when old and new log-probs come from one graph)
    pub first_ratio_max_dev: Option<f64>,
    /// value head's explained variance of the outcome
    pub explained_variance: f64,
    /// gradient norm of the last step
    pub grad_norm: f64,
    /// learning rate
    pub lr: f64,
    /// tokens per second over all epochs
    pub tokens_per_s: f64,
    /// mean |logp_old − logp_behavior| over sampled tokens
    pub logp_old_vs_behavior_mean: f64,
    /// largest |logp_old − logp_behavior|
    pub logp_old_vs_behavior_max: f64,
    /// normalised entropy of how the log-ratio change spreads over a session's turns
    pub turn_entropy: f64,
    /// how sessions were grouped (`group_key`, `batch`, `opening_clusters`, mixtures)
    pub grouping: String,
    /// distinct groups
    pub groups: usize,
    /// sessions in the batch-wide fallback group
    pub fallback_sessions: usize,
    /// distinct sampling temperatures of the batch's turns
    pub sampling_temperatures: Vec<f32>,
    /// wall time of the update
    pub seconds: f64,
    /// `ort` or `ndarray`
    pub backend: String,
    /// advantage estimator
    pub advantage: String,
    /// process signal per turn group
    pub process_signal: ProcessSignalGroups,
    /// value head's Brier score on unseen sessions
    pub value_brier_heldout: f64,
    /// value head's AUC on unseen sessions (None without both outcomes)
    pub value_auc_heldout: Option<f64>,
    /// states the calibration was measured on
    pub value_heldout_states: usize,
    /// ONNX Runtime execution provider used (None: ndarray)
    pub device: Option<String>,
    /// the AdamW moments came from the parent adapter
    pub optimizer_from_parent: bool,
    /// what the update trained: `output` (the output-projection LoRA) or the block LoRA's
    /// layout (`block k=2 q,v r=8`)
    pub trained: String,
    /// a block-LoRA update: sessions of the selection left out because their block inputs
    /// were not logged
    pub sessions_without_block: usize,
    /// sessions of the selection left out because they cannot be learned from (an outcome
    /// beyond ±1e6 or not finite, non-finite features or log-probs): `{session, reason}`
    pub unusable_sessions: Vec<serde_json::Value>,
}

impl Diagnostics {
    /// The record as JSON (what the store keeps).
    pub fn to_json(&self) -> serde_json::Value {
        // a struct of numbers, strings and vectors always serialises
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }

    /// The clip fraction on both sides.
    pub fn clip_frac(&self) -> f64 {
        self.clip_frac_low + self.clip_frac_high
    }
}

impl std::fmt::Display for Diagnostics {
    /// One line of JSON.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.to_json())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::objective::TokenBatch;

    /// Two turns: lr = (0.1, −0.1, 0.3) with turns (0, 0, 1). approx KL = −mean lr = −0.1;
    /// k3 = mean(e^lr − 1 − lr); turn means |0| and |0.3|; clip shares weighted by tokens.
    #[test]
    fn trust_region_by_hand() {
        let b = TokenBatch {
            turn: vec![0, 0, 1],
            logp_old: vec![-1.0, -2.0, -0.5],
            ..Default::default()
        };
        let new = [-0.9, -2.1, -0.2];
        let t = TrustRegion::measure([(&b, &new[..], (1.0 / 3.0, 0.0))]);
        assert_eq!(t.tokens, 3);
        assert!((t.approx_kl + 0.1).abs() < 1e-12, "{t:?}");
        let k3 = |x: f64| x.exp() - 1.0 - x;
        let want = (k3(0.1) + k3(-0.1) + k3(0.3)) / 3.0;
        assert!((t.k3 - want).abs() < 1e-12);
        assert!((t.clip_frac_low - 1.0 / 3.0).abs() < 1e-12);
        assert!((t.turn_log_ratio.max - 0.3).abs() < 1e-12);
        assert!(t.turn_log_ratio.p50.abs() < 1e-12);
        // nearest rank over |lr| = (0.1, 0.1, 0.3): median 0.1, p90 0.3
        assert!((t.token_log_ratio.p50 - 0.1).abs() < 1e-12);
        assert!((t.token_log_ratio.p90 - 0.3).abs() < 1e-12);
        // a second part of one token clipped above: shares weigh by tokens
        let b2 = TokenBatch {
            turn: vec![5],
            logp_old: vec![0.0],
            ..Default::default()
        };
        let t = TrustRegion::measure([
            (&b, &new[..], (1.0 / 3.0, 0.0)),
            (&b2, &[0.0][..], (0.0, 1.0)),
        ]);
        assert!((t.clip_frac_low - 0.25).abs() < 1e-12 && (t.clip_frac_high - 0.25).abs() < 1e-12);
    }
}
