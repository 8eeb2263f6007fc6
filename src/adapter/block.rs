//! Block LoRA files: a GGUF LoRA that llama.cpp loads itself, and PEFT safetensors in Hugging
//! Face names that TRL / PEFT / verl read and write.
//!
//! Turnwise trains in the GGUF weight basis. The HF → GGUF conversion of `llama` models permutes
//! the output rows of `q_proj` and `k_proj` (per head, HF's two RoPE halves become interleaved
//! pairs), so a PEFT file's `lora_B` rows of q/k are the inverse permutation of the GGUF ones;
//! `lora_A` (input side) and every other projection are the same in both.

use std::collections::HashMap;
use std::path::Path;

use ndarray::Array2;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use super::{f32_bytes, f32_tensor};
use crate::error::{Error, Result};
use crate::graph::block::{BlockFactors, BlockSpec};
use crate::policy::blocks::{target_tensor, Hparams};

/// The HF module name of a target (`q` → `self_attn.q_proj`).
pub fn hf_module(target: &str) -> Option<&'static str> {
    Some(match target {
        "q" => "self_attn.q_proj",
        "k" => "self_attn.k_proj",
        "v" => "self_attn.v_proj",
        "o" => "self_attn.o_proj",
        "gate" => "mlp.gate_proj",
        "up" => "mlp.up_proj",
        "down" => "mlp.down_proj",
        _ => return None,
    })
}

/// A block LoRA: its layout, the layers it adapts and its factors (GGUF basis).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockLora {
    /// rank, scale, targets, k
    pub spec: BlockSpec,
    /// adapted layers, ascending (the last `k` of the model)
    pub layers: Vec<usize>,
    /// factors in (layer, target) order
    pub factors: BlockFactors,
    /// `general.architecture` of the base model
    pub arch: String,
}

impl BlockLora {
    /// A fresh adapter: `A` uniform in `±1/√in` (PEFT's bound), `B = 0` (no change to the model).
    pub fn fresh(hp: &Hparams, spec: BlockSpec, seed: u64) -> Self {
        let mut rng = crate::policy::sampler::Rng::new(seed);
        let layers: Vec<usize> = (hp.n_layer - spec.k..hp.n_layer).collect();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for _ in &layers {
            for t in &spec.targets {
                let (dout, din) = hp.shape(t);
                let bound = 1.0 / (din as f64).sqrt();
                a.push(Array2::from_shape_fn((spec.r, din), |_| {
                    ((rng.next_f64() * 2.0 - 1.0) * bound) as f32
                }));
                b.push(Array2::zeros((dout, spec.r)));
            }
        }
        BlockLora {
            spec,
            layers,
            factors: BlockFactors { a, b },
            arch: hp.arch.clone(),
        }
    }

