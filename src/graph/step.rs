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

use super::builder::{Dim, Elem, Graph, V};
use super::runtime::{self, Device};
use crate::error::{Error, Result};

/// Which log-ratio a token's clip acts on.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Granularity {
    /// PPO/GRPO: `exp(lr_k)` per token
    Token,
    /// GSPO: `exp(mean lr)` over the session's assistant tokens
    Sequence,
    /// ATPO / A²TGPO: `exp(mean lr)` over the turn's tokens
    Turn,
}

/// What the graph optimises.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    /// the clipped surrogate with a given ratio granularity, with or without the KL term
    Surrogate {
        /// token, sequence or turn ratios
        granularity: Granularity,
        /// add `kl_coef · Σ w_kl · k3`
        kl: bool,
        /// subtract `ent_coef · Σ w_ent · H` (full-softmax entropy)
        entropy: bool,
        /// the token guard of sequence / turn ratios: a token's gradient passes only while its
        /// own log-ratio is inside `[glo, ghi]`
        guard: bool,
    },
    /// `−Σ w · logp` (supervised warm start); with `digit_class`, a token marked in `cls`
    /// contributes `log Σ_{digits} p` (the `dmask` columns) instead of its own log-prob
    /// ([`crate::learn::objective::lora_class_ce_and_grad`])
    CrossEntropy {
        /// the digit-class inputs `dmask` `[V, 1]` and `cls` `[T]` are used
        digit_class: bool,
    },
}

/// Builds the step graph; inputs are named as in [`StepInputs`], outputs are `loss`, `logp`,
/// `grad_a`, `grad_b`.
pub fn build(kind: StepKind, elem: Elem) -> Vec<u8> {
    use Dim::Sym;
    let mut g = Graph::new(elem);
    let base = g.input("base", &[Sym("T"), Sym("V")], false);
    let h = g.input("h", &[Sym("T"), Sym("D")], false);
    let a = g.input("a", &[Sym("R"), Sym("D")], true);
    let b = g.input("b", &[Sym("V"), Sym("R")], true);
    let scale = g.input("scale", &[], false);
    // logits = base + s · (h Aᵀ) Bᵀ
    let low = g.lora_term(h, a, b, scale);
    let z = g.add(base, low);
    let (loss, lp) = objective(&mut g, kind, z);
    let grads = g.grad(loss, &[a, b]);
    g.output(loss, "loss");
    g.output(lp, "logp");
    g.output(grads[0], "grad_a");
    g.output(grads[1], "grad_b");
    g.to_bytes()
}

