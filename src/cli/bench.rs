//! `turnwise bench`: prefill and decode speed of Turnwise's engine (hidden-state capture and
//! per-token log-prob bookkeeping on) against llama.cpp through the same crate with nothing
//! extra, in the same process, on the same prompt tokens.

use std::num::NonZeroU32;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context as _;
use clap::Args;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::sampling::LlamaSampler;
use llama_cpp_2::token::LlamaToken;
use turnwise::policy::{Message, Role, SamplerParams};
use turnwise::Engine;

use super::ModelArgs;

/// Options of `turnwise bench`.
#[derive(Args, Clone)]
pub struct BenchArgs {
    #[command(flatten)]
    pub(super) model: ModelArgs,
    /// Approximate prompt length in tokens
    #[arg(long, default_value_t = 256)]
    pub(super) prompt_tokens: usize,
    /// Tokens generated per measurement
    #[arg(long, default_value_t = 128)]
    pub(super) decode_tokens: usize,
    /// Repetitions (the median is reported)
    #[arg(long, default_value_t = 5)]
    pub(super) reps: usize,
    /// Benchmark the learner's step instead: ONNX Runtime vs ndarray at T = 256 and 1024,
    /// r = 8 and 16, plus the rescoring prefill
    #[arg(long)]
    pub(super) train: bool,
    /// Benchmark serving instead: completion latency (p50/p99) of `turnwise serve` on
    /// 127.0.0.1 while background updates run, against the same requests on an idle server
    #[arg(long, conflicts_with = "train")]
    pub(super) serve: bool,
    /// With --serve: requests per phase
    #[arg(long, default_value_t = 40)]
    pub(super) requests: usize,
    /// With --serve: logged sessions with outcomes the updates train on
    #[arg(long, default_value_t = 24)]
    pub(super) seed_sessions: usize,
    /// With --serve: threads of the learner's step
    #[arg(long, default_value_t = 2)]
    pub(super) serve_train_threads: usize,
    /// With --serve: nice value of the learner's thread (0: same priority as serving)
    #[arg(long, default_value_t = 19)]
    pub(super) learn_nice: i32,
    /// Benchmark serving under load instead: completion tokens/s and p50/p95 latency of
    /// `turnwise serve` with 1, 4 and 8 concurrent clients holding multi-turn sessions (and of
    /// llama.cpp's server with --llama-server)
    #[arg(long, conflicts_with_all = ["train", "serve"])]
    pub(super) load: bool,
    /// With --load: numbers of concurrent clients
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub(super) clients: Vec<usize>,
    /// With --load: sessions each client plays, one after another
    #[arg(long, default_value_t = 2)]
    pub(super) sessions: usize,
    /// With --load: turns (requests) per session
    #[arg(long, default_value_t = 3)]
    pub(super) turns: usize,
    /// With --load: tokens per reply (greedy, end-of-turn ignored)
    #[arg(long, default_value_t = 48)]
    pub(super) reply_tokens: usize,
    /// With --load: a `llama-server` binary to measure with the same client, model, threads
    /// and --parallel
    #[arg(long, value_name = "PATH")]
    pub(super) llama_server: Option<std::path::PathBuf>,
    /// Compare weight types of the default model instead: the kernels each gets, prompt and
    /// decode speed at 1/4/8 sequences through the engine, next-token KL to the shipped Q4_1
    #[arg(long, conflicts_with_all = ["train", "serve", "load"])]
    pub(super) formats: bool,
    /// With --formats: the types (Q4_1 is the shipped file, the others are converted once)
    #[arg(long, value_delimiter = ',', default_value = "Q4_1,Q4_0,IQ4_NL,Q8_0,Q4_0_M,IQ4_NL_M", value_parser = parse_file_type)]
    pub(super) types: Vec<turnwise::policy::llama::FileType>,
    /// With --formats: held-out desk scenarios whose transcripts are scored for KL
    #[arg(long, default_value_t = 12)]
    pub(super) kl_sessions: usize,
    /// Benchmark session lookup instead: a log of this many live sessions (200000 is the
    /// goal's size), then 4 clients flood `turnwise serve` with feedback on unknown session
    /// ids while /healthz is timed: latency of both against an idle server
    #[arg(long, value_name = "SESSIONS", conflicts_with_all = ["train", "serve", "load", "formats"])]
    pub(super) lookup: Option<usize>,
}

