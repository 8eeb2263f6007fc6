//! The third stage of an update: the step. One [`StepBackend`] computes, for a minibatch and
//! the adapter's matrices, the new log-probs, the loss and its gradient — on ONNX Runtime (the
//! graph built in `graph::step`) or on the ndarray reference (`learn::objective`), which the
//! tests hold against each other and against finite differences. The update's loop above it
//! (AdamW, gradient clip, value head) is the same for both.

use ndarray::{Array2, ArrayView2};

use super::config::{Backend, TrainConfig};
use super::objective::{
    aggregation_weights, clip_bounds, group_mean_matrix, guard_bounds, lora_class_ce_and_grad,
    lora_loss_and_grad, lora_loss_and_grad_entropy, policy_weights, surrogate, Aggregation,
    Granularity, SurrogateStats, TokenBatch,
};
use crate::error::{Error, Result};
use crate::graph::block::{BlockFactors, BlockGraphKind, BlockRows, OrtBlock, PolicyHead};
use crate::graph::step::{ObjectiveInputs, OrtStep, StepInputs, StepKind};
use crate::policy::blocks::TailModel;

/// What one step computed: loss, new log-probs, the gradients of the trained matrices (the
/// output LoRA's A and B, or the block LoRA's A's then B's), and (for RL) the surrogate's
/// statistics.
pub(super) type StepOutput = (f32, Vec<f32>, Vec<Array2<f32>>, Option<SurrogateStats>);

/// LoRA matrices and their scale: where a step evaluates the policy.
#[derive(Clone, Copy)]
pub(super) struct Lora<'a> {
    /// A (r × n_embd)
    pub(super) a: ArrayView2<'a, f32>,
    /// B (n_vocab × r)
    pub(super) b: ArrayView2<'a, f32>,
    /// alpha / r
    pub(super) scale: f32,
    /// the block LoRA (a block step; None: zero, the model's own blocks)
    pub(super) block: Option<&'a BlockFactors>,
}

/// The step's computation on one minibatch, by one engine.
pub(super) trait StepBackend {
    /// Log-probs of the minibatch's tokens under (`a`, `b`, `scale`) (old, reference).
    fn logp(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<Vec<f64>>;

    /// Loss, new log-probs and gradients at `w`.
    fn loss_and_grad(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<StepOutput>;

    /// The ONNX Runtime execution provider, or None for the ndarray reference.
    fn device(&self) -> Option<String>;
}

/// The objective a step graph computes for an SFT or an RL update.
fn step_kind(cfg: &TrainConfig, sft: bool) -> StepKind {
    if sft {
        StepKind::CrossEntropy {
            digit_class: cfg.sft_digit_class,
        }
    } else {
        StepKind::Surrogate {
            granularity: cfg.objective.granularity,
            kl: cfg.objective.kl_coef > 0.0,
            entropy: cfg.objective.entropy_coef > 0.0,
            guard: cfg.objective.active_guard().is_some(),
        }
    }
}

/// The backend `cfg.backend` names, for an SFT or an RL update; with `block` (the model's last
/// blocks and the block LoRA's layout) the block graph, which trains the block LoRA.
///
/// # Errors
/// ONNX Runtime cannot build the step session (library, device).
pub(super) fn backend<'a>(
    cfg: &'a TrainConfig,
    sft: bool,
    block: Option<(TailModel, crate::graph::block::BlockSpec)>,
) -> Result<Box<dyn StepBackend + 'a>> {
    let kind = step_kind(cfg, sft);
    if let Some((tail, spec)) = block {
        if cfg.backend == Backend::Ndarray {
            return Err(Error::Invalid(
                "a block-LoRA update runs on ONNX Runtime only (--backend ort)".into(),
            ));
        }
        let zero = zero_factors(&tail, &spec);
        return Ok(Box::new(BlockStep {
            graph: OrtBlock::new(
                tail,
                spec,
                BlockGraphKind::Step(kind),
                true,
                cfg.device,
                cfg.threads,
            )?,
            zero,
            cfg,
            sft,
        }));
    }
    Ok(match cfg.backend {
        Backend::Ort => Box::new(Ort {
            step: OrtStep::new(kind, cfg.device, cfg.threads)?,
            cfg,
            sft,
        }),
        Backend::Ndarray => Box::new(Reference { cfg, sft }),
    })
}

