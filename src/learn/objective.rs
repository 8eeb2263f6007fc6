//! The policy objective (docs/algorithms.md §4–§6, §8) as one kernel with switches, and the
//! output-LoRA forward/backward that turns per-token gradients into adapter gradients.
//!
//! The surrogate works on per-token log-probs and returns the loss and `∂loss/∂logπθ` per token;
//! [`lora_loss_and_grad`] chains that through `log_softmax(base + s·(H·Aᵀ)·Bᵀ)` to `∂A`, `∂B`.
//! Sequence and turn ratios use `exp(sg[mean lr] + logπθ − sg[logπθ])`: every token of the group
//! carries the group ratio, and its gradient is `s · Â` per token.

use ndarray::{Array2, ArrayView2, LinalgScalar, ScalarOperand};
use num_traits::Float;
use serde::{Deserialize, Serialize};

pub use crate::graph::step::Granularity;

/// How the clip region is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ClipMode {
    /// `[1 − ε_low, 1 + ε_high]`
    Fixed,
    /// A²TGPO: `c = 1 + β(2σ(îg) − 1)` widens informative turns; final turn `c = 1`
    Adaptive,
    /// seed variant: `ε / (1 + β|Â|)` tightens large-advantage turns
    AdvantageScaled,
}

/// How per-token terms are averaged into the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Aggregation {
    /// mean over all tokens of the batch
    TokenMean,
    /// mean over sessions of the mean over their tokens (A²TGPO paper)
    SeqMeanTokenMean,
    /// mean over turns of the mean over their tokens
    TurnMean,
    /// Dr.GRPO: sum over a session's tokens divided by the longest session, mean over sessions
    SeqMeanTokenSumNorm,
}

/// Settings of the surrogate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ObjectiveConfig {
    /// ratio granularity
    pub granularity: Granularity,
    /// clip mode
    pub clip: ClipMode,
    /// lower clip width
    pub eps_low: f64,
    /// upper clip width
    pub eps_high: f64,
    /// β of the adaptive / advantage-scaled clip
    pub clip_beta: f64,
    /// aggregation
    pub aggregation: Aggregation,
    /// truncated importance sampling cap `C` (None: off)
    pub tis_cap: Option<f64>,
    /// coefficient of the k3 KL to the base policy (adapter off)
    pub kl_coef: f64,
    /// coefficient of the entropy bonus (the loss subtracts `coef · Σ w · H`)
    #[serde(default)]
    pub entropy_coef: f64,
    /// MIS: drop tokens whose `exp(logp_old − logp_behavior)` is outside `[0.5, 2]`, also from
    /// the aggregation's denominators
    #[serde(default)]
    pub mis: bool,
    /// token guard inside sequence / turn ratios: `(ε_low, ε_high)` of each token's own ratio.
    /// A token whose ratio has left `[1 − ε_low, 1 + ε_high]` on the side its advantage pushes
    /// toward gets no policy gradient, even while its group's ratio is inside the group's clip
    /// (None: off; token ratios have their own clip and ignore it)
    #[serde(default)]
    pub token_guard: Option<(f64, f64)>,
}

impl ObjectiveConfig {
    /// The token guard's widths when it acts: set, and the ratio is not per token.
    pub fn active_guard(&self) -> Option<(f64, f64)> {
        self.token_guard
            .filter(|_| self.granularity != Granularity::Token)
    }
}

/// One batch of assistant tokens, flattened.
#[derive(Debug, Clone, Default)]
pub struct TokenBatch {
    /// session index of each token
    pub seq: Vec<usize>,
    /// global turn index of each token (unique across sessions)
    pub turn: Vec<usize>,
    /// advantage of each token (its turn's)
    pub adv: Vec<f64>,
    /// normalised process signal `îg` of the token's turn (adaptive clip)
    pub ig_hat: Vec<f64>,
    /// the token belongs to its session's final turn
    pub final_turn: Vec<bool>,
    /// log-prob under the adapter that generated it (recomputed from features)
    pub logp_old: Vec<f64>,
    /// log-prob the sampler recorded
    pub logp_behavior: Vec<f64>,
    /// log-prob under the base model (adapter off)
    pub logp_ref: Vec<f64>,
    /// tokens the policy term trains (empty: all); the others, e.g. digits copied from the
    /// context, stay in their turn's ratio but carry no policy gradient and leave the
    /// aggregation's denominators, as MIS-dropped tokens do
    pub trainable: Vec<bool>,
}

