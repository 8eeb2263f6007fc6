//! The training-step graph of the output LoRA: forward (LoRA logits, log-softmax, gathered
//! log-probs, the clipped surrogate or cross-entropy, optional k3 KL) written once, gradients
//! for `A` and `B` derived by [`Graph::grad`].
//!
//! Everything that carries no gradient — clip regions, aggregation × TIS weights, the
//! group-averaging matrix of sequence / turn ratios — is computed in Rust and fed as inputs, so
//! one graph serves every clip mode and aggregation.

use ndarray::{Array1, Array2, ArrayView2};
use ort::session::Session;
use ort::value::Tensor;

use super::builder::{Dim, Elem, Graph};
use super::runtime::{self, Device};
use crate::error::{Error, Result};
use crate::learn::objective::Granularity;

/// What the graph optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// the clipped surrogate with a given ratio granularity, with or without the KL term
    Surrogate {
        /// token, sequence or turn ratios
        granularity: Granularity,
        /// add `kl_coef · Σ w_kl · k3`
        kl: bool,
    },
    /// `−Σ w · logp` (supervised warm start)
    CrossEntropy,
}

/// Builds the step graph; inputs are named as in [`StepInputs`], outputs are `loss`, `logp`,
/// `grad_a`, `grad_b`.
pub fn build(kind: StepKind, elem: Elem) -> Vec<u8> {
    use Dim::{Fixed, Sym};
    let mut g = Graph::new(elem);
    let base = g.input("base", &[Sym("T"), Sym("V")], false);
    let h = g.input("h", &[Sym("T"), Sym("D")], false);
    let a = g.input("a", &[Sym("R"), Sym("D")], true);
    let b = g.input("b", &[Sym("V"), Sym("R")], true);
    let tok = g.input_i64("tok", &[Sym("T"), Fixed(1)]);
    let w = g.input("w", &[Sym("T")], false);
    let scale = g.input("scale", &[], false);
    // logits = base + s · (h Aᵀ) Bᵀ
    let at = g.transpose(a);
    let u = g.matmul(h, at);
    let bt = g.transpose(b);
    let low = g.matmul(u, bt);
    let low = g.mul(low, scale);
    let z = g.add(base, low);
    let ls = g.log_softmax(z);
    let lp2 = g.gather_elements(ls, tok);
    let lp = g.reshape(lp2, &[-1]);
    let loss = match kind {
        StepKind::CrossEntropy => {
            let t = g.mul(lp, w);
            let s = g.reduce_sum_all(t);
            g.neg(s)
        }
        StepKind::Surrogate { granularity, kl } => {
            let old = g.input("old", &[Sym("T")], false);
            let adv = g.input("adv", &[Sym("T")], false);
            let lo = g.input("lo", &[Sym("T")], false);
            let hi = g.input("hi", &[Sym("T")], false);
            let lr = g.sub(lp, old);
            let log_s = match granularity {
                Granularity::Token => lr,
                Granularity::Sequence | Granularity::Turn => {
                    // exp(sg[mean lr] + logπ − sg[logπ])
                    let gm = g.input("gmat", &[Sym("T"), Sym("T")], false);
                    let lr_sg = g.stop_gradient(lr);
                    let col = g.reshape(lr_sg, &[-1, 1]);
                    let mean = g.matmul(gm, col);
                    let mean = g.reshape(mean, &[-1]);
                    let lp_sg = g.stop_gradient(lp);
                    let d = g.sub(lp, lp_sg);
                    g.add(mean, d)
                }
            };
            let ten = g.scalar(10.0);
            let log_s = g.min(log_s, ten);
            let s = g.exp(log_s);
            let un = g.mul(s, adv);
            let c1 = g.min(s, hi);
            let c2 = g.max(c1, lo);
            let cl = g.mul(c2, adv);
            let obj = g.min(un, cl);
            let t = g.mul(obj, w);
            let t = g.reduce_sum_all(t);
            let pol = g.neg(t);
            if kl {
                let rf = g.input("ref", &[Sym("T")], false);
                let wk = g.input("w_kl", &[Sym("T")], false);
                let coef = g.input("kl_coef", &[], false);
                let d = g.sub(rf, lp);
                let e = g.exp(d);
                let k = g.sub(e, d);
                let one = g.scalar(1.0);
                let k = g.sub(k, one);
                let k = g.mul(k, wk);
                let k = g.reduce_sum_all(k);
                let k = g.mul(k, coef);
                g.add(pol, k)
            } else {
                pol
            }
        }
    };
    let grads = g.grad(loss, &[a, b]);
    g.output(loss, "loss");
    g.output(lp, "logp");
    g.output(grads[0], "grad_a");
    g.output(grads[1], "grad_b");
    g.to_bytes()
}

