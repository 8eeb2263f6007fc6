//! The trainable state: a LoRA adapter on the output projection and a value head, their
//! PEFT-style safetensors files, and their application at sampling time; optionally a block
//! LoRA inside the last transformer blocks ([`block`]), which llama.cpp applies itself from a
//! GGUF LoRA file in the same directory.
//!
//! `logits = W·h + (α/r)·B·(A·h)` with `A: [r, n_embd]`, `B: [n_vocab, r]`, where `h` is the
//! hidden state exactly as the output matmul saw it (the stored feature). `V(s) = σ(w·h_s + b)`.
//! A fresh adapter has `B = 0`, so it adds exact zeros and leaves generation bit-identical.

pub mod block;
pub mod merge;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use ndarray::{Array1, Array2};
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::policy::sampler::Rng;

/// PEFT tensor names.
pub const LORA_A: &str = "base_model.model.lm_head.lora_A.weight";
/// PEFT tensor names.
pub const LORA_B: &str = "base_model.model.lm_head.lora_B.weight";
/// Value-head weight `[1, n_embd]`.
pub const VALUE_W: &str = "value_head.weight";
/// Value-head bias `[1]`.
pub const VALUE_B: &str = "value_head.bias";
/// File names inside an adapter directory.
pub const WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// PEFT config file.
pub const CONFIG_FILE: &str = "adapter_config.json";
/// The block LoRA of a version, as the GGUF LoRA llama.cpp loads.
pub const BLOCK_FILE: &str = "block_adapter.gguf";

/// `adapter_config.json`, PEFT field names.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdapterConfig {
    /// always `LORA`
    pub peft_type: String,
    /// always `CAUSAL_LM`
    pub task_type: String,
    /// rank
    pub r: usize,
    /// scale numerator: the update is scaled by `lora_alpha / r`
    pub lora_alpha: f32,
    /// adapted modules (`lm_head` for stage 1)
    pub target_modules: Vec<String>,
    /// model the adapter was trained on (`general.name`)
    #[serde(default)]
    pub base_model_name_or_path: String,
}

/// LoRA on the output projection plus a value head.
#[derive(Debug, Clone, PartialEq)]
pub struct Adapter {
    /// rank and scale
    pub config: AdapterConfig,
    /// `[r, n_embd]`
    pub a: Array2<f32>,
    /// `[n_vocab, r]`
    pub b: Array2<f32>,
    /// value-head weight `[n_embd]`
    pub value_w: Array1<f32>,
    /// value-head bias
    pub value_b: f32,
    /// a LoRA inside the last blocks, applied by llama.cpp (none: the blocks are the base
    /// model's)
    pub block: Option<block::BlockLora>,
}

impl Adapter {
    /// A fresh adapter: `A` uniform in `±1/√n_embd` (PEFT's Kaiming-uniform bound), `B = 0`,
    /// value head zero (V = 0.5 everywhere).
    pub fn fresh(
        n_embd: usize,
        n_vocab: usize,
        r: usize,
        lora_alpha: f32,
        seed: u64,
        base: &str,
    ) -> Self {
        let mut rng = Rng::new(seed);
        let bound = 1.0 / (n_embd as f64).sqrt();
        let a = Array2::from_shape_fn((r, n_embd), |_| {
            ((rng.next_f64() * 2.0 - 1.0) * bound) as f32
        });
        Adapter {
            config: AdapterConfig {
                peft_type: "LORA".into(),
                task_type: "CAUSAL_LM".into(),
                r,
                lora_alpha,
                target_modules: vec!["lm_head".into()],
                base_model_name_or_path: base.into(),
            },
            a,
            b: Array2::zeros((n_vocab, r)),
            value_w: Array1::zeros(n_embd),
            value_b: 0.0,
            block: None,
        }
    }

    /// `lora_alpha / r`.
    pub fn scale(&self) -> f32 {
        self.config.lora_alpha / self.config.r as f32
    }