fn zero_factors(tail: &TailModel, spec: &crate::graph::block::BlockSpec) -> BlockFactors {
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in &tail.blocks {
        for t in &spec.targets {
            let (dout, din) = tail.hp.shape(t);
            a.push(Array2::zeros((spec.r, din)));
            b.push(Array2::zeros((dout, spec.r)));
        }
    }
    BlockFactors { a, b }
}

/// The block graph over whole sessions: the model's last blocks recomputed from the block
/// inputs logged at sampling time, the block LoRA trained, the output LoRA held fixed.
struct BlockStep<'a> {
    graph: OrtBlock,
    zero: BlockFactors,
    cfg: &'a TrainConfig,
    sft: bool,
}

impl BlockStep<'_> {
    /// Runs the step over the minibatch's sessions in parts of at most
    /// [`TrainConfig::block_run_positions`] positions and adds up their losses and gradients.
    fn run(
        &mut self,
        mb: &Minibatch,
        w: Lora<'_>,
    ) -> Result<(f32, Vec<f32>, Option<BlockFactors>)> {
        let blk = mb.block.as_ref().ok_or_else(|| {
            Error::Invalid("a block step needs the sessions' block inputs".into())
        })?;
        let all = step_inputs(self.cfg, self.sft, mb, w.a, w.b, w.scale).obj;
        let factors = w.block.unwrap_or(&self.zero);
        let (mut loss, mut logp, mut grads): (f32, Vec<f32>, Option<BlockFactors>) =
            (0.0, Vec::with_capacity(mb.tokens.len()), None);
        let mut i = 0;
        while i < blk.sessions.len() {
            let first = &blk.sessions[i];
            let mut j = i + 1;
            while j < blk.sessions.len()
                && blk.sessions[j].rows.end - first.rows.start <= self.cfg.block_run_positions
            {
                j += 1;
            }
            let part = &blk.sessions[i..j];
            let rows = first.rows.start..part[part.len() - 1].rows.end;
            let toks = first.tokens.start..part[part.len() - 1].tokens.end;
            let (mut pos, mut seg, mut scored) = (Vec::new(), Vec::new(), Vec::new());
            for (k, s) in part.iter().enumerate() {
                pos.extend(0..s.rows.len());
                seg.extend(std::iter::repeat_n(k, s.rows.len()));
                scored.extend(s.scored.iter().map(|&p| p + s.rows.start - rows.start));
            }
            let block_rows = BlockRows {
                x: blk.x.slice(ndarray::s![rows, ..]),
                pos,
                seg,
                scored,
            };
            let head = PolicyHead {
                output: Some((w.a, w.b, w.scale)),
                inv_t: blk.inv_t[toks.clone()].to_vec(),
                bias: Some(mb.base.slice(ndarray::s![toks.clone(), ..])),
            };
            let (l, lp, g) =
                self.graph
                    .step_policy(&block_rows, factors, &head, &all.slice(toks))?;
            loss += l;
            logp.extend(lp);
            grads = Some(match grads {
                None => g,
                Some(mut acc) => {
                    for (x, y) in acc
                        .a
                        .iter_mut()
                        .chain(acc.b.iter_mut())
                        .zip(g.a.iter().chain(&g.b))
                    {
                        *x += y;
                    }
                    acc
                }
            });
            i = j;
        }
        Ok((loss, logp, grads))
    }
}

impl StepBackend for BlockStep<'_> {
    fn logp(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<Vec<f64>> {
        Ok(self.run(mb, w)?.1.into_iter().map(f64::from).collect())
    }

    fn loss_and_grad(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<StepOutput> {
        let (loss, lp, grads) = self.run(mb, w)?;
        let grads = grads.unwrap_or_else(|| self.zero.clone());
        let stats = (!self.sft).then(|| {
            let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
            surrogate(&self.cfg.objective, &mb.batch, &lp64).2
        });
        Ok((
            loss,
            lp,
            grads.a.into_iter().chain(grads.b).collect(),
            stats,
        ))
    }

    fn device(&self) -> Option<String> {
        Some(format!("{:?}", self.graph.device).to_lowercase())
    }
}

/// The step as an ONNX graph run by ONNX Runtime.
struct Ort<'a> {
    step: OrtStep,
    cfg: &'a TrainConfig,
    sft: bool,
}

