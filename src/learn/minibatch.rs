//! The minibatch stage of an update: the kept sessions cut into minibatches, each with its
//! base logits (tempered and restricted to the sampler's support as each token was sampled),
//! the reference log-probs and the old log-probs under the adapter that generated each turn
//! (under the adapter being updated for imported turns, which no adapter of ours generated).

use std::collections::HashMap;

use ndarray::{Array2, Axis};

use super::batch::SessionData;
use super::config::TrainConfig;
use super::objective::TokenBatch;
use super::step::{self, Lora, Minibatch, StepBackend};
use crate::adapter::Adapter;
use crate::error::{Error, Result};
use crate::policy::sampler::Support;
use crate::policy::OutputHead;

/// Whether an RL token with turn advantage `adv` gets policy gradient under the digit masks
/// (`is_digit` is asked only when a mask applies).
fn token_learns(cfg: &TrainConfig, adv: f64, is_digit: impl FnOnce() -> bool) -> bool {
    let masked = cfg.mask_digits || (cfg.mask_negative_digits && adv <= 0.0);
    !masked || !is_digit()
}

/// A logit value no token of a support can lose to: `exp` of it is 0 in f32, and `0 · it` is 0
/// (an infinity would make the entropy term NaN).
pub(crate) const EXCLUDED: f32 = -1e9;

/// The policy a turn's ratio starts from (PPO's "old" policy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum OldPolicy {
    /// the stored adapter that sampled the turn
    Adapter(i64),
    /// the base model, which sampled the turn with no adapter
    Base,
    /// the adapter being updated: for imported turns, whose sampler is unknown. Their stored
    /// log-probs are the frozen base model's rescoring, which is not the policy being moved;
    /// taking it as "old" would start the ratio at π_parent / π_base (10⁶ after a warm start)
    Parent,
}

impl OldPolicy {
    fn of(turn: &super::batch::TurnData) -> Self {
        match (turn.rescored, turn.adapter_id) {
            (true, _) => OldPolicy::Parent,
            (false, Some(id)) => OldPolicy::Adapter(id),
            (false, None) => OldPolicy::Base,
        }
    }
}

/// Log-softmax of each row of `z` at its token.
pub(super) fn log_softmax_at(z: &Array2<f32>, tokens: &[usize]) -> Vec<f64> {
    z.rows()
        .into_iter()
        .zip(tokens)
        .map(|(row, &t)| {
            let row = row.to_vec();
            row[t] as f64 - crate::policy::sampler::logsumexp(&row)
        })
        .collect()
}

/// What the minibatch stage reads.
pub(super) struct ScoreInputs<'a> {
    pub(super) cfg: &'a TrainConfig,
    pub(super) sft: bool,
    pub(super) head: &'a OutputHead,
    pub(super) sessions: &'a [SessionData],
    /// sessions the update keeps (DAPO's filter)
    pub(super) keep: &'a [bool],
    /// advantage per session and turn
    pub(super) turn_adv: &'a [Vec<f64>],
    /// normalised process signal per session and turn
    pub(super) ig_hat: &'a [Vec<f64>],
    /// the adapters that sampled the turns
    pub(super) generators: &'a HashMap<i64, Adapter>,
    /// the KL term's reference adapter (None: the base model)
    pub(super) kl_ref: Option<&'a Adapter>,
    /// the adapter being trained (its shapes; the base policy is its A with B = 0)
    pub(super) current: &'a Adapter,
    pub(super) block_mode: bool,
}

/// What the minibatch stage gives the steps.
pub(super) struct Scored {
    pub(super) minibatches: Vec<Minibatch>,
    /// the kept sessions, in minibatch order
    pub(super) order_kept: Vec<usize>,
    /// sampled tokens of the kept sessions
    pub(super) total_tokens: usize,
    /// (Σ, max) of |logp_old − logp_behavior|
    pub(super) gap_behavior: (f64, f64),
    /// tokens in that sum
    pub(super) n_gap: usize,
}

