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

/// Every diagnostic of one update (docs/algorithms.md, "Diagnostics"). Ratios, clip fractions
/// and KL are those of the last optimizer step; calibration is measured on sessions no earlier
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
    /// mean(−log ratio) on the last step: the gate bounds its magnitude
    pub approx_kl: f64,
    /// k3 KL to the reference policy
    pub kl_ref_k3: f64,
    /// the KL reference adapter (None: the base model)
    pub kl_reference: Option<i64>,
    /// share of tokens clipped below
    pub clip_frac_low: f64,
    /// share of tokens clipped above
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
