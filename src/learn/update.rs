//! One update, top to bottom: select sessions → load the features stored at sampling time →
//! old / reference log-probs from those features → advantages → epochs of minibatch steps
//! (AdamW, gradient-norm clipping) → candidate adapter written atomically → `updates` row.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use ndarray::{Array1, Array2, Axis};
use serde::Serialize;
use serde_json::json;

use super::batch::{self, Batch, SessionData};
use super::config::{Algo, Selection, TrainConfig};
use super::credit::{self, Credit};
use super::diagnostics::{Diagnostics, TrustRegion};
use super::minibatch::{log_softmax_at, score_minibatches, ScoreInputs, Scored};
use super::objective::{lora_loss_and_grad, surrogate, SurrogateStats};
use super::optim::{load_optimizer, optimizer_blob, AdamW, OPTIMIZER_FILE};
use super::step::{self, Lora, Minibatch, StepBackend};
use crate::adapter::Adapter;
use crate::error::{Error, Result};
use crate::policy::blocks::TailModel;
use crate::policy::OutputHead;
use crate::store::{AdapterStatus, CandidateCommit, Store, UpdateStatus};

/// The result of an update.
#[derive(Debug, Clone, Serialize)]
pub struct UpdateReport {
    /// `updates.id`
    pub update_id: i64,
    /// the candidate adapter written (None when rejected)
    pub adapter_id: Option<i64>,
    /// what the update measured
    pub diagnostics: Diagnostics,
}

/// The policy an adapter is: its output LoRA and its block LoRA.
fn current_lora(a: &Adapter) -> Lora<'_> {
    Lora {
        a: a.a.view(),
        b: a.b.view(),
        scale: a.scale(),
        block: a.block.as_ref().map(|b| &b.factors),
    }
}

/// Log-probs of `tokens` under `adapter` (None: base) from base logits and features.
fn logprobs(
    base: &Array2<f32>,
    h: &Array2<f32>,
    tokens: &[usize],
    adapter: Option<&Adapter>,
) -> Vec<f64> {
    let (a, b, s) = match adapter {
        Some(ad) => (ad.a.view(), ad.b.view(), ad.scale()),
        None => return log_softmax_at(base, tokens),
    };
    let (_, lp, _, _) = lora_loss_and_grad(base.view(), h.view(), tokens, a, b, s, |lp| {
        (0.0, vec![0.0; lp.len()])
    });
    lp.into_iter().map(f64::from).collect()
}

