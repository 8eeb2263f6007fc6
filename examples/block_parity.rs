//! Measures how closely the block-LoRA graph reproduces llama.cpp's logits with a zero adapter:
//! greedy replies to a few customer messages on the default model, the block input captured at
//! every position, then the last `k` blocks recomputed in ONNX Runtime.
//!
//! `cargo run --release --example block_parity -- [k] [emulate 0|1] [tokens per reply]`

use turnwise::adapter::block::BlockLora;
use turnwise::graph::block::{BlockGraphKind, BlockSpec, OrtBlock};
use turnwise::graph::runtime::Device;
use turnwise::learn::block::{generate_captured, parity};
use turnwise::policy::blocks::TailModel;
use turnwise::policy::llama::{self, Context, ContextParams, Model};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let k: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(2);
    let emulate = args.get(2).map(|s| s != "0").unwrap_or(true);
    let n_new: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(48);
    let path = turnwise::assets::resolve_model(None, true)?;
    turnwise::graph::runtime::init(true)?;
    llama::init_backend(false);
    let model = Model::load(&path, 0)?;
    let tail = TailModel::from_gguf(&path, k)?;
    let layer = tail.input_layer();
    let mut ctx = Context::new(
        &model,
        ContextParams {
            n_ctx: 1024,
            n_batch: 512,
            n_threads: 2,
            capture_hidden: false,
            capture_block: Some(layer),
            n_seq: 1,
            kv_cells: None,
        },
    )?;
    let msgs = [
        "Hi, my order 48213 has not arrived. Can you help?",
        "I want a refund for order 77120, the mug was broken.",
        "Where is my package? Order 31995, it was due Monday.",
        "Can you check the status of 90211 please? I also paid 45 dollars for shipping.",
    ];
    let mut caps = Vec::new();
    for m in msgs {
        let text = Model::apply_template(
            "chatml",
            &[
                ("system", "You are a helpful customer-service assistant."),
                ("user", m),
            ],
            true,
        )?;
        let prompt = model.tokenize(&text, model.add_bos(), true)?;
        let c = generate_captured(&mut ctx, &prompt, n_new, model.n_embd(), |t| {
            model.is_eog(t)
        })?;
        caps.push(c);
    }
    let spec = BlockSpec {
        k,
        targets: vec!["q".into(), "v".into()],
        r: 8,
        alpha: 16.0,
    };
    let lora = BlockLora::fresh(&tail.hp, spec.clone(), 1);
    let t0 = std::time::Instant::now();
    let mut g = OrtBlock::new(tail, spec, BlockGraphKind::Logits, emulate, Device::Cpu, 2)?;
    let build = t0.elapsed();
    let t1 = std::time::Instant::now();
    let p = parity(&mut g, &caps, &lora)?;
    println!(
        "k={k} emulate={emulate} capture=l_out-{layer} bytes/token(f16)={} graph load {:.1}s, scoring {:.2}s",
        caps[0].bytes_per_token_f16(),
        build.as_secs_f64(),
        t1.elapsed().as_secs_f64()
    );
    println!("{}", serde_json::to_string(&p)?);
    // a GGUF LoRA written by Turnwise, served by llama.cpp: zero adapter, then a random one
    let dir = std::env::temp_dir().join(format!("tw-block-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let zero_path = dir.join("zero.gguf");
    std::fs::write(&zero_path, lora.to_gguf())?;
    let zero = llama::LoraAdapter::load(&model, &zero_path)?;
    ctx.set_lora(Some(&zero))?;
    let mut same = true;
    for c in &caps {
        let l = turnwise::learn::block::replay_logits(&mut ctx, c)?;
        same &= l == c.logits;
    }
    println!("zero adapter: llama.cpp logits bit-identical to no adapter: {same}");
    let mut rnd = lora.clone();
    let mut rng = turnwise::policy::sampler::Rng::new(7);
    for b in rnd.factors.b.iter_mut() {
        b.mapv_inplace(|_| ((rng.next_f64() * 2.0 - 1.0) * 0.05) as f32);
    }
    let rnd_path = dir.join("random.gguf");
    std::fs::write(&rnd_path, rnd.to_gguf())?;
    let ad = llama::LoraAdapter::load(&model, &rnd_path)?;
    ctx.set_lora(Some(&ad))?;
    let (mut change, mut miss, mut n) = (0f64, 0f64, 0usize);
    let mut with = Vec::new();
    for c in &caps {
        let l1 = turnwise::learn::block::replay_logits(&mut ctx, c)?;
        let rows = c.rows();
        let g1 = g.logits(&rows, &rnd.factors)?;
        let g0 = g.logits(&rows, &lora.factors)?;
        for i in 0..l1.nrows() {
            for j in 0..l1.ncols() {
                let dl = (l1[[i, j]] - c.logits[[i, j]]) as f64;
                let dg = (g1[[i, j]] - g0[[i, j]]) as f64;
                change += dl.abs();
                miss += (dl - dg).abs();
                n += 1;
            }
        }
        let mut c2 = c.clone();
        c2.logits = l1;
        with.push(c2);
    }
    ctx.set_lora(None)?;
    let p1 = parity(&mut g, &with, &rnd)?;
    println!(
        "random adapter: mean |Δlogit| by llama.cpp {:.4}, mean |Δllama − Δgraph| {:.5}; parity with it {}",
        change / n as f64,
        miss / n as f64,
        serde_json::to_string(&p1)?
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
