//! AdamW over a list of matrices, and its moments saved beside an adapter (so that an update can
//! continue its parent's optimizer: `TrainConfig::keep_optimizer`).

use std::collections::HashMap;
use std::path::Path;

use ndarray::Array2;

use crate::adapter::{f32_bytes, f32_tensor};
use crate::error::{Error, Result};

/// AdamW over a list of matrices (bias-corrected moments, decoupled weight decay).
#[derive(Clone)]
pub(crate) struct AdamW {
    m: Vec<Array2<f32>>,
    v: Vec<Array2<f32>>,
    t: i32,
}

impl AdamW {
    pub(crate) fn new(shapes: &[(usize, usize)]) -> Self {
        AdamW {
            m: shapes.iter().map(|&s| Array2::zeros(s)).collect(),
            v: shapes.iter().map(|&s| Array2::zeros(s)).collect(),
            t: 0,
        }
    }
    /// One step with `[lr, weight decay, eps]`.
    pub(crate) fn step(
        &mut self,
        params: &mut [&mut Array2<f32>],
        grads: &[Array2<f32>],
        hp: [f64; 3],
    ) {
        let [lr, wd, eps] = hp;
        self.t += 1;
        let (b1, b2, eps) = (0.9f32, 0.999f32, eps as f32);
        let c1 = 1.0 - b1.powi(self.t);
        let c2 = 1.0 - b2.powi(self.t);
        for (i, (p, g)) in params.iter_mut().zip(grads).enumerate() {
            let (m, v) = (&mut self.m[i], &mut self.v[i]);
            ndarray::Zip::from(&mut **p)
                .and(m)
                .and(v)
                .and(g)
                .for_each(|p, m, v, &g| {
                    *m = b1 * *m + (1.0 - b1) * g;
                    *v = b2 * *v + (1.0 - b2) * g * g;
                    *p -= lr as f32 * ((*m / c1) / ((*v / c2).sqrt() + eps) + wd as f32 * *p);
                });
        }
    }
}

/// AdamW moments saved next to an adapter (`optimizer.safetensors`): `lora_A.m`, `lora_A.v`,
/// `lora_B.m`, `lora_B.v`, `value.m`, `value.v`, and the step count in the metadata.
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";

/// The saved moments: per tensor name, which optimizer and which of its parameters.
const OPT_SLOTS: [(&str, bool, usize); 3] = [
    ("lora_A", false, 0),
    ("lora_B", false, 1),
    ("value", true, 0),
];

pub(super) fn optimizer_blob(opt: &AdamW, vopt: &AdamW) -> Result<Vec<u8>> {
    let err = |e: safetensors::SafeTensorError| Error::Invalid(format!("safetensors: {e}"));
    let mut data = Vec::new();
    for (name, value, k) in OPT_SLOTS {
        let o = if value { vopt } else { opt };
        for (kind, x) in [("m", &o.m[k]), ("v", &o.v[k])] {
            data.push((
                format!("{name}.{kind}"),
                x.shape().to_vec(),
                f32_bytes(x.iter()),
            ));
        }
    }
    let mut views = Vec::new();
    for (name, shape, b) in &data {
        let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
            .map_err(err)?;
        views.push((name.clone(), view));
    }
    let meta = HashMap::from([
        ("step".to_string(), opt.t.to_string()),
        ("value_step".to_string(), vopt.t.to_string()),
    ]);
    safetensors::serialize(views, Some(meta)).map_err(err)
}

/// The moments saved with the adapter in `dir`, when present and of the same shapes (`false`:
/// none, or another rank or model, and the optimizers stay fresh).
pub(super) fn load_optimizer(dir: &Path, opt: &mut AdamW, vopt: &mut AdamW) -> Result<bool> {
    let path = dir.join(OPTIMIZER_FILE);
    let Ok(blob) = std::fs::read(&path) else {
        return Ok(false);
    };
    let bad = |m: String| Error::Invalid(format!("{}: {m}", path.display()));
    let (_, meta) =
        safetensors::SafeTensors::read_metadata(&blob).map_err(|e| bad(e.to_string()))?;
    let st = safetensors::SafeTensors::deserialize(&blob).map_err(|e| bad(e.to_string()))?;
    let step = |k: &str| -> Result<i32> {
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get(k))
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| bad(format!("no {k} in the metadata")))
    };
    let (t, vt) = (step("step")?, step("value_step")?);
    let (mut fresh, mut vfresh) = (opt.clone(), vopt.clone());
    for (name, value, k) in OPT_SLOTS {
        let o = if value { &mut vfresh } else { &mut fresh };
        for (kind, x) in [("m", &mut o.m[k]), ("v", &mut o.v[k])] {
            let name = format!("{name}.{kind}");
            let (shape, v) = f32_tensor(&st, &name, &path)?;
            if shape != x.shape() {
                return Ok(false);
            }
            if v.iter().any(|x| !x.is_finite()) {
                return Err(bad(format!("{name} holds non-finite values")));
            }
            x.iter_mut().zip(v).for_each(|(d, s)| *d = s);
        }
    }
    (fresh.t, vfresh.t) = (t, vt);
    (*opt, *vopt) = (fresh, vfresh);
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// First AdamW step by hand: m̂ = g and v̂ = g², so a parameter moves by lr·g / (|g| + ε) —
    /// the full `lr` for any gradient far above ε, however small, and little below it.
    #[test]
    fn adamw_first_step_is_lr_times_g_over_g_plus_eps() {
        let g = Array2::from_shape_vec((1, 3), vec![0.5f32, 1e-9, -1e-6]).expect("shape");
        let mut p = Array2::from_elem((1, 3), 1.0f32);
        AdamW::new(&[(1, 3)]).step(&mut [&mut p], std::slice::from_ref(&g), [1e-2, 0.0, 1e-6]);
        let want = [
            1.0 - 1e-2 * 0.5 / (0.5 + 1e-6),
            1.0 - 1e-2 * 1e-9 / (1e-9 + 1e-6),
            1.0 + 1e-2 * 0.5,
        ];
        for (got, want) in p.iter().zip(want) {
            assert!((f64::from(*got) - want).abs() < 1e-7, "{got} vs {want}");
        }
        // at ε = 1e-8 the 1e-9 gradient (a softmax-tail token) still moves by lr / 11
        let mut q = Array2::from_elem((1, 3), 1.0f32);
        AdamW::new(&[(1, 3)]).step(&mut [&mut q], &[g], [1e-2, 0.0, 1e-8]);
        assert!((f64::from(q[[0, 1]]) - (1.0 - 1e-2 / 11.0)).abs() < 1e-6);
    }
}