    fn pairs(&self) -> impl Iterator<Item = (usize, &str, &Array2<f32>, &Array2<f32>)> + '_ {
        let nt = self.spec.targets.len();
        self.layers
            .iter()
            .enumerate()
            .flat_map(move |(li, &layer)| {
                self.spec.targets.iter().enumerate().map(move |(ti, t)| {
                    let n = li * nt + ti;
                    (layer, t.as_str(), &self.factors.a[n], &self.factors.b[n])
                })
            })
    }

    /// True when every value is finite.
    pub fn is_finite(&self) -> bool {
        self.factors
            .a
            .iter()
            .chain(&self.factors.b)
            .all(|m| m.iter().all(|x| x.is_finite()))
    }

    /// The adapter as a GGUF LoRA file for llama.cpp (`general.type = adapter`,
    /// `adapter.type = lora`, `adapter.lora.alpha`; `blk.N.<tensor>.weight.lora_a` with
    /// ne = [in, r] and `.lora_b` with ne = [r, out], f32).
    pub fn to_gguf(&self) -> Vec<u8> {
        let arch = self.arch.as_str();
        let mut tensors: Vec<(String, [u64; 2], Vec<u8>)> = Vec::new();
        for (layer, t, a, b) in self.pairs() {
            let stem = target_tensor(t).unwrap_or("attn_q");
            tensors.push((
                format!("blk.{layer}.{stem}.weight.lora_a"),
                [a.ncols() as u64, a.nrows() as u64],
                f32_bytes(a.as_standard_layout().iter()),
            ));
            tensors.push((
                format!("blk.{layer}.{stem}.weight.lora_b"),
                [b.ncols() as u64, b.nrows() as u64],
                f32_bytes(b.as_standard_layout().iter()),
            ));
        }
        let mut out = Vec::new();
        let s = |out: &mut Vec<u8>, x: &str| {
            out.extend_from_slice(&(x.len() as u64).to_le_bytes());
            out.extend_from_slice(x.as_bytes());
        };
        out.extend_from_slice(b"GGUF");
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&4u64.to_le_bytes());
        for (k, v) in [
            ("general.type", "adapter"),
            ("general.architecture", arch),
            ("adapter.type", "lora"),
        ] {
            s(&mut out, k);
            out.extend_from_slice(&8u32.to_le_bytes());
            s(&mut out, v);
        }
        s(&mut out, "adapter.lora.alpha");
        out.extend_from_slice(&6u32.to_le_bytes());
        out.extend_from_slice(&self.spec.alpha.to_le_bytes());
        let mut offset = 0u64;
        for (name, ne, data) in &tensors {
            s(&mut out, name);
            out.extend_from_slice(&2u32.to_le_bytes());
            out.extend_from_slice(&ne[0].to_le_bytes());
            out.extend_from_slice(&ne[1].to_le_bytes());
            out.extend_from_slice(&0u32.to_le_bytes()); // GGML_TYPE_F32
            out.extend_from_slice(&offset.to_le_bytes());
            offset += (data.len() as u64).div_ceil(32) * 32;
        }
        while out.len() % 32 != 0 {
            out.push(0);
        }
        for (_, _, data) in &tensors {
            out.extend_from_slice(data);
            while out.len() % 32 != 0 {
                out.push(0);
            }
        }
        out
    }

    /// The PEFT files: `adapter_model.safetensors` (HF names, q/k `lora_B` rows in HF order)
    /// and `adapter_config.json`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when safetensors refuses a tensor.
    pub fn to_peft(&self, hp: &Hparams, base: &str) -> Result<(Vec<u8>, String)> {
        let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
        for (layer, t, a, b) in self.pairs() {
            let module = hf_module(t).unwrap_or("self_attn.q_proj");
            let name = |ab: &str| {
                format!("base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight")
            };
            let b_hf = match t {
                "q" => permute_rows(b, hp.n_head, hp.head_dim, false),
                "k" => permute_rows(b, hp.n_head_kv, hp.head_dim, false),
                _ => b.clone(),
            };
            blobs.push((name("A"), vec![a.nrows(), a.ncols()], f32_bytes(a.iter())));
            blobs.push((
                name("B"),
                vec![b_hf.nrows(), b_hf.ncols()],
                f32_bytes(b_hf.iter()),
            ));
        }
        let err = |e: safetensors::SafeTensorError| Error::Invalid(format!("safetensors: {e}"));
        let views = blobs
            .iter()
            .map(|(n, shape, data)| {
                TensorView::new(Dtype::F32, shape.clone(), data)
                    .map(|v| (n.clone(), v))
                    .map_err(err)
            })
            .collect::<Result<Vec<_>>>()?;
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        let st = safetensors::serialize(views, Some(meta)).map_err(err)?;
        let cfg = PeftConfig {
            peft_type: "LORA".into(),
            task_type: "CAUSAL_LM".into(),
            r: self.spec.r,
            lora_alpha: self.spec.alpha,
            target_modules: self
                .spec
                .targets
                .iter()
                .filter_map(|t| hf_module(t))
                .map(|m| m.rsplit('.').next().unwrap_or(m).to_string())
                .collect(),
            layers_to_transform: Some(self.layers.clone()),
            lora_dropout: 0.0,
            bias: "none".into(),
            fan_in_fan_out: false,
            base_model_name_or_path: base.into(),
        };
        Ok((st, serde_json::to_string_pretty(&cfg)?))
    }

    /// Reads a PEFT LoRA directory (`adapter_config.json` + `adapter_model.safetensors`, HF
    /// names) trained elsewhere, converting q/k `lora_B` rows to the GGUF basis. The adapted
    /// layers must be the last `k` of the model for Turnwise to train it further; any set loads.
    ///
    /// # Errors
    /// [`Error::Invalid`] for missing files, unknown modules, shapes that do not fit the model or
    /// non-finite values.
    pub fn from_peft(dir: &Path, hp: &Hparams) -> Result<Self> {
        let cpath = dir.join(super::CONFIG_FILE);
        let cfg: PeftConfig =
            serde_json::from_slice(&std::fs::read(&cpath).map_err(|e| Error::io(&cpath, e))?)
                .map_err(|e| Error::Invalid(format!("{}: {e}", cpath.display())))?;
        let wpath = dir.join(super::WEIGHTS_FILE);
        let blob = std::fs::read(&wpath).map_err(|e| Error::io(&wpath, e))?;
        let st = SafeTensors::deserialize(&blob)
            .map_err(|e| Error::Invalid(format!("{}: {e}", wpath.display())))?;
        let mut targets = Vec::new();
        for m in &cfg.target_modules {
            let t = ["q", "k", "v", "o", "gate", "up", "down"]
                .into_iter()
                .find(|t| hf_module(t).is_some_and(|h| h.ends_with(m.as_str())))
                .ok_or_else(|| Error::Invalid(format!("unknown target module {m}")))?;
            targets.push(t.to_string());
        }
        // the layers present in the file
        let mut layers: Vec<usize> = st
            .names()
            .iter()
            .filter_map(|n| {
                n.split(".layers.")
                    .nth(1)
                    .and_then(|r| r.split('.').next())
                    .and_then(|x| x.parse().ok())
            })
            .collect();
        layers.sort_unstable();
        layers.dedup();
        if layers.is_empty() || layers.iter().any(|&l| l >= hp.n_layer) {
            return Err(Error::Invalid(format!(
                "{} adapts layers {layers:?} of a {}-layer model",
                wpath.display(),
                hp.n_layer
            )));
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        for &layer in &layers {
            for t in &targets {
                let module = hf_module(t).unwrap_or_default();
                let get = |ab: &str| {
                    let name =
                        format!("base_model.model.model.layers.{layer}.{module}.lora_{ab}.weight");
                    f32_tensor(&st, &name, &wpath)
                };
                let (sa, va) = get("A")?;
                let (sb, vb) = get("B")?;
                let (dout, din) = hp.shape(t);
                if sa != [cfg.r, din] || sb != [dout, cfg.r] {
                    return Err(Error::Invalid(format!(
                        "layer {layer} {module}: shapes {sa:?} / {sb:?}, expected [{}, {din}] / [{dout}, {}]",
                        cfg.r, cfg.r
                    )));
                }
                let shape = |e: ndarray::ShapeError| Error::Invalid(e.to_string());
                let am = Array2::from_shape_vec((cfg.r, din), va).map_err(shape)?;
                let bm = Array2::from_shape_vec((dout, cfg.r), vb).map_err(shape)?;
                let bm = match t.as_str() {
                    "q" => permute_rows(&bm, hp.n_head, hp.head_dim, true),
                    "k" => permute_rows(&bm, hp.n_head_kv, hp.head_dim, true),
                    _ => bm,
                };
                a.push(am);
                b.push(bm);
            }
        }
        let out = BlockLora {
            spec: BlockSpec {
                k: layers.len(),
                targets,
                r: cfg.r,
                alpha: cfg.lora_alpha,
            },
            layers,
            factors: BlockFactors { a, b },
            arch: hp.arch.clone(),
        };
        if !out.is_finite() {
            return Err(Error::Invalid(format!(
                "{} holds non-finite values",
                wpath.display()
            )));
        }
        Ok(out)
    }
}