/// What one evaluation of the surrogate measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SurrogateStats {
    /// policy loss (without KL)
    pub policy_loss: f64,
    /// k3 KL to the base policy, aggregated like the loss
    pub kl_ref: f64,
    /// share of tokens clipped at the low side (with the token guard: or stopped by it with a
    /// negative advantage)
    pub clip_low_frac: f64,
    /// share clipped at the high side (or stopped by the guard with a positive advantage)
    pub clip_high_frac: f64,
    /// mean ratio (before truncation)
    pub ratio_mean: f64,
    /// largest |ratio − 1|
    pub ratio_max_dev: f64,
    /// `mean(−lr)`
    pub approx_kl: f64,
    /// mean of the clip scale `c` (adaptive) or ε_high actually used
    pub clip_scale_mean: f64,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// Aggregation weight of every token.
pub fn aggregation_weights(b: &TokenBatch, agg: Aggregation) -> Vec<f64> {
    aggregation_weights_masked(b, agg, &vec![true; b.seq.len()])
}

/// Aggregation weights counting only the tokens with `keep[k]`; the others get 0.
pub fn aggregation_weights_masked(b: &TokenBatch, agg: Aggregation, keep: &[bool]) -> Vec<f64> {
    let n = keep.iter().filter(|&&k| k).count();
    let count = |keys: &[usize]| {
        let mut m = std::collections::HashMap::new();
        for (k, _) in keys.iter().zip(keep).filter(|(_, &kp)| kp) {
            *m.entry(*k).or_insert(0usize) += 1;
        }
        m
    };
    let per_group = |keys: &[usize]| {
        let c = count(keys);
        keys.iter()
            .map(|k| c.get(k).map_or(0.0, |&m| 1.0 / (c.len() * m) as f64))
            .collect::<Vec<f64>>()
    };
    let w = match agg {
        Aggregation::TokenMean => vec![1.0 / n.max(1) as f64; keep.len()],
        Aggregation::SeqMeanTokenMean => per_group(&b.seq),
        Aggregation::TurnMean => per_group(&b.turn),
        Aggregation::SeqMeanTokenSumNorm => {
            let c = count(&b.seq);
            let longest = c.values().copied().max().unwrap_or(1);
            vec![1.0 / (c.len().max(1) * longest) as f64; keep.len()]
        }
    };
    w.into_iter()
        .zip(keep)
        .map(|(w, &k)| if k { w } else { 0.0 })
        .collect()
}

/// Per-token clip region `(lo, hi, scale)`: constants of the update (no gradient through them).
pub fn clip_bounds(cfg: &ObjectiveConfig, b: &TokenBatch) -> Vec<(f64, f64, f64)> {
    (0..b.adv.len())
        .map(|k| match cfg.clip {
            ClipMode::Fixed => (1.0 - cfg.eps_low, 1.0 + cfg.eps_high, 1.0),
            ClipMode::Adaptive => {
                let c = if b.final_turn[k] {
                    1.0
                } else {
                    1.0 + cfg.clip_beta * (2.0 * sigmoid(b.ig_hat[k]) - 1.0)
                };
                (1.0 - c * cfg.eps_low, 1.0 + c * cfg.eps_high, c)
            }
            ClipMode::AdvantageScaled => {
                let d = 1.0 + cfg.clip_beta * b.adv[k].abs();
                (1.0 - cfg.eps_low / d, 1.0 + cfg.eps_high / d, 1.0 / d)
            }
        })
        .collect()
}

/// The token guard's per-token bounds on the token's log-ratio, `(low, high)`: a token with a
/// positive advantage keeps its gradient while `lr ≤ ln(1 + ε_high)`, one with a negative
/// advantage while `lr ≥ ln(1 − ε_low)`; the other side is open (±1e30). None when the guard is
/// off or the ratio is per token.
pub fn guard_bounds(cfg: &ObjectiveConfig, b: &TokenBatch) -> Option<Vec<(f64, f64)>> {
    let (lo, hi) = cfg.active_guard()?;
    let open = 1e30;
    Some(
        b.adv
            .iter()
            .map(|&a| {
                if a > 0.0 {
                    (-open, hi.ln_1p())
                } else if a < 0.0 {
                    ((-lo).ln_1p(), open)
                } else {
                    (-open, open)
                }
            })
            .collect(),
    )
}

/// Per-token weight of the policy term: aggregation weight × TIS weight
/// `min(exp(logp_old − logp_behavior), C)`, over the tokens MIS keeps that are trainable.
pub fn policy_weights(cfg: &ObjectiveConfig, b: &TokenBatch) -> Vec<f64> {
    let keep: Vec<bool> = mis_mask(cfg, b)
        .into_iter()
        .enumerate()
        .map(|(k, m)| m && b.trainable.get(k).copied().unwrap_or(true))
        .collect();
    aggregation_weights_masked(b, cfg.aggregation, &keep)
        .into_iter()
        .enumerate()
        .map(|(k, w)| {
            w * cfg
                .tis_cap
                .map_or(1.0, |c| (b.logp_old[k] - b.logp_behavior[k]).exp().min(c))
        })
        .collect()
}