    /// The output-projection LoRA as the block graphs take it: `(A, B, scale)`.
    pub fn output_lora(&self) -> crate::graph::block::OutputLora<'_> {
        (self.a.view(), self.b.view(), self.scale())
    }

    /// Hidden width.
    pub fn n_embd(&self) -> usize {
        self.a.ncols()
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.b.nrows()
    }

    /// Adds the low-rank term to one row of logits: `logits += (α/r)·B·(A·h)`.
    pub fn apply(&self, h: &[f32], logits: &mut [f32]) {
        let s = self.scale();
        let u: Vec<f32> = self
            .a
            .rows()
            .into_iter()
            .map(|row| row.iter().zip(h).map(|(x, y)| x * y).sum::<f32>() * s)
            .collect();
        for (l, brow) in logits.iter_mut().zip(self.b.rows()) {
            let mut acc = 0.0f32;
            for (bk, uk) in brow.iter().zip(&u) {
                acc += bk * uk;
            }
            *l += acc;
        }
    }

    /// `V(s) = σ(w·h + b)`.
    pub fn value(&self, h: &[f32]) -> f32 {
        let z: f32 = self.value_w.iter().zip(h).map(|(w, x)| w * x).sum::<f32>() + self.value_b;
        1.0 / (1.0 + (-z).exp())
    }

    /// True when every parameter is finite.
    pub fn is_finite(&self) -> bool {
        self.a
            .iter()
            .chain(self.b.iter())
            .chain(self.value_w.iter())
            .all(|x| x.is_finite())
            && self.value_b.is_finite()
            && self.block.as_ref().is_none_or(|b| b.is_finite())
    }

    /// Checks the shapes against a model.
    ///
    /// # Errors
    /// [`Error::Invalid`] on a mismatch.
    pub fn check_model(&self, n_embd: usize, n_vocab: usize) -> Result<()> {
        if self.n_embd() != n_embd || self.n_vocab() != n_vocab {
            return Err(Error::Invalid(format!(
                "adapter is for n_embd {} / n_vocab {}, the model has {n_embd} / {n_vocab}",
                self.n_embd(),
                self.n_vocab()
            )));
        }
        Ok(())
    }

    /// Writes the adapter directory atomically: everything goes to a temporary sibling which is
    /// synced and then renamed to `dir`. An existing `dir` is refused (versions are immutable).
    ///
    /// # Errors
    /// [`Error::Invalid`] for a non-finite adapter or an existing directory; I/O errors.
    pub fn save(&self, dir: &Path) -> Result<()> {
        self.save_with(dir, &[])
    }

    /// [`Adapter::save`] with extra files (name, bytes) written into the same directory before
    /// it is renamed into place (the learner's optimizer state).
    ///
    /// # Errors
    /// As [`Adapter::save`].
    pub fn save_with(&self, dir: &Path, extra: &[(&str, Vec<u8>)]) -> Result<()> {
        if !self.is_finite() {
            return Err(Error::Invalid(
                "refusing to write an adapter with non-finite values".into(),
            ));
        }
        if dir.exists() {
            return Err(Error::Invalid(format!("{} already exists", dir.display())));
        }
        let parent = dir.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        let tmp = parent.join(format!(
            ".{}.tmp-{}",
            dir.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("adapter"),
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let blob = self.safetensors_blob(true)?;
        write_synced(&tmp.join(WEIGHTS_FILE), &blob)?;
        write_synced(
            &tmp.join(CONFIG_FILE),
            serde_json::to_string_pretty(&self.config)?.as_bytes(),
        )?;
        if let Some(b) = &self.block {
            write_synced(&tmp.join(BLOCK_FILE), &b.to_gguf())?;
        }
        for (name, data) in extra {
            write_synced(&tmp.join(name), data)?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))?;
        if let Ok(d) = std::fs::File::open(parent) {
            let _ = d.sync_all();
        }
        Ok(())
    }

    /// The output-projection LoRA as PEFT files (`lm_head` names; no value head): the
    /// safetensors blob and `adapter_config.json`.
    ///
    /// # Errors
    /// [`Error::Invalid`] when safetensors refuses a tensor.
    pub fn to_peft(&self) -> Result<(Vec<u8>, String)> {
        Ok((
            self.safetensors_blob(false)?,
            serde_json::to_string_pretty(&self.config)?,
        ))
    }

    /// The LoRA tensors in PEFT names (and the value head with `with_value`) as safetensors.
    fn safetensors_blob(&self, with_value: bool) -> Result<Vec<u8>> {
        let (a, b) = (f32_bytes(self.a.iter()), f32_bytes(self.b.iter()));
        let (vw, vb) = (
            f32_bytes(self.value_w.iter()),
            f32_bytes([self.value_b].iter()),
        );
        let (r, d, v) = (self.config.r, self.n_embd(), self.n_vocab());
        let err = |e: safetensors::SafeTensorError| Error::Invalid(format!("safetensors: {e}"));
        let mut tensors = vec![
            (
                LORA_A,
                TensorView::new(Dtype::F32, vec![r, d], &a).map_err(err)?,
            ),
            (
                LORA_B,
                TensorView::new(Dtype::F32, vec![v, r], &b).map_err(err)?,
            ),
        ];
        if with_value {
            tensors.push((
                VALUE_W,
                TensorView::new(Dtype::F32, vec![1, d], &vw).map_err(err)?,
            ));
            tensors.push((
                VALUE_B,
                TensorView::new(Dtype::F32, vec![1], &vb).map_err(err)?,
            ));
        }
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize(tensors, Some(meta)).map_err(err)
    }

    /// Reads an adapter directory.
    ///
    /// # Errors
    /// [`Error::Invalid`] for missing tensors, wrong shapes or non-finite values; I/O errors.
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg_path = dir.join(CONFIG_FILE);
        let config: AdapterConfig = serde_json::from_slice(
            &std::fs::read(&cfg_path).map_err(|e| Error::io(&cfg_path, e))?,
        )?;
        let wpath = dir.join(WEIGHTS_FILE);
        let blob = std::fs::read(&wpath).map_err(|e| Error::io(&wpath, e))?;
        let st = SafeTensors::deserialize(&blob)
            .map_err(|e| Error::Invalid(format!("{}: {e}", wpath.display())))?;
        let get = |name: &str| f32_tensor(&st, name, &wpath);
        let shape_err =
            |e: ndarray::ShapeError| Error::Invalid(format!("adapter tensor shape: {e}"));
        let (sa, a) = get(LORA_A)?;
        let (sb, b) = get(LORA_B)?;
        let (_, vw) = get(VALUE_W)?;
        let (_, vb) = get(VALUE_B)?;
        if sa.len() != 2 || sb.len() != 2 || sa[0] != config.r || sb[1] != config.r {
            return Err(Error::Invalid(format!(
                "LoRA shapes {sa:?} / {sb:?} do not match r = {}",
                config.r
            )));
        }
        let out = Adapter {
            a: Array2::from_shape_vec((sa[0], sa[1]), a).map_err(shape_err)?,
            b: Array2::from_shape_vec((sb[0], sb[1]), b).map_err(shape_err)?,
            value_w: Array1::from(vw),
            value_b: vb.first().copied().unwrap_or(0.0),
            config,
            block: {
                let bp = dir.join(BLOCK_FILE);
                if bp.exists() {
                    Some(block::BlockLora::from_gguf(&bp)?)
                } else {
                    None
                }
            },
        };
        if out.value_w.len() != out.n_embd() {
            return Err(Error::Invalid(
                "value head width differs from the LoRA width".into(),
            ));
        }
        if !out.is_finite() {
            return Err(Error::Invalid(format!(
                "{} holds non-finite values",
                dir.display()
            )));
        }
        Ok(out)
    }
}

