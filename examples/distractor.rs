//! The supervised distractor case: single-turn refund / status requests whose message holds
//! other numbers besides the order id. A LoRA is trained with teacher-forced cross-entropy to
//! reply with a fixed sentence and `ACTION refund|status <id>`; held-out requests (unseen ids and
//! phrasings) are then answered greedily and counted right when the action line names the right
//! intent and id.
//!
//! Compared: the output-projection LoRA (r = 8, applied to llama.cpp's logits) and block LoRA on
//! q,v (r = 8) of the last k blocks, trained from captured block inputs in ONNX Runtime, written
//! as a GGUF LoRA and served by llama.cpp itself for the evaluation.
//!
//! `cargo run --release --example distractor -- [steps] [k,k,...] [lr] [targets] [r] [all|skip-output|stack] [seed]`
//! (defaults: 200 steps, k = 2,4, lr 2e-3, targets q,v, r = 8, seed 0 — the block LoRA's
//! initialisation and shuffling; the requests are the same for every seed)

use ndarray::{Array2, Axis};
use turnwise::adapter::block::BlockLora;
use turnwise::adapter::Adapter;
use turnwise::graph::block::{BlockGraphKind, BlockSpec, OrtBlock};
use turnwise::graph::runtime::Device;
use turnwise::graph::step::{ObjectiveInputs, OrtStep, StepInputs, StepKind};
use turnwise::learn::block::{teacher_forced, train_sft, SftConfig};
use turnwise::policy::blocks::TailModel;
use turnwise::policy::llama::{self, Context, ContextParams, LoraAdapter, Model, Token};
use turnwise::policy::sampler::Rng;
use turnwise::policy::OutputHead;

const SYSTEM: &str = "You are a customer-service agent. Answer in one sentence, then on a new \
                      line write ACTION refund <order id> or ACTION status <order id>.";

const TRAIN: [&str; 10] = [
    "Hi, I want a refund for order {id}.",
    "Please refund my order {id}, it arrived broken.",
    "Order {id} never came, I want my money back.",
    "Can I get a refund on {id}? The size is wrong.",
    "I'd like to return order {id} and get refunded.",
    "Where is my order {id}?",
    "What's the status of order {id}?",
    "Has order {id} shipped yet?",
    "Can you track my package, order {id}?",
    "I'm waiting for {id}, when will it arrive?",
];
const HELD_OUT: [&str; 4] = [
    "My order {id} was damaged so please give me a refund.",
    "Refund order {id} please, I changed my mind.",
    "Could you tell me where order {id} is right now?",
    "Any update on the delivery of order {id}?",
];
const DISTRACT: [&str; 6] = [
    " I paid {n} dollars for it.",
    " It had {n} items in it.",
    " My phone number is {n}.",
    " I ordered it {n} days ago.",
    " My account number is {n}.",
    " The box weighs {n} grams.",
];

struct Example {
    prompt: Vec<Token>,
    reply: Vec<Token>,
    intent: &'static str,
    id: u32,
}

fn make(model: &Model, rng: &mut Rng, phrases: &[&str], distract: bool) -> anyhow::Result<Example> {
    let pi = (rng.next_f64() * phrases.len() as f64) as usize % phrases.len();
    let phrase = phrases[pi];
    let refund =
        phrase.contains("efund") || phrase.contains("money back") || phrase.contains("return");
    let id = 10000 + (rng.next_f64() * 89999.0) as u32;
    let mut msg = phrase.replace("{id}", &id.to_string());
    if distract {
        let d = DISTRACT[(rng.next_f64() * DISTRACT.len() as f64) as usize % DISTRACT.len()];
        let n = 10 + (rng.next_f64() * 99989.0) as u32;
        let extra = d.replace("{n}", &n.to_string());
        // the other number comes before or after the request
        msg = if rng.next_f64() < 0.5 {
            format!("{}{extra}", msg)
        } else {
            format!("{} {msg}", extra.trim())
        };
    }
    let intent = if refund { "refund" } else { "status" };
    let sentence = if refund {
        "I'm sorry about that, I will refund it now."
    } else {
        "Let me check where your order is."
    };
    let text = Model::apply_template("chatml", &[("system", SYSTEM), ("user", &msg)], true)?;
    let prompt = model.tokenize(&text, model.add_bos(), true)?;
    let mut reply = model.tokenize(&format!("{sentence}\nACTION {intent} {id}"), false, false)?;
    reply.push(model.eot().unwrap_or(0));
    Ok(Example {
        prompt,
        reply,
        intent,
        id,
    })
}

