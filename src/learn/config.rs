//! What an update is asked to do: the presets, every switch of [`TrainConfig`] with its default,
//! and which sessions it reads ([`Selection`]). Below the learner's stages: they all read it,
//! none of it reads them.

use serde::{Deserialize, Serialize};

use super::objective::{Aggregation, ClipMode, Granularity, ObjectiveConfig};
use crate::error::{Error, Result};
use crate::graph::block::BlockSpec;
use crate::graph::Device;
use crate::store::Source;

/// The algorithm presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Algo {
    /// turn ratio, adaptive turn clip, turn-group advantages (default)
    A2tgpo,
    /// turn ratio, fixed clip
    Atpo,
    /// sequence ratio, fixed clip, outcome advantage
    Gspo,
    /// token ratio, clip-higher, outcome advantage
    Grpo,
    /// token ratio, clip-higher, GiGPO step advantages (γ 0.95, ω 1)
    Gigpo,
    /// token ratio, clip-higher, windowed turn-group GAE with the value head
    PpoToken,
    /// supervised warm start: token cross-entropy on assistant turns
    Sft,
}

impl Algo {
    /// The preset's name as `--algo` spells it (`a2tgpo`, `ppo-token`, …).
    pub fn name(self) -> String {
        clap::ValueEnum::to_possible_value(&self)
            .map(|v| v.get_name().to_string())
            .unwrap_or_else(|| format!("{self:?}"))
    }
}

/// How per-turn advantages are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum AdvantageMode {
    /// every turn gets the normalised outcome R̂ (GRPO, GSPO)
    Outcome,
    /// A²TGPO: turn-group normalised process signal, variance-rescaled accumulation, + R̂
    A2tgpo,
    /// GiGPO / SLEA: R̂ + ω · z(return-to-go) among steps with the same observation
    Gigpo,
    /// windowed turn-group GAE over the value head (window 5, γ 1, λ 0.95)
    WindowedGae,
}

/// The turn clip `(ε_low, ε_high)` of the A²TGPO and ATPO presets.
pub const TURN_EPS: (f64, f64) = (0.2, 0.28);

/// The token clip `(ε_low, ε_high)` of the GRPO, GiGPO and PPO-token presets.
pub const TOKEN_EPS: (f64, f64) = (0.2, 0.28);

/// The token guard of the A²TGPO preset: GRPO's token clip, applied to each token's own
/// ratio inside the turn ratio (docs/algorithms.md §5).
pub const A2TGPO_TOKEN_GUARD: (f64, f64) = TOKEN_EPS;

/// The released A²TGPO script's α.
pub const DEFAULT_ALPHA: f64 = 0.3;

/// Whether the process signal of A²TGPO is divided by its turn group's std.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ProcessScale {
    /// as the outcome: z-scored unless Dr.GRPO centres the outcome only
    #[default]
    AsOutcome,
    /// always z-scored (this project's behaviour before the switch)
    Std,
    /// only centred
    Centre,
}

impl ProcessScale {
    /// Whether the process signal is divided by its std under `dr_grpo`.
    pub fn divides(self, dr_grpo: bool) -> bool {
        match self {
            ProcessScale::AsOutcome => !dr_grpo,
            ProcessScale::Std => true,
            ProcessScale::Centre => false,
        }
    }
}

/// Which engine computes the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// the differentiated ONNX graph in ONNX Runtime (CPU or CUDA)
    Ort,
    /// the same step in Rust with ndarray (reference, and the benchmark's baseline)
    Ndarray,
}