/// Tokens kept by MIS (all when MIS is off).
pub fn mis_mask(cfg: &ObjectiveConfig, b: &TokenBatch) -> Vec<bool> {
    (0..b.seq.len())
        .map(|k| !cfg.mis || (0.5..=2.0).contains(&(b.logp_old[k] - b.logp_behavior[k]).exp()))
        .collect()
}

/// The averaging matrix of the ratio groups: `M[k][j] = 1/|group|` when tokens `k` and `j`
/// share a sequence (or turn), so that `M·lr` is each token's group-mean log-ratio.
pub fn group_mean_matrix(cfg: &ObjectiveConfig, b: &TokenBatch) -> Array2<f64> {
    let n = b.seq.len();
    let key = |k: usize| match cfg.granularity {
        Granularity::Token => k,
        Granularity::Sequence => b.seq[k],
        Granularity::Turn => b.turn[k],
    };
    let mut count = std::collections::HashMap::new();
    for k in 0..n {
        *count.entry(key(k)).or_insert(0usize) += 1;
    }
    Array2::from_shape_fn((n, n), |(k, j)| {
        if key(k) == key(j) {
            1.0 / count[&key(k)] as f64
        } else {
            0.0
        }
    })
}

/// The clipped surrogate: returns the loss, `∂loss/∂logπθ` per token, and diagnostics.
pub fn surrogate(
    cfg: &ObjectiveConfig,
    b: &TokenBatch,
    logp_new: &[f64],
) -> (f64, Vec<f64>, SurrogateStats) {
    let n = logp_new.len();
    let lr: Vec<f64> = logp_new
        .iter()
        .zip(&b.logp_old)
        .map(|(a, o)| a - o)
        .collect();
    // group mean of lr for sequence / turn ratios
    let key = |k: usize| match cfg.granularity {
        Granularity::Token => k,
        Granularity::Sequence => b.seq[k],
        Granularity::Turn => b.turn[k],
    };
    let mut sums: std::collections::HashMap<usize, (f64, usize)> = std::collections::HashMap::new();
    if cfg.granularity != Granularity::Token {
        for (k, l) in lr.iter().enumerate() {
            let e = sums.entry(key(k)).or_insert((0.0, 0));
            e.0 += l;
            e.1 += 1;
        }
    }
    let w = aggregation_weights(b, cfg.aggregation);
    let wt = policy_weights(cfg, b);
    let bounds = clip_bounds(cfg, b);
    let guard = guard_bounds(cfg, b);
    let mut grad = vec![0.0; n];
    let mut st = SurrogateStats::default();
    let (mut loss, mut kl) = (0.0, 0.0);
    for k in 0..n {
        let raw_log_s = match cfg.granularity {
            Granularity::Token => lr[k],
            _ => {
                let (s, c) = sums[&key(k)];
                s / c as f64
            }
        };
        // the clamp of log s at 10 is a constant beyond it: no gradient through that branch
        // (as the graph's Min gives none)
        let clamped = raw_log_s > 10.0;
        let log_s = raw_log_s.min(10.0);
        let s = log_s.exp();
        let a = b.adv[k];
        let (lo, hi, scale) = bounds[k];
        let clipped = s.clamp(lo, hi);
        let (un, cl) = (s * a, clipped * a);
        let active = un <= cl;
        // the guard stops a token that its group's term would still move (a guarded token
        // counts as clipped on its advantage's side)
        let guarded = active
            && guard
                .as_ref()
                .is_some_and(|g| !(g[k].0 <= lr[k] && lr[k] <= g[k].1));
        if !active {
            if s < lo {
                st.clip_low_frac += 1.0;
            } else {
                st.clip_high_frac += 1.0;
            }
        } else if guarded {
            if a < 0.0 {
                st.clip_low_frac += 1.0;
            } else {
                st.clip_high_frac += 1.0;
            }
        }
        loss -= wt[k] * un.min(cl);
        if active && !clamped && !guarded {
            grad[k] -= wt[k] * s * a;
        }
        if cfg.kl_coef > 0.0 {
            let d = b.logp_ref[k] - logp_new[k];
            kl += w[k] * (d.exp() - d - 1.0);
            grad[k] += cfg.kl_coef * w[k] * (1.0 - d.exp());
        }
        st.ratio_mean += s;
        st.ratio_max_dev = st.ratio_max_dev.max((s - 1.0).abs());
        st.approx_kl -= lr[k];
        st.clip_scale_mean += scale;
    }
    let nf = n.max(1) as f64;
    st.policy_loss = loss;
    st.kl_ref = kl;
    st.clip_low_frac /= nf;
    st.clip_high_frac /= nf;
    st.ratio_mean /= nf;
    st.approx_kl /= nf;
    st.clip_scale_mean /= nf;
    (loss + cfg.kl_coef * kl, grad, st)
}

