//! `turnwise train`: one update over the logged sessions (or `--replay N`, a recorded update again
//! without writing anything), the gate and activation; `--algo sft --block-k K` fits a block LoRA.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use turnwise::adapter::Adapter;
use turnwise::assets;
use turnwise::graph::Device;
use turnwise::learn::{gate, run_update, Algo, Backend, Selection, TrainConfig};
use turnwise::policy::OutputHead;
use turnwise::store::{Source, Store};

use super::adapters::check_block_loads;
use super::learn_args::LearnArgs;

/// Which logged sessions a command reads, and the model they were logged with.
#[derive(Args)]
pub struct SelectArgs {
    /// GGUF model the sessions were logged with [default: the default model]
    #[arg(long)]
    pub(super) model: Option<std::path::PathBuf>,
    /// Only sessions of this source (live, chat, import, demo)
    #[arg(long)]
    pub(super) source: Option<String>,
    /// Only sessions created at or after this time (ISO 8601, UTC)
    #[arg(long)]
    pub(super) since: Option<String>,
    /// At most this many (newest) sessions
    #[arg(long, default_value_t = 1000)]
    pub(super) limit: usize,
}

/// Options of `turnwise train`. Unset switches take the preset's value.
#[derive(Args)]
pub struct TrainArgs {
    /// Preset: a2tgpo (turn ratio, adaptive clip 0.2/0.28), atpo (turn ratio, fixed clip),
    /// gspo (sequence ratio), grpo (token ratio, clip 0.2/0.28), gigpo (token ratio, step-group
    /// advantages), ppo-token (token ratio, windowed GAE on the value head), sft (warm start)
    /// (default a2tgpo; with --replay, the recorded update's preset)
    #[arg(long, value_enum)]
    algo: Option<Algo>,
    #[command(flatten)]
    sel: SelectArgs,
    #[command(flatten)]
    learn: LearnArgs,
    /// Tokens per minibatch
    #[arg(long, default_value_t = 512)]
    minibatch_tokens: usize,
    /// DAPO: drop groups whose outcomes are all equal
    #[arg(long)]
    drop_uninformative: bool,
    /// Truncated importance sampling cap C (off when unset; docs/algorithms.md uses 2)
    #[arg(long)]
    tis: Option<f64>,
    /// Entropy-bonus coefficient
    #[arg(long, default_value_t = 0.0)]
    entropy_coef: f64,
    /// MIS: drop tokens whose behaviour ratio is outside [0.5, 2]
    #[arg(long)]
    mis: bool,
    /// Give digit tokens (copied order ids, amounts) no policy gradient in RL updates
    #[arg(long)]
    mask_digits: bool,
    /// Give digit tokens policy gradient only in turns with a positive advantage
    #[arg(long)]
    mask_negative_digits: bool,
    /// SFT: a digit token of the target counts as the digit class (−log Σ_digits p), so that
    /// demonstrations teach where an id goes and copying it stays with the base model
    #[arg(long)]
    sft_digit_class: bool,
    /// k3 KL coefficient (reference: the base policy, or --kl-ref)
    #[arg(long, default_value_t = 0.0)]
    kl_coef: f64,
    /// Reference adapter id of the KL term (default: the base policy, adapter off)
    #[arg(long)]
    kl_ref: Option<i64>,
    /// Offline replay: run update N of this database again — the same sessions (the newest
    /// of its selection created before it ran), its recorded settings and parent adapter —
    /// with the settings given here changed, and print what it measured (advantage balance,
    /// trust region per step). Writes nothing: no adapter, no update row, no annotation.
    #[arg(long, value_name = "UPDATE", conflicts_with_all = ["activate", "fresh", "block_k"])]
    replay: Option<i64>,
    /// With --replay: also write the replay's full diagnostics as JSON to this file
    #[arg(long, requires = "replay")]
    json: Option<std::path::PathBuf>,
    /// Groups (scenario keys or opening-state clusters) with fewer sessions merge into one
    /// batch-wide group judged against the value head
    #[arg(long, default_value_t = 2)]
    min_group_size: usize,
    /// GiGPO: weight ω of the step advantage
    #[arg(long, default_value_t = 1.0)]
    gigpo_omega: f64,
    /// GiGPO: observations at least this similar (token Jaccard; 1 = identical) share a step group
    #[arg(long, default_value_t = 1.0)]
    gigpo_similarity: f64,
    /// Windowed turn-group GAE (ppo-token): turns per window
    #[arg(long, default_value_t = 5)]
    gae_window: usize,
    /// Windowed turn-group GAE (ppo-token): λ
    #[arg(long, default_value_t = 0.95)]
    gae_lambda: f64,
    /// LoRA rank of a fresh adapter
    #[arg(long, default_value_t = 8)]
    rank: usize,
    /// Value-head loss coefficient (0 disables)
    #[arg(long, default_value_t = 0.5)]
    value_coef: f64,
    /// SFT: only sessions whose outcome is at least this
    #[arg(long)]
    min_outcome: Option<f64>,
    /// Step engine: ort (the differentiated ONNX graph) or ndarray (the Rust reference)
    #[arg(long, value_enum, default_value_t = Backend::Ort)]
    backend: Backend,
    /// ONNX Runtime device: cpu, cuda (error if unavailable) or auto (CUDA, else CPU)
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    device: Device,
    /// ONNX Runtime threads
    #[arg(long, default_value_t = 2)]
    train_threads: usize,
    /// Start from a fresh adapter instead of the active one
    #[arg(long)]
    fresh: bool,
    /// Activate the candidate when it passes the gate: |approx KL| to its parent within
    /// --gate-kl and the value head's mean success estimate on the selected sessions no more
    /// than 0.02 below the parent's (the server's background learner applies the same gate)
    #[arg(long)]
    activate: bool,
    /// With --activate: activate even when the gate refuses the candidate
    #[arg(long, requires = "activate")]
    force: bool,
    /// The gate's bound on |approx KL| of the candidate to its parent [default: 0.2; none for
    /// --algo sft, whose fit moves the policy to the demonstrations by design (a warm start
    /// from the base model measured KL 1.3): its gate is the value check, unless a bound is
    /// given]
    #[arg(long)]
    gate_kl: Option<f64>,
    /// Train a LoRA inside the last K blocks instead of the output-projection LoRA, from
    /// sessions logged with `--block-capture K`: RL algorithms update the active version's
    /// block LoRA (or a fresh one of rank --rank, alpha 2·rank) with the same objectives,
    /// TIS-corrected (cap 2 unless --tis) for the gap between the graph and llama.cpp;
    /// `--algo sft` trains it teacher-forced
    #[arg(long, value_name = "K")]
    block_k: Option<usize>,
    /// With --block-k: adapted projections, from q,k,v,o,gate,up,down
    #[arg(long, default_value = "q,v", requires = "block_k")]
    block_targets: String,
}