impl StepBackend for Ort<'_> {
    fn logp(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<Vec<f64>> {
        let out = self
            .step
            .run(&step_inputs(self.cfg, self.sft, mb, w.a, w.b, w.scale))?;
        Ok(out.1.into_iter().map(f64::from).collect())
    }

    fn loss_and_grad(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<StepOutput> {
        let (loss, lp, da, db) = self
            .step
            .run(&step_inputs(self.cfg, self.sft, mb, w.a, w.b, w.scale))?;
        let stats = (!self.sft).then(|| {
            let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
            surrogate(&self.cfg.objective, &mb.batch, &lp64).2
        });
        Ok((loss, lp, vec![da, db], stats))
    }

    fn device(&self) -> Option<String> {
        Some(format!("{:?}", self.step.device).to_lowercase())
    }
}

/// The step in ndarray: the reference the graph is tested against.
struct Reference<'a> {
    cfg: &'a TrainConfig,
    sft: bool,
}

impl StepBackend for Reference<'_> {
    fn logp(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<Vec<f64>> {
        let (_, lp, _, _) = lora_loss_and_grad(
            mb.base.view(),
            mb.hs.view(),
            &mb.tokens,
            w.a,
            w.b,
            w.scale,
            |lp| (0.0, vec![0.0; lp.len()]),
        );
        Ok(lp.into_iter().map(f64::from).collect())
    }

    fn loss_and_grad(&mut self, mb: &Minibatch, w: Lora<'_>) -> Result<StepOutput> {
        let (cfg, sft) = (self.cfg, self.sft);
        if let Some(digit) = mb.digit_vocab.as_deref() {
            let weights: Vec<f32> = aggregation_weights(&mb.batch, Aggregation::TokenMean)
                .iter()
                .map(|&x| x as f32)
                .collect();
            let (loss, lp, da, db) = lora_class_ce_and_grad(
                mb.base.view(),
                mb.hs.view(),
                &mb.tokens,
                w.a,
                w.b,
                w.scale,
                &weights,
                &mb.digit_class,
                digit,
            );
            return Ok((loss, lp, vec![da, db], None));
        }
        let ent_w: Option<Vec<f32>> = (!sft && cfg.objective.entropy_coef > 0.0).then(|| {
            aggregation_weights(&mb.batch, cfg.objective.aggregation)
                .iter()
                .map(|&x| x as f32)
                .collect()
        });
        let mut stats = None;
        let (loss, lp, da, db) = lora_loss_and_grad_entropy(
            mb.base.view(),
            mb.hs.view(),
            &mb.tokens,
            w.a,
            w.b,
            w.scale,
            ent_w
                .as_ref()
                .map(|w| (w.as_slice(), cfg.objective.entropy_coef as f32)),
            |lp: &[f32]| {
                let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
                if sft {
                    let w = aggregation_weights(&mb.batch, Aggregation::TokenMean);
                    let loss = -lp64.iter().zip(&w).map(|(l, w)| l * w).sum::<f64>();
                    return (loss as f32, w.iter().map(|w| -*w as f32).collect());
                }
                let (loss, g, st) = surrogate(&cfg.objective, &mb.batch, &lp64);
                stats = Some(st);
                (loss as f32, g.into_iter().map(|x| x as f32).collect())
            },
        );
        Ok((loss, lp, vec![da, db], stats))
    }

    fn device(&self) -> Option<String> {
        None
    }
}

