//! `turnwise bench --formats`: the default model in each candidate weight type, through
//! Turnwise's own engine, in one run: which kernels its weights get, prompt and decode speed at
//! 1 / 4 / 8 sequences, and the next-token KL divergence from the shipped Q4_1 file over desk
//! transcripts and generic chat.

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use turnwise::env::{self, Split};
use turnwise::policy::gguf::GgufIndex;
use turnwise::policy::llama::{self, FileType};
use turnwise::policy::sampler::Rng;
use turnwise::{assets, Engine, Message, Role, SamplerParams};

use super::bench::BenchArgs;

/// Generic chat prompts (the model's own replies to them are scored too).
const GENERIC: [&str; 16] = [
    "What is the capital of France, and what is it known for?",
    "Write a short poem about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for sleeping better.",
    "How do I make a cup of green tea?",
    "What is the difference between a virus and a bacterium?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "Suggest a name for a small bakery.",
    "How many legs does a spider have, and why?",
    "What should I pack for a weekend hiking trip?",
    "Translate 'good morning' into Spanish and German.",
    "Describe a healthy breakfast.",
    "What is a prime number? Give examples.",
    "How does a bicycle stay upright?",
    "Tell me a fun fact about octopuses.",
];

/// Runs the comparison and prints three tables.
///
/// # Errors
/// Provisioning, conversion, model and engine errors.
pub fn run(args: &BenchArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let shipped_asset = assets::asset(assets::DEFAULT_MODEL)?;
    let shipped = assets::ensure(&shipped_asset, &assets::cache_dir(), false)?;
    let mut models: Vec<(FileType, PathBuf)> = Vec::new();
    for ty in &args.types {
        let path = if *ty == FileType::Q4_1 {
            shipped.clone()
        } else {
            assets::convert_cached(&shipped, &shipped_asset.sha256, *ty, None, false)?.path
        };
        models.push((*ty, path));
    }
    let threads = args.model.threads;
    let m = turnwise::demo::Machine::this(&[], 0);
    println!(
        "default model in each weight type · {threads} threads · machine: {} cores ({}), {} GiB",
        m.cores, m.cpu, m.memory_gib
    );

    // ---- 1. which kernels the weights get -----------------------------------------------
    println!("\n## Weight buffers (llama.cpp's loader) and tensor types");
    for (ty, path) in &models {
        let (kinds, lines) = llama::capture_log(|| kernel_report(path));
        let buffers: Vec<String> = lines
            .iter()
            .filter(|l| l.contains("model buffer size"))
            .map(|l| {
                let t = l.split_once(':').map_or(l.as_str(), |(_, r)| r).trim();
                t.replace("model buffer size =", "")
                    .split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        println!(
            "- {ty}: buffers {} · tensors {}",
            if buffers.is_empty() {
                "(not logged)".into()
            } else {
                buffers.join(", ")
            },
            kinds?
        );
    }

    // ---- 2. quality: next-token KL to the shipped file ----------------------------------
    let reference = models
        .iter()
        .find(|(t, _)| *t == FileType::Q4_1)
        .map(|(_, p)| p.clone())
        .unwrap_or_else(|| shipped.clone());
    let sets = transcripts(&reference, args, verbose)?;
    println!(
        "\n## Next-token KL(Q4_1 shipped ‖ type), temperature 1, every position ({} desk transcripts, {} generic chats)",
        sets[0].1.len(),
        sets[1].1.len()
    );
    println!(
        "| type | set | positions | mean KL | p99 KL | max KL | same arg-max |\n|---|---|---|---|---|---|---|"
    );
    let backend = LlamaBackend::init().context("llama backend")?;
    let ref_model = load(&backend, &reference)?;
    let cands: Vec<(FileType, LlamaModel)> = models
        .iter()
        .filter(|(_, p)| *p != reference)
        .map(|(t, p)| Ok((*t, load(&backend, p)?)))
        .collect::<anyhow::Result<_>>()?;
    for (name, seqs) in &sets {
        // per candidate: every position's KL, and how often the arg-max agrees
        let mut kl: Vec<Vec<f64>> = vec![Vec::new(); cands.len()];
        let mut agree = vec![0usize; cands.len()];
        for seq in seqs {
            let p = all_logits(&backend, &ref_model, seq, threads)?;
            for (c, (_, model)) in cands.iter().enumerate() {
                let q = all_logits(&backend, model, seq, threads)?;
                for (lp, lq) in p.iter().zip(&q) {
                    let (d, same) = kl_row(lp, lq);
                    kl[c].push(d);
                    agree[c] += usize::from(same);
                }
            }
        }
        for (c, (ty, _)) in cands.iter().enumerate() {
            let v = &mut kl[c];
            let n = v.len();
            let mean = v.iter().sum::<f64>() / n.max(1) as f64;
            v.sort_by(f64::total_cmp);
            let q99 = v.get((n as f64 * 0.99) as usize).copied().unwrap_or(0.0);
            let max = v.last().copied().unwrap_or(0.0);
            println!(
                "| {ty} | {name} | {n} | {mean:.4} | {q99:.3} | {max:.2} | {:.1} % |",
                100.0 * agree[c] as f64 / n.max(1) as f64
            );
        }
    }
    drop(cands);
    drop(ref_model);

    // ---- 3. speed through Turnwise's engine ---------------------------------------------
    println!(
        "\n## Speed through Turnwise's engine (~{} -token prompts, {} -token replies, median of {} reps)",
        args.prompt_tokens, args.decode_tokens, args.reps
    );
    println!("| type | prompt t/s | decode t/s, 1 / 4 / 8 sequences | rows per step | all tokens t/s at 4 |\n|---|---|---|---|---|");
    for (ty, path) in &models {
        let mut cfg = args.model.engine_config(verbose)?;
        cfg.model = path.clone();
        cfg.n_seq = 8;
        let engine = Engine::start(cfg)?;
        let mut prompt = Vec::new();
        let mut decode = Vec::new();
        let mut rows = Vec::new();
        let mut all4 = Vec::new();
        for rep in 0..args.reps {
            for (k, n) in [1usize, 4, 8].into_iter().enumerate() {
                let r = concurrent(&engine, n, args, (rep * 100 + k * 10) as u64)?;
                if n == 1 {
                    prompt.push(r.prompt_tps);
                }
                if n == 4 {
                    all4.push(r.all_tps);
                }
                decode.push((n, r.decode_tps));
                rows.push((n, r.rows_per_step));
            }
        }
        let med = |v: &[(usize, f64)], n: usize| {
            super::bench::median(v.iter().filter(|(m, _)| *m == n).map(|(_, x)| *x).collect())
        };
        println!(
            "| {ty} | {:.0} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.0} |",
            super::bench::median(prompt),
            med(&decode, 1),
            med(&decode, 4),
            med(&decode, 8),
            med(&rows, 1),
            med(&rows, 4),
            med(&rows, 8),
            super::bench::median(all4),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Loads the model (which makes llama.cpp log its weight buffers) and counts its tensors by type.
fn kernel_report(path: &Path) -> anyhow::Result<String> {
    let m = llama::Model::load(path, 0)?;
    drop(m);
    let idx = GgufIndex::open(path)?;
    let mut by: Vec<(String, usize)> = Vec::new();
    for t in &idx.tensors {
        let name = llama::ggml_type_name(t.ggml_type);
        match by.iter_mut().find(|(n, _)| *n == name) {
            Some((_, c)) => *c += 1,
            None => by.push((name, 1)),
        }
    }
    by.sort_by_key(|t| std::cmp::Reverse(t.1));
    Ok(by
        .iter()
        .map(|(n, c)| format!("{c}× {n}"))
        .collect::<Vec<_>>()
        .join(", "))
}

fn load(backend: &LlamaBackend, path: &Path) -> anyhow::Result<LlamaModel> {
    LlamaModel::load_from_file(backend, path, &LlamaModelParams::default())
        .with_context(|| format!("loading {}", path.display()))
}

/// A named set of token sequences whose every position is scored.
type Scored = (&'static str, Vec<Vec<i32>>);

/// Token sequences to score: the scripted expert's desk sessions, the model's own first
/// replies to desk openings, and the model's replies to generic prompts (all rendered with the
/// model's chat template by an engine on `reference`).
fn transcripts(reference: &Path, args: &BenchArgs, verbose: bool) -> anyhow::Result<[Scored; 2]> {
    let mut cfg = args.model.engine_config(verbose)?;
    cfg.model = reference.to_path_buf();
    cfg.capture_hidden = false;
    let engine = Engine::start(cfg)?;
    let mut rng = Rng::new(17);
    let mut desk = Vec::new();
    let n_desk = args.kl_sessions;
    for (i, s) in env::stratified(&mut rng, Split::HeldOut, n_desk)
        .iter()
        .enumerate()
    {
        let conv = turnwise::demo::expert_conversation(s, 6);
        let key = 7_000_000 + i as u64;
        engine.append(key, conv.messages.clone())?;
        desk.push(engine.session_tokens(key)?);
        engine.close(key);
        // the model's own reply to the opening (sampled from the shipped file)
        let opening: Vec<Message> = conv
            .messages
            .iter()
            .take_while(|m| m.role != Role::Assistant)
            .cloned()
            .collect();
        let key = 7_500_000 + i as u64;
        engine.generate(key, opening, sampled(i as u64, 48), None)?;
        desk.push(engine.session_tokens(key)?);
        engine.close(key);
    }
    let mut generic = Vec::new();
    for (i, q) in GENERIC.iter().enumerate() {
        let key = 8_000_000 + i as u64;
        let msgs = vec![
            Message::new(Role::System, "You are a helpful assistant."),
            Message::new(Role::User, *q),
        ];
        engine.generate(key, msgs, sampled(i as u64, 160), None)?;
        generic.push(engine.session_tokens(key)?);
        engine.close(key);
    }
    Ok([("desk", desk), ("generic chat", generic)])
}

fn sampled(seed: u64, max_tokens: usize) -> SamplerParams {
    SamplerParams {
        seed,
        max_tokens,
        temperature: 0.8,
        ..Default::default()
    }
}

/// Temperature-1 logits of every position of `tokens` (one context, one decode).
fn all_logits(
    backend: &LlamaBackend,
    model: &LlamaModel,
    tokens: &[i32],
    threads: i32,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let n = tokens.len().max(1) as u32;
    let cp = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n.next_power_of_two().max(64)))
        .with_n_batch(n.next_power_of_two().max(64))
        .with_n_ubatch(512)
        .with_n_threads(threads)
        .with_n_threads_batch(threads);
    let mut ctx = model.new_context(backend, cp)?;
    let mut batch = LlamaBatch::new(tokens.len(), 1);
    for (i, &t) in tokens.iter().enumerate() {
        batch.add(LlamaToken(t), i as i32, &[0], true)?;
    }
    ctx.decode(&mut batch)?;
    // the last position predicts nothing in the sequence: leave it out
    Ok((0..tokens.len().saturating_sub(1))
        .map(|i| ctx.get_logits_ith(i as i32).to_vec())
        .collect())
}

/// KL(p ‖ q) of two logit rows (softmax at temperature 1) and whether their arg-max agrees.
fn kl_row(lp: &[f32], lq: &[f32]) -> (f64, bool) {
    let lse = |l: &[f32]| {
        let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        m + l.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln()
    };
    let (zp, zq) = (lse(lp), lse(lq));
    let mut kl = 0.0;
    for (&a, &b) in lp.iter().zip(lq) {
        let lpa = a as f64 - zp;
        kl += lpa.exp() * (lpa - (b as f64 - zq));
    }
    let argmax = |l: &[f32]| {
        l.iter()
            .enumerate()
            .max_by(|x, y| x.1.total_cmp(y.1))
            .map(|(i, _)| i)
    };
    (kl.max(0.0), argmax(lp) == argmax(lq))
}

/// What one round of `n` concurrent requests measured.
struct Round {
    prompt_tps: f64,
    decode_tps: f64,
    rows_per_step: f64,
    all_tps: f64,
}

/// `n` requests at once, each a fresh prompt of about `--prompt-tokens` tokens and a reply of
/// `--decode-tokens` tokens (greedy, end of turn ignored), timed with the engine's counters.
fn concurrent(engine: &Engine, n: usize, args: &BenchArgs, salt: u64) -> anyhow::Result<Round> {
    let filler = "Please tell me about the status of my order and the refund policy of your shop. ";
    let words = filler.split_whitespace().count();
    let user: String = filler.repeat((args.prompt_tokens / (words + 2)).max(1));
    let before = engine.stats().counters();
    let t0 = Instant::now();
    let results: Vec<anyhow::Result<usize>> = std::thread::scope(|sc| {
        let hs: Vec<_> = (0..n)
            .map(|i| {
                let user = user.clone();
                sc.spawn(move || -> anyhow::Result<usize> {
                    let key = 9_000_000 + salt * 16 + i as u64;
                    // a distinct first line per request defeats the prefix cache
                    let msgs = vec![
                        Message::new(
                            Role::System,
                            format!("Ticket {salt}-{i}. You are a support agent."),
                        ),
                        Message::new(Role::User, user),
                    ];
                    let params = SamplerParams {
                        temperature: 0.0,
                        max_tokens: args.decode_tokens,
                        ignore_eog: true,
                        ..Default::default()
                    };
                    let g = engine.generate(key, msgs, params, None)?;
                    engine.close(key);
                    Ok(g.reply.prefill_tokens + g.reply.tokens.len())
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("bench thread panicked")))
            })
            .collect()
    });
    let wall = t0.elapsed().as_secs_f64();
    let mut tokens = 0usize;
    for r in results {
        tokens += r?;
    }
    let c = engine.stats().counters().since(&before);
    Ok(Round {
        prompt_tps: c.prefill_tokens as f64 / (c.prefill_us as f64 / 1e6).max(1e-9),
        decode_tps: c.rows as f64 / (c.step_us as f64 / 1e6).max(1e-9),
        rows_per_step: c.rows as f64 / c.steps.max(1) as f64,
        all_tps: tokens as f64 / wall,
    })
}
