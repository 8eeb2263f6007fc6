//! Folding the output-projection LoRA into a copy of the model file, so that llama.cpp (and
//! everything built on it: `llama-server`, Ollama) serves the policy Turnwise served.
//!
//! A GGUF LoRA cannot carry the output LoRA of a model that ties its output projection to the
//! token embeddings (SmolLM2 and most small models): llama.cpp has no `output.weight` tensor to
//! attach it to, and a LoRA on `token_embd.weight` would change the input embeddings too. The
//! merged file is the model as it was, tensor for tensor and byte for byte, plus an untied
//! `output.weight = W + (α/r)·B·A` in f16 (or that tensor replaced, when the model has its own).
//! llama.cpp uses `output.weight` whenever a file has one. A block LoRA stays a separate GGUF
//! LoRA to load on top (`--lora`).

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::Adapter;
use crate::error::{Error, Result};
use crate::policy::gguf::{GgufIndex, TensorInfo};
use crate::policy::{llama, OutputHead};

/// ggml's type id of f16.
const GGML_TYPE_F16: u32 = 1;
/// The metadata key that records what was folded into a merged file.
pub const MERGED_KEY: &str = "turnwise.merged_adapter";

/// What [`write_merged_model`] wrote.
#[derive(Debug, Clone)]
pub struct Merged {
    /// the new model file
    pub path: PathBuf,
    /// the model had its own `output.weight`, which was replaced (otherwise one was added)
    pub replaced: bool,
    /// largest `|(α/r)·B·A|` entry folded in (0: the output LoRA was fresh)
    pub max_delta: f32,
    /// largest `|merged − (W + ΔW)|` entry: the f16 rounding of the new tensor
    pub max_rounding: f32,
    /// file size in bytes
    pub bytes: u64,
}

fn nbytes(t: &TensorInfo) -> Result<u64> {
    let first = *t.dims.first().unwrap_or(&1);
    let rows: u64 = t.dims.iter().skip(1).product();
    Ok(llama::row_size(t.ggml_type, first as usize)? as u64 * rows)
}