fn parse_file_type(s: &str) -> Result<turnwise::policy::llama::FileType, String> {
    turnwise::policy::llama::FileType::parse(s).ok_or_else(|| format!("unknown type {s:?}"))
}

pub(super) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Runs the benchmark and prints a table.
///
/// # Errors
/// Model loading or decoding errors.
pub fn run(args: BenchArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    if args.train {
        return train(args, verbose);
    }
    if args.load {
        return super::bench_load::run(args, verbose);
    }
    if args.formats {
        return super::bench_formats::run(&args, verbose);
    }
    if let Some(n) = args.lookup {
        return super::bench_serve::lookup(&args, n, verbose);
    }
    if args.serve {
        if args.requests == 0 || args.seed_sessions == 0 {
            anyhow::bail!("--requests and --seed-sessions must be at least 1");
        }
        return super::bench_serve::run(args, verbose);
    }
    let cfg = args.model.engine_config(verbose)?;
    let engine = Engine::start(cfg.clone())?;
    let mut plain_cfg = cfg.clone();
    plain_cfg.capture_hidden = false;
    let engine_nocap = Engine::start(plain_cfg)?;

    let filler = "Please tell me about the status of my order and the refund policy of your shop. ";
    let words = filler.split_whitespace().count();
    let user: String = filler.repeat((args.prompt_tokens / (words + 2)).max(1));
    let params = SamplerParams {
        max_tokens: args.decode_tokens,
        ignore_eog: true,
        ..Default::default()
    };

    // plain llama.cpp through llama-cpp-2's safe API
    let backend = LlamaBackend::init().context("llama backend")?;
    let model = LlamaModel::load_from_file(&backend, &cfg.model, &LlamaModelParams::default())?;
    let cparams = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(cfg.n_ctx))
        .with_n_batch(cfg.n_batch)
        .with_n_ubatch(cfg.n_batch)
        .with_n_threads(cfg.n_threads)
        .with_n_threads_batch(cfg.n_threads);
    let mut ctx = model.new_context(&backend, cparams)?;

    let (mut e_pre, mut e_dec, mut n_pre, mut n_dec, mut p_pre, mut p_dec) = (
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
        Vec::new(),
    );
    for rep in 0..args.reps {
        // a distinct system line per repetition defeats the engine's prefix cache
        let msgs = vec![
            Message::new(
                Role::System,
                format!("Session {rep}. You are a support agent."),
            ),
            Message::new(Role::User, user.clone()),
        ];
        let key = 1_000_000 + rep as u64;
        for (eng, pre, dec) in [
            (&engine, &mut e_pre, &mut e_dec),
            (&engine_nocap, &mut n_pre, &mut n_dec),
        ] {
            let g = eng.generate(
                key,
                msgs.clone(),
                SamplerParams {
                    seed: rep as u64,
                    ..params.clone()
                },
                None,
            )?;
            pre.push(g.reply.prefill_tokens as f64 / (g.reply.prefill_ms / 1e3));
            // the first token comes from the prefill; the rest are decode steps
            dec.push((g.reply.tokens.len() - 1) as f64 / (g.reply.decode_ms / 1e3));
            eng.close(key);
        }
        let tokens = engine_nocap.session_tokens(key).unwrap_or_default();
        let prompt: Vec<i32> = if tokens.is_empty() {
            let g = engine.generate(
                key,
                msgs.clone(),
                SamplerParams {
                    max_tokens: 1,
                    ..params.clone()
                },
                None,
            )?;
            let t = engine.session_tokens(key)?;
            engine.close(key);
            t[..g.reply.context_len].to_vec()
        } else {
            tokens
        };

        ctx.clear_kv_cache();
        let t0 = Instant::now();
        let mut batch = LlamaBatch::new(cfg.n_batch as usize, 1);
        let mut pos = 0usize;
        for chunk in prompt.chunks(cfg.n_batch as usize) {
            batch.clear();
            for (i, &t) in chunk.iter().enumerate() {
                let last = pos + i + 1 == prompt.len();
                batch.add(LlamaToken(t), (pos + i) as i32, &[0], last)?;
            }
            ctx.decode(&mut batch)?;
            pos += chunk.len();
        }
        p_pre.push(prompt.len() as f64 / t0.elapsed().as_secs_f64());
        let mut sampler = LlamaSampler::chain_simple([
            LlamaSampler::top_k(params.top_k as i32),
            LlamaSampler::top_p(params.top_p, 1),
            LlamaSampler::temp(params.temperature),
            LlamaSampler::dist(rep as u32),
        ]);
        let mut idx = batch.n_tokens() - 1;
        let t1 = Instant::now();
        for k in 0..args.decode_tokens {
            let tok = sampler.sample(&ctx, idx);
            sampler.accept(tok);
            if k + 1 == args.decode_tokens {
                break;
            }
            batch.clear();
            batch.add(tok, pos as i32, &[0], true)?;
            ctx.decode(&mut batch)?;
            pos += 1;
            idx = 0;
        }
        p_dec.push((args.decode_tokens - 1) as f64 / t1.elapsed().as_secs_f64());
    }
    drop(engine);
    drop(engine_nocap);
    let (ep, ed, np, nd, pp, pd) = (
        median(e_pre),
        median(e_dec),
        median(n_pre),
        median(n_dec),
        median(p_pre),
        median(p_dec),
    );
    println!(
        "model {} · {} threads · prompt ~{} tokens · {} decode tokens · median of {} reps",
        cfg.model.display(),
        cfg.n_threads,
        args.prompt_tokens,
        args.decode_tokens,
        args.reps
    );
    println!("{:<44} {:>12} {:>12}", "", "prefill t/s", "decode t/s");
    println!(
        "{:<44} {:>12.1} {:>12.1}",
        "llama.cpp via llama-cpp-2 (nothing extra)", pp, pd
    );
    println!(
        "{:<44} {:>12.1} {:>12.1}",
        "turnwise engine, hidden capture + logging", ep, ed
    );
    println!(
        "{:<44} {:>12.1} {:>12.1}",
        "turnwise engine, no hidden capture", np, nd
    );
    println!(
        "{:<44} {:>12.3} {:>12.3}",
        "ratio turnwise (capture) / plain",
        ep / pp,
        ed / pd
    );
    drop(backend);
    Ok(ExitCode::SUCCESS)
}