fn correct(model: &Model, tokens: &[Token], e: &Example) -> bool {
    let text: Vec<u8> = tokens.iter().flat_map(|&t| model.piece(t, false)).collect();
    let text = String::from_utf8_lossy(&text);
    text.lines()
        .find_map(|l| l.trim().strip_prefix("ACTION "))
        .map(|rest| rest.trim() == format!("{} {}", e.intent, e.id))
        .unwrap_or(false)
}

/// Greedy reply with llama.cpp (whatever LoRA the context holds), optionally adding the
/// output-projection adapter to the logits from the captured hidden state.
fn greedy(
    model: &Model,
    ctx: &mut Context,
    prompt: &[Token],
    head: Option<(&Adapter, bool)>,
) -> anyhow::Result<Vec<Token>> {
    ctx.truncate(0);
    let mut outs = vec![false; prompt.len()];
    outs[prompt.len() - 1] = true;
    let mut h = ctx.decode(prompt, 0, &outs)?;
    ctx.take_block_rows();
    let mut row = prompt.len() - 1;
    let mut out = Vec::new();
    for _ in 0..32 {
        let mut logits = ctx.logits(if out.is_empty() { row } else { 0 }).to_vec();
        if let Some((ad, _)) = head {
            ad.apply(&h, &mut logits);
        }
        let next = logits
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map(|(i, _)| i as Token)
            .unwrap_or(0);
        if model.is_eog(next) {
            break;
        }
        out.push(next);
        row = prompt.len() + out.len() - 1;
        h = ctx.decode(&[next], row, &[true])?;
        ctx.take_block_rows();
    }
    Ok(out)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let steps: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(200);
    let ks: Vec<usize> = args
        .get(2)
        .map(|s| s.split(',').filter_map(|x| x.parse().ok()).collect())
        .unwrap_or(vec![2, 4]);
    let lr: f64 = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(2e-3);
    let targets: Vec<String> = args
        .get(4)
        .map(|s| s.split(',').map(str::to_string).collect())
        .unwrap_or(vec!["q".into(), "v".into()]);
    let rank: usize = args.get(5).and_then(|s| s.parse().ok()).unwrap_or(8);
    // skip-output: block LoRAs only; stack: each block LoRA is trained on top of the output
    // LoRA (fixed) and served together with it, as `turnwise demo --adapter block` does
    let mode = args.get(6).map(String::as_str).unwrap_or("all");
    let (skip_output, stack) = (mode == "skip-output", mode == "stack");
    // the block LoRA's initialisation and shuffling seed (the requests themselves never change)
    let seed: u64 = args.get(7).and_then(|s| s.parse().ok()).unwrap_or(0);
    // TW_SHOW_WRONG=1 lists the held-out requests an adapter got wrong, with its reply
    let show_wrong = std::env::var_os("TW_SHOW_WRONG").is_some();
    let path = turnwise::assets::resolve_model(None, true)?;
    turnwise::graph::runtime::init(true)?;
    llama::init_backend(false);
    let model = Model::load(&path, 0)?;
    let mut rng = Rng::new(2024);
    let train: Vec<Example> = (0..60)
        .map(|i| make(&model, &mut rng, &TRAIN, i % 2 == 1))
        .collect::<anyhow::Result<_>>()?;
    let clean: Vec<Example> = (0..30)
        .map(|_| make(&model, &mut rng, &HELD_OUT, false))
        .collect::<anyhow::Result<_>>()?;
    let distract: Vec<Example> = (0..16)
        .map(|_| make(&model, &mut rng, &HELD_OUT, true))
        .collect::<anyhow::Result<_>>()?;
    // TW_TRAIN_DISTRACT=1: a different training set (own seed) whose 60 requests all hold another
    // number, for asking whether more such demonstrations help; the held-out sets stay the same
    let train = if std::env::var_os("TW_TRAIN_DISTRACT").is_some() {
        let mut rng = Rng::new(2025);
        (0..60)
            .map(|_| make(&model, &mut rng, &TRAIN, true))
            .collect::<anyhow::Result<Vec<_>>>()?
    } else {
        train
    };
    let text = |t: &[Token]| {
        let b: Vec<u8> = t.iter().flat_map(|&t| model.piece(t, true)).collect();
        String::from_utf8_lossy(&b).into_owned()
    };
    let score =
        |ctx: &mut Context, head: Option<(&Adapter, bool)>| -> anyhow::Result<(usize, usize)> {
            let mut right = [0, 0];
            for (set, examples) in [&clean, &distract].into_iter().enumerate() {
                for e in examples {
                    let reply = greedy(&model, ctx, &e.prompt, head)?;
                    let ok = correct(&model, &reply, e);
                    right[set] += usize::from(ok);
                    if !ok && show_wrong {
                        let prompt = text(&e.prompt);
                        let user = prompt.rsplit("user\n").next().unwrap_or("");
                        let user = user.split("<|im_end|>").next().unwrap_or("");
                        println!(
                            "  wrong: {user:?} -> {:?} (want {} {})",
                            text(&reply),
                            e.intent,
                            e.id
                        );
                    }
                }
            }
            let [a, b] = right;
            Ok((a, b))
        };
    let params = |capture_hidden, capture_block| ContextParams {
        n_ctx: 1024,
        n_batch: 512,
        n_threads: 2,
        capture_hidden,
        capture_block,
        n_seq: 1,
        kv_cells: None,
    };

    // base model
    if !skip_output && !stack {
        let mut ctx = Context::new(&model, params(false, Some(0)))?;
        let (a, b) = score(&mut ctx, None)?;
        println!("base model: held-out {a}/30, distractor set {b}/16");
    }

    // output-projection LoRA, r = 8
    let output = if skip_output {
        None
    } else {
        let t0 = std::time::Instant::now();
        let head = OutputHead::from_gguf(&path)?;
        let mut ctx = Context::new(&model, params(true, None))?;
        let (mut hs, mut toks) = (Vec::new(), Vec::new());
        for e in &train {
            let all: Vec<Token> = e.prompt.iter().chain(&e.reply).copied().collect();
            ctx.truncate(0);
            let n = all.len() - 1;
            let outs: Vec<bool> = (0..n).map(|i| i + 1 >= e.prompt.len()).collect();
            let h = ctx.decode(&all[..n], 0, &outs)?;
            hs.push(Array2::from_shape_vec(
                (h.len() / head.n_embd(), head.n_embd()),
                h,
            )?);
            toks.push(e.reply.iter().map(|&t| t as usize).collect::<Vec<_>>());
        }
        let mut ad = Adapter::fresh(head.n_embd(), head.n_vocab(), 8, 16.0, 1, "distractor");
        let mut step = OrtStep::new(
            StepKind::CrossEntropy { digit_class: false },
            Device::Cpu,
            2,
        )?;
        let (mut m, mut v) = (
            vec![Array2::<f32>::zeros(ad.a.dim()), Array2::zeros(ad.b.dim())],
            vec![Array2::<f32>::zeros(ad.a.dim()), Array2::zeros(ad.b.dim())],
        );
        let mut order: Vec<usize> = (0..train.len()).collect();
        let mut last = 0.0;
        for s in 0..steps {
            if s % (train.len() / 4) == 0 {
                for i in (1..order.len()).rev() {
                    let j = (rng.next_f64() * (i + 1) as f64) as usize;
                    order.swap(i, j.min(i));
                }
            }
            let pick: Vec<usize> = (0..4).map(|i| order[(s * 4 + i) % order.len()]).collect();
            let hv: Vec<_> = pick.iter().map(|&i| hs[i].view()).collect();
            let h = ndarray::concatenate(Axis(0), &hv)?;
            let t: Vec<usize> = pick.iter().flat_map(|&i| toks[i].clone()).collect();
            let base = head.base_logits(h.view())?;
            let w = vec![1.0 / t.len() as f32; t.len()];
            let inputs = StepInputs {
                base: base.view(),
                h: h.view(),
                a: ad.a.view(),
                b: ad.b.view(),
                scale: ad.scale(),
                obj: ObjectiveInputs::cross_entropy(&t, w),
            };
            let (loss, _, ga, gb) = step.run(&inputs)?;
            last = loss;
            let tt = (s + 1) as i32;
            for (k, (p, g)) in [(&mut ad.a, ga), (&mut ad.b, gb)].into_iter().enumerate() {
                ndarray::Zip::from(p)
                    .and(&mut m[k])
                    .and(&mut v[k])
                    .and(&g)
                    .for_each(|p, m, v, &g| {
                        *m = 0.9 * *m + 0.1 * g;
                        *v = 0.999 * *v + 0.001 * g * g;
                        let mh = *m / (1.0 - 0.9f32.powi(tt));
                        let vh = *v / (1.0 - 0.999f32.powi(tt));
                        *p -= lr as f32 * mh / (vh.sqrt() + 1e-8);
                    });
            }
        }
        let train_s = t0.elapsed().as_secs_f64();
        let (a, b) = score(&mut ctx, Some((&ad, true)))?;
        println!(
            "output LoRA r=8: held-out {a}/30, distractor set {b}/16 (final loss {last:.4}, {steps} steps in {train_s:.0} s)"
        );
        Some(ad)
    };
    let stacked = output.as_ref().filter(|_| stack);

    // block LoRA on q,v of the last k blocks, r = 8
    for &k in &ks {
        let t0 = std::time::Instant::now();
        let tail = TailModel::from_gguf(&path, k)?;
        let layer = tail.input_layer();
        let mut ctx = Context::new(&model, params(stacked.is_some(), Some(layer)))?;
        let mut data = Vec::new();
        for e in &train {
            let all: Vec<Token> = e.prompt.iter().chain(&e.reply).copied().collect();
            data.push(teacher_forced(
                &mut ctx,
                &all,
                e.prompt.len(),
                model.n_embd(),
            )?);
        }
        let spec = BlockSpec {
            k,
            targets: targets.clone(),
            r: rank,
            alpha: 2.0 * rank as f32,
        };
        let mut lora = BlockLora::fresh(&tail.hp, spec.clone(), 1 + seed);
        let mut g = OrtBlock::new(
            tail,
            spec,
            BlockGraphKind::Step(StepKind::CrossEntropy { digit_class: false }),
            true,
            Device::Cpu,
            2,
        )?;
        let losses = train_sft(
            &mut g,
            &data,
            &mut lora,
            stacked.map(Adapter::output_lora),
            SftConfig {
                steps,
                batch: 4,
                lr,
                seed: 3 + seed,
            },
            |_, _| {},
        )?;
        let train_s = t0.elapsed().as_secs_f64();
        let dir = std::env::temp_dir().join(format!("tw-distractor-{}-{k}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        let p = dir.join("adapter.gguf");
        std::fs::write(&p, lora.to_gguf())?;
        let ad = LoraAdapter::load(&model, &p)?;
        ctx.set_lora(Some(&ad))?;
        let (a, b) = score(&mut ctx, stacked.map(|o| (o, true)))?;
        ctx.set_lora(None)?;
        let _ = std::fs::remove_dir_all(&dir);
        println!(
            "block LoRA {} k={k} r={rank} lr={lr} (served by llama.cpp{}): held-out {a}/30, distractor set {b}/16 (final loss {:.4}, {steps} steps in {train_s:.0} s)",
            targets.join(","),
            if stacked.is_some() {
                ", on top of the output LoRA"
            } else {
                ""
            },
            losses.last().copied().unwrap_or(f32::NAN)
        );
    }
    Ok(())
}