impl BlockLora {
    /// Reads a GGUF LoRA (as [`BlockLora::to_gguf`] writes it, or as llama.cpp's
    /// `convert_lora_to_gguf.py` does with f32 / f16 tensors): alpha from `adapter.lora.alpha`,
    /// rank from the shapes, targets and layers from the tensor names.
    ///
    /// # Errors
    /// [`Error::BadModel`] for a file that is not a LoRA adapter, tensors of unknown projections,
    /// inconsistent ranks or targets that differ between layers.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        use crate::policy::gguf::GgufIndex;
        use crate::policy::llama;
        let idx = GgufIndex::open(path)?;
        let bad = |reason: String| Error::BadModel {
            path: path.into(),
            reason,
        };
        if idx.meta.get("general.type").map(String::as_str) != Some("adapter")
            || idx.meta.get("adapter.type").map(String::as_str) != Some("lora")
        {
            return Err(bad(
                "not a GGUF LoRA adapter (general.type / adapter.type)".into()
            ));
        }
        let alpha = idx.meta_f64("adapter.lora.alpha")? as f32;
        // (layer, target) -> (A, B)
        let mut found: std::collections::BTreeMap<(usize, usize), [Option<Array2<f32>>; 2]> =
            Default::default();
        let order = ["q", "k", "v", "o", "gate", "up", "down"];
        for t in &idx.tensors {
            let (stem, ab) = match t.name.strip_suffix(".weight.lora_a") {
                Some(s) => (s, 0),
                None => match t.name.strip_suffix(".weight.lora_b") {
                    Some(s) => (s, 1),
                    None => continue,
                },
            };
            let mut parts = stem.splitn(3, '.');
            let (Some("blk"), Some(layer), Some(tensor)) =
                (parts.next(), parts.next(), parts.next())
            else {
                return Err(bad(format!("unexpected LoRA tensor {}", t.name)));
            };
            let layer: usize = layer
                .parse()
                .map_err(|_| bad(format!("unexpected LoRA tensor {}", t.name)))?;
            let ti = order
                .iter()
                .position(|o| target_tensor(o) == Some(tensor))
                .ok_or_else(|| bad(format!("LoRA on {tensor} is not supported")))?;
            let (cols, rows) = match t.dims.as_slice() {
                [c, r] => (*c as usize, *r as usize),
                d => return Err(bad(format!("{} has shape {d:?}", t.name))),
            };
            let n = cols * rows;
            let raw = idx.read_tensor_bytes(t, llama::row_size(t.ggml_type, n)?)?;
            let v = llama::dequantize(t.ggml_type, &raw, n)?;
            let m = Array2::from_shape_vec((rows, cols), v).map_err(|e| bad(e.to_string()))?;
            found.entry((layer, ti)).or_default()[ab] = Some(m);
        }
        let layers: Vec<usize> = {
            let mut l: Vec<usize> = found.keys().map(|k| k.0).collect();
            l.dedup();
            l
        };
        let targets_of = |layer: usize| -> Vec<usize> {
            found.keys().filter(|k| k.0 == layer).map(|k| k.1).collect()
        };
        let first = layers
            .first()
            .copied()
            .ok_or_else(|| bad("the file holds no LoRA tensors".into()))?;
        let tis = targets_of(first);
        if layers.iter().any(|&l| targets_of(l) != tis) {
            return Err(bad("layers adapt different projections".into()));
        }
        let (mut a, mut b) = (Vec::new(), Vec::new());
        let mut r = None;
        for (&(layer, ti), pair) in &found {
            let [Some(am), Some(bm)] = pair else {
                return Err(bad(format!(
                    "layer {layer} {}: lora_a or lora_b is missing",
                    order[ti]
                )));
            };
            if am.nrows() != bm.ncols() || r.is_some_and(|r| r != am.nrows()) {
                return Err(bad(format!(
                    "layer {layer} {}: inconsistent rank",
                    order[ti]
                )));
            }
            r = Some(am.nrows());
            a.push(am.clone());
            b.push(bm.clone());
        }
        let spec = BlockSpec {
            k: layers.len(),
            targets: tis.iter().map(|&t| order[t].to_string()).collect(),
            r: r.unwrap_or(0),
            alpha,
        };
        let out = BlockLora {
            spec,
            layers,
            factors: BlockFactors { a, b },
            arch: idx.architecture.clone().unwrap_or_default(),
        };
        if !out.is_finite() {
            return Err(bad("non-finite LoRA values".into()));
        }
        Ok(out)
    }
}