/// Forward and backward of the output LoRA for one batch: `base` `[T, V]` base logits, `h`
/// `[T, d]` features, `tokens` the sampled ids, adapter `a` `[r, d]`, `b` `[V, r]`, `scale` α/r.
/// `objective` maps the new log-probs to (loss, ∂loss/∂logp). Returns
/// `(loss, logp_new, ∂A, ∂B)`.
pub fn lora_loss_and_grad<F: Float + LinalgScalar + ScalarOperand>(
    base: ArrayView2<'_, F>,
    h: ArrayView2<'_, F>,
    tokens: &[usize],
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    scale: F,
    objective: impl FnOnce(&[F]) -> (F, Vec<F>),
) -> (F, Vec<F>, Array2<F>, Array2<F>) {
    lora_loss_and_grad_entropy(base, h, tokens, a, b, scale, None, objective)
}

/// [`lora_loss_and_grad`] with an entropy bonus: `entropy = Some((w, coef))` adds
/// `−coef · Σ_k w_k H_k` to the loss, `H_k` the full-softmax entropy at token `k`.
#[allow(clippy::too_many_arguments)]
pub fn lora_loss_and_grad_entropy<F: Float + LinalgScalar + ScalarOperand>(
    base: ArrayView2<'_, F>,
    h: ArrayView2<'_, F>,
    tokens: &[usize],
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    scale: F,
    entropy: Option<(&[F], F)>,
    objective: impl FnOnce(&[F]) -> (F, Vec<F>),
) -> (F, Vec<F>, Array2<F>, Array2<F>) {
    let (u, mut z) = lora_logits(base, h, a, b, scale);
    let mut logp = Vec::with_capacity(tokens.len());
    let mut ent = Vec::with_capacity(tokens.len());
    for (mut row, &tok) in z.rows_mut().into_iter().zip(tokens) {
        let lse = row_logsumexp(row.view());
        logp.push(row[tok] - lse);
        if entropy.is_some() {
            // H = lse − Σ p z
            let pz = row
                .iter()
                .fold(F::zero(), |acc, &x| acc + (x - lse).exp() * x);
            ent.push(lse - pz);
        }
        // keep softmax in place for the backward pass
        row.mapv_inplace(|x| (x - lse).exp());
    }
    let (mut loss, g) = objective(&logp);
    // dZ = g · (onehot − softmax); the entropy bonus adds ∂(−c·w·H)/∂z = c·w·p·(log p + H)
    for (k, ((mut row, &tok), &gk)) in z.rows_mut().into_iter().zip(tokens).zip(&g).enumerate() {
        match entropy {
            Some((w, c)) => {
                let (cw, hk) = (c * w[k], ent[k]);
                row.mapv_inplace(|p| {
                    let plogp = if p > F::zero() { p * p.ln() } else { F::zero() };
                    -gk * p + cw * (plogp + p * hk)
                });
            }
            None => row.mapv_inplace(|p| -gk * p),
        }
        row[tok] = row[tok] + gk;
    }
    if let Some((w, c)) = entropy {
        loss = loss
            - c * ent
                .iter()
                .zip(w)
                .fold(F::zero(), |acc, (&hk, &wk)| acc + hk * wk);
    }
    let (da, db) = lora_backward(&z, &u, b, h, scale);
    (loss, logp, da, db)
}

/// The LoRA forward: `u = h Aᵀ` `[T, r]` and the logits `z = base + s · u Bᵀ` `[T, V]`.
fn lora_logits<F: Float + LinalgScalar + ScalarOperand>(
    base: ArrayView2<'_, F>,
    h: ArrayView2<'_, F>,
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    scale: F,
) -> (Array2<F>, Array2<F>) {
    let u = h.dot(&a.t());
    let z = base.to_owned() + &(u.dot(&b.t()) * scale);
    (u, z)
}

/// `log Σ exp(x)` of one row, shifted by its maximum.
fn row_logsumexp<F: Float>(row: ndarray::ArrayView1<'_, F>) -> F {
    let m = row.iter().copied().fold(F::neg_infinity(), F::max);
    m + row
        .iter()
        .fold(F::zero(), |acc, &x| acc + (x - m).exp())
        .ln()
}

/// The LoRA backward from `dz = ∂loss/∂z`: `(∂A, ∂B)`.
fn lora_backward<F: Float + LinalgScalar + ScalarOperand>(
    dz: &Array2<F>,
    u: &Array2<F>,
    b: ArrayView2<'_, F>,
    h: ArrayView2<'_, F>,
    scale: F,
) -> (Array2<F>, Array2<F>) {
    let db = dz.t().dot(u) * scale; // [V, r]
    let du = dz.dot(&b) * scale; // [T, r]
    (du.t().dot(&h), db) // ∂A [r, d]
}