/// Everything an update needs to know; defaults are the A²TGPO preset.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    /// preset
    pub algo: Algo,
    /// the surrogate's switches
    pub objective: ObjectiveConfig,
    /// Dr.GRPO: centre outcomes without dividing by the std
    pub dr_grpo: bool,
    /// DAPO: drop groups whose outcomes are all equal
    pub drop_uninformative: bool,
    /// how turn advantages are formed
    pub advantage: AdvantageMode,
    /// A²TGPO α (process-term weight): 0.3 as in the released training script (the paper's
    /// 1.0 lets the process term outweigh the outcome: docs/algorithms.md, "Advantage scale")
    pub alpha: f64,
    /// whether A²TGPO's process signal is divided by its turn group's std: by default as the
    /// outcome is (one switch, `dr_grpo`, governs both, as `norm_adv_by_std_in_grpo` does in
    /// the released code)
    #[serde(default = "legacy_process_scale")]
    pub process_scale: ProcessScale,
    /// A²TGPO γ
    pub gamma: f64,
    /// AdamW learning rate
    pub lr: f64,
    /// AdamW weight decay
    pub weight_decay: f64,
    /// AdamW ε: a parameter whose gradient is far below it barely moves. At the usual 1e-8 every
    /// row of the LoRA's vocabulary matrix moves by the full `lr` at a fresh optimizer's first
    /// step, even for tokens with a probability of 1e-7 whose gradient is only softmax tail;
    /// a larger ε (e.g. 1e-6) keeps those still and spends the step on tokens the policy
    /// actually weighs.
    #[serde(default = "default_adam_eps")]
    pub adam_eps: f64,
    /// gradient-norm clip
    pub max_grad_norm: f64,
    /// passes over the batch
    pub epochs: usize,
    /// tokens per minibatch (sessions are not split)
    pub minibatch_tokens: usize,
    /// LoRA rank of a fresh adapter
    pub rank: usize,
    /// LoRA alpha of a fresh adapter
    pub lora_alpha: f32,
    /// value-head loss coefficient (BCE on the outcome); 0 disables
    pub value_coef: f64,
    /// seed of a fresh adapter
    pub seed: u64,
    /// SFT: only sessions with at least this outcome
    pub sft_min_outcome: Option<f64>,
    /// sessions without a group key are grouped by leader clustering of their opening states at
    /// this cosine similarity (None: one batch-wide group)
    pub cluster_threshold: Option<f64>,
    /// step engine
    pub backend: Backend,
    /// ONNX Runtime device
    pub device: Device,
    /// ONNX Runtime intra-op threads
    pub threads: usize,
    /// carry the AdamW moments over from the parent adapter (saved next to every adapter this
    /// update writes). Off: every update starts a fresh optimizer, whose first step moves every
    /// parameter by `lr` in the sign of its gradient, however noisy that gradient is.
    #[serde(default)]
    pub keep_optimizer: bool,
    /// the reference of the KL term (`objective.kl_coef`): this stored adapter (e.g. the warm
    /// start, so that RL stays near what the demonstrations taught on every token the reward
    /// does not explain); None: the base policy, adapter off (docs/algorithms.md §8)
    #[serde(default)]
    pub kl_ref_adapter: Option<i64>,
    /// RL updates give digit tokens no policy gradient (they stay in their turn's ratio and
    /// KL). An order id is copied from the context one digit token at a time, and which digits
    /// are right differs in every session: the output-projection LoRA cannot learn from the
    /// reward which number to copy, it can only shift digit logits as a function of the final
    /// hidden state, and those shifts accumulate until ids are miscopied (measured: `ACTION
    /// status 3999999…`). Masked, the reward trains the decisions: which action, whether to ask.
    /// Supervised updates always train every token.
    #[serde(default)]
    pub mask_digits: bool,
    /// RL updates give digit tokens policy gradient only in turns with a positive advantage:
    /// a success reinforces copying the id it copied, a failure does not push the digits it
    /// copied down (which spreads their mass over the other digits; measured: `ACTION cancel
    /// 1777777…`). The turn's other tokens learn from both signs. Ignored with `mask_digits`.
    #[serde(default)]
    pub mask_negative_digits: bool,
    /// SFT only: a digit token of the target counts as the digit class (`−log Σ_digits p`)
    /// instead of itself ([`lora_class_ce_and_grad`]): the demonstrations teach that an id
    /// comes here, not which digits, and copying stays with the base model. Random order ids
    /// in a few dozen demonstrations are otherwise memorised by the output LoRA as digit biases
    /// that override copying on new ids (`ACTION status 8000` for order 69567)
    #[serde(default)]
    pub sft_digit_class: bool,
    /// groups (cluster or key) with fewer sessions than this merge into one batch-wide group
    /// whose outcome baseline is the value head's estimate of each opening state (§7); a
    /// session alone in its group would otherwise get zero advantage on every turn
    #[serde(default = "default_min_group_size")]
    pub min_group_size: usize,
    /// GiGPO: weight ω of the step term
    #[serde(default = "default_one")]
    pub gigpo_omega: f64,
    /// GiGPO: observations whose token-multiset Jaccard similarity reaches this share a step
    /// group (1: identical observations only)
    #[serde(default = "default_one")]
    pub gigpo_similarity: f64,
    /// windowed turn-group GAE: turns per window
    #[serde(default = "default_gae_window")]
    pub gae_window: usize,
    /// windowed turn-group GAE: λ
    #[serde(default = "default_gae_lambda")]
    pub gae_lambda: f64,
    /// RL trains a LoRA inside the model's last blocks (served by llama.cpp itself) instead of
    /// the output-projection LoRA: the parent's block LoRA, or a fresh one of this layout. The
    /// sessions must have been logged with their block inputs (`--block-capture k`); old and
    /// new log-probs come from the same block graph, the output LoRA stays as it is, and the
    /// value head still learns from the stored features. None: the output LoRA is trained.
    #[serde(default)]
    pub block: Option<BlockSpec>,
    /// a block-LoRA update runs the graph over whole sessions of at most this many positions
    /// together (a longer session runs alone) and adds up their losses and gradients: the
    /// attention is dense over a run's rows, so its memory grows with their square
    #[serde(default = "default_block_run_positions")]
    pub block_run_positions: usize,
    /// measure only: the update runs and returns its diagnostics, and writes nothing (no
    /// annotation, no update row, no adapter) — `turnwise train --replay`
    #[serde(skip)]
    pub dry_run: bool,
}

