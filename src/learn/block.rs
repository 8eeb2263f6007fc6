//! Block LoRA from captured activations: capturing a session's block input with llama.cpp,
//! measuring how closely the ONNX graph reproduces llama.cpp's logits, and supervised
//! (teacher-forced cross-entropy) training of a [`BlockLora`].

use ndarray::{Array2, Axis};

use std::path::Path;

use crate::adapter::block::BlockLora;
use crate::adapter::Adapter;
use crate::error::{Error, Result};
use crate::graph::block::{BlockGraphKind, BlockRows, OrtBlock, OutputLora, PolicyHead};
use crate::graph::step::ObjectiveInputs;
use crate::graph::step::StepKind;
use crate::graph::Device;
use crate::learn::optim::AdamW;
use crate::policy::blocks::TailModel;
use crate::policy::llama::{Context, Token};
use crate::store::Store;

/// One session as llama.cpp processed it: its tokens, the block input of every position, and
/// llama.cpp's own logits at the positions that produced a token.
#[derive(Debug, Clone)]
pub struct Captured {
    /// every token of the session (prompt and reply)
    pub tokens: Vec<Token>,
    /// `[N, n_embd]`: the input of the first adapted block at each position
    pub x: Array2<f32>,
    /// positions whose logits produced the next token
    pub scored: Vec<usize>,
    /// llama.cpp's logits at `scored`, `[S, n_vocab]` (empty when not kept)
    pub logits: Array2<f32>,
    /// llama.cpp's final normalised hidden state at `scored` when the context captures it
    /// (`n_embd` per scored row; empty otherwise)
    pub hidden: Vec<f32>,
}

impl Captured {
    /// The tokens the scored positions produced.
    pub fn targets(&self) -> Vec<usize> {
        self.scored
            .iter()
            .map(|&p| self.tokens[p + 1] as usize)
            .collect()
    }

    /// The session as one run of the block graph: every position, one segment, its scored rows.
    pub fn rows(&self) -> BlockRows<'_> {
        let n = self.x.nrows();
        BlockRows {
            x: self.x.view(),
            pos: (0..n).collect(),
            seg: vec![0; n],
            scored: self.scored.clone(),
        }
    }

    /// Bytes per position of the stored activations at f16.
    pub fn bytes_per_token_f16(&self) -> usize {
        self.x.ncols() * 2
    }
}

fn rows_of(ctx: &mut Context, n: usize, width: usize) -> Result<Array2<f32>> {
    let v = ctx.take_block_rows();
    Array2::from_shape_vec((n, width), v).map_err(|e| Error::Llama(e.to_string()))
}

/// Decodes `prompt` in one batch, then generates `n_new` tokens greedily one at a time, the way
/// the engine samples, capturing block inputs and keeping llama.cpp's logits of every step.
/// The context must capture a block (`ContextParams::capture_block`); its KV cache is cleared.
///
/// # Errors
/// [`Error::Llama`] on decode failures or a context without block capture.
pub fn generate_captured(
    ctx: &mut Context,
    prompt: &[Token],
    n_new: usize,
    n_embd: usize,
    stop: impl Fn(Token) -> bool,
) -> Result<Captured> {
    ctx.truncate(0);
    let mut outs = vec![false; prompt.len()];
    if let Some(l) = outs.last_mut() {
        *l = true;
    }
    let mut hidden = ctx.decode(prompt, 0, &outs)?;
    let mut xs = vec![rows_of(ctx, prompt.len(), n_embd)?];
    let mut tokens = prompt.to_vec();
    let mut logits = vec![ctx.logits(prompt.len() - 1).to_vec()];
    let mut scored = vec![prompt.len() - 1];
    for _ in 0..n_new {
        let last = logits.last().map(Vec::as_slice).unwrap_or(&[]);
        let next = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as Token)
            .unwrap_or(0);
        tokens.push(next);
        if stop(next) {
            break;
        }
        let pos = tokens.len() - 1;
        hidden.extend(ctx.decode(&[next], pos, &[true])?);
        xs.push(rows_of(ctx, 1, n_embd)?);
        logits.push(ctx.logits(0).to_vec());
        scored.push(pos);
    }
    // the last scored position's token was appended; drop a trailing unscored position
    let views: Vec<_> = xs.iter().map(|a| a.view()).collect();
    let x = ndarray::concatenate(Axis(0), &views).map_err(|e| Error::Llama(e.to_string()))?;
    let n = x.nrows();
    tokens.truncate(n + 1);
    scored.retain(|&p| p < n && p + 1 < tokens.len());
    logits.truncate(scored.len());
    let v = logits.first().map(Vec::len).unwrap_or(0);
    let flat: Vec<f32> = logits.into_iter().flatten().collect();
    let logits =
        Array2::from_shape_vec((scored.len(), v), flat).map_err(|e| Error::Llama(e.to_string()))?;
    hidden.truncate(scored.len() * n_embd);
    Ok(Captured {
        tokens,
        x,
        scored,
        logits,
        hidden,
    })
}