impl TrainArgs {
    /// The preset: `--algo`, a2tgpo when not given.
    fn algo(&self) -> Algo {
        self.algo.unwrap_or(Algo::A2tgpo)
    }
}

/// Supervised training of a block LoRA on logged sessions: teacher-forced cross-entropy on every
/// assistant token, from the block inputs logged with `--block-capture K`. The candidate keeps
/// its parent's output LoRA and value head; the block LoRA is trained (and the gate's KL
/// measured) with that output LoRA on top, as the engine serves them.
pub(super) fn run_block_sft(args: TrainArgs, db: &Path) -> anyhow::Result<ExitCode> {
    use turnwise::adapter::block::BlockLora;
    use turnwise::graph::block::BlockSpec;
    use turnwise::learn::block::{fit_block_sft, logged_sessions, BlockSft, SftConfig};
    use turnwise::policy::blocks::TailModel;

    let k = args.block_k.unwrap_or(2);
    let targets = block_targets(&args.block_targets)?;
    let mut store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let model = assets::resolve_model(args.sel.model.as_deref(), false)?;
    store.set_policy_model(&assets::model_stamp_json(&model));
    let tail = TailModel::from_gguf(&model, k)?;
    let layer = tail.input_layer();
    let sessions = store.training_sessions(
        parse_source(args.sel.source.as_deref())?,
        args.sel.since.as_deref(),
        args.min_outcome.is_some(),
        args.sel.limit,
    )?;
    let ids: Vec<i64> = sessions
        .iter()
        .filter(|s| {
            args.min_outcome
                .is_none_or(|m| s.outcome_reward.is_some_and(|o| o >= m))
        })
        .map(|s| s.id)
        .collect();
    let (data, skipped) = logged_sessions(&store, &ids, layer, tail.hp.n_embd)?;
    if data.is_empty() {
        anyhow::bail!(
            "none of the {} selected sessions has block inputs of l_out-{layer} for every \
             position ({skipped} skipped): log them with `--block-capture {k}`",
            ids.len()
        );
    }
    let head = OutputHead::from_gguf(&model)?;
    let parent = if args.fresh {
        None
    } else {
        active_adapter(&store)?
    };
    let mut adapter = match &parent {
        Some((_, a)) => a.as_ref().clone(),
        None => Adapter::fresh(
            head.n_embd(),
            head.n_vocab(),
            args.rank,
            2.0 * args.rank as f32,
            0,
            "",
        ),
    };
    let spec = BlockSpec {
        k,
        targets,
        r: args.rank,
        alpha: 2.0 * args.rank as f32,
    };
    // the parent's policy in this graph: its block LoRA, or a fresh one (B = 0: the base
    // model's blocks); a block LoRA of another layout cannot be scored here
    let (lora, parent_lora) = match adapter.block.take() {
        Some(b) if b.spec == spec => (b.clone(), Some(b)),
        None => {
            let fresh = BlockLora::fresh(&tail.hp, spec.clone(), 1);
            (fresh.clone(), Some(fresh))
        }
        Some(_) => (BlockLora::fresh(&tail.hp, spec.clone(), 1), None),
    };
    let batch = 4usize;
    let epochs = args.learn.epochs.unwrap_or(20);
    let steps = epochs * data.len().div_ceil(batch);
    let pb = ProgressBar::new(steps as u64);
    pb.set_style(
        ProgressStyle::with_template("block SFT {bar:30} {pos}/{len} steps, loss {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let vid = parent.as_ref().map(|(id, _)| *id);
    let fit = fit_block_sft(
        &mut store,
        db,
        tail,
        BlockSft {
            data: &data,
            lora,
            parent_lora,
            adapter,
            parent: vid,
            sft: SftConfig {
                steps,
                batch,
                lr: args.learn.lr.unwrap_or(2e-3),
                seed: 1,
            },
            device: args.device,
            threads: args.train_threads,
        },
        serde_json::json!({ "skipped": skipped }),
        |loss| {
            pb.set_message(format!("{loss:.4}"));
            pb.inc(1);
        },
    );
    pb.finish_and_clear();
    let fit = fit?;
    let (id, losses, kl, metrics) = (fit.id, fit.losses, fit.kl, fit.metrics);
    store.record_update(
        Some(id),
        "sft-block",
        &serde_json::json!({"k": k, "steps": steps}),
        &metrics,
        turnwise::store::UpdateStatus::Ok,
    )?;
    println!(
        "candidate adapter {id}: block LoRA {} on the last {k} blocks, {} sessions ({skipped} skipped), {steps} steps, loss {:.4} -> {:.4}",
        spec.targets.join(","),
        data.len(),
        losses.first().copied().unwrap_or(f32::NAN),
        losses.last().copied().unwrap_or(f32::NAN)
    );
    let Some((approx_kl, old, new, n)) = kl else {
        println!(
            "the parent's block LoRA has another layout: no KL to it was measured (the gate cannot \
             judge this candidate)"
        );
        if args.activate {
            if !args.force {
                eprintln!(
                    "adapter {id} stays a candidate: activate it with --force or `turnwise \
                     adapters activate {id}`"
                );
                return Ok(ExitCode::from(3));
            }
            activate_checked(&mut store, id, &head, &model)?;
            println!("adapter {id} is active (forced: no gate)");
        }
        return Ok(ExitCode::SUCCESS);
    };
    println!(
        "reply tokens: mean log-prob {old:.4} (parent) -> {new:.4}, approx KL {approx_kl:.4} over \
         {n} tokens"
    );
    gate_and_activate(
        &mut store,
        db,
        id,
        approx_kl,
        &args,
        parent.as_ref().map(|p| p.1.as_ref()),
        parse_source(args.sel.source.as_deref())?,
        &head,
        &model,
    )
}

/// The `--block-targets` list.
pub(super) fn block_targets(list: &str) -> anyhow::Result<Vec<String>> {
    let targets: Vec<String> = list.split(',').map(|t| t.trim().to_string()).collect();
    if let Some(t) = targets
        .iter()
        .find(|t| turnwise::policy::blocks::target_tensor(t).is_none())
    {
        anyhow::bail!("unknown block target {t:?} (q, k, v, o, gate, up, down)");
    }
    Ok(targets)
}

/// Registers a new adapter version, writes it atomically and marks it a candidate (rejected,
/// with the error, when the write fails): `learn::candidate::write_candidate`.
pub(super) fn save_candidate(
    store: &mut Store,
    db: &Path,
    parent: Option<i64>,
    adapter: &Adapter,
    metrics: &serde_json::Value,
) -> anyhow::Result<i64> {
    Ok(turnwise::learn::candidate::write_candidate(
        store, db, parent, adapter, metrics,
    )?)
}

pub(crate) fn parse_source(s: Option<&str>) -> anyhow::Result<Option<Source>> {
    Ok(match s {
        None => None,
        Some("live") => Some(Source::Live),
        Some("chat") => Some(Source::Chat),
        Some("import") => Some(Source::Import),
        Some("demo") => Some(Source::Demo),
        Some(other) => anyhow::bail!("unknown source {other:?} (live, chat, import, demo)"),
    })
}

/// The active adapter of a store, loaded and checked, for the engine.
///
/// # Errors
/// Store errors or an unreadable adapter directory.
pub fn active_adapter(store: &Store) -> anyhow::Result<Option<(i64, Arc<Adapter>)>> {
    match store.active_adapter()? {
        None => Ok(None),
        Some(rec) => {
            let a = Adapter::load(Path::new(&rec.path))
                .with_context(|| format!("loading active adapter {}", rec.id))?;
            Ok(Some((rec.id, Arc::new(a))))
        }
    }
}

/// Runs one update.
///
/// # Errors
/// Selection, store and numerical errors (a rejected update leaves the active adapter as it was).
pub fn run(args: TrainArgs, db: &Path) -> anyhow::Result<ExitCode> {
    if args.block_k.is_some() && args.algo() == Algo::Sft {
        return run_block_sft(args, db);
    }
    if let Some(update) = args.replay {
        return run_replay(&args, db, update);
    }
    let mut store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let model = assets::resolve_model(args.sel.model.as_deref(), false)?;
    store.set_policy_model(&assets::model_stamp_json(&model));
    let head = OutputHead::from_gguf(&model)?;
    let mut cfg = TrainConfig::preset(args.algo());
    args.learn.apply(&mut cfg);
    cfg.objective.tis_cap = args.tis;
    cfg.objective.kl_coef = args.kl_coef;
    cfg.kl_ref_adapter = args.kl_ref;
    cfg.objective.entropy_coef = args.entropy_coef;
    cfg.objective.mis = args.mis;
    cfg.mask_digits = args.mask_digits;
    cfg.mask_negative_digits = args.mask_negative_digits;
    cfg.sft_digit_class = args.sft_digit_class;
    cfg.drop_uninformative = args.drop_uninformative;
    cfg.min_group_size = args.min_group_size;
    cfg.gigpo_omega = args.gigpo_omega;
    cfg.gigpo_similarity = args.gigpo_similarity;
    cfg.gae_window = args.gae_window;
    cfg.gae_lambda = args.gae_lambda;
    cfg.rank = args.rank;
    cfg.value_coef = args.value_coef;
    cfg.minibatch_tokens = args.minibatch_tokens;
    cfg.sft_min_outcome = args.min_outcome;
    cfg.backend = args.backend;
    cfg.device = args.device;
    cfg.threads = args.train_threads;
    if let Some(k) = args.block_k {
        cfg.block = Some(turnwise::graph::block::BlockSpec {
            k,
            targets: block_targets(&args.block_targets)?,
            r: args.rank,
            alpha: 2.0 * args.rank as f32,
        });
        cfg.objective.tis_cap = args.tis.or(Some(2.0));
    }
    cfg.validate()?;
    let parent = if args.fresh {
        None
    } else {
        active_adapter(&store)?
    };
    let gate_parent = parent.clone();
    let sel = Selection {
        source: parse_source(args.sel.source.as_deref())?,
        since: args.sel.since.clone(),
        until: None,
        limit: args.sel.limit,
    };
    let pb = ProgressBar::new(1);
    pb.set_style(
        ProgressStyle::with_template("{msg:18} [{bar:30}] {pos}/{len}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let report = run_update(
        &mut store,
        db,
        &head,
        parent,
        &cfg,
        &sel,
        |phase, done, total| {
            pb.set_message(phase.to_string());
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    );
    pb.finish_and_clear();
    let report = report?;
    let id = report.adapter_id.unwrap_or_default();
    println!("update {} wrote candidate adapter {id}", report.update_id);
    println!("{}", serde_json::to_string_pretty(&report.diagnostics)?);
    gate_and_activate(
        &mut store,
        db,
        id,
        report.diagnostics.approx_kl,
        &args,
        gate_parent.as_ref().map(|p| p.1.as_ref()),
        sel.source,
        &head,
        &model,
    )
}

/// With `--activate`: the same gate as the server's learner — the KL bound, then the value
/// check — and activation when it passes (or with `--force`). Exit code 3 when the candidate
/// stays inactive; without `--activate` the candidate stays a candidate (success).
#[allow(clippy::too_many_arguments)]
pub(super) fn gate_and_activate(
    store: &mut Store,
    db: &Path,
    id: i64,
    kl: f64,
    args: &TrainArgs,
    parent: Option<&Adapter>,
    source: Option<Source>,
    head: &OutputHead,
    model: &Path,
) -> anyhow::Result<ExitCode> {
    if !args.activate {
        return Ok(ExitCode::SUCCESS);
    }
    let bound = match (args.gate_kl, args.algo()) {
        (Some(b), _) => b,
        (None, Algo::Sft) => f64::INFINITY,
        (None, _) => gate::DEFAULT_KL_BOUND,
    };
    let verdict = gate::decide(
        kl,
        bound,
        || {
            let cand = Adapter::load(&turnwise::adapter::adapter_dir(db, id))?;
            gate::value_check(store, &cand, parent, source, gate::VALUE_SESSIONS).map(Some)
        },
        || Ok(None),
    )?;
    println!("gate: {}", serde_json::to_string(&verdict)?);
    if !verdict.passed && !args.force {
        gate::record(store, id, &verdict)?;
        eprintln!(
            "adapter {id} failed the gate ({}); it stays inactive (--force activates it anyway)",
            verdict.reason.as_deref().unwrap_or("")
        );
        return Ok(ExitCode::from(3));
    }
    if verdict.passed {
        gate::record(store, id, &verdict)?;
    }
    activate_checked(store, id, head, model)?;
    println!(
        "adapter {id} is active{}",
        if verdict.passed {
            ""
        } else {
            " (forced past the gate)"
        }
    );
    Ok(ExitCode::SUCCESS)
}

/// Activates `id` after checking it against the model's output head (`learn::gate::activate`;
/// nothing is served in this process, so there is nothing to restore when the write fails).
pub(super) fn activate_checked(
    store: &mut Store,
    id: i64,
    head: &OutputHead,
    model: &Path,
) -> anyhow::Result<()> {
    gate::activate(
        store,
        id,
        |a| {
            a.check_model(head.n_embd(), head.n_vocab())?;
            match &a.block {
                Some(b) => check_block_loads(model, b)
                    .map_err(|e| turnwise::Error::Invalid(format!("{e:#}"))),
                None => Ok(()),
            }
        },
        || Ok(()),
    )?;
    Ok(())
}

/// `turnwise train --replay N`: update N again on the sessions it saw, with its recorded
/// settings except those given on the command line, in dry-run mode.
pub(super) fn run_replay(args: &TrainArgs, db: &Path, update: i64) -> anyhow::Result<ExitCode> {
    let mut store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let rec = store
        .update_record(update)
        .with_context(|| format!("reading update {update}"))?;
    let mut cfg: TrainConfig = serde_json::from_value(rec.config.clone())
        .with_context(|| format!("update {update}'s recorded settings"))?;
    let adapter = rec.adapter_id.with_context(|| {
        format!("update {update} wrote no adapter (it was rejected): there is no batch to replay")
    })?;
    let parent = match store.adapter(adapter)?.parent_id {
        Some(p) => {
            let a = Adapter::load(Path::new(&store.adapter(p)?.path))
                .with_context(|| format!("loading the update's parent adapter {p}"))?;
            Some((p, Arc::new(a)))
        }
        None => None,
    };
    let sessions = rec.diagnostics["sessions"].as_u64().unwrap_or(0) as usize;
    let source = match rec.algo.as_str() {
        "sft" => Some(Source::Import),
        _ => parse_source(args.sel.source.as_deref())?,
    };
    let sel = Selection {
        source,
        since: args.sel.since.clone(),
        until: Some(rec.created_at.clone()),
        limit: if sessions > 0 {
            sessions
        } else {
            args.sel.limit
        },
    };
    let recorded = cfg.algo;
    if let Some(algo) = args.algo {
        cfg = cfg.with_preset(algo);
    }
    args.learn.apply(&mut cfg);
    cfg.dry_run = true;
    let model = assets::resolve_model(args.sel.model.as_deref(), false)?;
    let head = OutputHead::from_gguf(&model)?;
    let report = run_update(&mut store, db, &head, parent, &cfg, &sel, |_, _, _| {})?;
    let d = &report.diagnostics;
    let b = &d.advantage_balance;
    println!(
        "update {update} replayed: {} sessions, {} tokens, {} steps ({}{}, alpha {}, process \
         scale {:?}, dr_grpo {}, {:?} ratios, clip {:?} {}/{}{}, lr {}, epochs {})",
        d.sessions,
        d.tokens,
        d.steps,
        cfg.algo.name(),
        if cfg.algo == recorded {
            String::new()
        } else {
            format!(" instead of the recorded {}", recorded.name())
        },
        cfg.alpha,
        cfg.process_scale,
        cfg.dr_grpo,
        cfg.objective.granularity,
        cfg.objective.clip,
        cfg.objective.eps_low,
        cfg.objective.eps_high,
        cfg.objective
            .active_guard()
            .map_or(String::new(), |(lo, hi)| format!(", token guard {lo}/{hi}")),
        cfg.lr,
        cfg.epochs
    );
    println!(
        "advantages: outcome share {:.3}, process turns against their outcome {}/{} ({:.1} %)",
        b.outcome_share,
        b.contradicting,
        b.process_turns,
        100.0 * b.contradiction_rate()
    );
    for k in &b.by_kind {
        println!(
            "  {:32} {:>4}/{:<4} against",
            k.kind, k.contradicting, k.turns
        );
    }
    println!(
        "{:>5} {:>7} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "step",
        "clip lo",
        "clip hi",
        "turn p50",
        "turn p90",
        "turn max",
        "tok p50",
        "tok p90",
        "KL k3"
    );
    let n = d.trust_region_steps.len();
    for (i, t) in d.trust_region_steps.iter().enumerate() {
        let label = if i + 1 == n {
            "final".to_string()
        } else {
            (i + 1).to_string()
        };
        println!(
            "{:>5} {:>7.3} {:>7.3} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e} {:>9.2e}",
            label,
            t.clip_frac_low,
            t.clip_frac_high,
            t.turn_log_ratio.p50,
            t.turn_log_ratio.p90,
            t.turn_log_ratio.max,
            t.token_log_ratio.p50,
            t.token_log_ratio.p90,
            t.k3
        );
    }
    println!(
        "candidate over the whole batch: approx KL {:.4}, k3 {:.4}, clipped {:.3} low / {:.3} high",
        d.candidate.approx_kl,
        d.candidate.k3,
        d.candidate.clip_frac_low,
        d.candidate.clip_frac_high
    );
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&d.to_json())?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(ExitCode::SUCCESS)
}
