//! The model's output projection, reproduced outside llama.cpp: `base_logits(h)` recomputes the
//! logits from a stored final hidden state `h`.
//!
//! llama.cpp's CPU backend converts the activation to the weight's `vec_dot_type` (Q8_0 blocks of
//! 32 for a Q8_0 weight) before its matmul, so we round `h` through that type and multiply with
//! the dequantised weight (ggml's own `to_float`). On the default model this reproduces
//! llama.cpp's logits to a few 1e-5, which is what lets the learner compute old and new policy
//! log-probs from stored features instead of re-running llama.cpp.

use std::path::Path;

use ndarray::{Array2, ArrayView2};

use super::gguf::GgufIndex;
use super::llama;
use crate::error::{Error, Result};

/// What the engine needs of an adapter to serve it. The policy layer knows no adapter file
/// format: [`crate::adapter::Adapter`] implements this, and the engine applies whatever it is
/// given — a low-rank term on the logits at every sampled or rescored position, and a LoRA
/// inside the blocks that llama.cpp itself applies.
pub trait ServedAdapter: Send + Sync {
    /// Checks the adapter's shapes against the model's width and vocabulary.
    ///
    /// # Errors
    /// [`Error::Invalid`] on a mismatch.
    fn check_model(&self, n_embd: usize, n_vocab: usize) -> Result<()>;
    /// Adds the adapter's term to one row of logits computed from the final hidden state `h`.
    fn apply(&self, h: &[f32], logits: &mut [f32]);
    /// The LoRA inside the blocks as a GGUF LoRA file for llama.cpp, when the adapter has one.
    /// Equal bytes mean the same LoRA (the engine keeps a loaded one instead of reloading it).
    fn block_gguf(&self) -> Option<Vec<u8>>;
}

/// How stored hidden states are encoded. The engine rounds each captured `h` through the
/// activation type of the output matmul (what llama.cpp multiplies with), so the stored feature is
/// exactly the vector the logits came from; Q8_0 (also used for Q8_1 activations, whose values are
/// `d · q` as well) stores that losslessly in 34 bytes per 32 values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FeatureDtype {
    /// Q8_0 blocks (f16 scale + 32 × i8)
    Q8_0,
    /// IEEE half
    F16,
    /// IEEE single
    F32,
}

impl FeatureDtype {
    /// The encoding for activations of ggml type `act_type`.
    pub fn for_activation(act_type: u32) -> Self {
        match act_type {
            llama_cpp_sys_2::GGML_TYPE_Q8_0 | llama_cpp_sys_2::GGML_TYPE_Q8_1 => FeatureDtype::Q8_0,
            llama_cpp_sys_2::GGML_TYPE_F16 => FeatureDtype::F16,
            _ => FeatureDtype::F32,
        }
    }
    /// Name stored in `features.dtype`.
    pub fn as_str(self) -> &'static str {
        match self {
            FeatureDtype::Q8_0 => "q8_0",
            FeatureDtype::F16 => "f16",
            FeatureDtype::F32 => "f32",
        }
    }
    /// Parses a stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "q8_0" => Some(FeatureDtype::Q8_0),
            "f16" => Some(FeatureDtype::F16),
            "f32" => Some(FeatureDtype::F32),
            _ => None,
        }
    }
}

/// The ggml type of a GGUF model's output projection and the activation type the CPU backend
/// converts hidden states to before multiplying with it.
///
/// # Errors
/// [`Error::BadModel`] when the model has no output projection.
pub fn output_types(path: &Path) -> Result<(u32, u32)> {
    let idx = GgufIndex::open(path)?;
    let t = idx.output_tensor()?;
    Ok((t.ggml_type, llama::vec_dot_type(t.ggml_type)))
}

/// The dequantised output projection `W` (`[n_vocab, n_embd]`) and the activation type.
pub struct OutputHead {
    w: Array2<f32>,
    act_type: u32,
    /// which tensor it came from (`output.weight`, or `token_embd.weight` when tied)
    pub tensor: String,
    /// ggml type of the stored weight
    pub weight_type: u32,
    /// the GGUF file it was read from (a block-LoRA update reads the model's last blocks)
    pub path: std::path::PathBuf,
    /// per token id: its piece is a number (digits only, after the tokenizer's space marker)
    digits: Vec<bool>,
}