fn put_str(w: &mut impl Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

fn pad(w: &mut impl Write, written: u64, align: u64) -> std::io::Result<u64> {
    let target = written.div_ceil(align) * align;
    w.write_all(&vec![0u8; (target - written) as usize])?;
    Ok(target)
}

/// Writes `out`: `model` with the adapter's output LoRA folded into an f16 `output.weight` and
/// `provenance` recorded under [`MERGED_KEY`]. Written to a temporary file and renamed, so `out`
/// is either the old file or the whole new one. The adapter's block LoRA is not part of it.
///
/// # Errors
/// [`Error::BadModel`] for a model that is not GGUF or has no output projection; an adapter of
/// another shape; I/O errors.
pub fn write_merged_model(
    model: &Path,
    adapter: &Adapter,
    out: &Path,
    provenance: &str,
) -> Result<Merged> {
    let idx = GgufIndex::open(model)?;
    let head = OutputHead::from_gguf(model)?;
    adapter.check_model(head.n_embd(), head.n_vocab())?;
    let delta = adapter.b.dot(&adapter.a) * adapter.scale();
    let max_delta = delta.iter().fold(0f32, |m, x| m.max(x.abs()));
    let merged = &head.weight() + &delta;
    drop(delta); // 113 MB for the default model, not needed past here
    let (n_vocab, n_embd) = merged.dim();
    let mut data16 = Vec::with_capacity(n_vocab * n_embd * 2);
    let mut max_rounding = 0f32;
    for &x in merged.iter() {
        let h = half::f16::from_f32(x);
        max_rounding = max_rounding.max((h.to_f32() - x).abs());
        data16.extend_from_slice(&h.to_le_bytes());
    }
    let new_info = TensorInfo {
        name: "output.weight".into(),
        dims: vec![n_embd as u64, n_vocab as u64],
        ggml_type: GGML_TYPE_F16,
        offset: 0,
    };
    let replaced = idx.tensor("output.weight").is_some();
    // (info, where its bytes come from: None = the folded projection)
    let mut plan: Vec<(TensorInfo, Option<u64>)> = Vec::with_capacity(idx.tensors.len() + 1);
    for t in &idx.tensors {
        if t.name == "output.weight" {
            plan.push((new_info.clone(), None));
        } else {
            plan.push((t.clone(), Some(idx.data_start + t.offset)));
        }
    }
    if !replaced {
        plan.push((new_info, None));
    }
    let align = idx.alignment;
    let mut offset = 0u64;
    for (t, from) in plan.iter_mut() {
        t.offset = offset;
        let n = match from {
            None => data16.len() as u64,
            Some(_) => nbytes(t)?,
        };
        offset += n.div_ceil(align) * align;
    }

    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model.gguf".into());
    let tmp = out.with_file_name(format!(".{name}.{}.part", std::process::id()));
    let io = |e: std::io::Error| Error::io(out, e);
    let result = (|| -> Result<u64> {
        let mut src = File::open(model).map_err(|e| Error::io(model, e))?;
        let mut w = BufWriter::new(File::create(&tmp).map_err(|e| Error::io(&tmp, e))?);
        w.write_all(b"GGUF").map_err(io)?;
        w.write_all(&idx.version.to_le_bytes()).map_err(io)?;
        w.write_all(&(plan.len() as u64).to_le_bytes())
            .map_err(io)?;
        w.write_all(&(idx.n_kv + 1).to_le_bytes()).map_err(io)?;
        // the metadata pairs, verbatim
        src.seek(SeekFrom::Start(24))
            .map_err(|e| Error::io(model, e))?;
        let kv_len = idx.kv_end - 24;
        let copied = std::io::copy(&mut (&mut src).take(kv_len), &mut w).map_err(io)?;
        if copied != kv_len {
            return Err(Error::BadModel {
                path: model.into(),
                reason: "metadata is truncated".into(),
            });
        }
        put_str(&mut w, MERGED_KEY).map_err(io)?;
        w.write_all(&8u32.to_le_bytes()).map_err(io)?; // string
        put_str(&mut w, provenance).map_err(io)?;
        for (t, _) in &plan {
            put_str(&mut w, &t.name).map_err(io)?;
            w.write_all(&(t.dims.len() as u32).to_le_bytes())
                .map_err(io)?;
            for d in &t.dims {
                w.write_all(&d.to_le_bytes()).map_err(io)?;
            }
            w.write_all(&t.ggml_type.to_le_bytes()).map_err(io)?;
            w.write_all(&t.offset.to_le_bytes()).map_err(io)?;
        }
        let header = w.stream_position().map_err(io)?;
        let data_start = pad(&mut w, header, align).map_err(io)?;
        let mut at = 0u64;
        for (t, from) in &plan {
            debug_assert_eq!(at, t.offset);
            let n = match from {
                Some(pos) => {
                    let n = nbytes(t)?;
                    src.seek(SeekFrom::Start(*pos))
                        .map_err(|e| Error::io(model, e))?;
                    let c = std::io::copy(&mut (&mut src).take(n), &mut w).map_err(io)?;
                    if c != n {
                        return Err(Error::BadModel {
                            path: model.into(),
                            reason: format!("tensor {} is truncated", t.name),
                        });
                    }
                    n
                }
                None => {
                    w.write_all(&data16).map_err(io)?;
                    data16.len() as u64
                }
            };
            at = pad(&mut w, at + n, align).map_err(io)?;
        }
        let f = w.into_inner().map_err(|e| io(e.into_error()))?;
        f.sync_all().map_err(io)?;
        Ok(data_start + at)
    })();
    let bytes = match result {
        Ok(b) => b,
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
    };
    std::fs::rename(&tmp, out).map_err(io)?;
    Ok(Merged {
        path: out.into(),
        replaced,
        max_delta,
        max_rounding,
        bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::Array2;

    /// A two-tensor GGUF: `token_embd.weight` f32 `[n_embd 4, n_vocab 3]` (tied output) and a
    /// 5-value f32 tensor, with two metadata pairs.
    fn tiny_model(dir: &Path) -> PathBuf {
        let mut b = Vec::new();
        let s = |b: &mut Vec<u8>, x: &str| {
            b.extend_from_slice(&(x.len() as u64).to_le_bytes());
            b.extend_from_slice(x.as_bytes());
        };
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        s(&mut b, "general.architecture");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "llama");
        s(&mut b, "general.name");
        b.extend_from_slice(&8u32.to_le_bytes());
        s(&mut b, "tiny");
        s(&mut b, "token_embd.weight");
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&3u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        s(&mut b, "extra");
        b.extend_from_slice(&1u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&64u64.to_le_bytes()); // 48 bytes padded to 64
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for i in 0..12 {
            b.extend_from_slice(&(i as f32 * 0.5).to_le_bytes());
        }
        b.extend_from_slice(&[0u8; 16]);
        for i in 0..5 {
            b.extend_from_slice(&(100.0 + i as f32).to_le_bytes());
        }
        let p = dir.join("tiny.gguf");
        std::fs::write(&p, &b).unwrap();
        p
    }

    #[test]
    fn the_folded_projection_is_w_plus_the_scaled_low_rank_term_by_hand() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(dir.path());
        let mut ad = Adapter::fresh(4, 3, 1, 2.0, 1, "tiny"); // scale 2
        ad.a = Array2::from_shape_vec((1, 4), vec![1.0, 0.0, -1.0, 0.5]).unwrap();
        ad.b = Array2::from_shape_vec((3, 1), vec![0.25, 0.0, -1.0]).unwrap();
        let out = dir.path().join("merged.gguf");
        let m = write_merged_model(&model, &ad, &out, "adapter 7").unwrap();
        assert!(!m.replaced);
        // ΔW[v][j] = 2·B[v]·A[j]: row 0 = 0.5·A, row 1 = 0, row 2 = −2·A
        let want: [[f32; 4]; 3] = [
            [0.0 + 0.5, 0.5, 1.0 - 0.5, 1.5 + 0.25],
            [2.0, 2.5, 3.0, 3.5],
            [4.0 - 2.0, 4.5, 5.0 + 2.0, 5.5 - 1.0],
        ];
        assert_eq!(m.max_delta, 2.0);
        let idx = GgufIndex::open(&out).unwrap();
        assert_eq!(
            idx.meta.get(MERGED_KEY).map(String::as_str),
            Some("adapter 7")
        );
        assert_eq!(
            idx.meta.get("general.name").map(String::as_str),
            Some("tiny")
        );
        assert_eq!(idx.tensors.len(), 3);
        let o = idx.tensor("output.weight").unwrap();
        assert_eq!((o.dims.clone(), o.ggml_type), (vec![4, 3], GGML_TYPE_F16));
        let raw = idx.read_tensor_bytes(o, 24).unwrap();
        let got: Vec<f32> = raw
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        assert_eq!(got, want.concat(), "these values are exact in f16");
        // the other tensors are byte for byte the model's
        let src = GgufIndex::open(&model).unwrap();
        for name in ["token_embd.weight", "extra"] {
            let (a, b) = (src.tensor(name).unwrap(), idx.tensor(name).unwrap());
            let n = nbytes(a).unwrap() as usize;
            assert_eq!(
                src.read_tensor_bytes(a, n).unwrap(),
                idx.read_tensor_bytes(b, n).unwrap()
            );
        }
        // offsets are contiguous and aligned, as ggml's reader requires
        let offsets: Vec<u64> = idx.tensors.iter().map(|t| t.offset).collect();
        assert_eq!(offsets, vec![0, 64, 96]);
        assert_eq!(idx.data_start % 32, 0);
        assert_eq!(
            std::fs::metadata(&out).unwrap().len(),
            idx.data_start + 96 + 32
        );
        assert_eq!(m.bytes, idx.data_start + 128);

        // merging again onto the merged file replaces its output.weight instead of adding one
        let again = dir.path().join("again.gguf");
        let m2 = write_merged_model(&out, &ad, &again, "twice").unwrap();
        assert!(m2.replaced);
        let idx2 = GgufIndex::open(&again).unwrap();
        assert_eq!(idx2.tensors.len(), 3);
        let raw2 = idx2
            .read_tensor_bytes(idx2.tensor("output.weight").unwrap(), 24)
            .unwrap();
        let got2: Vec<f32> = raw2
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect();
        // folded onto the already-folded projection: W + 2ΔW
        assert_eq!(got2[0], 0.0 + 2.0 * 0.5);
        assert_eq!(got2[11], 5.5 - 2.0);
    }

    #[test]
    fn a_wrong_shape_or_a_broken_model_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let model = tiny_model(dir.path());
        let out = dir.path().join("m.gguf");
        let ad = Adapter::fresh(5, 3, 1, 2.0, 1, "other");
        assert!(write_merged_model(&model, &ad, &out, "x").is_err());
        let bad = dir.path().join("bad.gguf");
        std::fs::write(&bad, b"GGUF\x03\x00\x00\x00").unwrap();
        let ad = Adapter::fresh(4, 3, 1, 2.0, 1, "tiny");
        assert!(write_merged_model(&bad, &ad, &out, "x").is_err());
        // a model whose data ends early
        let full = std::fs::read(&model).unwrap();
        std::fs::write(&bad, &full[..full.len() - 8]).unwrap();
        let e = write_merged_model(&bad, &ad, &out, "x").unwrap_err();
        assert!(e.to_string().contains("truncated"), "{e}");
        assert!(!out.exists());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().ends_with(".part"))
            .collect();
        assert!(left.is_empty(), "a temporary file was left behind");
    }
}
