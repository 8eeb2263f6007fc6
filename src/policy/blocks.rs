//! The last `k` transformer blocks of a GGUF model, dequantised, with the hyperparameters that
//! llama.cpp applies to them: what the block-LoRA graph ([`crate::graph::block`]) recomputes from
//! the activations captured at block `L − k`.
//!
//! Only the `llama` architecture (RMSNorm, grouped-query attention with "normal" RoPE on adjacent
//! pairs, SwiGLU MLP) is supported; other architectures get a clear error. Weights stay in the
//! GGUF basis: llama.cpp's q/k rows are already permuted for its RoPE, so the graph needs no
//! permutation and a GGUF LoRA trained on it loads as is.

use std::path::Path;

use ndarray::Array2;

use super::gguf::{GgufIndex, TensorInfo};
use super::llama;
use crate::error::{Error, Result};

/// The input of the first adapted block (`l_out-{layer}`) at consecutive positions of a session,
/// as the engine captures them for a reply (`--block-capture K`); the store keeps them with the
/// assistant turn whose generation covered them (f16).
#[derive(Debug, Clone, PartialEq)]
pub struct BlockFeatures {
    /// N of `l_out-N`
    pub layer: usize,
    /// width of one row
    pub n_embd: usize,
    /// the session position of the first row
    pub first_pos: usize,
    /// `n_pos × n_embd` values, row-major
    pub values: Vec<f32>,
}

impl BlockFeatures {
    /// Number of positions.
    pub fn n_pos(&self) -> usize {
        self.values.len() / self.n_embd.max(1)
    }
}

/// The projections a block LoRA can adapt, in llama.cpp's tensor names (`blk.N.<name>.weight`).
pub const TARGETS: [(&str, &str); 7] = [
    ("q", "attn_q"),
    ("k", "attn_k"),
    ("v", "attn_v"),
    ("o", "attn_output"),
    ("gate", "ffn_gate"),
    ("up", "ffn_up"),
    ("down", "ffn_down"),
];

/// The GGUF tensor stem of a target (`q` → `attn_q`).
pub fn target_tensor(target: &str) -> Option<&'static str> {
    TARGETS.iter().find(|(t, _)| *t == target).map(|(_, n)| *n)
}

/// Hyperparameters read from the GGUF.
#[derive(Debug, Clone, PartialEq)]
pub struct Hparams {
    /// `general.architecture`
    pub arch: String,
    /// number of blocks `L`
    pub n_layer: usize,
    /// hidden width
    pub n_embd: usize,
    /// MLP width
    pub n_ff: usize,
    /// query heads
    pub n_head: usize,
    /// key/value heads
    pub n_head_kv: usize,
    /// per-head width
    pub head_dim: usize,
    /// RoPE base frequency
    pub rope_base: f32,
    /// RMSNorm epsilon
    pub rms_eps: f32,
    /// vocabulary size
    pub n_vocab: usize,
}

impl Hparams {
    /// Reads the hyperparameters; refuses architectures and settings the graph does not model.
    ///
    /// # Errors
    /// [`Error::BadModel`] for another architecture, RoPE scaling, or missing keys.
    pub fn from_index(idx: &GgufIndex) -> Result<Self> {
        let bad = |reason: String| Error::BadModel {
            path: idx.path.clone(),
            reason,
        };
        let arch = idx.architecture.clone().unwrap_or_default();
        if arch != "llama" {
            return Err(bad(format!(
                "block LoRA models the `llama` architecture only; this model is `{arch}` \
                 (use --adapter output)"
            )));
        }
        let key = |k: &str| format!("{arch}.{k}");
        if let Some(t) = idx.meta.get(&key("rope.scaling.type")) {
            if t != "none" {
                return Err(bad(format!(
                    "RoPE scaling `{t}` is not modelled by block LoRA"
                )));
            }
        }
        let n = |k: &str| idx.meta_f64(&key(k)).map(|v| v as usize);
        let n_embd = n("embedding_length")?;
        let n_head = n("attention.head_count")?;
        let n_head_kv = n("attention.head_count_kv").unwrap_or(n_head);
        let head_dim = n_embd / n_head.max(1);
        if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 || head_dim % 2 != 0 {
            return Err(bad(format!(
                "{n_head} heads over {n_head_kv} key/value heads of width {head_dim}"
            )));
        }
        if let Ok(rot) = n("rope.dimension_count") {
            if rot != head_dim {
                return Err(bad(format!(
                    "partial RoPE ({rot} of {head_dim} dimensions) is not modelled"
                )));
            }
        }
        let n_vocab = idx
            .output_tensor()?
            .dims
            .get(1)
            .copied()
            .ok_or_else(|| bad("output projection is not a matrix".into()))?
            as usize;
        Ok(Hparams {
            n_layer: n("block_count")?,
            n_embd,
            n_ff: n("feed_forward_length")?,
            n_head,
            n_head_kv,
            head_dim,
            rope_base: idx.meta_f64(&key("rope.freq_base")).unwrap_or(10000.0) as f32,
            rms_eps: idx.meta_f64(&key("attention.layer_norm_rms_epsilon"))? as f32,
            n_vocab,
            arch,
        })
    }