/// Captures the block inputs of positions `0 .. tokens.len() − 1` of a known sequence (the last
/// token is only a target) in prefill batches. The KV cache is cleared first.
///
/// # Errors
/// [`Error::Llama`] on decode failures; [`Error::Invalid`] for fewer than two tokens.
pub fn capture_sequence(ctx: &mut Context, tokens: &[Token], n_embd: usize) -> Result<Array2<f32>> {
    if tokens.len() < 2 {
        return Err(Error::Invalid("a sequence of fewer than two tokens".into()));
    }
    ctx.truncate(0);
    let nb = ctx.n_batch();
    let n = tokens.len() - 1;
    let mut xs = Vec::new();
    let mut start = 0;
    while start < n {
        let end = (start + nb).min(n);
        ctx.decode(&tokens[start..end], start, &vec![false; end - start])?;
        xs.push(rows_of(ctx, end - start, n_embd)?);
        start = end;
    }
    let views: Vec<_> = xs.iter().map(|a| a.view()).collect();
    ndarray::concatenate(Axis(0), &views).map_err(|e| Error::Llama(e.to_string()))
}

/// Captures the block inputs of a whole known sequence (prompt + reply) in prefill batches,
/// scoring the positions from `prompt_len − 1` on (each predicts the next reply token).
///
/// # Errors
/// [`Error::Llama`] on decode failures; [`Error::Invalid`] when there is no reply token.
pub fn teacher_forced(
    ctx: &mut Context,
    tokens: &[Token],
    prompt_len: usize,
    n_embd: usize,
) -> Result<Captured> {
    if prompt_len == 0 || prompt_len >= tokens.len() {
        return Err(Error::Invalid(format!(
            "a prompt of {prompt_len} tokens in a sequence of {}",
            tokens.len()
        )));
    }
    let x = capture_sequence(ctx, tokens, n_embd)?;
    Ok(Captured {
        tokens: tokens.to_vec(),
        scored: (prompt_len - 1..x.nrows()).collect(),
        x,
        logits: Array2::zeros((0, 0)),
        hidden: Vec::new(),
    })
}

/// The assistant turns of logged sessions as training sequences: the session's tokens and the
/// positions that produced each assistant token (block inputs not yet captured: `x` is empty).
///
/// # Errors
/// Store errors.
pub fn assistant_positions(
    store: &crate::store::Store,
    id: i64,
) -> Result<Option<(Vec<Token>, Vec<usize>)>> {
    use crate::policy::Role;
    let mut tokens: Vec<Token> = Vec::new();
    let mut scored = Vec::new();
    for t in store.turns(id)? {
        if t.context_len != tokens.len() {
            return Ok(None);
        }
        if t.role == Role::Assistant {
            let c = t.context_len;
            scored.extend((0..t.token_ids.len()).filter_map(|i| (c + i).checked_sub(1)));
        }
        tokens.extend_from_slice(&t.token_ids);
    }
    Ok((!scored.is_empty() && tokens.len() >= 2).then_some((tokens, scored)))
}