/// The warm start's cross-entropy with a digit class: a token `k` with `class[k]` (a digit of
/// the target) contributes `−w_k log Σ_{d digit} p_k(d)` — the model is taught that a digit comes
/// here, not which one, so copying an order id stays with the base model — every other token
/// `−w_k log p_k(token)`. `digit[v]`: vocabulary entry `v` is a digit token. Returns
/// `(loss, logp of the target tokens, ∂A, ∂B)`; the reference of the step graph's
/// [`crate::graph::step::StepKind::CrossEntropy`] with `digit_class`.
#[allow(clippy::too_many_arguments)]
pub fn lora_class_ce_and_grad<F: Float + LinalgScalar + ScalarOperand>(
    base: ArrayView2<'_, F>,
    h: ArrayView2<'_, F>,
    tokens: &[usize],
    a: ArrayView2<'_, F>,
    b: ArrayView2<'_, F>,
    scale: F,
    w: &[F],
    class: &[bool],
    digit: &[bool],
) -> (F, Vec<F>, Array2<F>, Array2<F>) {
    let (u, mut z) = lora_logits(base, h, a, b, scale);
    let mut logp = Vec::with_capacity(tokens.len());
    let mut loss = F::zero();
    for (k, (mut row, &tok)) in z.rows_mut().into_iter().zip(tokens).enumerate() {
        let lse = row_logsumexp(row.view());
        logp.push(row[tok] - lse);
        row.mapv_inplace(|x| (x - lse).exp());
        let wk = w[k];
        if class[k] {
            // dZ_j = w (p_j − [j digit] p_j / P_D)
            let pd = row
                .iter()
                .zip(digit)
                .filter(|(_, &d)| d)
                .fold(F::zero(), |acc, (&p, _)| acc + p);
            loss = loss - wk * pd.ln();
            for (p, &d) in row.iter_mut().zip(digit) {
                *p = if d { wk * (*p - *p / pd) } else { wk * *p };
            }
        } else {
            loss = loss - wk * logp[k];
            row.mapv_inplace(|p| wk * p);
            row[tok] = row[tok] - wk;
        }
    }
    let (da, db) = lora_backward(&z, &u, b, h, scale);
    (loss, logp, da, db)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::sampler::Rng;

    /// Random base logits `[t, v]`, features `[t, d]`, LoRA A `[r, d]` and B `[v, r]` (B's
    /// entries in ±`b_scale`).
    fn random_problem(
        (t, v, d, r): (usize, usize, usize, usize),
        seed: u64,
        b_scale: f64,
    ) -> [Array2<f64>; 4] {
        let mut rng = Rng::new(seed);
        let mut rand = |shape: (usize, usize), s: f64| {
            Array2::from_shape_fn(shape, |_| (rng.next_f64() * 2.0 - 1.0) * s)
        };
        [
            rand((t, v), 2.0),
            rand((t, d), 1.0),
            rand((r, d), 0.5),
            rand((v, r), b_scale),
        ]
    }

    /// Asserts that `grad[i, j]` is the central difference of `f` at `x` for every `(i, j)` of
    /// `at`, within `tol · (1 + |fd|)`.
    fn assert_central_differences(
        what: &str,
        x: &Array2<f64>,
        grad: &Array2<f64>,
        at: &[(usize, usize)],
        tol: f64,
        f: impl Fn(&Array2<f64>) -> f64,
    ) {
        let eps = 1e-6;
        for &(i, j) in at {
            let (mut xp, mut xm) = (x.clone(), x.clone());
            xp[[i, j]] += eps;
            xm[[i, j]] -= eps;
            let fd = (f(&xp) - f(&xm)) / (2.0 * eps);
            assert!(
                (fd - grad[[i, j]]).abs() < tol * (1.0 + fd.abs()),
                "{what}[{i},{j}] fd {fd} vs {}",
                grad[[i, j]]
            );
        }
    }

    /// Every index of a `rows × cols` matrix.
    fn all_indices(rows: usize, cols: usize) -> Vec<(usize, usize)> {
        (0..rows)
            .flat_map(|i| (0..cols).map(move |j| (i, j)))
            .collect()
    }

    fn cfg(g: Granularity, c: ClipMode, agg: Aggregation) -> ObjectiveConfig {
        ObjectiveConfig {
            granularity: g,
            clip: c,
            eps_low: 0.2,
            eps_high: 0.28,
            clip_beta: 0.3,
            aggregation: agg,
            tis_cap: Some(2.0),
            kl_coef: 0.05,
            entropy_coef: 0.0,
            mis: false,
            token_guard: None,
        }
    }

    #[test]
    fn surrogate_by_hand() {
        // two tokens, token ratios exp(0.1) and exp(-0.5), advantages +1 and -1, token-mean
        let b = TokenBatch {
            seq: vec![0, 0],
            turn: vec![0, 1],
            adv: vec![1.0, -1.0],
            ig_hat: vec![0.0, 0.0],
            final_turn: vec![false, true],
            logp_old: vec![-1.0, -1.0],
            logp_behavior: vec![-1.0, -1.0],
            logp_ref: vec![-0.9, -1.5],
            trainable: Vec::new(),
        };
        let mut c = cfg(Granularity::Token, ClipMode::Fixed, Aggregation::TokenMean);
        c.kl_coef = 0.0;
        let (loss, g, st) = surrogate(&c, &b, &[-0.9, -1.5]);
        // token 0: s = 1.105 inside [0.8, 1.28] -> obj 1.105; token 1: s = 0.6065 < 0.8, A < 0:
        // min(-0.6065, -0.8) = -0.8 (clipped, no gradient)
        let s0 = 0.1f64.exp();
        assert!((loss - (-(s0 - 0.8) / 2.0)).abs() < 1e-12);
        assert!((g[0] + s0 / 2.0).abs() < 1e-12 && g[1] == 0.0);
        assert_eq!(st.clip_low_frac, 0.5);
        // adaptive: îg = 0 gives c = 1, same result
        let ca = ObjectiveConfig {
            clip: ClipMode::Adaptive,
            ..c.clone()
        };
        assert!((surrogate(&ca, &b, &[-0.9, -1.5]).0 - loss).abs() < 1e-12);
    }

    #[test]
    fn mis_drops_tokens_from_the_denominator() {
        let b = TokenBatch {
            seq: vec![0, 0, 1],
            turn: vec![0, 0, 1],
            logp_old: vec![-1.0, -1.0, -1.0],
            logp_behavior: vec![-1.0, -2.0, -1.1], // ratios 1, e (dropped), 1.105
            ..Default::default()
        };
        let mut c = cfg(Granularity::Token, ClipMode::Fixed, Aggregation::TokenMean);
        c.tis_cap = None;
        c.mis = true;
        assert_eq!(policy_weights(&c, &b), vec![0.5, 0.0, 0.5]);
        c.aggregation = Aggregation::SeqMeanTokenMean;
        assert_eq!(policy_weights(&c, &b), vec![0.5, 0.0, 0.5]);
    }

    #[test]
    fn untrainable_tokens_carry_no_policy_gradient_but_stay_in_the_turn_ratio() {
        // one turn of three tokens, the middle one untrainable (a copied digit); turn ratio,
        // fixed clip 0.2 / 0.28, token-mean over the two trainable tokens, advantage +1
        let b = TokenBatch {
            seq: vec![0, 0, 0],
            turn: vec![0, 0, 0],
            adv: vec![1.0; 3],
            ig_hat: vec![0.0; 3],
            final_turn: vec![true; 3],
            logp_old: vec![-1.0; 3],
            logp_behavior: vec![-1.0; 3],
            logp_ref: vec![-1.0; 3],
            trainable: vec![true, false, true],
        };
        let mut c = cfg(Granularity::Turn, ClipMode::Fixed, Aggregation::TokenMean);
        c.eps_low = 0.2;
        c.eps_high = 0.28;
        c.kl_coef = 0.0;
        c.tis_cap = None;
        assert_eq!(policy_weights(&c, &b), vec![0.5, 0.0, 0.5]);
        // log-ratios 0.1, 0.4, 0.1: the turn's ratio is exp(0.2), the digit's drift included
        let (loss, g, _) = surrogate(&c, &b, &[-0.9, -0.6, -0.9]);
        let s = 0.2f64.exp();
        assert!((loss + s).abs() < 1e-12, "{loss}");
        assert!((g[0] + s / 2.0).abs() < 1e-12 && g[1] == 0.0 && (g[2] + s / 2.0).abs() < 1e-12);
        // a larger drift of the untrainable token alone clips the whole turn (exp(0.3) > 1.28)
        let (_, g, st) = surrogate(&c, &b, &[-0.9, -0.3, -0.9]);
        assert!(g.iter().all(|&x| x == 0.0) && st.clip_high_frac == 1.0);
    }

    #[test]
    fn the_token_guard_stops_tokens_past_their_own_bound_inside_an_active_turn() {
        // one turn of three tokens, log-ratios 0.05, 0.2, −0.25: the turn's ratio is exp(0) = 1,
        // inside the turn clip; guard (0.2, 0.1): bounds ln 0.8 = −0.223 and ln 1.1 = 0.0953
        let b = |adv: f64| TokenBatch {
            seq: vec![0; 3],
            turn: vec![0; 3],
            adv: vec![adv; 3],
            ig_hat: vec![0.0; 3],
            final_turn: vec![true; 3],
            logp_old: vec![-1.0; 3],
            logp_behavior: vec![-1.0; 3],
            logp_ref: vec![-1.0; 3],
            trainable: Vec::new(),
        };
        let mut c = cfg(Granularity::Turn, ClipMode::Fixed, Aggregation::TokenMean);
        c.kl_coef = 0.0;
        c.tis_cap = None;
        c.token_guard = Some((0.2, 0.1));
        let lp = [-0.95, -0.8, -1.25];
        let third = 1.0 / 3.0;
        // A = +1: the token at 0.2 is past 1.1 on the side the advantage pushes: stopped
        let (loss, g, st) = surrogate(&c, &b(1.0), &lp);
        assert!((loss + 1.0).abs() < 1e-12, "{loss}");
        assert!((g[0] + third).abs() < 1e-12 && g[1] == 0.0 && (g[2] + third).abs() < 1e-12);
        assert!((st.clip_high_frac - third).abs() < 1e-12 && st.clip_low_frac == 0.0);
        // A = −1: now the token at −0.25 (below 0.8) is stopped, the one at 0.2 is free
        let (loss, g, st) = surrogate(&c, &b(-1.0), &lp);
        assert!((loss - 1.0).abs() < 1e-12, "{loss}");
        assert!((g[0] - third).abs() < 1e-12 && (g[1] - third).abs() < 1e-12 && g[2] == 0.0);
        assert!((st.clip_low_frac - third).abs() < 1e-12 && st.clip_high_frac == 0.0);
        // without the guard, or with token ratios (their own clip), every token is free
        for c in [
            ObjectiveConfig {
                token_guard: None,
                ..c.clone()
            },
            ObjectiveConfig {
                granularity: Granularity::Token,
                eps_low: 0.9,
                eps_high: 5.0,
                ..c.clone()
            },
        ] {
            let (_, g, _) = surrogate(&c, &b(1.0), &lp);
            assert!(g.iter().all(|&x| x < 0.0), "{:?}: {g:?}", c.granularity);
        }
    }

    #[test]
    fn entropy_bonus_gradient_matches_finite_differences() {
        let [base, h, a, b] = random_problem((3, 6, 4, 2), 21, 0.5);
        let tokens = vec![0, 5, 2];
        let w = vec![0.2, 0.3, 0.5];
        let f = |b: &Array2<f64>| {
            lora_loss_and_grad_entropy(
                base.view(),
                h.view(),
                &tokens,
                a.view(),
                b.view(),
                1.5,
                Some((&w, 0.7)),
                |lp| (-lp[1], vec![0.0, -1.0, 0.0]),
            )
        };
        let (_, _, _, db) = f(&b);
        assert_central_differences("dB", &b, &db, &[(0, 0), (3, 1), (5, 0)], 1e-6, |b| f(b).0);
    }

    #[test]
    fn aggregation_weights_by_hand() {
        let b = TokenBatch {
            seq: vec![0, 0, 0, 1],
            turn: vec![0, 0, 1, 2],
            ..Default::default()
        };
        assert_eq!(
            aggregation_weights(&b, Aggregation::TokenMean),
            vec![0.25; 4]
        );
        let s = aggregation_weights(&b, Aggregation::SeqMeanTokenMean);
        assert_eq!(s, vec![1.0 / 6.0, 1.0 / 6.0, 1.0 / 6.0, 0.5]);
        let t = aggregation_weights(&b, Aggregation::TurnMean);
        assert_eq!(t, vec![1.0 / 6.0, 1.0 / 6.0, 1.0 / 3.0, 1.0 / 3.0]);
        assert_eq!(
            aggregation_weights(&b, Aggregation::SeqMeanTokenSumNorm),
            vec![1.0 / 6.0; 4]
        );
    }

    /// The digit-class cross-entropy by hand and against central finite differences.
    #[test]
    fn digit_class_cross_entropy_matches_hand_values_and_finite_differences() {
        // by hand: zero adapter, base logits ln(1), ln(2), ln(3), ln(4) over [word, d, d, word]:
        // p = .1 .2 .3 .4, the digit class holds .5, so a class token costs −ln .5 (weight 1) and
        // a word token (the last) −ln .4
        let base = Array2::from_shape_vec(
            (2, 4),
            [1.0f64, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0]
                .map(f64::ln)
                .to_vec(),
        )
        .unwrap();
        let h = Array2::from_elem((2, 3), 0.5f64);
        let (a, b) = (
            Array2::from_elem((2, 3), 0.1f64),
            Array2::<f64>::zeros((4, 2)),
        );
        let digit = [false, true, true, false];
        let (loss, logp, _, db) = lora_class_ce_and_grad(
            base.view(),
            h.view(),
            &[1, 3],
            a.view(),
            b.view(),
            2.0,
            &[1.0, 1.0],
            &[true, false],
            &digit,
        );
        assert!(
            (loss - (-(0.5f64.ln()) - 0.4f64.ln())).abs() < 1e-12,
            "{loss}"
        );
        assert!((logp[0] - 0.2f64.ln()).abs() < 1e-12);
        // with B = 0, ∂B_v = scale · Σ_k dZ_kv · u_k; u = A h = 0.15 per rank
        // class row: dZ = (.1, .2 − .4, .3 − .6, .4); word row: dZ = (.1, .2, .3, .4 − 1)
        let want = [0.2, -0.2 + 0.2, -0.3 + 0.3, 0.4 - 0.6];
        for (v, w) in want.iter().enumerate() {
            assert!(
                (db[[v, 0]] - 2.0 * 0.15 * w).abs() < 1e-12,
                "{v}: {}",
                db[[v, 0]]
            );
        }

        let (v, d, r) = (12, 6, 3);
        let [base, h, a, b] = random_problem((5, v, d, r), 21, 0.5);
        let digit: Vec<bool> = (0..v).map(|i| i % 3 == 0).collect();
        let tokens = [0, 4, 3, 6, 1];
        let class = [true, false, true, true, false];
        let w = [0.2, 0.2, 0.3, 0.1, 0.2];
        let f = |a: &Array2<f64>, b: &Array2<f64>| {
            lora_class_ce_and_grad(
                base.view(),
                h.view(),
                &tokens,
                a.view(),
                b.view(),
                1.5,
                &w,
                &class,
                &digit,
            )
        };
        let (_, _, da, db) = f(&a, &b);
        assert_central_differences("dA", &a, &da, &all_indices(r, d), 1e-6, |a| f(a, &b).0);
        assert_central_differences("dB", &b, &db, &all_indices(v, r), 1e-6, |b| f(&a, b).0);
    }

    /// The full step (LoRA forward, log-softmax, surrogate, backward) against central finite
    /// differences in f64, for every granularity and clip mode.
    #[test]
    fn lora_step_gradient_matches_finite_differences() {
        let [base, h, a, b0] = random_problem((6, 9, 5, 2), 4, 0.3);
        let tokens = vec![1, 4, 4, 0, 8, 2];
        // two sessions; turns 0,1 | 2; advantages constant within a session (GSPO-compatible)
        let seq = vec![0, 0, 0, 0, 1, 1];
        let turn = vec![0, 0, 1, 1, 2, 2];
        let adv = vec![0.7, 0.7, 0.7, 0.7, -1.1, -1.1];
        let ig_hat = vec![0.4, 0.4, 0.0, 0.0, -0.3, -0.3];
        let final_turn = vec![false, false, true, true, true, true];
        let scale = 2.0;
        // old policy: slightly different B so that ratios are not all 1
        let old_b = &b0 * 0.9;
        let (_, logp_old, _, _) = lora_loss_and_grad(
            base.view(),
            h.view(),
            &tokens,
            a.view(),
            old_b.view(),
            scale,
            |lp| (0.0, vec![0.0; lp.len()]),
        );
        let batch = TokenBatch {
            seq,
            turn,
            adv,
            ig_hat,
            final_turn,
            logp_old: logp_old.clone(),
            logp_behavior: logp_old.iter().map(|x| x - 0.05).collect(),
            logp_ref: logp_old.iter().map(|x| x - 0.2).collect(),
            trainable: Vec::new(),
        };
        for g in [Granularity::Token, Granularity::Sequence, Granularity::Turn] {
            for c in [
                ClipMode::Fixed,
                ClipMode::Adaptive,
                ClipMode::AdvantageScaled,
            ] {
                for agg in [
                    Aggregation::TokenMean,
                    Aggregation::SeqMeanTokenMean,
                    Aggregation::TurnMean,
                    Aggregation::SeqMeanTokenSumNorm,
                ] {
                    // wide clips keep the finite differences away from the kinks
                    let conf = ObjectiveConfig {
                        eps_low: 0.9,
                        eps_high: 5.0,
                        ..cfg(g, c, agg)
                    };
                    let f = |a: &Array2<f64>, b: &Array2<f64>| {
                        lora_loss_and_grad(
                            base.view(),
                            h.view(),
                            &tokens,
                            a.view(),
                            b.view(),
                            scale,
                            |lp| {
                                let (l, gr, _) = surrogate(&conf, &batch, lp);
                                (l, gr)
                            },
                        )
                    };
                    let (_, _, da, db) = f(&a, &b0);
                    let what = format!("{g:?} {c:?} {agg:?}");
                    let at_a = [(0, 0), (1, 3), (0, 4)];
                    let at_b = [(0, 0), (4, 1), (8, 0), (2, 1)];
                    assert_central_differences(&format!("{what} dA"), &a, &da, &at_a, 1e-6, |a| {
                        f(a, &b0).0
                    });
                    assert_central_differences(&format!("{what} dB"), &b0, &db, &at_b, 1e-6, |b| {
                        f(&a, b).0
                    });
                }
            }
        }
    }
}
