//! The block-LoRA graph: the last `k` transformer blocks of the model, the final norm and the
//! output projection, recomputed from the activations captured at block `L − k` (`l_out-N`),
//! with LoRA on a chosen set of projections.
//!
//! The forward follows llama.cpp's `llama` graph on the CPU: RMSNorm, Q/K/V projections,
//! "normal" RoPE on adjacent pairs, grouped-query causal softmax attention with scale
//! `1/√head_dim`, the output projection and residual, RMSNorm, SwiGLU MLP and residual; then the
//! final RMSNorm and the output projection, only at the scored rows. With `emulate`, the
//! roundings llama.cpp applies are reproduced with straight-through gradients: activations
//! quantised to 8-bit blocks before every quantised matmul, and the f16 KV cache, f16 queries and
//! f16 attention weights of its non-flash attention path. A LoRA term uses the unrounded input in
//! f32, as llama.cpp's `build_lora_mm` does.
//!
//! Several sessions are scored in one run by concatenating their rows: positions restart per
//! session and the attention mask is block-diagonal.

use ndarray::{Array2, ArrayView2};
use ort::session::Session;
use ort::value::Tensor;

use super::builder::{Dim, Elem, Graph, V};
use super::runtime::{self, Device};
use super::step::{objective, objective_feed, ObjectiveInputs, StepKind};
use crate::error::{Error, Result};
use crate::policy::blocks::{rope_tables, TailModel};
use crate::policy::llama;

/// Which projections carry LoRA, its rank and scale.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct BlockSpec {
    /// number of adapted blocks at the top of the model
    pub k: usize,
    /// adapted projections, from `q,k,v,o,gate,up,down`
    pub targets: Vec<String>,
    /// rank
    pub r: usize,
    /// the update is scaled by `alpha / r`
    pub alpha: f32,
}

impl BlockSpec {
    /// `alpha / r`.
    pub fn scale(&self) -> f32 {
        self.alpha / self.r as f32
    }
}

/// What a graph computes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum BlockGraphKind {
    /// logits of the scored rows, `[S, V]` (forward only)
    Logits,
    /// a training step of the given objective: loss, log-probs and LoRA gradients
    Step(StepKind),
}

/// The LoRA factors, one `(A [r, in], B [out, r])` pair per adapted block and target, blocks
/// outer, targets in [`BlockSpec::targets`] order.
#[derive(Debug, Clone, PartialEq)]
pub struct BlockFactors {
    /// `A` matrices
    pub a: Vec<Array2<f32>>,
    /// `B` matrices
    pub b: Vec<Array2<f32>>,
}

/// The rows of one run: captured activations of whole sessions, concatenated.
#[derive(Debug, Clone)]
pub struct BlockRows<'a> {
    /// `[N, n_embd]`, the input of block `L − k` at every position
    pub x: ArrayView2<'a, f32>,
    /// per row: its position in its session
    pub pos: Vec<usize>,
    /// per row: which session it belongs to (rows of a session are contiguous)
    pub seg: Vec<usize>,
    /// rows whose next-token distribution is scored, in output order
    pub scored: Vec<usize>,
}

fn input_name(block: usize, target: &str, ab: &str) -> String {
    format!("lora.{block}.{target}.{ab}")
}

/// The activation rounding llama.cpp applies before a matmul with a weight of `ggml_type`.
fn round_activation(g: &mut Graph, x: V, width: usize, ggml_type: u32) -> V {
    let t = llama::vec_dot_type(ggml_type);
    if t == llama_cpp_sys_2::GGML_TYPE_Q8_0 || t == llama_cpp_sys_2::GGML_TYPE_Q8_1 {
        g.round_q8(x, width as i64)
    } else if t == llama_cpp_sys_2::GGML_TYPE_Q8_K && width.is_multiple_of(256) {
        g.round_q8k(x, width as i64)
    } else if t == llama_cpp_sys_2::GGML_TYPE_F16 {
        g.round_f16(x)
    } else {
        // f32 weights: no rounding
        x
    }
}

struct Builder<'m> {
    g: Graph,
    tail: &'m TailModel,
    spec: &'m BlockSpec,
    emulate: bool,
    lora: Vec<(V, V)>,
    scale: V,
    swap: V,
}