/// How closely the graph reproduces llama.cpp's logits.
#[derive(Debug, Clone, Copy, Default, serde::Serialize)]
pub struct Parity {
    /// scored tokens compared
    pub tokens: usize,
    /// largest |logit gap| over every vocabulary entry of every token
    pub max_logit_gap: f32,
    /// mean |logit gap|
    pub mean_logit_gap: f64,
    /// mean |log p_graph − log p_llama.cpp| of the token that was chosen
    pub mean_logp_gap: f64,
    /// largest such gap
    pub max_logp_gap: f64,
}

fn log_softmax_at(row: ndarray::ArrayView1<'_, f32>, i: usize) -> f64 {
    let m = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let s: f64 = row.iter().map(|&z| (z as f64 - m).exp()).sum();
    row[i] as f64 - m - s.ln()
}

/// Scores each captured session with the graph (built as logits) and `lora`, comparing with
/// llama.cpp's logits.
///
/// # Errors
/// [`Error::Invalid`] when a session kept no logits; graph errors.
pub fn parity(graph: &mut OrtBlock, sessions: &[Captured], lora: &BlockLora) -> Result<Parity> {
    let mut p = Parity::default();
    let (mut sum_gap, mut n_gap, mut sum_lp) = (0f64, 0usize, 0f64);
    for c in sessions {
        if c.logits.nrows() != c.scored.len() {
            return Err(Error::Invalid("captured session kept no logits".into()));
        }
        let z = graph.logits(&c.rows(), &lora.factors)?;
        for (i, t) in c.targets().into_iter().enumerate() {
            let (zg, zl) = (z.row(i), c.logits.row(i));
            for (a, b) in zg.iter().zip(zl.iter()) {
                let d = (a - b).abs();
                p.max_logit_gap = p.max_logit_gap.max(d);
                sum_gap += d as f64;
            }
            n_gap += zg.len();
            let d = (log_softmax_at(zg, t) - log_softmax_at(zl, t)).abs();
            sum_lp += d;
            p.max_logp_gap = p.max_logp_gap.max(d);
            p.tokens += 1;
        }
    }
    p.mean_logit_gap = sum_gap / n_gap.max(1) as f64;
    p.mean_logp_gap = sum_lp / p.tokens.max(1) as f64;
    Ok(p)
}

/// A supervised block-LoRA fit that ends in a candidate adapter version.
pub struct BlockSft<'a> {
    /// the captured sessions trained on
    pub data: &'a [Captured],
    /// the block LoRA it starts from (trained in place)
    pub lora: BlockLora,
    /// the parent's block LoRA in the same layout, when there is one to measure the KL to
    pub parent_lora: Option<BlockLora>,
    /// the candidate's other parts (output LoRA, value head: the parent's, or fresh); the block
    /// LoRA is trained and scored with this output LoRA on top, as the engine serves them
    pub adapter: Adapter,
    /// the parent version (None: a fresh adapter)
    pub parent: Option<i64>,
    /// steps, batch, learning rate, seed
    pub sft: SftConfig,
    /// ONNX Runtime device and threads
    pub device: Device,
    /// ONNX Runtime threads
    pub threads: usize,
}

/// What [`fit_block_sft`] wrote and measured.
#[derive(Debug, Clone)]
pub struct BlockSftReport {
    /// the candidate version
    pub id: i64,
    /// the loss of every step
    pub losses: Vec<f32>,
    /// (approx KL to the parent, parent's mean reply log-prob, candidate's, reply tokens) when
    /// [`BlockSft::parent_lora`] was given
    pub kl: Option<(f64, f64, f64, usize)>,
    /// the metrics stored with the candidate
    pub metrics: serde_json::Value,
}