/// Little-endian bytes of f32 values (safetensors' F32 layout).
pub(crate) fn f32_bytes<'a>(v: impl Iterator<Item = &'a f32>) -> Vec<u8> {
    v.flat_map(|x| x.to_le_bytes()).collect()
}

/// Shape and values of the F32 tensor `name` of `st` (read from `path`, for the messages).
pub(crate) fn f32_tensor(
    st: &SafeTensors,
    name: &str,
    path: &Path,
) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = st
        .tensor(name)
        .map_err(|_| Error::Invalid(format!("{} has no tensor {name}", path.display())))?;
    if t.dtype() != Dtype::F32 {
        return Err(Error::Invalid(format!(
            "{name} is {:?}, expected F32",
            t.dtype()
        )));
    }
    let v = t
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    Ok((t.shape().to_vec(), v))
}

fn write_synced(path: &Path, data: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    f.write_all(data).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Where adapter versions of a database live: `<db dir>/<db name>.adapters/<id>`, so that two
/// databases in one directory never share version directories.
pub fn adapter_dir(db: &Path, id: i64) -> PathBuf {
    adapters_root(db).join(format!("{id:06}"))
}

/// The folder that holds the adapters of the database `db`.
pub fn adapters_root(db: &Path) -> PathBuf {
    let name = db
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "turnwise".into());
    db.parent()
        .unwrap_or(Path::new("."))
        .join(format!("{name}.adapters"))
}