/// The minibatch stage: the kept sessions cut into minibatches of about
/// [`TrainConfig::minibatch_tokens`], each with its base logits (tempered and restricted to the
/// sampler's support as each token was sampled), the reference log-probs, and the old
/// log-probs under the adapter that generated each turn, computed by the step's own backend
/// (so that the first ratio of the update is exactly 1).
pub(super) fn score_minibatches(
    x: &ScoreInputs<'_>,
    backend: &mut dyn StepBackend,
    progress: &mut impl FnMut(&str, usize, usize),
) -> Result<Scored> {
    let ScoreInputs {
        cfg,
        sft,
        head,
        sessions,
        keep,
        turn_adv,
        ig_hat,
        generators,
        kl_ref,
        current,
        block_mode,
    } = *x;
    let n_embd = head.n_embd();
    let success = super::annotate::success_target;
    let digit_vocab = (sft && cfg.sft_digit_class).then(|| {
        std::sync::Arc::new(
            (0..head.n_vocab())
                .map(|v| head.is_digit_token(v))
                .collect::<Vec<bool>>(),
        )
    });
    let order_kept: Vec<usize> = (0..sessions.len()).filter(|&i| keep[i]).collect();
    let mut order = order_kept.clone();
    if order.is_empty() {
        return Err(Error::NothingToLearn(
            "every group has equal outcomes (DAPO filter)".into(),
        ));
    }
    let mut minibatches: Vec<Minibatch> = Vec::new();
    let total_tokens: usize = order
        .iter()
        .map(|&i| {
            sessions[i]
                .turns
                .iter()
                .map(|t| t.tokens.len())
                .sum::<usize>()
        })
        .sum();
    let (mut gap_behavior, mut n_gap) = ((0f64, 0f64), 0usize);
    let mut turn_counter = 0usize;
    while !order.is_empty() {
        let mut take = Vec::new();
        let mut n = 0;
        while let Some(&i) = order.first() {
            let len: usize = sessions[i].turns.iter().map(|t| t.tokens.len()).sum();
            if !take.is_empty() && n + len > cfg.minibatch_tokens {
                break;
            }
            take.push(order.remove(0));
            n += len;
        }
        let mut rows = Vec::with_capacity(n * n_embd);
        let mut mb = Minibatch {
            sessions: take.clone(),
            h: Array2::zeros((0, n_embd)),
            hs: Array2::zeros((0, n_embd)),
            base: Array2::zeros((0, 0)),
            tokens: Vec::with_capacity(n),
            batch: TokenBatch::default(),
            states: Vec::new(),
            digit_class: Vec::new(),
            digit_vocab: digit_vocab.clone(),
            block: None,
        };
        let mut block_parts = Vec::new();
        let mut gens = Vec::new();
        // per token: 1 / temperature, the support, the generating adapter
        let mut behaviour: Vec<(f32, Option<&Support>, Option<i64>)> = Vec::with_capacity(n);
        for (si, &i) in take.iter().enumerate() {
            let s = &sessions[i];
            if let Some(x) = &s.block_x {
                // positions 0 .. the one that produced the session's last token
                let end = s
                    .turns
                    .iter()
                    .map(|t| t.context_len + t.tokens.len() - 1)
                    .max()
                    .unwrap_or(0);
                let scored: Vec<usize> = s
                    .turns
                    .iter()
                    .flat_map(|t| (0..t.tokens.len()).map(move |k| t.context_len - 1 + k))
                    .collect();
                let first = mb.tokens.len();
                block_parts.push((x.slice(ndarray::s![..end, ..]), first, scored));
            }
            for (t, turn) in s.turns.iter().enumerate() {
                mb.states.push((mb.tokens.len(), success(s.outcome)));
                for k in 0..turn.tokens.len() {
                    mb.batch.seq.push(si);
                    mb.batch.turn.push(turn_counter);
                    let adv = if sft { 1.0 } else { turn_adv[i][t] };
                    mb.batch.adv.push(adv);
                    mb.batch.ig_hat.push(ig_hat[i][t]);
                    mb.batch.final_turn.push(t + 1 == s.turns.len());
                    mb.batch.logp_behavior.push(turn.logp_behavior[k] as f64);
                    let support = turn.support.get(k).filter(|_| !sft);
                    // a token the sampler had no choice over (greedy, a point-mass digit)
                    // has log-prob 0 under every adapter: nothing to learn from it
                    let forced =
                        support.is_some_and(|s| s.keep.as_ref().is_some_and(|k| k.len() == 1));
                    mb.batch.trainable.push(
                        sft || (!forced
                            && token_learns(cfg, adv, || head.is_digit_token(turn.tokens[k]))),
                    );
                    let inv_t = if sft { 1.0 } else { 1.0 / turn.temperature };
                    behaviour.push((inv_t, support, turn.adapter_id));
                }
                turn_counter += 1;
                if sft && cfg.sft_digit_class {
                    mb.digit_class
                        .extend(turn.tokens.iter().map(|&t| head.is_digit_token(t)));
                }
                mb.tokens.extend_from_slice(&turn.tokens);
                rows.extend(turn.h.iter().copied());
                gens.push((OldPolicy::of(turn), turn.tokens.len()));
            }
        }
        mb.h = Array2::from_shape_vec((mb.tokens.len(), n_embd), rows)
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        mb.base = head.base_logits(mb.h.view())?;
        // the policy each token was sampled from: logits / T (LoRA is linear in h, so the
        // features are divided too), restricted to the sampler's support
        mb.hs = mb.h.clone();
        for (k, &(inv_t, support, gen)) in behaviour.iter().enumerate() {
            let mut row = mb.base.row_mut(k);
            if inv_t != 1.0 {
                row.mapv_inplace(|x| x * inv_t);
                mb.hs.row_mut(k).mapv_inplace(|x| x * inv_t);
            }
            let Some(support) = support.filter(|s| !s.is_full()) else {
                continue;
            };
            let row = row
                .as_slice_mut()
                .ok_or_else(|| Error::Corrupt("base logits are not contiguous".into()))?;
            let excluded = match gen.and_then(|g| generators.get(&g)) {
                // top-p's kept set is ranked by the generating policy's own logits
                Some(ad) if support.top_n.is_some() => {
                    let mut z = vec![0f32; row.len()];
                    ad.apply(&mb.hs.row(k).to_vec(), &mut z);
                    z.iter_mut().zip(row.iter()).for_each(|(z, b)| *z += b);
                    support.excluded(&z)
                }
                _ => support.excluded(row),
            };
            row.iter_mut()
                .zip(excluded)
                .filter(|(_, e)| *e)
                .for_each(|(x, _)| *x = EXCLUDED);
        }
        // the base policy's log-probs; with a reference adapter they are only the step
        // graph's input of the right length while it computes the reference's own
        if block_mode {
            // the block graph computes the logits; `base` keeps only the sampler's support
            mb.base
                .mapv_inplace(|x| if x == EXCLUDED { EXCLUDED } else { 0.0 });
            let views: Vec<_> = block_parts.iter().map(|p| p.0.view()).collect();
            let x =
                ndarray::concatenate(Axis(0), &views).map_err(|e| Error::Corrupt(e.to_string()))?;
            let (mut row, mut parts) = (0, Vec::with_capacity(block_parts.len()));
            for (xs, first, scored) in block_parts {
                parts.push(step::BlockSession {
                    rows: row..row + xs.nrows(),
                    tokens: first..first + scored.len(),
                    scored,
                });
                row += xs.nrows();
            }
            mb.block = Some(step::BlockBatch {
                x,
                inv_t: behaviour.iter().map(|b| b.0).collect(),
                sessions: parts,
            });
        }
        mb.batch.logp_ref = if block_mode {
            vec![0.0; mb.tokens.len()]
        } else {
            log_softmax_at(&mb.base, &mb.tokens)
        };
        let zero_b = Array2::<f32>::zeros(current.b.dim());
        if let Some(r) = kl_ref {
            let w = Lora {
                a: r.a.view(),
                b: r.b.view(),
                scale: r.scale(),
                block: r.block.as_ref().map(|b| &b.factors),
            };
            mb.batch.logp_ref = backend.logp(&mb, w)?;
        } else if block_mode && cfg.objective.kl_coef > 0.0 {
            // the base policy: no adapter at all
            let w = Lora {
                a: current.a.view(),
                b: zero_b.view(),
                scale: current.scale(),
                block: None,
            };
            mb.batch.logp_ref = backend.logp(&mb, w)?;
        }
        // logp_old per turn under the adapter that generated it (the adapter being updated for
        // imports), computed by the same step engine as the new log-probs (so the first ratio
        // of the update is exactly 1 on the turns the parent generated)
        let mut by_gen: HashMap<OldPolicy, Vec<f64>> = HashMap::new();
        for (gen, _) in &gens {
            if !by_gen.contains_key(gen) {
                let generator = match gen {
                    OldPolicy::Adapter(id) => generators.get(id),
                    OldPolicy::Parent => Some(current),
                    OldPolicy::Base => None,
                };
                let (a, b, scale, block) = match generator {
                    Some(ad) => (
                        ad.a.view(),
                        ad.b.view(),
                        ad.scale(),
                        ad.block.as_ref().map(|b| &b.factors),
                    ),
                    None => (current.a.view(), zero_b.view(), current.scale(), None),
                };
                let lp = backend.logp(&mb, Lora { a, b, scale, block })?;
                by_gen.insert(*gen, lp);
            }
        }
        let mut off = 0;
        for (gen, len) in gens {
            let old = &by_gen[&gen][off..off + len];
            for (k, o) in old.iter().enumerate() {
                let db = (o - mb.batch.logp_behavior[off + k]).abs();
                gap_behavior.0 += db;
                gap_behavior.1 = gap_behavior.1.max(db);
                n_gap += 1;
            }
            mb.batch.logp_old.extend_from_slice(old);
            off += len;
        }
        minibatches.push(mb);
        progress(
            "scoring features",
            minibatches.len(),
            minibatches.len() + order.len().min(1),
        );
    }

    Ok(Scored {
        minibatches,
        order_kept,
        total_tokens,
        gap_behavior,
        n_gap,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::learn::config::Algo;

    #[test]
    fn digit_masks_decide_which_tokens_learn() {
        let mut cfg = TrainConfig::preset(Algo::A2tgpo);
        // (advantage, is a digit) → learns, for off / negative / all
        let cases = [
            (0.5, true),
            (-0.5, true),
            (0.0, true),
            (-0.5, false),
            (0.5, false),
        ];
        let learns = |cfg: &TrainConfig| -> Vec<bool> {
            cases
                .iter()
                .map(|&(a, d)| token_learns(cfg, a, || d))
                .collect()
        };
        assert_eq!(learns(&cfg), [true, true, true, true, true]);
        cfg.mask_negative_digits = true;
        assert_eq!(learns(&cfg), [true, false, false, true, true]);
        cfg.mask_digits = true;
        assert_eq!(learns(&cfg), [false, false, false, true, true]);
    }
}