/// The loss of `kind` over logits `z` (`[T, V]`, one row per scored token), declaring the
/// inputs it reads (`tok`, `w`, and per kind `old`, `adv`, `lo`, `hi`, `gmat`, `ref`, …).
/// Returns `(loss, logp)`. Shared by the output-LoRA and block-LoRA graphs.
pub(crate) fn objective(g: &mut Graph, kind: StepKind, z: V) -> (V, V) {
    use Dim::{Fixed, Sym};
    let tok = g.input_i64("tok", &[Sym("T"), Fixed(1)]);
    let w = g.input("w", &[Sym("T")], false);
    let ls = g.log_softmax(z);
    let lp2 = g.gather_elements(ls, tok);
    let lp = g.reshape(lp2, &[-1]);
    let loss = match kind {
        StepKind::CrossEntropy { digit_class } => {
            let lp = if digit_class {
                // log P(digit) = log(softmax · dmask), then lp + cls · (log P(digit) − lp)
                let dmask = g.input("dmask", &[Sym("V"), Fixed(1)], false);
                let cls = g.input("cls", &[Sym("T")], false);
                let p = g.exp(ls);
                let pd = g.matmul(p, dmask);
                let tiny = g.scalar(1e-30);
                let pd = g.add(pd, tiny);
                let ld = g.log(pd);
                let ld = g.reshape(ld, &[-1]);
                let diff = g.sub(ld, lp);
                let sel = g.mul(cls, diff);
                g.add(lp, sel)
            } else {
                lp
            };
            let t = g.mul(lp, w);
            let s = g.reduce_sum_all(t);
            g.neg(s)
        }
        StepKind::Surrogate {
            granularity,
            kl,
            entropy,
            guard,
        } => {
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
                    // the gradient path: logπ itself, or with the guard the token's log-ratio
                    // clamped to its bounds (no gradient outside them; the value is unchanged)
                    let path = if guard {
                        let glo = g.input("glo", &[Sym("T")], false);
                        let ghi = g.input("ghi", &[Sym("T")], false);
                        let c = g.min(lr, ghi);
                        g.max(c, glo)
                    } else {
                        lp
                    };
                    let path_sg = g.stop_gradient(path);
                    let d = g.sub(path, path_sg);
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
            let pol = if entropy {
                let we = g.input("w_ent", &[Sym("T")], false);
                let coef = g.input("ent_coef", &[], false);
                let p = g.exp(ls);
                let plp = g.mul(p, ls);
                let neg_h = g.reduce_sum_last(plp); // −H, [T, 1]
                let neg_h = g.reshape(neg_h, &[-1]);
                let t = g.mul(neg_h, we);
                let t = g.reduce_sum_all(t);
                let t = g.mul(t, coef);
                g.add(pol, t)
            } else {
                pol
            };
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
    (loss, lp)
}

/// The inputs of a step's objective (f32), shared by the output-LoRA and block-LoRA graphs.
pub struct ObjectiveInputs<'a> {
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
    /// the token guard's bounds on each token's log-ratio, `(low, high)`
    pub guard: Option<(Vec<f32>, Vec<f32>)>,
    /// KL: reference log-probs, weights, coefficient
    pub kl: Option<(Vec<f32>, Vec<f32>, f32)>,
    /// entropy bonus: weights, coefficient
    pub entropy: Option<(Vec<f32>, f32)>,
    /// digit-class cross-entropy: per vocabulary entry 1 for a digit token, per token 1 where
    /// the digit class replaces the token's log-prob
    pub digit_class: Option<(Vec<f32>, Vec<f32>)>,
}

impl<'a> ObjectiveInputs<'a> {
    /// The inputs of tokens `r` alone. The objective is a sum over tokens whose weights were
    /// set for the whole batch, so the losses and gradients of the parts of a batch cut between
    /// sessions add up to the whole's (a ratio group never spans two sessions).
    pub fn slice(&self, r: std::ops::Range<usize>) -> ObjectiveInputs<'a> {
        let v = |x: &[f32]| x[r.clone()].to_vec();
        ObjectiveInputs {
            tokens: &self.tokens[r.clone()],
            w: v(&self.w),
            old: v(&self.old),
            adv: v(&self.adv),
            lo: v(&self.lo),
            hi: v(&self.hi),
            gmat: self
                .gmat
                .as_ref()
                .map(|m| m.slice(ndarray::s![r.clone(), r.clone()]).to_owned()),
            guard: self.guard.as_ref().map(|(l, h)| (v(l), v(h))),
            kl: self.kl.as_ref().map(|(l, w, c)| (v(l), v(w), *c)),
            entropy: self.entropy.as_ref().map(|(w, c)| (v(w), *c)),
            digit_class: self.digit_class.as_ref().map(|(d, c)| (d.clone(), v(c))),
        }
    }

    /// Cross-entropy inputs: `−Σ w · logp(tokens)`.
    pub fn cross_entropy(tokens: &'a [usize], w: Vec<f32>) -> Self {
        let n = tokens.len();
        ObjectiveInputs {
            tokens,
            w,
            old: vec![0.0; n],
            adv: vec![0.0; n],
            lo: vec![1.0; n],
            hi: vec![1.0; n],
            gmat: None,
            guard: None,
            kl: None,
            entropy: None,
            digit_class: None,
        }
    }
}

/// The per-step inputs of the output-LoRA graph (f32).
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
    /// the objective's inputs
    pub obj: ObjectiveInputs<'a>,
}