impl Builder<'_> {
    fn rms_norm(&mut self, x: V, w: &[f32], name: &str) -> V {
        let g = &mut self.g;
        let d = w.len();
        let wv = g.constant(name, &[d], w);
        let eps = f64::from(self.tail.hp.rms_eps);
        if self.emulate {
            g.rms_norm_ggml(x, wv, d, eps)
        } else {
            g.rms_norm(x, wv, d, eps)
        }
    }

    /// `W·x` (+ the LoRA term of `target` in block slot `bi` when adapted).
    fn linear(&mut self, x: V, bi: usize, target: &str) -> V {
        let tail = self.tail;
        let block = &tail.blocks[bi];
        let p = block.proj(target);
        let (_, din) = tail.hp.shape(target);
        let wname = format!("w.{}.{target}", block.index);
        let konst = |g: &mut Graph, name: &str, m: &Array2<f32>| {
            let t = m.t().as_standard_layout().to_owned();
            g.constant(name, &[t.nrows(), t.ncols()], t.as_slice().unwrap_or(&[]))
        };
        let y = match (&p.split, self.emulate) {
            (Some((scaled, mins)), true) => {
                // ggml's Q4_1 × Q8_1 dot: Σ d_w·d_x·Σ q_w q_x + Σ m_w · s_x
                let (xq, sums) = self.g.round_q8_sums(x, din as i64);
                let wd = konst(&mut self.g, &wname, scaled);
                let wm = konst(&mut self.g, &format!("{wname}.min"), mins);
                let g = &mut self.g;
                let main = g.matmul(xq, wd);
                let lo = g.matmul(sums, wm);
                g.add(main, lo)
            }
            _ => {
                let wv = konst(&mut self.g, &wname, &p.w);
                let xin = if self.emulate {
                    round_activation(&mut self.g, x, din, p.ggml_type)
                } else {
                    x
                };
                self.g.matmul(xin, wv)
            }
        };
        match self.spec.targets.iter().position(|t| t == target) {
            Some(ti) => {
                let (a, b) = self.lora[bi * self.spec.targets.len() + ti];
                let l = self.g.lora_term(x, a, b, self.scale);
                self.g.add(y, l)
            }
            None => y,
        }
    }

    fn rope(&mut self, x: V, cos: V, sin: V, width: usize) -> V {
        let g = &mut self.g;
        // swap(x)[2i] = −x[2i+1], swap(x)[2i+1] = x[2i]
        let pairs = g.reshape(x, &[-1, 2]);
        let sw = g.matmul(pairs, self.swap);
        let sw = g.reshape(sw, &[-1, width as i64]);
        let a = g.mul(x, cos);
        let b = g.mul(sw, sin);
        g.add(a, b)
    }

    fn block(&mut self, x: V, bi: usize, rope: [V; 4], mask: V) -> V {
        let hp = self.tail.hp.clone();
        let (d, dh) = (hp.n_embd as i64, hp.head_dim as i64);
        let (nh, nkv) = (hp.n_head as i64, hp.n_head_kv as i64);
        let index = self.tail.blocks[bi].index;
        let attn_norm = self.tail.blocks[bi].attn_norm.clone();
        let cur = self.rms_norm(x, &attn_norm, &format!("attn_norm.{index}"));
        let q = self.linear(cur, bi, "q");
        let k = self.linear(cur, bi, "k");
        let v = self.linear(cur, bi, "v");
        let q = self.rope(q, rope[0], rope[1], hp.n_embd);
        let k = self.rope(k, rope[2], rope[3], hp.n_embd_kv());
        let (q, k, v) = if self.emulate {
            let g = &mut self.g;
            (g.round_f16(q), g.round_f16(k), g.round_f16(v))
        } else {
            (q, k, v)
        };
        let g = &mut self.g;
        let qh = g.reshape(q, &[-1, nh, dh]);
        let qh = g.permute(qh, &[1, 0, 2]);
        let qh = g.reshape(qh, &[nkv, -1, dh]); // [Hkv, n_rep·N, dh]
        let kh = g.reshape(k, &[-1, nkv, dh]);
        let kh = g.permute(kh, &[1, 2, 0]); // [Hkv, dh, N]
        let vh = g.reshape(v, &[-1, nkv, dh]);
        let vh = g.permute(vh, &[1, 0, 2]); // [Hkv, N, dh]
        let s = g.matmul(qh, kh);
        let sc = g.scalar(1.0 / (dh as f64).sqrt());
        let s = g.mul(s, sc);
        let s = g.add(s, mask);
        let p = g.softmax(s);
        let p = if self.emulate { g.round_f16(p) } else { p };
        let o = g.matmul(p, vh); // [Hkv, n_rep·N, dh]
        let o = g.reshape(o, &[nh, -1, dh]);
        let o = g.permute(o, &[1, 0, 2]);
        let o = g.reshape(o, &[-1, d]);
        let o = self.linear(o, bi, "o");
        let ffn_inp = self.g.add(o, x);
        let ffn_norm = self.tail.blocks[bi].ffn_norm.clone();
        let cur = self.rms_norm(ffn_inp, &ffn_norm, &format!("ffn_norm.{index}"));
        let gate = self.linear(cur, bi, "gate");
        let up = self.linear(cur, bi, "up");
        let g = &mut self.g;
        let sg = g.sigmoid(gate);
        let silu = g.mul(gate, sg);
        let act = g.mul(silu, up);
        let down = self.linear(act, bi, "down");
        self.g.add(down, ffn_inp)
    }
}