/// `adapter_config.json` of a PEFT LoRA on the blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PeftConfig {
    /// `LORA`
    pub peft_type: String,
    /// `CAUSAL_LM`
    #[serde(default)]
    pub task_type: String,
    /// rank
    pub r: usize,
    /// scale numerator
    pub lora_alpha: f32,
    /// HF module names (`q_proj`, …)
    pub target_modules: Vec<String>,
    /// adapted layers
    #[serde(default)]
    pub layers_to_transform: Option<Vec<usize>>,
    /// dropout used in training
    #[serde(default)]
    pub lora_dropout: f32,
    /// bias handling
    #[serde(default)]
    pub bias: String,
    /// weight layout flag
    #[serde(default)]
    pub fan_in_fan_out: bool,
    /// base model
    #[serde(default)]
    pub base_model_name_or_path: String,
}

/// Permutes the rows of a q/k output-side matrix between the HF and GGUF bases. Within each of
/// `n_heads` heads of width `d`, GGUF row `2i + j` is HF row `j·d/2 + i` (the conversion
/// script's `reshape(n_head, 2, d/2).swapaxes(1, 2)`). `to_gguf` selects the direction.
pub fn permute_rows(m: &Array2<f32>, n_heads: usize, d: usize, to_gguf: bool) -> Array2<f32> {
    let half = d / 2;
    let mut out = m.clone();
    for h in 0..n_heads {
        for i in 0..half {
            for j in 0..2 {
                let gguf = h * d + 2 * i + j;
                let hf = h * d + j * half + i;
                let (dst, src) = if to_gguf { (gguf, hf) } else { (hf, gguf) };
                out.row_mut(dst).assign(&m.row(src));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rope_permutation_round_trips_and_interleaves_halves() {
        let m = Array2::from_shape_fn((8, 1), |(i, _)| i as f32);
        // 2 heads of width 4: HF rows [0 1 | 2 3] per head become GGUF [0 2 1 3]
        let g = permute_rows(&m, 2, 4, true);
        assert_eq!(
            g.column(0).to_vec(),
            vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
        );
        assert_eq!(permute_rows(&g, 2, 4, false), m);
    }
}