/// Trains the block LoRA of `job` teacher-forced ([`train_sft`]) on the tail `tail`, measures
/// the approximate KL to the parent's block LoRA on the tokens trained on (as the other updates
/// measure it), and writes the candidate ([`crate::learn::candidate::write_candidate`]) with
/// `extra` merged into its metrics. `tick` is called after every step with its loss.
///
/// # Errors
/// Graph errors, a non-finite loss, store and write errors (a failed write leaves the version
/// rejected).
pub fn fit_block_sft(
    store: &mut Store,
    db: &Path,
    tail: TailModel,
    job: BlockSft<'_>,
    extra: serde_json::Value,
    mut tick: impl FnMut(f32),
) -> Result<BlockSftReport> {
    let BlockSft {
        data,
        mut lora,
        parent_lora,
        mut adapter,
        parent,
        sft,
        device,
        threads,
    } = job;
    let spec = lora.spec.clone();
    let mut g = OrtBlock::new(
        tail,
        spec.clone(),
        BlockGraphKind::Step(StepKind::CrossEntropy { digit_class: false }),
        true,
        device,
        threads,
    )?;
    let output = Some(adapter.output_lora());
    let losses = train_sft(&mut g, data, &mut lora, output, sft, |_, loss| tick(loss))?;
    let kl = match &parent_lora {
        Some(p) => {
            let (old, n) = mean_reply_logp(&mut g, data, p, output)?;
            let (new, _) = mean_reply_logp(&mut g, data, &lora, output)?;
            Some((old - new, old, new, n))
        }
        None => None,
    };
    adapter.block = Some(lora);
    let mut metrics = serde_json::json!({
        "algo": "sft-block",
        "block": {"k": spec.k, "targets": spec.targets, "r": spec.r, "alpha": spec.alpha},
        "sessions": data.len(),
        "steps": sft.steps,
        "first_loss": losses.first(),
        "final_loss": losses.last(),
    });
    if let Some((approx_kl, old, new, n)) = kl {
        metrics["approx_kl"] = approx_kl.into();
        metrics["reply_logp_parent"] = old.into();
        metrics["reply_logp"] = new.into();
        metrics["reply_tokens"] = n.into();
    }
    if let (Some(m), serde_json::Value::Object(x)) = (metrics.as_object_mut(), extra) {
        m.extend(x);
    }
    let id = crate::learn::candidate::write_candidate(store, db, parent, &adapter, &metrics)?;
    Ok(BlockSftReport {
        id,
        losses,
        kl,
        metrics,
    })
}

/// Supervised training settings.
#[derive(Debug, Clone, Copy)]
pub struct SftConfig {
    /// optimizer steps
    pub steps: usize,
    /// sessions per step
    pub batch: usize,
    /// AdamW learning rate
    pub lr: f64,
    /// shuffling seed
    pub seed: u64,
}