/// Builds the graph. Inputs: `x [N, D]`, `cos_q`/`sin_q [N, H·dh]`, `cos_k`/`sin_k [N, Hkv·dh]`,
/// `mask [n_rep·N, N]`, `sel [S, N]`, `scale`, the LoRA factors `lora.{block}.{target}.a|b`,
/// and for a step the objective's inputs. Outputs: `logits`, or `loss`, `logp` and
/// `grad.{block}.{target}.a|b`.
pub fn build(tail: &TailModel, spec: &BlockSpec, kind: BlockGraphKind, emulate: bool) -> Vec<u8> {
    use Dim::{Fixed, Sym};
    let hp = &tail.hp;
    let train = matches!(kind, BlockGraphKind::Step(_));
    let mut g = Graph::new(Elem::F32);
    let d = hp.n_embd as i64;
    let x = g.input("x", &[Sym("N"), Fixed(d)], false);
    let wq = (hp.n_embd) as i64;
    let wkv = hp.n_embd_kv() as i64;
    let rope = [
        g.input("cos_q", &[Sym("N"), Fixed(wq)], false),
        g.input("sin_q", &[Sym("N"), Fixed(wq)], false),
        g.input("cos_k", &[Sym("N"), Fixed(wkv)], false),
        g.input("sin_k", &[Sym("N"), Fixed(wkv)], false),
    ];
    let mask = g.input("mask", &[Sym("R"), Sym("N")], false);
    let sel = g.input("sel", &[Sym("T"), Sym("N")], false);
    let scale = g.input("scale", &[], false);
    let mut lora = Vec::new();
    for block in &tail.blocks {
        for t in &spec.targets {
            let (dout, din) = hp.shape(t);
            let a = g.input(
                &input_name(block.index, t, "a"),
                &[Fixed(spec.r as i64), Fixed(din as i64)],
                train,
            );
            let b = g.input(
                &input_name(block.index, t, "b"),
                &[Fixed(dout as i64), Fixed(spec.r as i64)],
                train,
            );
            lora.push((a, b));
        }
    }
    let swap = g.constant("rope_swap", &[2, 2], &[0.0, 1.0, -1.0, 0.0]);
    let mut bld = Builder {
        g,
        swap,
        tail,
        spec,
        emulate,
        lora: lora.clone(),
        scale,
    };
    let mut h = x;
    for bi in 0..tail.blocks.len() {
        h = bld.block(h, bi, rope, mask);
    }
    let hs = bld.g.matmul(sel, h);
    let hn = bld.rms_norm(hs, &tail.output_norm, "output_norm");
    if kind == BlockGraphKind::Logits {
        bld.g.output(hn, "hidden");
    }
    let hs = if emulate {
        round_activation(&mut bld.g, hn, hp.n_embd, tail.output.ggml_type)
    } else {
        hn
    };
    let wt = tail.output.w.t().as_standard_layout().to_owned();
    let wv = bld.g.constant(
        "w.output",
        &[wt.nrows(), wt.ncols()],
        wt.as_slice().unwrap_or(&[]),
    );
    let z = bld.g.matmul(hs, wv);
    let mut g = bld.g;
    match kind {
        BlockGraphKind::Logits => g.output(z, "logits"),
        BlockGraphKind::Step(sk) => {
            // the sampling policy: + the output-projection LoRA on the final normalised
            // hidden state (unrounded, as the engine applies it), / temperature, + the
            // sampler's support (0 or a large negative logit per vocabulary entry)
            let nv = tail.output.w.nrows() as i64;
            let out_a = g.input("out_a", &[Sym("RO"), Fixed(d)], false);
            let out_b = g.input("out_b", &[Fixed(nv), Sym("RO")], false);
            let out_scale = g.input("out_scale", &[], false);
            let inv_t = g.input("inv_t", &[Sym("T"), Fixed(1)], false);
            let bias = g.input("bias", &[Sym("T"), Fixed(nv)], false);
            let l = g.lora_term(hn, out_a, out_b, out_scale);
            let z = g.add(z, l);
            let z = g.mul_bc(z, inv_t, &[1]);
            let z = g.add(z, bias);
            let (loss, lp) = objective(&mut g, sk, z);
            let wrt: Vec<V> = lora.iter().flat_map(|&(a, b)| [a, b]).collect();
            let grads = g.grad(loss, &wrt);
            g.output(loss, "loss");
            g.output(lp, "logp");
            for (i, block) in tail.blocks.iter().enumerate() {
                for (j, t) in spec.targets.iter().enumerate() {
                    let n = 2 * (i * spec.targets.len() + j);
                    g.output(grads[n], &format!("grad.{}.{t}.a", block.index));
                    g.output(grads[n + 1], &format!("grad.{}.{t}.b", block.index));
                }
            }
        }
    }
    g.to_bytes()
}