    /// Width of the key/value projections.
    pub fn n_embd_kv(&self) -> usize {
        self.n_head_kv * self.head_dim
    }

    /// `(out, in)` of a target projection.
    pub fn shape(&self, target: &str) -> (usize, usize) {
        match target {
            "q" | "o" => (self.n_embd, self.n_embd),
            "k" | "v" => (self.n_embd_kv(), self.n_embd),
            "gate" | "up" => (self.n_ff, self.n_embd),
            _ => (self.n_embd, self.n_ff),
        }
    }
}

/// One projection: the dequantised weight `[out, in]` and its ggml type.
#[derive(Debug, Clone)]
pub struct Proj {
    /// `[out, in]`, as `W·x` uses it
    pub w: Array2<f32>,
    /// ggml type of the stored weight (decides how llama.cpp rounds the activation)
    pub ggml_type: u32,
    /// for Q4_1 weights (`d·q + m` per block of 32): the scaled part `d·q` `[out, in]` and the
    /// block minima `m` `[out, in/32]`, which ggml's dot product multiplies with the
    /// activation's stored block sums rather than with the rounded activations
    pub split: Option<(Array2<f32>, Array2<f32>)>,
}

/// Splits a Q4_1 matrix (`rows` rows of `cols`) into `d·q` and the block minima.
fn split_q4_1(raw: &[u8], rows: usize, cols: usize) -> Option<(Array2<f32>, Array2<f32>)> {
    const BLOCK: usize = 20; // f16 d, f16 m, 16 bytes of nibbles
    let nb = cols / 32;
    if !cols.is_multiple_of(32) || raw.len() < rows * nb * BLOCK {
        return None;
    }
    let mut scaled = Array2::zeros((rows, cols));
    let mut mins = Array2::zeros((rows, nb));
    for r in 0..rows {
        for b in 0..nb {
            let blk = &raw[(r * nb + b) * BLOCK..][..BLOCK];
            let d = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
            let m = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
            mins[[r, b]] = m;
            for j in 0..16 {
                let q = blk[4 + j];
                scaled[[r, b * 32 + j]] = f32::from(q & 0x0f) * d;
                scaled[[r, b * 32 + j + 16]] = f32::from(q >> 4) * d;
            }
        }
    }
    Some((scaled, mins))
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct Block {
    /// index in the model
    pub index: usize,
    /// attention RMSNorm weight
    pub attn_norm: Vec<f32>,
    /// MLP RMSNorm weight
    pub ffn_norm: Vec<f32>,
    /// projections in [`TARGETS`] order: q, k, v, o, gate, up, down
    pub proj: Vec<Proj>,
}

impl Block {
    /// A projection by target name.
    pub fn proj(&self, target: &str) -> &Proj {
        let i = TARGETS.iter().position(|(t, _)| *t == target).unwrap_or(0);
        &self.proj[i]
    }
}

/// The last `k` blocks, the final norm and the output projection.
#[derive(Debug, Clone)]
pub struct TailModel {
    /// hyperparameters
    pub hp: Hparams,
    /// blocks `L − k … L − 1`
    pub blocks: Vec<Block>,
    /// final RMSNorm weight
    pub output_norm: Vec<f32>,
    /// output projection `[n_vocab, n_embd]`
    pub output: Proj,
}

fn read_matrix(idx: &GgufIndex, t: &TensorInfo) -> Result<Array2<f32>> {
    Ok(read_proj(idx, t)?.w)
}

fn read_proj(idx: &GgufIndex, t: &TensorInfo) -> Result<Proj> {
    let bad = |reason: String| Error::BadModel {
        path: idx.path.clone(),
        reason,
    };
    let (cols, rows) = match t.dims.as_slice() {
        [c] => (*c as usize, 1),
        [c, r] => (*c as usize, *r as usize),
        d => return Err(bad(format!("{} has shape {d:?}", t.name))),
    };
    let row_bytes = llama::row_size(t.ggml_type, cols)?;
    let raw = idx.read_tensor_bytes(t, row_bytes * rows)?;
    let mut w = Vec::with_capacity(cols * rows);
    for row in raw.chunks_exact(row_bytes) {
        w.extend(llama::dequantize(t.ggml_type, row, cols)?);
    }
    let split = if t.ggml_type == llama_cpp_sys_2::GGML_TYPE_Q4_1 {
        split_q4_1(&raw, rows, cols)
    } else {
        None
    };
    Ok(Proj {
        w: Array2::from_shape_vec((rows, cols), w).map_err(|e| bad(e.to_string()))?,
        ggml_type: t.ggml_type,
        split,
    })
}

impl TailModel {
    /// Reads and dequantises the last `k` blocks of a GGUF model.
    ///
    /// # Errors
    /// [`Error::BadModel`] for an unsupported architecture, `k` out of range or missing tensors.
    pub fn from_gguf(path: &Path, k: usize) -> Result<Self> {
        let idx = GgufIndex::open(path)?;
        let hp = Hparams::from_index(&idx)?;
        if k == 0 || k >= hp.n_layer {
            return Err(Error::BadModel {
                path: path.into(),
                reason: format!("block LoRA over the last {k} of {} blocks", hp.n_layer),
            });
        }
        let tensor = |name: &str| -> Result<&TensorInfo> {
            idx.tensor(name).ok_or_else(|| Error::BadModel {
                path: path.into(),
                reason: format!("tensor {name} is missing"),
            })
        };
        let vector = |name: &str| -> Result<Vec<f32>> {
            Ok(read_matrix(&idx, tensor(name)?)?
                .into_raw_vec_and_offset()
                .0)
        };
        let mut blocks = Vec::with_capacity(k);
        for index in hp.n_layer - k..hp.n_layer {
            let mut proj = Vec::with_capacity(TARGETS.len());
            for (target, stem) in TARGETS {
                let t = tensor(&format!("blk.{index}.{stem}.weight"))?;
                let p = read_proj(&idx, t)?;
                if p.w.dim() != hp.shape(target) {
                    return Err(Error::BadModel {
                        path: path.into(),
                        reason: format!(
                            "{} is {:?}, expected {:?}",
                            t.name,
                            p.w.dim(),
                            hp.shape(target)
                        ),
                    });
                }
                proj.push(p);
            }
            blocks.push(Block {
                index,
                attn_norm: vector(&format!("blk.{index}.attn_norm.weight"))?,
                ffn_norm: vector(&format!("blk.{index}.ffn_norm.weight"))?,
                proj,
            });
        }
        let output = read_proj(&idx, idx.output_tensor()?)?;
        Ok(TailModel {
            output_norm: vector("output_norm.weight")?,
            hp,
            blocks,
            output,
        })
    }

    /// Index of the block whose output (`l_out-N`) is the graph's input.
    pub fn input_layer(&self) -> usize {
        self.blocks[0].index - 1
    }
}

/// RoPE tables for positions `pos`, computed the way ggml's CPU `rope` (mode "normal", no
/// scaling) does: `θ = pos`, multiplied by `base^(−2/d)` once per pair, in f32. Returns
/// `(cos, sin)`, each `[T, n_heads · head_dim]` with every pair's value written to both of its
/// lanes and repeated for every head.
pub fn rope_tables(pos: &[usize], hp: &Hparams, n_heads: usize) -> (Array2<f32>, Array2<f32>) {
    let d = hp.head_dim;
    let theta_scale = hp.rope_base.powf(-2.0 / d as f32);
    let width = n_heads * d;
    let mut cos = Array2::zeros((pos.len(), width));
    let mut sin = Array2::zeros((pos.len(), width));
    for (t, &p) in pos.iter().enumerate() {
        let mut theta = p as f32;
        let mut pair = vec![(0f32, 0f32); d / 2];
        for v in pair.iter_mut() {
            *v = (theta.cos(), theta.sin());
            theta *= theta_scale;
        }
        for h in 0..n_heads {
            for (i, &(c, s)) in pair.iter().enumerate() {
                for lane in 0..2 {
                    cos[[t, h * d + 2 * i + lane]] = c;
                    sin[[t, h * d + 2 * i + lane]] = s;
                }
            }
        }
    }
    (cos, sin)
}
