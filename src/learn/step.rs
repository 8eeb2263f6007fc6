//! The third stage of an update: the step. One [`StepBackend`] computes, for a minibatch and
//! the adapter's matrices, the new log-probs, the loss and its gradient — on ONNX Runtime (the
//! graph built in `graph::step`) or on the ndarray reference (`learn::objective`), which the
//! tests hold against each other and against finite differences. The update's loop above it
//! (AdamW, gradient clip, value head) is the same for both.

use ndarray::{Array2, ArrayView2};

use super::config::{Backend, TrainConfig};
use super::objective::{
    aggregation_weights, clip_bounds, group_mean_matrix, lora_class_ce_and_grad,
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
    /// support (0 or [`super::update::EXCLUDED`] per vocabulary entry)
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