/// The session inputs of `kind`'s objective, named as [`objective`] declares them.
///
/// # Errors
/// [`Error::Invalid`] when an input the kind needs is missing; [`Error::Ort`].
pub(crate) fn objective_feed(
    kind: StepKind,
    x: &ObjectiveInputs<'_>,
) -> Result<Vec<(&'static str, ort::session::SessionInputValue<'static>)>> {
    let e = |what: &'static str| move |err: ort::Error| Error::Ort(format!("{what}: {err}"));
    let t = x.tokens.len();
    let tensor = |v: ArrayView2<'_, f32>| Tensor::from_array(v.to_owned()).map_err(e("input"));
    let vec = |v: &[f32]| Tensor::from_array(Array1::from(v.to_vec())).map_err(e("input"));
    let mut inputs: Vec<(&str, ort::session::SessionInputValue<'_>)> = vec![
        (
            "tok",
            Tensor::from_array(Array2::from_shape_fn((t, 1), |(i, _)| x.tokens[i] as i64))
                .map_err(e("input"))?
                .into(),
        ),
        ("w", vec(&x.w)?.into()),
    ];
    if let StepKind::CrossEntropy { digit_class: true } = kind {
        let (dmask, cls) = x
            .digit_class
            .as_ref()
            .ok_or_else(|| Error::Invalid("digit-class inputs missing".into()))?;
        let v = dmask.len();
        inputs.push((
            "dmask",
            Tensor::from_array(Array2::from_shape_fn((v, 1), |(i, _)| dmask[i]))
                .map_err(e("input"))?
                .into(),
        ));
        inputs.push(("cls", vec(cls)?.into()));
    }
    if let StepKind::Surrogate {
        granularity,
        kl,
        entropy,
        guard,
    } = kind
    {
        if entropy {
            let (we, c) = x
                .entropy
                .as_ref()
                .ok_or_else(|| Error::Invalid("entropy inputs missing".into()))?;
            inputs.push(("w_ent", vec(we)?.into()));
            inputs.push((
                "ent_coef",
                Tensor::from_array(ndarray::arr0(*c))
                    .map_err(e("input"))?
                    .into(),
            ));
        }
        inputs.push(("old", vec(&x.old)?.into()));
        inputs.push(("adv", vec(&x.adv)?.into()));
        inputs.push(("lo", vec(&x.lo)?.into()));
        inputs.push(("hi", vec(&x.hi)?.into()));
        if granularity != Granularity::Token {
            let m = x
                .gmat
                .as_ref()
                .ok_or_else(|| Error::Invalid("group matrix missing".into()))?;
            inputs.push(("gmat", tensor(m.view())?.into()));
            if guard {
                let (gl, gh) = x
                    .guard
                    .as_ref()
                    .ok_or_else(|| Error::Invalid("token guard bounds missing".into()))?;
                inputs.push(("glo", vec(gl)?.into()));
                inputs.push(("ghi", vec(gh)?.into()));
            }
        }
        if kl {
            let (rf, wk, c) =
                x.kl.as_ref()
                    .ok_or_else(|| Error::Invalid("KL inputs missing".into()))?;
            inputs.push(("ref", vec(rf)?.into()));
            inputs.push(("w_kl", vec(wk)?.into()));
            inputs.push((
                "kl_coef",
                Tensor::from_array(ndarray::arr0(*c))
                    .map_err(e("input"))?
                    .into(),
            ));
        }
    }
    Ok(inputs)
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
        Ok(OrtStep {
            session,
            kind,
            device,
        })
    }

    /// Runs one step.
    ///
    /// # Errors
    /// [`Error::Ort`] when ONNX Runtime fails.
    pub fn run(&mut self, x: &StepInputs<'_>) -> Result<StepOutput> {
        let e = |what: &'static str| move |err: ort::Error| Error::Ort(format!("{what}: {err}"));
        let tensor = |v: ArrayView2<'_, f32>| Tensor::from_array(v.to_owned()).map_err(e("input"));
        let mut inputs: Vec<(&str, ort::session::SessionInputValue<'_>)> = vec![
            ("base", tensor(x.base)?.into()),
            ("h", tensor(x.h)?.into()),
            ("a", tensor(x.a)?.into()),
            ("b", tensor(x.b)?.into()),
            (
                "scale",
                Tensor::from_array(ndarray::arr0(x.scale))
                    .map_err(e("input"))?
                    .into(),
            ),
        ];
        inputs.extend(objective_feed(self.kind, &x.obj)?);
        let out = self.session.run(inputs).map_err(e("running the step"))?;
        let get = |name: &str| -> Result<ndarray::ArrayD<f32>> {
            Ok(out[name]
                .try_extract_array::<f32>()
                .map_err(e("output"))?
                .to_owned())
        };
        let loss = get("loss")?.iter().copied().next().unwrap_or(f32::NAN);
        let logp = get("logp")?.iter().copied().collect();
        let to2 = |a: ndarray::ArrayD<f32>| {
            a.into_dimensionality::<ndarray::Ix2>()
                .map_err(|err| Error::Ort(err.to_string()))
        };
        Ok((loss, logp, to2(get("grad_a")?)?, to2(get("grad_b")?)?))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! Helpers of the step tests in `learn::step`, which run the graph as the update feeds it.

    use super::*;
    use crate::policy::sampler::Rng;

    /// Base logits `[t, v]` (uniform in ±`base_scale`), features `[t, d]` (±1) and a LoRA
    /// `A [r, d]`, `B [v, r]` (±0.3), from a seeded stream.
    #[allow(clippy::type_complexity)]
    pub(crate) fn random_problem(
        (t, v, d, r): (usize, usize, usize, usize),
        seed: u64,
        base_scale: f64,
    ) -> (Array2<f64>, Array2<f64>, Array2<f64>, Array2<f64>) {
        let mut rng = Rng::new(seed);
        let mut rnd = |shape: (usize, usize), s: f64| {
            Array2::from_shape_simple_fn(shape, || (rng.next_f64() * 2.0 - 1.0) * s)
        };
        (
            rnd((t, v), base_scale),
            rnd((t, d), 1.0),
            rnd((r, d), 0.3),
            rnd((v, r), 0.3),
        )
    }

    /// The ORT step's (loss, logp, ∂A, ∂B) against the f64 reference, to 2e-4 relative.
    pub(crate) fn assert_step_matches(
        what: &str,
        (loss, lp, da, db): StepOutput,
        (l_ref, lp_ref, da_ref, db_ref): (f64, &[f64], &Array2<f64>, &Array2<f64>),
    ) {
        let close = |x: f64, y: f64| (x - y).abs() <= 2e-4 * (1.0 + y.abs());
        assert!(close(loss as f64, l_ref), "{what}: loss {loss} vs {l_ref}");
        for (x, y) in lp.iter().zip(lp_ref) {
            assert!(close(*x as f64, *y), "{what}: logp {x} vs {y}");
        }
        for (x, y) in da
            .iter()
            .zip(da_ref.iter())
            .chain(db.iter().zip(db_ref.iter()))
        {
            assert!(close(*x as f64, *y), "{what}: gradient {x} vs {y}");
        }
    }
}