/// A minibatch: flattened tokens, their features, and the base logits computed once.
pub(super) struct Minibatch {
    pub(super) sessions: Vec<usize>,
    /// the features as stored (value head, base logits)
    pub(super) h: Array2<f32>,
    /// the features divided by each token's sampling temperature (the policy step)
    pub(super) hs: Array2<f32>,
    pub(super) base: Array2<f32>,
    pub(super) tokens: Vec<usize>,
    pub(super) batch: TokenBatch,
    /// index in `h` of each turn's first token (its state) and the session's outcome in [0, 1]
    pub(super) states: Vec<(usize, f64)>,
    /// SFT with [`TrainConfig::sft_digit_class`]: per token, it is a digit and counts as the
    /// digit class (empty otherwise)
    pub(super) digit_class: Vec<bool>,
    /// with `digit_class`: per vocabulary entry, whether it is a digit token
    pub(super) digit_vocab: Option<std::sync::Arc<Vec<bool>>>,
    /// a block-LoRA update: the sessions' block inputs; `base` then holds only the sampler's
    /// support (0 or [`super::minibatch::EXCLUDED`] per vocabulary entry)
    pub(super) block: Option<BlockBatch>,
}

/// The block inputs of a minibatch's sessions, concatenated.
pub(super) struct BlockBatch {
    /// `[positions, n_embd]`
    pub(super) x: Array2<f32>,
    /// per token, 1 / its sampling temperature
    pub(super) inv_t: Vec<f32>,
    /// per session, in minibatch order
    pub(super) sessions: Vec<BlockSession>,
}

/// Where one session lies in a [`BlockBatch`].
pub(super) struct BlockSession {
    /// its rows of `x` (positions 0 ..)
    pub(super) rows: std::ops::Range<usize>,
    /// its tokens in the minibatch
    pub(super) tokens: std::ops::Range<usize>,
    /// per token, the position that produced it (relative to the session)
    pub(super) scored: Vec<usize>,
}