/// Runs one update over the selected sessions, starting from `parent` (the active adapter, or a
/// fresh one), and writes a candidate adapter next to the database.
///
/// # Errors
/// [`Error::NothingToLearn`] when nothing can be learned from the selection;
/// [`Error::UpdateRejected`] when the update is not finite (then an `updates` row with status
/// `rejected` records why, and no adapter is written); [`Error::Invalid`] for settings that do
/// not fit the parent or the sessions; store and I/O errors.
pub fn run_update(
    store: &mut Store,
    db_path: &Path,
    head: &OutputHead,
    parent: Option<(i64, Arc<Adapter>)>,
    cfg: &TrainConfig,
    sel: &Selection,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<UpdateReport> {
    let t_start = Instant::now();
    let sft = cfg.algo == Algo::Sft;
    cfg.validate()?;
    // the KL reference first: an unknown one fails before anything is written
    let kl_ref = match cfg
        .kl_ref_adapter
        .filter(|_| cfg.objective.kl_coef > 0.0 && !sft)
    {
        Some(id) => Some(Adapter::load(Path::new(&store.adapter(id)?.path))?),
        None => None,
    };
    // ---- a block-LoRA update: its layout (the parent's, or a fresh one's) and the last blocks
    let block_spec = cfg.block.clone().filter(|_| !sft);
    if let (Some(spec), Some((id, p))) = (&block_spec, &parent) {
        if let Some(b) = p.block.as_ref().filter(|b| &b.spec != spec) {
            return Err(Error::Invalid(format!(
                "the parent adapter {id} has a block LoRA of another layout (k={} {} r={} \
                 alpha={}) than the one asked for (k={} {} r={} alpha={}); train it with its \
                 layout, or start fresh",
                b.spec.k,
                b.spec.targets.join(","),
                b.spec.r,
                b.spec.alpha,
                spec.k,
                spec.targets.join(","),
                spec.r,
                spec.alpha
            )));
        }
    }
    let tail = match &block_spec {
        Some(spec) => Some(TailModel::from_gguf(&head.path, spec.k)?),
        None => None,
    };
    let block_io = tail.as_ref().map(|t| (t.input_layer(), t.hp.n_embd));
    let Batch {
        sessions,
        groups,
        fell_back,
        grouping,
        without_block,
        unusable,
    } = batch::select(store, sel, cfg, block_io, &mut progress)?;
    for (id, why) in &unusable {
        tracing::warn!(session = id, "left out of the update: {why}");
    }
    // ---- adapters: the one being trained, and those that generated the turns -------------------
    let n_embd = head.n_embd();
    let mut current = parent
        .as_ref()
        .map(|(_, a)| (**a).clone())
        .unwrap_or_else(|| {
            Adapter::fresh(
                n_embd,
                head.n_vocab(),
                cfg.rank,
                cfg.lora_alpha,
                cfg.seed,
                "",
            )
        });
    if let (Some(t), Some(spec), None) = (&tail, &block_spec, &current.block) {
        current.block = Some(crate::adapter::block::BlockLora::fresh(
            &t.hp,
            spec.clone(),
            cfg.seed,
        ));
    }
    let trained = match &block_spec {
        Some(b) => format!("block k={} {} r={}", b.k, b.targets.join(","), b.r),
        None => "output".into(),
    };
    let Credit {
        balance,
        keep,
        turn_adv,
        ig_hat,
        process_signal,
        value_brier,
        value_auc,
        value_states,
        fallback,
    } = credit::assign(
        store,
        &sessions,
        &groups,
        &fell_back,
        &current,
        parent.as_ref().map(|p| p.0),
        cfg,
    )?;
    let mut generators: HashMap<i64, Adapter> = HashMap::new();
    for s in &sessions {
        for t in &s.turns {
            if let Some(id) = t.adapter_id.filter(|id| !generators.contains_key(id)) {
                let rec = store.adapter(id)?;
                generators.insert(id, Adapter::load(Path::new(&rec.path))?);
            }
        }
    }

    let block_mode = tail.is_some();
    if block_mode {
        for (id, g) in &generators {
            if let Some(b) = g
                .block
                .as_ref()
                .filter(|b| Some(&b.spec) != block_spec.as_ref())
            {
                return Err(Error::Invalid(format!(
                    "turns of the selection were sampled with adapter {id}, whose block LoRA \
                     ({:?}) has another layout than the one trained ({block_spec:?})",
                    b.spec
                )));
            }
        }
    }
    let mut backend = step::backend(cfg, sft, tail.zip(block_spec.clone()))?;
    let Scored {
        minibatches,
        order_kept,
        total_tokens,
        gap_behavior,
        n_gap,
    } = score_minibatches(
        &ScoreInputs {
            cfg,
            sft,
            head,
            sessions: &sessions,
            keep: &keep,
            turn_adv: &turn_adv,
            ig_hat: &ig_hat,
            generators: &generators,
            kl_ref: kl_ref.as_ref(),
            current: &current,
            block_mode,
        },
        backend.as_mut(),
        &mut progress,
    )?;

    let device_used = backend.device();
    let steps_out = train_steps(
        store,
        cfg,
        parent.as_ref().map(|(id, _)| *id),
        &minibatches,
        &mut current,
        backend.as_mut(),
        block_mode,
        &mut progress,
    )?;
    let Trained {
        opt,
        vopt,
        optimizer_from_parent,
        steps,
        first_ratio_dev,
        last_stats,
        grad_norm_last,
        value_loss_last,
        loss_last,
        mut trace,
    } = steps_out;

    let Measured {
        candidate,
        turn_entropy,
        explained_variance,
    } = measure_candidate(cfg, &minibatches, &current, backend.as_mut(), block_mode)?;
    if !sft {
        trace.push(candidate.clone());
    }
    let secs = t_start.elapsed().as_secs_f64();
    let st = last_stats.unwrap_or_default();
    let mut temperatures: Vec<f32> = order_kept
        .iter()
        .flat_map(|&i| sessions[i].turns.iter().map(|t| t.temperature))
        .collect();
    temperatures.sort_by(f32::total_cmp);
    temperatures.dedup();
    let diagnostics = Diagnostics {
        sessions: minibatches.iter().map(|m| m.sessions.len()).sum::<usize>(),
        tokens: total_tokens,
        untrainable_tokens: minibatches
            .iter()
            .map(|m| m.batch.trainable.iter().filter(|&&t| !t).count())
            .sum::<usize>(),
        steps,
        loss: loss_last,
        policy_loss: st.policy_loss,
        value_loss: value_loss_last,
        approx_kl: candidate.approx_kl,
        last_step_approx_kl: st.approx_kl,
        kl_ref_k3: st.kl_ref,
        kl_reference: cfg.kl_ref_adapter,
        clip_frac_low: candidate.clip_frac_low,
        clip_frac_high: candidate.clip_frac_high,
        candidate,
        trust_region_steps: trace,
        advantage_balance: balance,
        clip_scale_mean: st.clip_scale_mean,
        ratio_mean: st.ratio_mean,
        ratio_max_dev: st.ratio_max_dev,
        first_ratio_max_dev: first_ratio_dev,
        explained_variance,
        grad_norm: grad_norm_last,
        lr: cfg.lr,
        tokens_per_s: (total_tokens * cfg.epochs) as f64 / secs,
        logp_old_vs_behavior_mean: gap_behavior.0 / n_gap.max(1) as f64,
        logp_old_vs_behavior_max: gap_behavior.1,
        turn_entropy,
        grouping: grouping.to_string(),
        groups: groups
            .iter()
            .collect::<std::collections::HashSet<_>>()
            .len(),
        fallback_sessions: fallback.len(),
        sampling_temperatures: temperatures,
        seconds: secs,
        backend: format!("{:?}", cfg.backend).to_lowercase(),
        advantage: format!("{:?}", cfg.advantage).to_lowercase(),
        process_signal,
        value_brier_heldout: value_brier,
        value_auc_heldout: value_auc,
        value_heldout_states: value_states,
        device: device_used,
        optimizer_from_parent,
        trained,
        sessions_without_block: without_block,
        unusable_sessions: unusable
            .iter()
            .map(|(id, why)| json!({"session": id, "reason": why}))
            .collect(),
    };
    if cfg.dry_run {
        return Ok(UpdateReport {
            update_id: 0,
            adapter_id: None,
            diagnostics,
        });
    }
    commit(
        store,
        db_path,
        parent.as_ref().map(|(id, _)| *id),
        &current,
        cfg,
        (&opt, &vopt),
        (&sessions, &turn_adv, &keep),
        &minibatches,
        diagnostics,
        &mut progress,
    )
}

/// What the steps leave for the diagnostics and the candidate.
struct Trained {
    opt: AdamW,
    vopt: AdamW,
    optimizer_from_parent: bool,
    steps: usize,
    first_ratio_dev: Option<f64>,
    last_stats: Option<SurrogateStats>,
    grad_norm_last: f64,
    value_loss_last: f64,
    loss_last: f64,
    /// every step's trust region before the step
    trace: Vec<TrustRegion>,
}

/// The steps: epochs of AdamW over the minibatches (gradient-norm clipping; the value head's
/// BCE on every turn's state), training `current` in place. A non-finite loss or gradient
/// rejects the update (recorded as a rejected `updates` row unless it is a dry run).
#[allow(clippy::too_many_arguments)]
fn train_steps(
    store: &mut Store,
    cfg: &TrainConfig,
    parent_id: Option<i64>,
    minibatches: &[Minibatch],
    current: &mut Adapter,
    backend: &mut dyn StepBackend,
    block_mode: bool,
    progress: &mut impl FnMut(&str, usize, usize),
) -> Result<Trained> {
    let sft = cfg.algo == Algo::Sft;
    let n_embd = current.value_w.len();
    let shapes: Vec<(usize, usize)> = match (&current.block, block_mode) {
        (Some(b), true) => b
            .factors
            .a
            .iter()
            .chain(&b.factors.b)
            .map(|m| m.dim())
            .collect(),
        _ => vec![current.a.dim(), current.b.dim()],
    };
    let mut opt = AdamW::new(&shapes);
    let mut vopt = AdamW::new(&[(1, n_embd + 1)]);
    let mut optimizer_from_parent = false;
    if cfg.keep_optimizer {
        if let Some(pid) = parent_id {
            let rec = store.adapter(pid)?;
            optimizer_from_parent = load_optimizer(Path::new(&rec.path), &mut opt, &mut vopt)?;
        }
    }
    let steps = cfg.epochs * minibatches.len();
    let mut step = 0;
    let (mut first_ratio_dev, mut last_stats, mut grad_norm_last, mut value_loss_last) =
        (None, None, 0f64, 0f64);
    let mut loss_last = 0f64;
    let mut trace: Vec<TrustRegion> = Vec::with_capacity(steps + 1);
    for _epoch in 0..cfg.epochs {
        for mb in minibatches {
            let w = current_lora(current);
            let (loss, logp_new, grads, stats) = backend.loss_and_grad(mb, w)?;
            if let Some(st) = &stats {
                let lp: Vec<f64> = logp_new.iter().map(|&x| x as f64).collect();
                trace.push(TrustRegion::measure([(
                    &mb.batch,
                    lp.as_slice(),
                    (st.clip_low_frac, st.clip_high_frac),
                )]));
            }
            if first_ratio_dev.is_none() && !sft {
                let dev = logp_new
                    .iter()
                    .zip(&mb.batch.logp_old)
                    .map(|(n, o)| ((*n as f64 - o).exp() - 1.0).abs())
                    .fold(0.0, f64::max);
                first_ratio_dev = Some(dev);
            }
            // value head: BCE of σ(w·h + b) on each turn's state against the session's success.
            // Not under SFT: demonstrations are another policy's sessions (an expert's, which
            // all succeed), and a head fitted on them says that every state of this policy
            // succeeds — the warm start left it at 1 − 1e-8 on live traffic that succeeds a
            // third of the time, and the success contributions it annotates were then 0
            let fit_value = cfg.value_coef > 0.0 && !sft;
            let (mut gw, mut vloss) = (Array1::<f32>::zeros(n_embd + 1), 0f64);
            if fit_value && !mb.states.is_empty() {
                for &(row, y) in &mb.states {
                    let h = mb.h.row(row);
                    let p = current.value(h.as_slice().unwrap_or(&h.to_vec())) as f64;
                    vloss -= y * p.max(1e-7).ln() + (1.0 - y) * (1.0 - p).max(1e-7).ln();
                    let d = ((p - y) * cfg.value_coef / mb.states.len() as f64) as f32;
                    for (g, x) in gw.iter_mut().zip(h.iter()) {
                        *g += d * x;
                    }
                    gw[n_embd] += d;
                }
                vloss /= mb.states.len() as f64;
            }
            let norm = grads
                .iter()
                .flat_map(|g| g.iter())
                .map(|x| (*x as f64).powi(2))
                .sum::<f64>()
                .sqrt();
            if (!loss.is_finite() || !norm.is_finite() || !vloss.is_finite()) && cfg.dry_run {
                return Err(Error::UpdateRejected {
                    update: None,
                    reason: format!(
                        "non-finite loss or gradient at step {step} (dry run: nothing recorded)"
                    ),
                });
            }
            if !loss.is_finite() || !norm.is_finite() || !vloss.is_finite() {
                let diag = json!({"rejected": "non-finite loss or gradient", "step": step, "loss": loss.to_string(), "grad_norm": norm.to_string()});
                let id = store.record_update(
                    None,
                    &format!("{:?}", cfg.algo).to_lowercase(),
                    &serde_json::to_value(cfg)?,
                    &diag,
                    UpdateStatus::Rejected,
                )?;
                return Err(Error::UpdateRejected {
                    update: Some(id),
                    reason: format!(
                        "update {id}: non-finite loss or gradient at step {step}; the active \
                         adapter is unchanged"
                    ),
                });
            }
            let clip = if norm > cfg.max_grad_norm {
                (cfg.max_grad_norm / norm) as f32
            } else {
                1.0
            };
            let grads: Vec<Array2<f32>> = grads.into_iter().map(|g| g * clip).collect();
            let mut params: Vec<&mut Array2<f32>> = match current.block.as_mut() {
                Some(b) if block_mode => b
                    .factors
                    .a
                    .iter_mut()
                    .chain(b.factors.b.iter_mut())
                    .collect(),
                _ => vec![&mut current.a, &mut current.b],
            };
            opt.step(
                &mut params,
                &grads,
                [cfg.lr, cfg.weight_decay, cfg.adam_eps],
            );
            if fit_value {
                let mut vp = Array2::from_shape_fn((1, n_embd + 1), |(_, j)| {
                    if j < n_embd {
                        current.value_w[j]
                    } else {
                        current.value_b
                    }
                });
                vopt.step(
                    &mut [&mut vp],
                    &[gw.insert_axis(Axis(0))],
                    [cfg.lr, 0.0, cfg.adam_eps],
                );
                for j in 0..n_embd {
                    current.value_w[j] = vp[[0, j]];
                }
                current.value_b = vp[[0, n_embd]];
            }
            grad_norm_last = norm;
            value_loss_last = vloss;
            loss_last = loss as f64;
            if stats.is_some() {
                last_stats = stats;
            }
            step += 1;
            progress("training", step, steps);
        }
    }

    if !current.is_finite() {
        return Err(Error::UpdateRejected {
            update: None,
            reason: "the updated adapter is not finite".into(),
        });
    }
    Ok(Trained {
        opt,
        vopt,
        optimizer_from_parent,
        steps,
        first_ratio_dev,
        last_stats,
        grad_norm_last,
        value_loss_last,
        loss_last,
        trace,
    })
}

/// The candidate measured over the whole batch after the last step.
struct Measured {
    /// its trust region against the sampling adapters (what the gate reads)
    candidate: TrustRegion,
    /// normalised entropy of how the log-ratio change spreads over a session's turns
    turn_entropy: f64,
    /// the value head's explained variance of the outcome
    explained_variance: f64,
}

/// Measures the final adapter on every minibatch: its log-probs, clip fractions, turn entropy
/// and the value head's fit.
fn measure_candidate(
    cfg: &TrainConfig,
    minibatches: &[Minibatch],
    current: &Adapter,
    backend: &mut dyn StepBackend,
    block_mode: bool,
) -> Result<Measured> {
    let sft = cfg.algo == Algo::Sft;
    let (mut ent_sum, mut ent_n) = (0f64, 0usize);
    let (mut ev_num, mut ev_den, mut ys) = (0f64, 0f64, Vec::new());
    let mut finals = Vec::with_capacity(minibatches.len());
    for mb in minibatches {
        let new = if block_mode {
            backend.logp(mb, current_lora(current))?
        } else {
            logprobs(&mb.base, &mb.hs, &mb.tokens, Some(current))
        };
        let clipped = if sft {
            (0.0, 0.0)
        } else {
            let st = surrogate(&cfg.objective, &mb.batch, &new).2;
            (st.clip_low_frac, st.clip_high_frac)
        };
        // turn entropy: per session, softmax over per-turn shares of the session's Σ lr
        let mut per_seq: BTreeMap<usize, BTreeMap<usize, f64>> = BTreeMap::new();
        for (k, (n, o)) in new.iter().zip(&mb.batch.logp_old).enumerate() {
            *per_seq
                .entry(mb.batch.seq[k])
                .or_default()
                .entry(mb.batch.turn[k])
                .or_default() += n - o;
        }
        for turns in per_seq.values() {
            if turns.len() < 2 {
                ent_n += 1;
                continue;
            }
            let total: f64 = turns.values().sum();
            let rel: Vec<f64> = turns
                .values()
                .map(|v| if total.abs() > 1e-12 { v / total } else { 0.0 })
                .collect();
            let m = rel.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = rel.iter().map(|r| (r - m).exp()).sum();
            let h: f64 = rel
                .iter()
                .map(|r| {
                    let p = (r - m).exp() / z;
                    // p ln p → 0 as p → 0 (an underflowed share would give 0 · −inf = NaN)
                    if p > 0.0 {
                        -p * p.ln()
                    } else {
                        0.0
                    }
                })
                .sum();
            ent_sum += h / (turns.len() as f64).ln();
            ent_n += 1;
        }
        for &(row, y) in &mb.states {
            let h = mb.h.row(row).to_vec();
            ys.push((y, current.value(&h) as f64));
        }
        finals.push((new, clipped));
    }
    let candidate = TrustRegion::measure(
        minibatches
            .iter()
            .zip(&finals)
            .map(|(mb, (new, c))| (&mb.batch, new.as_slice(), *c)),
    );
    let ymean = ys.iter().map(|p| p.0).sum::<f64>() / ys.len().max(1) as f64;
    for (y, p) in &ys {
        ev_num += (y - p).powi(2);
        ev_den += (y - ymean).powi(2);
    }
    Ok(Measured {
        candidate,
        turn_entropy: ent_sum / ent_n.max(1) as f64,
        explained_variance: if ev_den > 0.0 {
            1.0 - ev_num / ev_den
        } else {
            0.0
        },
    })
}

/// Writes the candidate atomically, then registers it with its update: the `updates` row with
/// the diagnostics, the advantage each turn received and the sessions learned from. A failed
/// registration leaves the version rejected.
#[allow(clippy::too_many_arguments)]
fn commit(
    store: &mut Store,
    db_path: &Path,
    parent_id: Option<i64>,
    current: &Adapter,
    cfg: &TrainConfig,
    (opt, vopt): (&AdamW, &AdamW),
    (sessions, turn_adv, keep): (&[SessionData], &[Vec<f64>], &[bool]),
    minibatches: &[Minibatch],
    diagnostics: Diagnostics,
    progress: &mut impl FnMut(&str, usize, usize),
) -> Result<UpdateReport> {
    let sft = cfg.algo == Algo::Sft;
    let diagnostics_json = diagnostics.to_json();

    // ---- write the candidate atomically, then register it -------------------------------------
    progress("writing adapter", 0, 1);
    let extra = if cfg.keep_optimizer {
        vec![(OPTIMIZER_FILE, optimizer_blob(opt, vopt)?)]
    } else {
        Vec::new()
    };
    let id = super::candidate::write(store, db_path, parent_id, current, &extra)?;
    // the advantage each turn received in this update, and the sessions it used
    let advantages: Vec<(i64, f64)> = if sft {
        Vec::new()
    } else {
        sessions
            .iter()
            .zip(turn_adv)
            .enumerate()
            .filter(|(i, _)| keep[*i])
            .flat_map(|(_, (s, adv))| s.turns.iter().zip(adv).map(|(t, a)| (t.turn_id, *a)))
            .collect()
    };
    let learned: Vec<i64> = minibatches
        .iter()
        .flat_map(|m| m.sessions.iter().map(|&i| sessions[i].id))
        .collect();
    let committed = store.commit_candidate(&CandidateCommit {
        adapter_id: id,
        algo: &format!("{:?}", cfg.algo).to_lowercase(),
        config: &serde_json::to_value(cfg)?,
        diagnostics: &diagnostics_json,
        advantages: &advantages,
        learned: &learned,
    });
    let update_id = match committed {
        Ok(u) => u,
        Err(e) => {
            let why = json!({"error": e.to_string()});
            store.set_adapter_status(id, AdapterStatus::Rejected, Some(&why))?;
            return Err(e);
        }
    };
    Ok(UpdateReport {
        update_id,
        adapter_id: Some(id),
        diagnostics,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validate_accepts_the_presets_and_refuses_impossible_settings() {
        use clap::ValueEnum;
        for algo in Algo::value_variants() {
            TrainConfig::preset(*algo).validate().unwrap();
        }
        let refused = |f: &dyn Fn(&mut TrainConfig), what: &str| {
            let mut c = TrainConfig::preset(Algo::A2tgpo);
            f(&mut c);
            match c.validate() {
                Err(Error::Invalid(m)) => assert!(m.contains(what), "{m}"),
                other => panic!("{what}: {other:?}"),
            }
        };
        refused(&|c| c.objective.eps_low = 1.5, "clip range");
        refused(&|c| c.objective.eps_low = 0.0, "clip range");
        refused(&|c| c.objective.eps_high = -0.1, "clip range");
        refused(&|c| c.objective.eps_high = f64::INFINITY, "clip range");
        refused(&|c| c.lr = f64::NAN, "learning rate");
        refused(&|c| c.lr = -1e-3, "learning rate");
        refused(&|c| c.max_grad_norm = 0.0, "gradient clip");
        refused(&|c| c.epochs = 0, "epochs");
        refused(&|c| c.objective.tis_cap = Some(0.5), "TIS cap");
        refused(&|c| c.objective.kl_coef = -1.0, "KL");
        // the boundary values that are allowed
        let mut c = TrainConfig::preset(Algo::Grpo);
        c.objective.eps_low = 0.999;
        c.objective.tis_cap = Some(1.0);
        c.lr = 0.0;
        c.validate().unwrap();
    }
}