/// The per-step inputs (f32).
pub struct StepInputs<'a> {
    /// base logits `[T, V]`
    pub base: ArrayView2<'a, f32>,
    /// features `[T, D]`
    pub h: ArrayView2<'a, f32>,
    /// LoRA A `[R, D]`
    pub a: ArrayView2<'a, f32>,
    /// LoRA B `[V, R]`
    pub b: ArrayView2<'a, f32>,
    /// α / r
    pub scale: f32,
    /// sampled token ids
    pub tokens: &'a [usize],
    /// policy weights (aggregation × TIS), or the cross-entropy weights
    pub w: Vec<f32>,
    /// surrogate inputs: logp_old, advantage, clip low, clip high
    pub old: Vec<f32>,
    /// advantages
    pub adv: Vec<f32>,
    /// lower clip bounds
    pub lo: Vec<f32>,
    /// upper clip bounds
    pub hi: Vec<f32>,
    /// group-mean matrix (sequence / turn ratios)
    pub gmat: Option<Array2<f32>>,
    /// KL: reference log-probs, weights, coefficient
    pub kl: Option<(Vec<f32>, Vec<f32>, f32)>,
}

/// The step graph in an ONNX Runtime session.
pub struct OrtStep {
    session: Session,
    kind: StepKind,
    /// the device the session runs on
    pub device: Device,
}

/// Output of one step: loss, new log-probs, ∂A, ∂B.
pub type StepOutput = (f32, Vec<f32>, Array2<f32>, Array2<f32>);

impl OrtStep {
    /// Builds and loads the graph.
    ///
    /// # Errors
    /// [`Error::Ort`].
    pub fn new(kind: StepKind, device: Device, threads: usize) -> Result<Self> {
        let (session, device) = runtime::session(&build(kind, Elem::F32), device, threads)?;
        Ok(OrtStep { session, kind, device })
    }

    /// Runs one step.
    ///
    /// # Errors
    /// [`Error::Ort`] when ONNX Runtime fails.
    pub fn run(&mut self, x: &StepInputs<'_>) -> Result<StepOutput> {
        let e = |what: &'static str| move |err: ort::Error| Error::Ort(format!("{what}: {err}"));
        let t = x.tokens.len();
        let tensor = |v: ArrayView2<'_, f32>| Tensor::from_array(v.to_owned()).map_err(e("input"));
        let vec = |v: &[f32]| Tensor::from_array(Array1::from(v.to_vec())).map_err(e("input"));
        let mut inputs: Vec<(&str, ort::session::SessionInputValue<'_>)> = vec![
            ("base", tensor(x.base)?.into()),
            ("h", tensor(x.h)?.into()),
            ("a", tensor(x.a)?.into()),
            ("b", tensor(x.b)?.into()),
            ("tok", Tensor::from_array(Array2::from_shape_fn((t, 1), |(i, _)| x.tokens[i] as i64)).map_err(e("input"))?.into()),
            ("w", vec(&x.w)?.into()),
            ("scale", Tensor::from_array(ndarray::arr0(x.scale)).map_err(e("input"))?.into()),
        ];
        if let StepKind::Surrogate { granularity, kl } = self.kind {
            inputs.push(("old", vec(&x.old)?.into()));
            inputs.push(("adv", vec(&x.adv)?.into()));
            inputs.push(("lo", vec(&x.lo)?.into()));
            inputs.push(("hi", vec(&x.hi)?.into()));
            if granularity != Granularity::Token {
                let m = x.gmat.as_ref().ok_or_else(|| Error::Invalid("group matrix missing".into()))?;
                inputs.push(("gmat", tensor(m.view())?.into()));
            }
            if kl {
                let (rf, wk, c) = x.kl.as_ref().ok_or_else(|| Error::Invalid("KL inputs missing".into()))?;
                inputs.push(("ref", vec(rf)?.into()));
                inputs.push(("w_kl", vec(wk)?.into()));
                inputs.push(("kl_coef", Tensor::from_array(ndarray::arr0(*c)).map_err(e("input"))?.into()));
            }
        }
        let out = self.session.run(inputs).map_err(e("running the step"))?;
        let get = |name: &str| -> Result<ndarray::ArrayD<f32>> {
            Ok(out[name].try_extract_array::<f32>().map_err(e("output"))?.to_owned())
        };
        let loss = get("loss")?.iter().copied().next().unwrap_or(f32::NAN);
        let logp = get("logp")?.iter().copied().collect();
        let to2 = |a: ndarray::ArrayD<f32>| a.into_dimensionality::<ndarray::Ix2>().map_err(|err| Error::Ort(err.to_string()));
        Ok((loss, logp, to2(get("grad_a")?)?, to2(get("grad_b")?)?))
    }
}