/// The graph in an ONNX Runtime session, with the model tables it needs per run.
pub struct OrtBlock {
    session: Session,
    kind: BlockGraphKind,
    tail: TailModel,
    spec: BlockSpec,
    /// the device the session runs on
    pub device: Device,
}

/// Output of a step: loss, new log-probs, gradients in [`BlockFactors`] order.
pub type BlockStepOutput = (f32, Vec<f32>, BlockFactors);

/// An output-projection LoRA as the step graphs take it, `(A [r, n_embd], B [n_vocab, r],
/// scale)`, on the final normalised hidden state.
pub type OutputLora<'a> = (ArrayView2<'a, f32>, ArrayView2<'a, f32>, f32);

/// How a step graph turns the model's logits at the scored rows into the policy the tokens
/// were sampled from: the output-projection LoRA (fixed, not trained here), the sampling
/// temperature and the sampler's support. The default is the model itself.
#[derive(Debug, Clone, Default)]
pub struct PolicyHead<'a> {
    /// the output-projection LoRA (None: the model's own output projection)
    pub output: Option<OutputLora<'a>>,
    /// per scored row, 1 / temperature (empty: 1)
    pub inv_t: Vec<f32>,
    /// per scored row, added to the tempered logits: 0, or a large negative value for a
    /// vocabulary entry outside the sampler's support (None: zeros)
    pub bias: Option<ArrayView2<'a, f32>>,
}

impl OrtBlock {
    /// Builds and loads the graph (the frozen weights become constants of the model).
    ///
    /// # Errors
    /// [`Error::Ort`].
    pub fn new(
        tail: TailModel,
        spec: BlockSpec,
        kind: BlockGraphKind,
        emulate: bool,
        device: Device,
        threads: usize,
    ) -> Result<Self> {
        let bytes = build(&tail, &spec, kind, emulate);
        let (session, device) = runtime::session(&bytes, device, threads)?;
        Ok(OrtBlock {
            session,
            kind,
            tail,
            spec,
            device,
        })
    }

    /// The model tail the graph was built from.
    pub fn tail(&self) -> &TailModel {
        &self.tail
    }

    /// The LoRA layout.
    pub fn spec(&self) -> &BlockSpec {
        &self.spec
    }