/// Teacher-forced cross-entropy on captured sessions (`graph` built as a cross-entropy step):
/// each step concatenates `batch` sessions, weights every reply token by 1 / (tokens in the
/// batch), and applies AdamW to `lora`. The policy trained is the blocks with `lora` plus the
/// fixed `output` LoRA the adapter is served with (None: the model's own output projection).
/// Returns the loss of every step.
///
/// # Errors
/// Graph errors; [`Error::Invalid`] when a loss is not finite (the adapter is left as it was
/// before that step).
pub fn train_sft(
    graph: &mut OrtBlock,
    data: &[Captured],
    lora: &mut BlockLora,
    output: Option<OutputLora<'_>>,
    cfg: SftConfig,
    mut progress: impl FnMut(usize, f32),
) -> Result<Vec<f32>> {
    if data.is_empty() {
        return Err(Error::Invalid("no training sessions".into()));
    }
    let shapes: Vec<(usize, usize)> = lora
        .factors
        .a
        .iter()
        .chain(&lora.factors.b)
        .map(|m| m.dim())
        .collect();
    let head = PolicyHead {
        output,
        ..PolicyHead::default()
    };
    let mut opt = AdamW::new(&shapes);
    let mut rng = crate::policy::sampler::Rng::new(cfg.seed);
    let mut order: Vec<usize> = (0..data.len()).collect();
    let mut cursor = order.len();
    let mut losses = Vec::with_capacity(cfg.steps);
    for step in 0..cfg.steps {
        let mut pick = Vec::with_capacity(cfg.batch);
        while pick.len() < cfg.batch.min(data.len()) {
            if cursor == order.len() {
                for i in (1..order.len()).rev() {
                    let j = (rng.next_f64() * (i + 1) as f64) as usize;
                    order.swap(i, j.min(i));
                }
                cursor = 0;
            }
            pick.push(order[cursor]);
            cursor += 1;
        }
        let views: Vec<_> = pick.iter().map(|&i| data[i].x.view()).collect();
        let x = ndarray::concatenate(Axis(0), &views).map_err(|e| Error::Invalid(e.to_string()))?;
        let (mut pos, mut seg, mut scored, mut targets) = (vec![], vec![], vec![], vec![]);
        let mut off = 0;
        for (s, &i) in pick.iter().enumerate() {
            let c = &data[i];
            let n = c.x.nrows();
            pos.extend(0..n);
            seg.extend(std::iter::repeat_n(s, n));
            scored.extend(c.scored.iter().map(|&p| p + off));
            targets.extend(c.targets());
            off += n;
        }
        let w = vec![1.0 / targets.len().max(1) as f32; targets.len()];
        let obj = ObjectiveInputs::cross_entropy(&targets, w);
        let rows = BlockRows {
            x: x.view(),
            pos,
            seg,
            scored,
        };
        let (loss, _, grads) = graph.step_policy(&rows, &lora.factors, &head, &obj)?;
        if !loss.is_finite() {
            return Err(Error::Invalid(format!(
                "cross-entropy is {loss} at step {step}; the adapter keeps its previous values"
            )));
        }
        let gs: Vec<Array2<f32>> = grads.a.into_iter().chain(grads.b).collect();
        let mut params: Vec<&mut Array2<f32>> = lora
            .factors
            .a
            .iter_mut()
            .chain(lora.factors.b.iter_mut())
            .collect();
        opt.step(&mut params, &gs, [cfg.lr, 0.0, 1e-8]);
        losses.push(loss);
        progress(step, loss);
    }
    Ok(losses)
}

/// The mean log-prob of the reply tokens of `data` under `lora` with the fixed `output` LoRA on
/// top (a graph built as a cross-entropy step; its log-probs are read, its gradients ignored),
/// one session per run, and the number of tokens. `turnwise train --algo sft --block-k` gates its candidate on the
/// difference between the parent's and the candidate's value (the approximate KL of the other
/// updates: the mean of `logp_parent − logp_candidate` over the tokens trained on).
///
/// # Errors
/// Graph errors; [`Error::Invalid`] when there are no reply tokens or a log-prob is not finite.
pub fn mean_reply_logp(
    graph: &mut OrtBlock,
    data: &[Captured],
    lora: &BlockLora,
    output: Option<OutputLora<'_>>,
) -> Result<(f64, usize)> {
    let head = PolicyHead {
        output,
        ..PolicyHead::default()
    };
    let (mut sum, mut n) = (0f64, 0usize);
    for c in data {
        let targets = c.targets();
        if targets.is_empty() {
            continue;
        }
        let w = vec![1.0 / targets.len() as f32; targets.len()];
        let obj = ObjectiveInputs::cross_entropy(&targets, w);
        let (_, logp, _) = graph.step_policy(&c.rows(), &lora.factors, &head, &obj)?;
        if let Some(bad) = logp.iter().find(|l| !l.is_finite()) {
            return Err(Error::Invalid(format!("a reply token's log-prob is {bad}")));
        }
        sum += logp.iter().map(|&l| f64::from(l)).sum::<f64>();
        n += logp.len();
    }
    if n == 0 {
        return Err(Error::Invalid("no reply tokens to score".into()));
    }
    Ok((sum / n as f64, n))
}