/// The step inputs of a minibatch for adapter matrices `a`, `b`. Before `logp_old` is known
/// (the forward pass that computes it) the surrogate inputs are neutral.
pub(super) fn step_inputs<'a>(
    cfg: &TrainConfig,
    sft: bool,
    mb: &'a Minibatch,
    a: ndarray::ArrayView2<'a, f32>,
    b: ndarray::ArrayView2<'a, f32>,
    scale: f32,
) -> StepInputs<'a> {
    let f = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let n = mb.tokens.len();
    let ready = mb.batch.logp_old.len() == n;
    let w = if sft {
        f(&aggregation_weights(&mb.batch, Aggregation::TokenMean))
    } else if ready {
        f(&policy_weights(&cfg.objective, &mb.batch))
    } else {
        vec![0.0; n]
    };
    let bounds = if ready {
        clip_bounds(&cfg.objective, &mb.batch)
    } else {
        vec![(1.0, 1.0, 1.0); n]
    };
    StepInputs {
        base: mb.base.view(),
        h: mb.hs.view(),
        a,
        b,
        scale,
        obj: ObjectiveInputs {
            tokens: &mb.tokens,
            w,
            old: if ready {
                f(&mb.batch.logp_old)
            } else {
                vec![0.0; n]
            },
            adv: f(&mb.batch.adv),
            lo: bounds.iter().map(|b| b.0 as f32).collect(),
            hi: bounds.iter().map(|b| b.1 as f32).collect(),
            gmat: (!sft && cfg.objective.granularity != Granularity::Token)
                .then(|| group_mean_matrix(&cfg.objective, &mb.batch).mapv(|x| x as f32)),
            guard: (!sft)
                .then(|| {
                    guard_bounds(&cfg.objective, &mb.batch).map(|g| {
                        (
                            g.iter().map(|b| b.0 as f32).collect(),
                            g.iter().map(|b| b.1 as f32).collect(),
                        )
                    })
                })
                .flatten(),
            kl: (cfg.objective.kl_coef > 0.0).then(|| {
                (
                    f(&mb.batch.logp_ref),
                    f(&aggregation_weights(&mb.batch, cfg.objective.aggregation)),
                    cfg.objective.kl_coef as f32,
                )
            }),
            entropy: (!sft && cfg.objective.entropy_coef > 0.0).then(|| {
                (
                    f(&aggregation_weights(&mb.batch, cfg.objective.aggregation)),
                    cfg.objective.entropy_coef as f32,
                )
            }),
            digit_class: mb.digit_vocab.as_ref().map(|v| {
                let f01 = |x: &[bool]| x.iter().map(|&c| f32::from(u8::from(c))).collect();
                (f01(v), f01(&mb.digit_class))
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    //! The step as the update runs it — a [`Minibatch`] turned into the graph's inputs by
    //! [`step_inputs`] and run by the backend [`backend`] picks — against the f64 reference of
    //! `learn::objective` (itself checked against finite differences), on both backends.

    use std::sync::Arc;

    use super::*;
    use crate::graph::step::tests::{assert_step_matches, random_problem};
    use crate::learn::config::Algo;
    use crate::learn::objective::{
        lora_class_ce_and_grad, lora_loss_and_grad, lora_loss_and_grad_entropy, ClipMode,
        Granularity, ObjectiveConfig, TokenBatch,
    };

    /// A minibatch as the update builds it (one sampling temperature: `hs` = `h`).
    fn minibatch(
        base: &Array2<f64>,
        h: &Array2<f64>,
        tokens: &[usize],
        batch: TokenBatch,
    ) -> Minibatch {
        let h32 = h.mapv(|x| x as f32);
        Minibatch {
            sessions: Vec::new(),
            h: h32.clone(),
            hs: h32,
            base: base.mapv(|x| x as f32),
            tokens: tokens.to_vec(),
            batch,
            states: Vec::new(),
            digit_class: Vec::new(),
            digit_vocab: None,
            block: None,
        }
    }

    /// `loss_and_grad` of `cfg`'s step on both backends, as graph-shaped outputs.
    fn both_backends(
        cfg: &TrainConfig,
        sft: bool,
        mb: &Minibatch,
        (a, b, scale): (&Array2<f64>, &Array2<f64>, f64),
    ) -> Vec<(Backend, crate::graph::step::StepOutput)> {
        let (a, b) = (a.mapv(|x| x as f32), b.mapv(|x| x as f32));
        [Backend::Ort, Backend::Ndarray]
            .into_iter()
            .map(|be| {
                let mut cfg = cfg.clone();
                cfg.backend = be;
                cfg.threads = 1;
                let mut step = backend(&cfg, sft, None).unwrap();
                let lora = Lora {
                    a: a.view(),
                    b: b.view(),
                    scale: scale as f32,
                    block: None,
                };
                let (loss, lp, mut g, _) = step.loss_and_grad(mb, lora).unwrap();
                let db = g.pop().unwrap();
                let da = g.pop().unwrap();
                (be, (loss, lp, da, db))
            })
            .collect()
    }

    /// Both backends' step against the f64 reference `(loss, logp, ∂A, ∂B)`.
    fn assert_backends_match(
        what: &str,
        cfg: &TrainConfig,
        sft: bool,
        mb: &Minibatch,
        lora: (&Array2<f64>, &Array2<f64>, f64),
        reference: (f64, &[f64], &Array2<f64>, &Array2<f64>),
    ) {
        for (be, out) in both_backends(cfg, sft, mb, lora) {
            assert_step_matches(&format!("{what} {be:?}"), out, reference);
        }
    }

    /// Every ratio granularity and clip mode, with the KL and entropy terms and two untrainable
    /// tokens.
    #[test]
    fn the_update_step_matches_the_reference_gradient_on_both_backends() {
        let (t, v, d, r) = (7, 40, 16, 4);
        let (base, h, a, b) = random_problem((t, v, d, r), 8, 3.0);
        let tokens = vec![3, 17, 0, 39, 8, 8, 21];
        let scale = 2.0;
        let (_, old, _, _) = lora_loss_and_grad(
            base.view(),
            h.view(),
            &tokens,
            a.view(),
            (&b * 0.8).view(),
            scale,
            |lp| (0.0, vec![0.0; lp.len()]),
        );
        let batch = TokenBatch {
            seq: vec![0, 0, 0, 1, 1, 1, 1],
            turn: vec![0, 0, 1, 2, 2, 3, 3],
            adv: vec![0.9, 0.9, 0.9, -0.4, -0.4, -0.4, -0.4],
            ig_hat: vec![0.5, 0.5, 0.0, -1.0, -1.0, 0.0, 0.0],
            final_turn: vec![false, false, true, false, false, true, true],
            logp_old: old.clone(),
            logp_behavior: old.iter().map(|x| x - 0.1).collect(),
            logp_ref: old.iter().map(|x| x + 0.05).collect(),
            // two untrainable tokens (e.g. copied digits): zero policy weight in both engines
            trainable: vec![true, false, true, true, true, false, true],
        };
        let mb = minibatch(&base, &h, &tokens, batch.clone());
        let guards = [None, Some((0.05, 0.05))];
        for (g, c, guard) in [Granularity::Token, Granularity::Sequence, Granularity::Turn]
            .into_iter()
            .flat_map(|g| {
                [
                    ClipMode::Fixed,
                    ClipMode::Adaptive,
                    ClipMode::AdvantageScaled,
                ]
                .into_iter()
                .flat_map(move |c| guards.map(|guard| (g, c, guard)))
            })
        {
            let mut cfg = TrainConfig::preset(Algo::A2tgpo);
            cfg.objective = ObjectiveConfig {
                granularity: g,
                clip: c,
                eps_low: 0.2,
                eps_high: 0.28,
                clip_beta: 0.3,
                aggregation: Aggregation::SeqMeanTokenMean,
                tis_cap: Some(2.0),
                kl_coef: 0.1,
                entropy_coef: 0.05,
                mis: false,
                token_guard: guard,
            };
            let w_ent = aggregation_weights(&batch, cfg.objective.aggregation);
            let reference = |cfg: &TrainConfig| {
                lora_loss_and_grad_entropy(
                    base.view(),
                    h.view(),
                    &tokens,
                    a.view(),
                    b.view(),
                    scale,
                    Some((&w_ent, 0.05)),
                    |lp| {
                        let (l, gr, _) = surrogate(&cfg.objective, &batch, lp);
                        (l, gr)
                    },
                )
            };
            let (l_ref, lp_ref, da_ref, db_ref) = reference(&cfg);
            if guard.is_some() && g != Granularity::Token {
                // the guard stops some tokens here and leaves others: the gradient changes
                let mut open = cfg.clone();
                open.objective.token_guard = None;
                let st = surrogate(&cfg.objective, &batch, &lp_ref).2;
                let st_open = surrogate(&open.objective, &batch, &lp_ref).2;
                let stopped = st.clip_low_frac + st.clip_high_frac
                    - st_open.clip_low_frac
                    - st_open.clip_high_frac;
                assert!(stopped > 0.0 && stopped < 0.5, "{g:?} {c:?}: {stopped}");
                assert!(reference(&open).2 != da_ref, "{g:?} {c:?}");
            }
            assert_backends_match(
                &format!("{g:?} {c:?} guard {guard:?}"),
                &cfg,
                false,
                &mb,
                (&a, &b, scale),
                (l_ref, &lp_ref, &da_ref, &db_ref),
            );
        }
    }

    /// The warm start's cross-entropy, plain and with the digit class (every third vocabulary
    /// entry a digit; target tokens that are digits count as the class).
    #[test]
    fn the_supervised_step_matches_the_reference_gradient_on_both_backends() {
        let (t, v, d, r) = (7, 40, 16, 4);
        let (base, h, a, b) = random_problem((t, v, d, r), 8, 3.0);
        let tokens = vec![3, 17, 0, 39, 8, 8, 21];
        let scale = 2.0;
        let batch = TokenBatch {
            seq: vec![0; t],
            turn: vec![0; t],
            adv: vec![0.0; t],
            ig_hat: vec![0.0; t],
            final_turn: vec![true; t],
            logp_old: Vec::new(),
            logp_behavior: Vec::new(),
            logp_ref: Vec::new(),
            trainable: Vec::new(),
        };
        let mut mb = minibatch(&base, &h, &tokens, batch);
        let w: Vec<f64> = vec![1.0 / t as f64; t];
        let (l_ref, lp_ref, da_ref, db_ref) = lora_loss_and_grad(
            base.view(),
            h.view(),
            &tokens,
            a.view(),
            b.view(),
            scale,
            |lp| {
                (
                    -lp.iter().zip(&w).map(|(l, w)| l * w).sum::<f64>(),
                    w.iter().map(|w| -w).collect(),
                )
            },
        );
        let mut cfg = TrainConfig::preset(Algo::Sft);
        assert_backends_match(
            "cross-entropy",
            &cfg,
            true,
            &mb,
            (&a, &b, scale),
            (l_ref, &lp_ref, &da_ref, &db_ref),
        );
        let digit: Vec<bool> = (0..v).map(|i| i % 3 == 0).collect();
        let class: Vec<bool> = tokens.iter().map(|&k| digit[k]).collect();
        assert!(
            class.iter().any(|&c| c) && class.iter().any(|&c| !c),
            "{tokens:?}"
        );
        let (l_ref, lp_ref, da_ref, db_ref) = lora_class_ce_and_grad(
            base.view(),
            h.view(),
            &tokens,
            a.view(),
            b.view(),
            scale,
            &w,
            &class,
            &digit,
        );
        cfg.sft_digit_class = true;
        mb.digit_class = class;
        mb.digit_vocab = Some(Arc::new(digit));
        assert_backends_match(
            "digit class",
            &cfg,
            true,
            &mb,
            (&a, &b, scale),
            (l_ref, &lp_ref, &da_ref, &db_ref),
        );
    }

    /// The clamp of log s at 10 cuts the gradient on both engines: on stale data a token with
    /// log-ratio 12 and a negative advantage is on the unclipped side of the min, and before
    /// the fix the Rust reference still returned its e^10-sized gradient while the graph gave 0.
    #[test]
    fn clamped_ratio_has_no_gradient_on_either_engine() {
        let t = 6;
        let (base, h, a, b) = random_problem((t, 24, 8, 2), 3, 2.0);
        let tokens = vec![1, 5, 9, 13, 17, 21];
        let (_, lp, _, _) = lora_loss_and_grad(
            base.view(),
            h.view(),
            &tokens,
            a.view(),
            b.view(),
            2.0,
            |lp| (0.0, vec![0.0; lp.len()]),
        );
        let mut cfg = TrainConfig::preset(Algo::Grpo);
        cfg.objective.aggregation = Aggregation::TokenMean;
        let run = |stale: &[bool]| {
            let batch = TokenBatch {
                seq: vec![0; t],
                turn: vec![0; t],
                adv: vec![-1.0; t],
                ig_hat: vec![0.0; t],
                final_turn: vec![true; t],
                logp_old: lp
                    .iter()
                    .zip(stale)
                    .map(|(x, &st)| if st { x - 12.0 } else { x - 0.01 })
                    .collect(),
                logp_behavior: lp.clone(),
                logp_ref: lp.clone(),
                trainable: Vec::new(),
            };
            let reference = lora_loss_and_grad(
                base.view(),
                h.view(),
                &tokens,
                a.view(),
                b.view(),
                2.0,
                |lp| {
                    let (l, g, _) = surrogate(&cfg.objective, &batch, lp);
                    (l, g)
                },
            );
            let mb = minibatch(&base, &h, &tokens, batch);
            (reference, both_backends(&cfg, false, &mb, (&a, &b, 2.0)))
        };
        let max = |x: &mut dyn Iterator<Item = f64>| x.fold(0f64, |m, v| m.max(v.abs()));
        // every token clamped: no gradient at all, on both engines
        let ((_, _, da, db), outs) = run(&[true; 6]);
        assert_eq!(max(&mut da.iter().chain(db.iter()).copied()), 0.0);
        for (be, (_, _, oa, ob)) in outs {
            let g = max(&mut oa.iter().chain(ob.iter()).map(|&x| f64::from(x)));
            assert_eq!(g, 0.0, "{be:?}");
        }
        // half clamped: the engines agree, and the gradient is that of the other half alone
        let (reference, outs) = run(&[true, false, true, false, true, false]);
        for (be, out) in outs {
            assert_step_matches(
                &format!("half clamped {be:?}"),
                out,
                (reference.0, &reference.1, &reference.2, &reference.3),
            );
        }
        assert!(max(&mut reference.3.iter().copied()) > 0.0);
        assert!(
            max(&mut reference.3.iter().copied()) < 1.0,
            "no e^10-sized gradient"
        );
    }
}
