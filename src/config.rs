//! Resolved configuration: where the database and the cache live, and documented defaults.
//! Flags win over environment variables, which win over the defaults here.

use std::path::PathBuf;

/// Default database: `TURNWISE_DB`, else `<data dir>/turnwise/turnwise.db`
/// (`~/.local/share/turnwise/turnwise.db` on Linux).
pub fn default_db() -> PathBuf {
    std::env::var_os("TURNWISE_DB")
        .map(PathBuf::from)
        .or_else(|| dirs::data_dir().map(|d| d.join("turnwise").join("turnwise.db")))
        .unwrap_or_else(|| PathBuf::from("turnwise.db"))
}

/// Default feature retention: features of sessions older than this many days that an update
/// has learned from are dropped by `turnwise gc`.
pub const FEATURE_RETENTION_DAYS: f64 = 30.0;

/// Default context window of the engine, in tokens.
pub const DEFAULT_CTX: u32 = 2048;

/// Default number of CPU threads for llama.cpp.
pub const DEFAULT_THREADS: i32 = 2;
