//! A minimal GGUF reader: validates a model file before llama.cpp sees it, and reads the output
//! projection so that [`crate::policy::OutputHead`] can recompute logits without llama.cpp.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// One tensor's entry in the GGUF index.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    /// tensor name, e.g. `token_embd.weight`
    pub name: String,
    /// dimensions, innermost first (ggml order)
    pub dims: Vec<u64>,
    /// ggml type id
    pub ggml_type: u32,
    /// byte offset from the start of the data section
    pub offset: u64,
}

/// The parts of a GGUF file's header Turnwise needs.
#[derive(Debug, Clone)]
pub struct GgufIndex {
    /// the file
    pub path: PathBuf,
    /// `general.architecture`
    pub architecture: Option<String>,
    /// `general.name`
    pub name: Option<String>,
    /// tensor index
    pub tensors: Vec<TensorInfo>,
    /// `tokenizer.ggml.tokens`: each token id's piece (empty when the file has none)
    pub tokens: Vec<String>,
    /// absolute offset of the data section
    pub data_start: u64,
    /// every scalar metadata value (numbers, booleans and strings) as text, by key
    pub meta: std::collections::HashMap<String, String>,
    /// GGUF version (2 or 3)
    pub version: u32,
    /// number of metadata pairs
    pub n_kv: u64,
    /// absolute offset where the metadata pairs end (they start at byte 24)
    pub kv_end: u64,
    /// `general.alignment` (32 when absent)
    pub alignment: u64,
}

const MAX_STRING: u64 = 1 << 26;
const MAX_COUNT: u64 = 1 << 32;

struct Reader<R> {
    r: R,
    path: PathBuf,
}

impl<R: Read> Reader<R> {
    fn bad(&self, reason: impl Into<String>) -> Error {
        Error::BadModel {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }
    fn bytes<const N: usize>(&mut self) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.r
            .read_exact(&mut b)
            .map_err(|_| self.bad("truncated GGUF header"))?;
        Ok(b)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.bytes()?))
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > MAX_STRING {
            return Err(self.bad(format!("string of {n} bytes in header")));
        }
        let mut b = vec![0u8; n as usize];
        self.r
            .read_exact(&mut b)
            .map_err(|_| self.bad("truncated GGUF header"))?;
        String::from_utf8(b).map_err(|_| self.bad("header string is not UTF-8"))
    }
    /// Reads an array value whose type tag has been read: its strings when it is an array of
    /// strings, else nothing (the values are skipped).
    fn strings(&mut self) -> Result<Vec<String>> {
        let inner = self.u32()?;
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(self.bad("array too long"));
        }
        let mut out = Vec::new();
        for _ in 0..n {
            if inner == 8 {
                out.push(self.string()?);
            } else {
                self.value(inner)?;
            }
        }
        Ok(out)
    }
    /// Reads a value of GGUF type `ty`, returning it as a string when it is one.
    fn value(&mut self, ty: u32) -> Result<Option<String>> {
        let fixed = match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            10..=12 => 8,
            8 => return self.string().map(Some),
            9 => {
                let inner = self.u32()?;
                let n = self.u64()?;
                if n > MAX_COUNT {
                    return Err(self.bad("array too long"));
                }
                for _ in 0..n {
                    self.value(inner)?;
                }
                return Ok(None);
            }
            other => return Err(self.bad(format!("unknown metadata type {other}"))),
        };
        let mut b = [0u8; 8];
        self.r
            .read_exact(&mut b[..fixed])
            .map_err(|_| self.bad("truncated GGUF header"))?;
        let [b0, b1, b2, b3, ..] = b;
        Ok(Some(match ty {
            0 => b0.to_string(),
            1 => (b0 as i8).to_string(),
            2 => u16::from_le_bytes([b0, b1]).to_string(),
            3 => i16::from_le_bytes([b0, b1]).to_string(),
            4 => u32::from_le_bytes([b0, b1, b2, b3]).to_string(),
            5 => i32::from_le_bytes([b0, b1, b2, b3]).to_string(),
            6 => f32::from_le_bytes([b0, b1, b2, b3]).to_string(),
            7 => (b0 != 0).to_string(),
            10 => u64::from_le_bytes(b).to_string(),
            11 => i64::from_le_bytes(b).to_string(),
            _ => f64::from_le_bytes(b).to_string(),
        }))
    }
}