/// A token piece that only writes digits: `7`, `42`, `Ġ3` (byte-level BPE's space), `▁9`
/// (SentencePiece's).
pub fn is_digit_piece(piece: &str) -> bool {
    let p = piece.trim_start_matches(['Ġ', '▁', ' ']);
    !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit())
}

impl OutputHead {
    /// Reads and dequantises the output projection of a GGUF model.
    ///
    /// # Errors
    /// [`Error::BadModel`] when the file has neither `output.weight` nor `token_embd.weight`, or
    /// its type cannot be dequantised.
    pub fn from_gguf(path: &Path) -> Result<Self> {
        let idx = GgufIndex::open(path)?;
        let t = idx.output_tensor()?.clone();
        if t.dims.len() != 2 {
            return Err(Error::BadModel {
                path: path.into(),
                reason: format!("{} has {} dimensions", t.name, t.dims.len()),
            });
        }
        let (n_embd, n_vocab) = (t.dims[0] as usize, t.dims[1] as usize);
        let bytes_per_row = row_bytes(t.ggml_type, n_embd)?;
        let raw = idx.read_tensor_bytes(&t, bytes_per_row * n_vocab)?;
        let mut w = Vec::with_capacity(n_embd * n_vocab);
        for row in raw.chunks_exact(bytes_per_row) {
            w.extend(llama::dequantize(t.ggml_type, row, n_embd)?);
        }
        let w = Array2::from_shape_vec((n_vocab, n_embd), w)
            .map_err(|e| Error::Corrupt(e.to_string()))?;
        let digits = idx.tokens.iter().map(|p| is_digit_piece(p)).collect();
        Ok(OutputHead {
            w,
            act_type: llama::vec_dot_type(t.ggml_type),
            tensor: t.name,
            weight_type: t.ggml_type,
            path: path.into(),
            digits,
        })
    }

    /// Whether token `id` only writes digits (false for ids the GGUF's vocabulary lacks).
    pub fn is_digit_token(&self, id: usize) -> bool {
        self.digits.get(id).copied().unwrap_or(false)
    }

    /// Width of the hidden state.
    pub fn n_embd(&self) -> usize {
        self.w.ncols()
    }

    /// Vocabulary size.
    pub fn n_vocab(&self) -> usize {
        self.w.nrows()
    }

    /// The dequantised weight, `[n_vocab, n_embd]`.
    pub fn weight(&self) -> ArrayView2<'_, f32> {
        self.w.view()
    }

    /// Rounds hidden states (`[T, n_embd]`) the way the CPU backend does before the matmul.
    ///
    /// # Errors
    /// [`Error::Invalid`] on a width mismatch.
    pub fn quantize_hidden(&self, h: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
        if h.ncols() != self.n_embd() {
            return Err(Error::Invalid(format!(
                "hidden width {} != model width {}",
                h.ncols(),
                self.n_embd()
            )));
        }
        let mut out = Array2::zeros(h.raw_dim());
        for (src, mut dst) in h.rows().into_iter().zip(out.rows_mut()) {
            let row: Vec<f32> = src.iter().copied().collect();
            let q = llama::round_through(self.act_type, &row)?;
            dst.iter_mut().zip(q).for_each(|(d, v)| *d = v);
        }
        Ok(out)
    }

    /// Base-model logits for hidden states `h` (`[T, n_embd]` → `[T, n_vocab]`).
    ///
    /// # Errors
    /// [`Error::Invalid`] on a width mismatch.
    pub fn base_logits(&self, h: ArrayView2<'_, f32>) -> Result<Array2<f32>> {
        let hq = self.quantize_hidden(h)?;
        Ok(hq.dot(&self.w.t()))
    }
}

/// Bytes of one row of `n` values of ggml type `ty`.
fn row_bytes(ty: u32, n: usize) -> Result<usize> {
    llama::row_size(ty, n)
}

#[cfg(test)]
mod tests {
    use super::is_digit_piece;

    #[test]
    fn digit_pieces_with_and_without_space_markers() {
        for p in ["7", "42", "Ġ3", "▁9", " 12"] {
            assert!(is_digit_piece(p), "{p}");
        }
        for p in ["", "Ġ", "x1", "1.5", "ACTION", "Ġorder", "١"] {
            assert!(!is_digit_piece(p), "{p}");
        }
    }
}
