//! Shared helpers: the real default model (fetched once), one shared engine, temp databases,
//! and running the real binary with its output shown when an assertion fails.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use turnwise::policy::OutputHead;
use turnwise::{assets, Engine, EngineConfig};

/// The default model, provisioned on first use (downloads from PyPI in CI).
pub fn model_path() -> PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| assets::resolve_model(None, true).expect("default model"))
        .clone()
}

/// One engine for the whole test binary (2 threads, 2048-token context).
pub fn engine() -> &'static Engine {
    static E: OnceLock<Engine> = OnceLock::new();
    E.get_or_init(|| Engine::start(EngineConfig::new(model_path())).expect("engine"))
}

/// An engine of its own (a fresh cache history), for tests that must not share one.
pub fn fresh_engine() -> Engine {
    Engine::start(EngineConfig::new(model_path())).expect("engine")
}

/// The dequantised output projection of the default model.
pub fn head() -> &'static OutputHead {
    static H: OnceLock<OutputHead> = OnceLock::new();
    H.get_or_init(|| OutputHead::from_gguf(&model_path()).expect("output head"))
}

/// A session key no other test uses.
pub fn session_key() -> u64 {
    static K: AtomicU64 = AtomicU64::new(1 << 40);
    K.fetch_add(1, Ordering::Relaxed)
}

/// A fresh temporary directory.
pub fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().expect("tempdir")
}

/// The `turnwise` binary with a database in `dir` and the cached model.
pub fn turnwise(db: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_turnwise"));
    c.env("TURNWISE_DB", db).env("TURNWISE_MODEL", model_path());
    c
}

/// Describes a finished command for assertion messages.
pub fn show(o: &Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}\n--- stderr\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}