impl GgufIndex {
    /// Reads and validates the header and tensor index of a GGUF file.
    ///
    /// # Errors
    /// [`Error::BadModel`] when the file is missing, not GGUF, or truncated.
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| Error::BadModel {
            path: path.into(),
            reason: e.to_string(),
        })?;
        let mut rd = Reader {
            r: BufReader::new(f),
            path: path.into(),
        };
        let magic: [u8; 4] = rd
            .bytes()
            .map_err(|_| rd.bad("file is too short to be a GGUF model"))?;
        if &magic != b"GGUF" {
            return Err(rd.bad("not a GGUF model (the file does not start with the GGUF magic)"));
        }
        let version = rd.u32()?;
        if !(2..=3).contains(&version) {
            return Err(rd.bad(format!("unsupported GGUF version {version}")));
        }
        let n_tensors = rd.u64()?;
        let n_kv = rd.u64()?;
        if n_tensors > MAX_COUNT || n_kv > MAX_COUNT {
            return Err(rd.bad("implausible tensor or metadata count"));
        }
        let (mut architecture, mut name, mut alignment) = (None, None, 32u64);
        let mut tokens = Vec::new();
        let mut meta = std::collections::HashMap::new();
        for _ in 0..n_kv {
            let key = rd.string()?;
            let ty = rd.u32()?;
            if key == "tokenizer.ggml.tokens" && ty == 9 {
                tokens = rd.strings()?;
                continue;
            }
            let v = rd.value(ty)?;
            if let Some(v) = &v {
                meta.insert(key.clone(), v.clone());
            }
            match key.as_str() {
                "general.architecture" => architecture = v,
                "general.name" => name = v,
                "general.alignment" => {
                    alignment = v.and_then(|s| s.parse().ok()).unwrap_or(32).max(1);
                }
                _ => {}
            }
        }
        let kv_end = rd.r.stream_position().map_err(|e| Error::io(path, e))?;
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        for _ in 0..n_tensors {
            let tname = rd.string()?;
            let nd = rd.u32()?;
            if nd > 4 {
                return Err(rd.bad(format!("tensor {tname} has {nd} dimensions")));
            }
            let dims = (0..nd).map(|_| rd.u64()).collect::<Result<Vec<_>>>()?;
            let ggml_type = rd.u32()?;
            let offset = rd.u64()?;
            tensors.push(TensorInfo {
                name: tname,
                dims,
                ggml_type,
                offset,
            });
        }
        let pos = rd.r.stream_position().map_err(|e| Error::io(path, e))?;
        let data_start = pos.div_ceil(alignment) * alignment;
        if tensors.is_empty() {
            return Err(rd.bad("GGUF file holds no tensors (a vocabulary-only file?)"));
        }
        Ok(GgufIndex {
            path: path.into(),
            architecture,
            name,
            tensors,
            tokens,
            data_start,
            meta,
            version,
            n_kv,
            kv_end,
            alignment,
        })
    }

    /// A numeric metadata value.
    ///
    /// # Errors
    /// [`Error::BadModel`] naming the key when it is missing or not a number.
    pub fn meta_f64(&self, key: &str) -> Result<f64> {
        self.meta
            .get(key)
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| Error::BadModel {
                path: self.path.clone(),
                reason: format!("metadata {key} is missing or not a number"),
            })
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The output projection: `output.weight`, or `token_embd.weight` when the model ties them.
    ///
    /// # Errors
    /// [`Error::BadModel`] when the model has neither.
    pub fn output_tensor(&self) -> Result<&TensorInfo> {
        self.tensor("output.weight")
            .or_else(|| self.tensor("token_embd.weight"))
            .ok_or_else(|| Error::BadModel {
                path: self.path.clone(),
                reason: "no output.weight or token_embd.weight tensor".into(),
            })
    }

    /// Reads `len` raw bytes of a tensor's data.
    ///
    /// # Errors
    /// [`Error::BadModel`] when the file is shorter than its index says.
    pub fn read_tensor_bytes(&self, t: &TensorInfo, len: usize) -> Result<Vec<u8>> {
        let mut f = File::open(&self.path).map_err(|e| Error::io(&self.path, e))?;
        f.seek(SeekFrom::Start(self.data_start + t.offset))
            .map_err(|e| Error::io(&self.path, e))?;
        let mut buf = vec![0u8; len];
        f.read_exact(&mut buf).map_err(|_| Error::BadModel {
            path: self.path.clone(),
            reason: format!("tensor {} is truncated", t.name),
        })?;
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_non_gguf_and_truncated_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.gguf");
        std::fs::write(&p, b"PK\x03\x04 this is a zip").unwrap();
        let e = GgufIndex::open(&p).unwrap_err().to_string();
        assert!(e.contains("not a GGUF model"), "{e}");
        std::fs::write(&p, b"GGUF\x03\x00\x00\x00\x01").unwrap();
        let e = GgufIndex::open(&p).unwrap_err().to_string();
        assert!(e.contains("truncated"), "{e}");
        let e = GgufIndex::open(&dir.path().join("missing.gguf"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("bad model file"), "{e}");
    }

    #[test]
    fn reads_a_hand_written_index() {
        let mut b = Vec::new();
        b.extend_from_slice(b"GGUF");
        b.extend_from_slice(&3u32.to_le_bytes());
        b.extend_from_slice(&1u64.to_le_bytes()); // tensors
        b.extend_from_slice(&1u64.to_le_bytes()); // kv
        let key = b"general.architecture";
        b.extend_from_slice(&(key.len() as u64).to_le_bytes());
        b.extend_from_slice(key);
        b.extend_from_slice(&8u32.to_le_bytes());
        b.extend_from_slice(&5u64.to_le_bytes());
        b.extend_from_slice(b"llama");
        let tn = b"w";
        b.extend_from_slice(&(tn.len() as u64).to_le_bytes());
        b.extend_from_slice(tn);
        b.extend_from_slice(&2u32.to_le_bytes());
        b.extend_from_slice(&4u64.to_le_bytes());
        b.extend_from_slice(&2u64.to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes()); // f32
        b.extend_from_slice(&0u64.to_le_bytes());
        while b.len() % 32 != 0 {
            b.push(0);
        }
        for i in 0..8 {
            b.extend_from_slice(&(i as f32).to_le_bytes());
        }
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.gguf");
        std::fs::write(&p, &b).unwrap();
        let idx = GgufIndex::open(&p).unwrap();
        assert_eq!(idx.architecture.as_deref(), Some("llama"));
        let t = idx.tensor("w").unwrap();
        assert_eq!(t.dims, vec![4, 2]);
        let raw = idx.read_tensor_bytes(t, 32).unwrap();
        assert_eq!(
            f32::from_le_bytes([raw[28], raw[29], raw[30], raw[31]]),
            7.0
        );
    }
}