/// The block-LoRA step (q,v, r = 8, last k blocks, llama.cpp's roundings emulated) on four
/// sessions of 256 positions with 64 scored reply tokens each, as tokens per second; then
/// llama.cpp's decode speed with a GGUF block adapter set against none.
fn block_step(
    args: &BenchArgs,
    cfg: &turnwise::EngineConfig,
    obj: &turnwise::learn::objective::ObjectiveConfig,
) -> anyhow::Result<()> {
    use ndarray::Array2;
    use turnwise::adapter::block::BlockLora;
    use turnwise::graph::block::{BlockGraphKind, BlockRows, BlockSpec, OrtBlock};
    use turnwise::graph::step::{ObjectiveInputs, StepKind};
    use turnwise::graph::Device;
    use turnwise::learn::objective::{clip_bounds, group_mean_matrix, policy_weights, TokenBatch};
    use turnwise::policy::blocks::TailModel;
    use turnwise::policy::llama::{self, Context, ContextParams, LoraAdapter, Model};
    use turnwise::policy::sampler::Rng;

    let (sessions, len, reply) = (4usize, 256usize, 64usize);
    println!(
        "block-LoRA step (q,v r=8, turn ratio, adaptive clip): {sessions} sessions x {len} positions, {} scored; median of {} reps",
        sessions * reply,
        args.reps
    );
    println!(
        "{:>4} {:>10} {:>18} {:>16}",
        "k", "ms/step", "scored tokens/s", "positions/s"
    );
    let mut rng = Rng::new(2);
    let n = sessions * len;
    let s = sessions * reply;
    let batch = TokenBatch {
        seq: (0..s).map(|k| k / reply).collect(),
        turn: (0..s).map(|k| k / 16).collect(),
        adv: (0..s)
            .map(|k| if (k / reply) % 2 == 0 { 1.0 } else { -1.0 })
            .collect(),
        ig_hat: vec![0.0; s],
        final_turn: (0..s).map(|k| k % reply >= 48).collect(),
        logp_old: vec![-3.0; s],
        logp_behavior: vec![-3.0; s],
        logp_ref: vec![-3.0; s],
        trainable: Vec::new(),
    };
    let f = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<f32>>();
    let bounds = clip_bounds(obj, &batch);
    for k in [2usize, 4] {
        let tail = TailModel::from_gguf(&cfg.model, k)?;
        let hp = tail.hp.clone();
        let x = Array2::from_shape_fn((n, hp.n_embd), |_| (rng.next_f64() * 2.0 - 1.0) as f32);
        let tokens: Vec<usize> = (0..s)
            .map(|_| (rng.next_u64() % hp.n_vocab as u64) as usize)
            .collect();
        let spec = BlockSpec {
            k,
            targets: vec!["q".into(), "v".into()],
            r: 8,
            alpha: 16.0,
        };
        let mut lora = BlockLora::fresh(&hp, spec.clone(), 1);
        for b in lora.factors.b.iter_mut() {
            b.mapv_inplace(|_| (rng.next_f64() * 0.02 - 0.01) as f32);
        }
        let mut g = OrtBlock::new(
            tail,
            spec,
            BlockGraphKind::Step(StepKind::Surrogate {
                granularity: turnwise::learn::objective::Granularity::Turn,
                kl: false,
                entropy: false,
                guard: false,
            }),
            true,
            Device::Cpu,
            cfg.n_threads as usize,
        )?;
        let rows = BlockRows {
            x: x.view(),
            pos: (0..n).map(|i| i % len).collect(),
            seg: (0..n).map(|i| i / len).collect(),
            scored: (0..s)
                .map(|i| (i / reply) * len + len - reply - 1 + i % reply)
                .collect(),
        };
        let objective = ObjectiveInputs {
            tokens: &tokens,
            w: f(&policy_weights(obj, &batch)),
            old: f(&batch.logp_old),
            adv: f(&batch.adv),
            lo: bounds.iter().map(|b| b.0 as f32).collect(),
            hi: bounds.iter().map(|b| b.1 as f32).collect(),
            gmat: Some(group_mean_matrix(obj, &batch).mapv(|x| x as f32)),
            guard: None,
            kl: None,
            entropy: None,
            digit_class: None,
        };
        g.step(&rows, &lora.factors, &objective)?; // warm-up
        let mut ms = Vec::new();
        for _ in 0..args.reps {
            let t0 = Instant::now();
            g.step(&rows, &lora.factors, &objective)?;
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        let m = median(ms);
        println!(
            "{k:>4} {m:>10.0} {:>18.0} {:>16.0}",
            s as f64 / (m / 1e3),
            n as f64 / (m / 1e3)
        );
    }

    // serving: decode speed with a block adapter set in llama.cpp vs none
    llama::init_backend(false);
    let model = Model::load(&cfg.model, 0)?;
    let tail = TailModel::from_gguf(&cfg.model, 2)?;
    let mut lora = BlockLora::fresh(
        &tail.hp,
        BlockSpec {
            k: 2,
            targets: vec!["q".into(), "v".into()],
            r: 8,
            alpha: 16.0,
        },
        1,
    );
    for b in lora.factors.b.iter_mut() {
        b.mapv_inplace(|_| (rng.next_f64() * 0.02 - 0.01) as f32);
    }
    let dir = tempfile_dir()?;
    let path = dir.join("bench-block.gguf");
    std::fs::write(&path, lora.to_gguf())?;
    let adapter = LoraAdapter::load(&model, &path)?;
    let prompt = model.tokenize(
        "<|im_start|>user\nWhere is my order 48213?<|im_end|>\n<|im_start|>assistant\n",
        true,
        true,
    )?;
    let decode_rate = |block_mode: bool, with: bool| -> anyhow::Result<f64> {
        let mut ctx = Context::new(
            &model,
            ContextParams {
                n_ctx: 1024,
                n_batch: 512,
                n_threads: cfg.n_threads,
                capture_hidden: false,
                capture_block: block_mode.then_some(tail.input_layer()),
                n_seq: 1,
                kv_cells: None,
            },
        )?;
        ctx.set_lora(with.then_some(&adapter))?;
        let mut rates = Vec::new();
        for _ in 0..args.reps {
            ctx.truncate(0);
            let mut outs = vec![false; prompt.len()];
            outs[prompt.len() - 1] = true;
            ctx.decode(&prompt, 0, &outs)?;
            let t0 = Instant::now();
            let mut tok = prompt[prompt.len() - 1];
            for i in 0..args.decode_tokens {
                let l = ctx.logits(if i == 0 { prompt.len() - 1 } else { 0 });
                tok = l
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(j, _)| j as i32)
                    .unwrap_or(tok);
                ctx.decode(&[tok], prompt.len() + i, &[true])?;
                ctx.take_block_rows();
            }
            rates.push(args.decode_tokens as f64 / t0.elapsed().as_secs_f64());
        }
        Ok(median(rates))
    };
    let plain = decode_rate(false, false)?;
    let block_none = decode_rate(true, false)?;
    let block_with = decode_rate(true, true)?;
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "llama.cpp decode, {} tokens: no adapter (flash attention auto) {plain:.1} tok/s; block mode (capture l_out-{}, no flash attention) {block_none:.1} tok/s; with a k=2 q,v r=8 GGUF LoRA {block_with:.1} tok/s = {:.3}x block mode, {:.3}x plain",
        args.decode_tokens,
        tail.input_layer(),
        block_with / block_none,
        block_with / plain
    );
    Ok(())
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("turnwise-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

/// The learner's step: the differentiated ONNX graph in ONNX Runtime against the same step in
/// ndarray, on real features (rounded hidden states of the default model) and its real output
/// weight; plus the prefill used to rescore imported logs.
fn train(args: BenchArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    use ndarray::Array2;
    use turnwise::adapter::Adapter;
    use turnwise::graph::step::{ObjectiveInputs, OrtStep, StepInputs, StepKind};
    use turnwise::graph::Device;
    use turnwise::learn::objective::{
        clip_bounds, group_mean_matrix, lora_loss_and_grad, policy_weights, surrogate, Aggregation,
        ClipMode, Granularity, ObjectiveConfig, TokenBatch,
    };
    use turnwise::policy::sampler::Rng;
    use turnwise::policy::OutputHead;

    let cfg = args.model.engine_config(verbose)?;
    let head = OutputHead::from_gguf(&cfg.model)?;
    let (d, v) = (head.n_embd(), head.n_vocab());
    let obj = ObjectiveConfig {
        granularity: Granularity::Turn,
        clip: ClipMode::Adaptive,
        eps_low: 3e-3,
        eps_high: 4e-3,
        clip_beta: 0.3,
        aggregation: Aggregation::SeqMeanTokenMean,
        tis_cap: None,
        kl_coef: 0.0,
        entropy_coef: 0.0,
        mis: false,
        token_guard: None,
    };
    println!(
        "learner step (turn ratio, adaptive clip): loss + ∂A + ∂B; median of {} reps; {} threads",
        args.reps, cfg.n_threads
    );
    println!(
        "{:>6} {:>4} {:>14} {:>14} {:>10} {:>14}",
        "T", "r", "ort ms", "ndarray ms", "speed-up", "ort tokens/s"
    );
    let mut rng = Rng::new(1);
    for &t in &[256usize, 1024] {
        let h = Array2::from_shape_fn((t, d), |_| (rng.next_f64() * 4.0 - 2.0) as f32);
        let h = head.quantize_hidden(h.view())?;
        let base = head.base_logits(h.view())?;
        let tokens: Vec<usize> = (0..t)
            .map(|_| (rng.next_u64() % v as u64) as usize)
            .collect();
        let batch = TokenBatch {
            seq: (0..t).map(|k| k / 64).collect(),
            turn: (0..t).map(|k| k / 16).collect(),
            adv: (0..t)
                .map(|k| if (k / 64) % 2 == 0 { 1.0 } else { -1.0 })
                .collect(),
            ig_hat: vec![0.0; t],
            final_turn: (0..t).map(|k| k % 64 >= 48).collect(),
            logp_old: vec![-3.0; t],
            logp_behavior: vec![-3.0; t],
            logp_ref: vec![-3.0; t],
            trainable: Vec::new(),
        };
        let f = |x: &[f64]| x.iter().map(|&y| y as f32).collect::<Vec<f32>>();
        for &r in &[8usize, 16] {
            let mut ad = Adapter::fresh(d, v, r, 2.0 * r as f32, 3, "bench");
            ad.b.mapv_inplace(|_| (rng.next_f64() * 0.02 - 0.01) as f32);
            let bounds = clip_bounds(&obj, &batch);
            let inputs = StepInputs {
                base: base.view(),
                h: h.view(),
                a: ad.a.view(),
                b: ad.b.view(),
                scale: ad.scale(),
                obj: ObjectiveInputs {
                    tokens: &tokens,
                    w: f(&policy_weights(&obj, &batch)),
                    old: f(&batch.logp_old),
                    adv: f(&batch.adv),
                    lo: bounds.iter().map(|b| b.0 as f32).collect(),
                    hi: bounds.iter().map(|b| b.1 as f32).collect(),
                    gmat: Some(group_mean_matrix(&obj, &batch).mapv(|x| x as f32)),
                    guard: None,
                    kl: None,
                    entropy: None,
                    digit_class: None,
                },
            };
            let mut step = OrtStep::new(
                StepKind::Surrogate {
                    granularity: Granularity::Turn,
                    kl: false,
                    entropy: false,
                    guard: false,
                },
                Device::Cpu,
                cfg.n_threads as usize,
            )?;
            step.run(&inputs)?; // warm-up
            let (mut ort_ms, mut nd_ms) = (Vec::new(), Vec::new());
            for _ in 0..args.reps {
                let t0 = Instant::now();
                step.run(&inputs)?;
                ort_ms.push(t0.elapsed().as_secs_f64() * 1e3);
                let t1 = Instant::now();
                lora_loss_and_grad(
                    base.view(),
                    h.view(),
                    &tokens,
                    ad.a.view(),
                    ad.b.view(),
                    ad.scale(),
                    |lp: &[f32]| {
                        let lp64: Vec<f64> = lp.iter().map(|&x| x as f64).collect();
                        let (l, g, _) = surrogate(&obj, &batch, &lp64);
                        (l as f32, g.into_iter().map(|x| x as f32).collect())
                    },
                );
                nd_ms.push(t1.elapsed().as_secs_f64() * 1e3);
            }
            let (o, n) = (median(ort_ms), median(nd_ms));
            println!(
                "{t:>6} {r:>4} {o:>14.1} {n:>14.1} {:>9.2}x {:>14.0}",
                n / o,
                t as f64 / (o / 1e3)
            );
        }
    }
    block_step(&args, &cfg, &obj)?;
    // rescoring prefill (imports): one prefill over ~1000 tokens with outputs on the reply rows
    let engine = Engine::start(cfg.clone())?;
    let text = "Order 48213 was a blue jacket, size M, shipped to Lisbon. ".repeat(60);
    let tokens = engine.tokenize(&text)?;
    let positions: Vec<usize> = (tokens.len() / 2..tokens.len()).collect();
    let mut rates = Vec::new();
    for _ in 0..args.reps.min(3) {
        let t0 = Instant::now();
        engine.rescore(tokens.clone(), positions.clone())?;
        rates.push(tokens.len() as f64 / t0.elapsed().as_secs_f64());
    }
    println!(
        "rescoring prefill: {} tokens, {} scored positions: {:.0} tokens/s",
        tokens.len(),
        positions.len(),
        median(rates)
    );
    Ok(ExitCode::SUCCESS)
}