/// Removes the temporary folders of adapter writes whose process is gone (a crash between
/// writing and renaming); returns how many. Folders of running processes are left alone.
pub fn remove_stale_temp_dirs(db: &Path) -> usize {
    let Ok(entries) = std::fs::read_dir(adapters_root(db)) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix('.')
            .and_then(|n| n.rsplit_once(".tmp-"))
            .and_then(|(_, pid)| pid.parse::<u32>().ok())
        else {
            continue;
        };
        let running =
            pid == std::process::id() || Path::new("/proc").join(pid.to_string()).exists();
        if !running && std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

impl crate::policy::ServedAdapter for Adapter {
    fn check_model(&self, n_embd: usize, n_vocab: usize) -> Result<()> {
        Adapter::check_model(self, n_embd, n_vocab)
    }

    fn apply(&self, h: &[f32], logits: &mut [f32]) {
        Adapter::apply(self, h, logits);
    }

    fn block_gguf(&self) -> Option<Vec<u8>> {
        self.block.as_ref().map(block::BlockLora::to_gguf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_adapter_adds_exact_zeros() {
        let ad = Adapter::fresh(64, 10, 4, 8.0, 1, "m");
        let h: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut l: Vec<f32> = (0..10).map(|i| i as f32 * -0.3).collect();
        let before = l.clone();
        ad.apply(&h, &mut l);
        assert_eq!(l, before);
        assert_eq!(ad.value(&h), 0.5);
    }

    #[test]
    fn apply_matches_a_hand_computation() {
        let mut ad = Adapter::fresh(2, 3, 1, 2.0, 1, "m"); // scale 2
        ad.a = Array2::from_shape_vec((1, 2), vec![1.0, -1.0]).unwrap();
        ad.b = Array2::from_shape_vec((3, 1), vec![0.5, 0.0, -2.0]).unwrap();
        let mut l = vec![1.0, 1.0, 1.0];
        ad.apply(&[3.0, 1.0], &mut l); // A·h = 2, ×2 = 4 -> B·4 = [2, 0, -8]
        assert_eq!(l, vec![3.0, 1.0, -7.0]);
        ad.value_w = Array1::from(vec![1.0, 0.0]);
        ad.value_b = -3.0;
        assert!((ad.value(&[3.0, 9.0]) - 0.5).abs() < 1e-7);
    }

    #[test]
    fn save_is_atomic_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let mut ad = Adapter::fresh(32, 7, 2, 4.0, 3, "m");
        ad.b[[3, 1]] = 0.25;
        ad.value_b = -1.5;
        let p = dir.path().join("000001");
        ad.save(&p).unwrap();
        assert_eq!(Adapter::load(&p).unwrap(), ad);
        assert!(ad.save(&p).is_err(), "versions are immutable");
        let cfg: serde_json::Value =
            serde_json::from_slice(&std::fs::read(p.join(CONFIG_FILE)).unwrap()).unwrap();
        assert_eq!(cfg["r"], 2);
        assert_eq!(cfg["lora_alpha"], 4.0);
        let mut bad = ad.clone();
        bad.b[[0, 0]] = f32::NAN;
        assert!(bad.save(&dir.path().join("x")).is_err());
        assert!(!dir.path().join("x").exists());
        // only the final directory remains, no temporary
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 1);
        assert!(Adapter::load(&dir.path().join("missing")).is_err());
    }
}