    fn feed(
        &self,
        rows: &BlockRows<'_>,
        lora: &BlockFactors,
    ) -> Result<Vec<(String, ort::session::SessionInputValue<'static>)>> {
        let e = |what: &'static str| move |err: ort::Error| Error::Ort(format!("{what}: {err}"));
        let hp = &self.tail.hp;
        let n = rows.x.nrows();
        if rows.pos.len() != n || rows.seg.len() != n || rows.x.ncols() != hp.n_embd {
            return Err(Error::Invalid(format!(
                "block rows: {n} activations of width {}, {} positions, {} segment ids",
                rows.x.ncols(),
                rows.pos.len(),
                rows.seg.len()
            )));
        }
        if rows.scored.iter().any(|&i| i >= n) {
            return Err(Error::Invalid("a scored row is out of range".into()));
        }
        let want = self.tail.blocks.len() * self.spec.targets.len();
        if lora.a.len() != want || lora.b.len() != want {
            return Err(Error::Invalid(format!(
                "{} LoRA pairs for {want} adapted projections",
                lora.a.len()
            )));
        }
        let (cq, sq) = rope_tables(&rows.pos, hp, hp.n_head);
        let (ck, sk) = rope_tables(&rows.pos, hp, hp.n_head_kv);
        let rep = hp.n_head / hp.n_head_kv;
        let mask = Array2::from_shape_fn((rep * n, n), |(r, s)| {
            let t = r % n;
            if rows.seg[s] == rows.seg[t] && s <= t {
                0.0f32
            } else {
                f32::NEG_INFINITY
            }
        });
        let sel = Array2::from_shape_fn((rows.scored.len(), n), |(i, j)| {
            f32::from(u8::from(rows.scored[i] == j))
        });
        let t2 = |a: Array2<f32>| -> Result<ort::session::SessionInputValue<'static>> {
            Ok(Tensor::from_array(a).map_err(e("input"))?.into())
        };
        let mut feed: Vec<(String, ort::session::SessionInputValue<'static>)> = vec![
            ("x".into(), t2(rows.x.to_owned())?),
            ("cos_q".into(), t2(cq)?),
            ("sin_q".into(), t2(sq)?),
            ("cos_k".into(), t2(ck)?),
            ("sin_k".into(), t2(sk)?),
            ("mask".into(), t2(mask)?),
            ("sel".into(), t2(sel)?),
            (
                "scale".into(),
                Tensor::from_array(ndarray::arr0(self.spec.scale()))
                    .map_err(e("input"))?
                    .into(),
            ),
        ];
        for (i, block) in self.tail.blocks.iter().enumerate() {
            for (j, t) in self.spec.targets.iter().enumerate() {
                let n = i * self.spec.targets.len() + j;
                let (dout, din) = hp.shape(t);
                if lora.a[n].dim() != (self.spec.r, din) || lora.b[n].dim() != (dout, self.spec.r) {
                    return Err(Error::Invalid(format!(
                        "LoRA {}.{t}: shapes {:?} and {:?}",
                        block.index,
                        lora.a[n].dim(),
                        lora.b[n].dim()
                    )));
                }
                feed.push((input_name(block.index, t, "a"), t2(lora.a[n].clone())?));
                feed.push((input_name(block.index, t, "b"), t2(lora.b[n].clone())?));
            }
        }
        Ok(feed)
    }

    fn head_feed(
        &self,
        s: usize,
        head: &PolicyHead<'_>,
    ) -> Result<Vec<(String, ort::session::SessionInputValue<'static>)>> {
        let (nv, d) = self.tail.output.w.dim();
        let bad = |m: String| Err(Error::Invalid(format!("policy head: {m}")));
        let (a, b, scale) = match head.output {
            Some((a, b, sc)) => {
                if a.ncols() != d || b.nrows() != nv || a.nrows() != b.ncols() {
                    return bad(format!(
                        "output LoRA of shapes {:?}, {:?} for a model of width {d} and {nv} tokens",
                        a.dim(),
                        b.dim()
                    ));
                }
                (a.to_owned(), b.to_owned(), sc)
            }
            None => (Array2::zeros((1, d)), Array2::zeros((nv, 1)), 0.0),
        };
        let inv_t = if head.inv_t.is_empty() {
            vec![1.0; s]
        } else {
            head.inv_t.clone()
        };
        if inv_t.len() != s {
            return bad(format!("{} temperatures for {s} scored rows", inv_t.len()));
        }
        let bias = match head.bias {
            Some(b) if b.dim() != (s, nv) => {
                return bad(format!("a support of shape {:?} for {s} rows", b.dim()))
            }
            Some(b) => b.to_owned(),
            None => Array2::zeros((s, nv)),
        };
        let e = |err: ort::Error| Error::Ort(format!("input: {err}"));
        let t2 = |a: Array2<f32>| -> Result<ort::session::SessionInputValue<'static>> {
            Ok(Tensor::from_array(a).map_err(e)?.into())
        };
        let inv_t =
            Array2::from_shape_vec((s, 1), inv_t).map_err(|x| Error::Invalid(x.to_string()))?;
        Ok(vec![
            ("out_a".into(), t2(a)?),
            ("out_b".into(), t2(b)?),
            (
                "out_scale".into(),
                Tensor::from_array(ndarray::arr0(scale)).map_err(e)?.into(),
            ),
            ("inv_t".into(), t2(inv_t)?),
            ("bias".into(), t2(bias)?),
        ])
    }

    /// Logits `[S, n_vocab]` at the scored rows (a graph built as [`BlockGraphKind::Logits`]).
    ///
    /// # Errors
    /// [`Error::Invalid`] on inconsistent rows or a step graph; [`Error::Ort`].
    pub fn logits(&mut self, rows: &BlockRows<'_>, lora: &BlockFactors) -> Result<Array2<f32>> {
        Ok(self.forward(rows, lora)?.0)
    }

    /// Logits `[S, n_vocab]` and the final normalised hidden state `[S, n_embd]` at the scored
    /// rows (what llama.cpp calls `result_norm`).
    ///
    /// # Errors
    /// As [`OrtBlock::logits`].
    pub fn forward(
        &mut self,
        rows: &BlockRows<'_>,
        lora: &BlockFactors,
    ) -> Result<(Array2<f32>, Array2<f32>)> {
        if self.kind != BlockGraphKind::Logits {
            return Err(Error::Invalid("this block graph is a training step".into()));
        }
        let feed = self.feed(rows, lora)?;
        let out = self
            .session
            .run(feed)
            .map_err(|err| Error::Ort(format!("block forward: {err}")))?;
        let get = |name: &str| {
            out[name]
                .try_extract_array::<f32>()
                .map_err(|err| Error::Ort(err.to_string()))?
                .to_owned()
                .into_dimensionality::<ndarray::Ix2>()
                .map_err(|err| Error::Ort(err.to_string()))
        };
        Ok((get("logits")?, get("hidden")?))
    }

    /// One training step: loss, log-probs of `obj.tokens` at the scored rows and the gradients.
    ///
    /// # Errors
    /// [`Error::Invalid`] on inconsistent inputs or a logits graph; [`Error::Ort`].
    pub fn step(
        &mut self,
        rows: &BlockRows<'_>,
        lora: &BlockFactors,
        obj: &ObjectiveInputs<'_>,
    ) -> Result<BlockStepOutput> {
        self.step_policy(rows, lora, &PolicyHead::default(), obj)
    }

    /// One training step of the policy `head` makes of the model's logits.
    ///
    /// # Errors
    /// As [`OrtBlock::step`]; [`Error::Invalid`] when `head` does not match the rows.
    pub fn step_policy(
        &mut self,
        rows: &BlockRows<'_>,
        lora: &BlockFactors,
        head: &PolicyHead<'_>,
        obj: &ObjectiveInputs<'_>,
    ) -> Result<BlockStepOutput> {
        let BlockGraphKind::Step(sk) = self.kind else {
            return Err(Error::Invalid(
                "this block graph only computes logits".into(),
            ));
        };
        if obj.tokens.len() != rows.scored.len() {
            return Err(Error::Invalid(format!(
                "{} tokens for {} scored rows",
                obj.tokens.len(),
                rows.scored.len()
            )));
        }
        let mut feed = self.feed(rows, lora)?;
        feed.extend(self.head_feed(rows.scored.len(), head)?);
        feed.extend(
            objective_feed(sk, obj)?
                .into_iter()
                .map(|(k, v)| (k.to_string(), v)),
        );
        let out = self
            .session
            .run(feed)
            .map_err(|err| Error::Ort(format!("block step: {err}")))?;
        let get = |name: &str| -> Result<ndarray::ArrayD<f32>> {
            Ok(out[name]
                .try_extract_array::<f32>()
                .map_err(|err| Error::Ort(err.to_string()))?
                .to_owned())
        };
        let to2 = |a: ndarray::ArrayD<f32>| {
            a.into_dimensionality::<ndarray::Ix2>()
                .map_err(|err| Error::Ort(err.to_string()))
        };
        let loss = get("loss")?.iter().copied().next().unwrap_or(f32::NAN);
        let logp = get("logp")?.iter().copied().collect();
        let mut grads = BlockFactors {
            a: Vec::new(),
            b: Vec::new(),
        };
        for block in &self.tail.blocks {
            for t in &self.spec.targets {
                grads
                    .a
                    .push(to2(get(&format!("grad.{}.{t}.a", block.index))?)?);
                grads
                    .b
                    .push(to2(get(&format!("grad.{}.{t}.b", block.index))?)?);
            }
        }
        Ok((loss, logp, grads))
    }
}