/// Re-runs llama.cpp over a captured session with the same batching as
/// [`generate_captured`] (prompt in one batch, then one token per decode) and returns its
/// logits at the scored positions: how the session's tokens score under whatever adapter the
/// context holds now. The KV cache is cleared first.
///
/// # Errors
/// [`Error::Llama`] on decode failures; [`Error::Invalid`] for a session without scored rows.
pub fn replay_logits(ctx: &mut Context, c: &Captured) -> Result<Array2<f32>> {
    let first = *c
        .scored
        .first()
        .ok_or_else(|| Error::Invalid("session has no scored positions".into()))?;
    ctx.truncate(0);
    let prompt = &c.tokens[..=first];
    let mut outs = vec![false; prompt.len()];
    outs[first] = true;
    ctx.decode(prompt, 0, &outs)?;
    ctx.take_block_rows();
    let mut rows = vec![ctx.logits(first).to_vec()];
    for &p in &c.scored[1..] {
        ctx.decode(&[c.tokens[p]], p, &[true])?;
        ctx.take_block_rows();
        rows.push(ctx.logits(0).to_vec());
    }
    let v = rows[0].len();
    Array2::from_shape_vec((rows.len(), v), rows.into_iter().flatten().collect())
        .map_err(|e| Error::Llama(e.to_string()))
}

/// Assembles logged sessions for block-LoRA training: every position's block input from the
/// `block_features` of the session's assistant turns (a later chunk wins where two overlap, as
/// after a restored session), the session's tokens, and as scored rows the positions that
/// produced each assistant token. Sessions logged without block capture of `layer`, or whose
/// positions are not all covered, are skipped; returns the sessions and how many were skipped.
///
/// # Errors
/// Store errors.
pub fn logged_sessions(
    store: &crate::store::Store,
    ids: &[i64],
    layer: usize,
    n_embd: usize,
) -> Result<(Vec<Captured>, usize)> {
    let mut out = Vec::new();
    let mut skipped = 0;
    for &id in ids {
        let Some((tokens, mut scored)) = assistant_positions(store, id)? else {
            skipped += 1;
            continue;
        };
        let Some(x) = session_block_inputs(store, id, layer, n_embd)? else {
            skipped += 1;
            continue;
        };
        scored.retain(|&p| p < x.nrows());
        if scored.is_empty() {
            skipped += 1;
            continue;
        }
        out.push(Captured {
            tokens,
            x,
            scored,
            logits: Array2::zeros((0, 0)),
            hidden: Vec::new(),
        });
    }
    Ok((out, skipped))
}

/// The block inputs of session `id`'s positions `0 .. end` from the `block_features` of its
/// assistant turns (a later chunk wins where two overlap, as after a restored session), or
/// None when the session was logged without capturing block `layer` (or another width) or
/// a position is not covered.
///
/// # Errors
/// Store errors.
pub fn session_block_inputs(
    store: &crate::store::Store,
    id: i64,
    layer: usize,
    n_embd: usize,
) -> Result<Option<Array2<f32>>> {
    use crate::policy::Role;
    let mut chunks = Vec::new();
    for t in store.turns(id)? {
        if t.role == Role::Assistant {
            if let Some(b) = store.block_features(t.id)? {
                if b.layer != layer || b.n_embd != n_embd {
                    return Ok(None);
                }
                chunks.push(b);
            }
        }
    }
    let end = chunks
        .iter()
        .map(|b| b.first_pos + b.n_pos())
        .max()
        .unwrap_or(0);
    let mut x = Array2::<f32>::zeros((end, n_embd));
    let mut covered = vec![false; end];
    for b in &chunks {
        for (i, row) in b.values.chunks_exact(n_embd).enumerate() {
            let p = b.first_pos + i;
            x.row_mut(p).iter_mut().zip(row).for_each(|(d, &v)| *d = v);
            covered[p] = true;
        }
    }
    Ok((end > 0 && covered.iter().all(|&c| c)).then_some(x))
}