/// The group key of sessions whose own group was too small ([`TrainConfig::min_group_size`]).
pub const FALLBACK_GROUP: &str = "batch-fallback";

/// Settings recorded before the switch existed divided the process signal always.
fn legacy_process_scale() -> ProcessScale {
    ProcessScale::Std
}

fn default_min_group_size() -> usize {
    2
}
fn default_one() -> f64 {
    1.0
}
fn default_gae_window() -> usize {
    5
}
fn default_gae_lambda() -> f64 {
    0.95
}

impl TrainConfig {
    /// Refuses settings no update can run with: a clip range outside `0 < ε_low < 1`,
    /// `ε_high > 0`, a negative or non-finite learning rate (0 is allowed: an update that does
    /// not move), a gradient clip or AdamW ε that is not positive, no epochs, a TIS cap below 1
    /// or a negative KL / entropy coefficient.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the setting.
    pub fn validate(&self) -> Result<()> {
        let o = &self.objective;
        let positive = |x: f64| x.is_finite() && x > 0.0;
        let bad = |m: &str| Err(Error::Invalid(m.into()));
        if !(o.eps_low > 0.0 && o.eps_low < 1.0 && positive(o.eps_high)) {
            return bad("the clip range needs 0 < eps_low < 1 and eps_high > 0");
        }
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("the learning rate must be finite and not negative");
        }
        if !positive(self.max_grad_norm) || !positive(self.adam_eps) {
            return bad("the gradient clip and AdamW epsilon must be positive");
        }
        if self.epochs == 0
            || self.minibatch_tokens == 0
            || self.rank == 0
            || self.block_run_positions == 0
        {
            return bad("epochs, minibatch tokens, block run positions and the LoRA rank must be at least 1");
        }
        let steps_ok = self.gigpo_similarity > 0.0
            && self.gigpo_similarity <= 1.0
            && (0.0..=1.0).contains(&self.gae_lambda)
            && self.gae_window > 0
            && self.gigpo_omega.is_finite();
        if !steps_ok {
            return bad("GiGPO similarity must be in (0, 1], GAE lambda in [0, 1], the GAE window at least 1");
        }
        if o.token_guard
            .is_some_and(|(lo, hi)| !(lo > 0.0 && lo < 1.0 && positive(hi)))
        {
            return bad("the token guard needs 0 < eps_low < 1 and eps_high > 0");
        }
        if o.tis_cap.is_some_and(|c| !(c.is_finite() && c >= 1.0)) {
            return bad("the TIS cap must be at least 1");
        }
        let non_negative = |x: f64| x.is_finite() && x >= 0.0;
        if !(non_negative(o.kl_coef) && non_negative(o.entropy_coef)) {
            return bad("the KL and entropy coefficients must be finite and not negative");
        }
        if let Some(b) = &self.block {
            if self.algo == Algo::Sft {
                return bad("a supervised block LoRA is trained with `turnwise train --algo sft --block-k K`");
            }
            if self.keep_optimizer {
                return bad("carrying the optimizer over is not supported for a block LoRA");
            }
            if b.k == 0
                || b.r == 0
                || b.targets.is_empty()
                || !(b.alpha.is_finite() && b.alpha > 0.0)
            {
                return bad(
                    "a block LoRA needs k, r and at least one target, and a positive alpha",
                );
            }
        }
        Ok(())
    }

    /// The preset of `algo` with the defaults of docs/algorithms.md.
    pub fn preset(algo: Algo) -> Self {
        let (granularity, clip, eps_low, eps_high, aggregation) = match algo {
            // the turn clip at the token clip's widths: the released script's 3e-3 / 4e-3 is
            // for full fine-tuning at lr 1e-6; a LoRA at lr 1e-3 moves a turn's mean log-ratio
            // by ~0.1 per step, and at 3e-3 the clip cut 43 % of the tokens at a median step
            // (GRPO's token clip: 4 %); at 0.2 / 0.28 it cuts 7 % (docs/results.md, "Offline
            // replay")
            Algo::A2tgpo => (
                Granularity::Turn,
                ClipMode::Adaptive,
                TURN_EPS.0,
                TURN_EPS.1,
                Aggregation::SeqMeanTokenMean,
            ),
            Algo::Atpo => (
                Granularity::Turn,
                ClipMode::Fixed,
                TURN_EPS.0,
                TURN_EPS.1,
                Aggregation::SeqMeanTokenMean,
            ),
            Algo::Gspo => (
                Granularity::Sequence,
                ClipMode::Fixed,
                3e-3,
                4e-3,
                Aggregation::SeqMeanTokenMean,
            ),
            Algo::Grpo | Algo::Gigpo | Algo::PpoToken | Algo::Sft => (
                Granularity::Token,
                ClipMode::Fixed,
                TOKEN_EPS.0,
                TOKEN_EPS.1,
                Aggregation::TokenMean,
            ),
        };
        let advantage = match algo {
            Algo::A2tgpo | Algo::Atpo => AdvantageMode::A2tgpo,
            Algo::Gigpo => AdvantageMode::Gigpo,
            Algo::PpoToken => AdvantageMode::WindowedGae,
            Algo::Gspo | Algo::Grpo | Algo::Sft => AdvantageMode::Outcome,
        };
        TrainConfig {
            algo,
            objective: ObjectiveConfig {
                granularity,
                clip,
                eps_low,
                eps_high,
                clip_beta: 0.3,
                aggregation,
                tis_cap: None,
                kl_coef: 0.0,
                entropy_coef: 0.0,
                mis: false,
                token_guard: (algo == Algo::A2tgpo).then_some(A2TGPO_TOKEN_GUARD),
            },
            dr_grpo: false,
            drop_uninformative: false,
            advantage,
            alpha: DEFAULT_ALPHA,
            process_scale: ProcessScale::AsOutcome,
            gamma: if algo == Algo::Gigpo { 0.95 } else { 1.0 },
            lr: if algo == Algo::Sft { 5e-3 } else { 1e-3 },
            weight_decay: 0.0,
            adam_eps: default_adam_eps(),
            max_grad_norm: 1.0,
            epochs: if algo == Algo::Sft { 20 } else { 2 },
            minibatch_tokens: 512,
            rank: 8,
            lora_alpha: 16.0,
            value_coef: 0.5,
            seed: 0,
            sft_min_outcome: None,
            cluster_threshold: Some(0.5),
            backend: Backend::Ort,
            device: Device::Cpu,
            threads: 2,
            keep_optimizer: false,
            kl_ref_adapter: None,
            mask_digits: false,
            mask_negative_digits: false,
            sft_digit_class: false,
            min_group_size: default_min_group_size(),
            gigpo_omega: 1.0,
            gigpo_similarity: 1.0,
            gae_window: default_gae_window(),
            gae_lambda: default_gae_lambda(),
            block: None,
            block_run_positions: default_block_run_positions(),
            dry_run: false,
        }
    }

    /// Changes the preset of a configuration and keeps everything else: what `--algo`
    /// decides (the ratio's granularity, the clip rule and widths, the token guard, the
    /// aggregation, the advantage estimator, γ) is taken from [`TrainConfig::preset`]; the
    /// schedule and the run's other settings (lr, epochs, Dr.GRPO, α, seed, threads, …) stay
    /// as recorded. An offline replay uses it to run a logged batch under another preset.
    #[must_use]
    pub fn with_preset(mut self, algo: Algo) -> Self {
        let p = TrainConfig::preset(algo);
        self.algo = algo;
        self.objective.granularity = p.objective.granularity;
        self.objective.clip = p.objective.clip;
        self.objective.eps_low = p.objective.eps_low;
        self.objective.eps_high = p.objective.eps_high;
        self.objective.aggregation = p.objective.aggregation;
        self.objective.token_guard = p.objective.token_guard;
        self.advantage = p.advantage;
        self.gamma = p.gamma;
        self
    }
}

fn default_block_run_positions() -> usize {
    1024
}

fn default_adam_eps() -> f64 {
    1e-8
}

/// Which sessions an update reads.
#[derive(Debug, Clone, Default)]
pub struct Selection {
    /// only this source
    pub source: Option<Source>,
    /// created at or after (ISO 8601)
    pub since: Option<String>,
    /// created before (ISO 8601): the batch an earlier update saw
    pub until: Option<String>,
    /// newest N
    pub limit: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_preset_changes_what_the_preset_decides_and_keeps_the_rest() {
        // a recorded demo update: a2tgpo with the demo's schedule and α 0.1
        let mut rec = TrainConfig::preset(Algo::A2tgpo);
        rec.lr = 7e-4;
        rec.epochs = 3;
        rec.dr_grpo = true;
        rec.alpha = 0.1;
        rec.seed = 42;
        let g = rec.clone().with_preset(Algo::Grpo);
        let p = TrainConfig::preset(Algo::Grpo);
        assert_eq!(g.algo, Algo::Grpo);
        assert_eq!(g.objective.granularity, p.objective.granularity);
        assert_eq!(g.objective.clip, p.objective.clip);
        assert_eq!(
            (g.objective.eps_low, g.objective.eps_high),
            (p.objective.eps_low, p.objective.eps_high)
        );
        assert_eq!(g.objective.aggregation, p.objective.aggregation);
        assert_eq!(g.advantage, p.advantage);
        assert_eq!(
            (g.lr, g.epochs, g.dr_grpo, g.alpha, g.seed),
            (7e-4, 3, true, 0.1, 42)
        );
        // and back: the recorded preset's own switches return
        let back = g.clone().with_preset(Algo::A2tgpo);
        assert_eq!(back.objective.granularity, rec.objective.granularity);
        assert_eq!(back.objective.clip, rec.objective.clip);
        assert_eq!(back.advantage, rec.advantage);
        assert_eq!(back.objective.token_guard, Some(A2TGPO_TOKEN_GUARD));
        assert_eq!(g.objective.token_guard, None);
        assert_eq!(
            TrainConfig::preset(Algo::Gigpo)
                .with_preset(Algo::Grpo)
                .gamma,
            p.gamma
        );
    }
}
