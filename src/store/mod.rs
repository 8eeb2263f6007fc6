//! The turn log: every session, turn, sampled token and feature, in one SQLite file.
//!
//! All SQL of Turnwise lives in this module. The schema comes from the numbered files in
//! `migrations/`, applied on open (tracked by `PRAGMA user_version`); the database runs in WAL
//! mode with `synchronous = FULL`, and each logical write (a session's new turns, an import) is
//! one transaction, so a turn that was acknowledged survives a crash the next instant.

mod adapters;
pub use adapters::{CandidateCommit, UpdateRecord};
mod annotations;
mod blob;
mod experience;
pub use experience::{ExperienceEntry, ExperienceRow, ExperienceWriter};
mod features;
mod sessions;

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

pub use blob::{
    f16_blob, f32_blob, from_f16_blob, from_f32_blob, from_i32_blob, from_q8_0_blob, i32_blob,
    q8_0_blob,
};

use crate::error::{Error, Result};
pub use crate::policy::blocks::BlockFeatures;
use crate::policy::sampler::Support;
use crate::policy::{FeatureDtype, Role, SamplerParams};

/// How long a connection waits for another's write lock before `database is locked`.
const BUSY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The migrations, in order. Each is applied once, in its own transaction.
pub const MIGRATIONS: &[(&str, &str)] = &[
    (
        "0001_init.sql",
        include_str!("../../migrations/0001_init.sql"),
    ),
    (
        "0002_updates_metrics.sql",
        include_str!("../../migrations/0002_updates_metrics.sql"),
    ),
    (
        "0003_adapter_activation.sql",
        include_str!("../../migrations/0003_adapter_activation.sql"),
    ),
    (
        "0004_turn_credit.sql",
        include_str!("../../migrations/0004_turn_credit.sql"),
    ),
    (
        "0005_opening_clusters.sql",
        include_str!("../../migrations/0005_opening_clusters.sql"),
    ),
    (
        "0006_experience.sql",
        include_str!("../../migrations/0006_experience.sql"),
    ),
    (
        "0007_token_support.sql",
        include_str!("../../migrations/0007_token_support.sql"),
    ),
    (
        "0008_block_features.sql",
        include_str!("../../migrations/0008_block_features.sql"),
    ),
    (
        "0009_policy_model.sql",
        include_str!("../../migrations/0009_policy_model.sql"),
    ),
    (
        "0010_client_session_index.sql",
        include_str!("../../migrations/0010_client_session_index.sql"),
    ),
    (
        "0011_held_out.sql",
        include_str!("../../migrations/0011_held_out.sql"),
    ),
];

/// A closed set of names stored as text: `as_str`, parsing, `Display`, SQLite and serde
/// conversions, so that a misspelt status or kind is a compile error, not a silent new value.
macro_rules! text_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident = $s:literal),+ $(,)? }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        pub enum $name {
            $($(#[$vm])* #[serde(rename = $s)] $v),+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$v),+];

            /// The stored name.
            pub fn as_str(self) -> &'static str {
                match self { $($name::$v => $s),+ }
            }
        }

        impl std::str::FromStr for $name {
            type Err = Error;

            fn from_str(s: &str) -> Result<Self> {
                match s {
                    $($s => Ok($name::$v),)+
                    other => Err(Error::Invalid(format!(
                        concat!("unknown ", stringify!($name), " {:?} (one of: {})"),
                        other,
                        [$($s),+].join(", ")
                    ))),
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.pad(self.as_str())
            }
        }

        impl rusqlite::ToSql for $name {
            fn to_sql(&self) -> rusqlite::Result<rusqlite::types::ToSqlOutput<'_>> {
                Ok(self.as_str().into())
            }
        }

        impl rusqlite::types::FromSql for $name {
            fn column_result(v: rusqlite::types::ValueRef<'_>) -> rusqlite::types::FromSqlResult<Self> {
                let s = v.as_str()?;
                s.parse().map_err(|e: Error| rusqlite::types::FromSqlError::Other(Box::new(e)))
            }
        }
    };
}

text_enum! {
    /// Where an adapter version stands.
    AdapterStatus {
        /// registered, its files being written (a crash leaves it so; rejected at start-up)
        Writing = "writing",
        /// fully written, not (yet) active
        Candidate = "candidate",
        /// the policy serves with it
        Active = "active",
        /// was active, replaced by another
        Retired = "retired",
        /// failed its gate or could not be written
        Rejected = "rejected",
    }
}

text_enum! {
    /// What an annotation of a turn measures.
    AnnotationKind {
        /// the value head's success estimate before the turn
        ValueBefore = "value_before",
        /// the value head's success estimate after the turn
        ValueAfter = "value_after",
        /// value after − value before (clamped success target at the final turn)
        SuccessContribution = "success_contribution",
        /// information gain of the ground truth from the turn
        InfoGain = "info_gain",
        /// the advantage the last update gave the turn
        Advantage = "advantage",
    }
}

text_enum! {
    /// What a feedback row says.
    FeedbackKind {
        /// thumbs up (1) or down (0) on a turn
        Thumb = "thumb",
        /// the session's outcome reward (also stored on the session)
        Outcome = "outcome",
        /// free text
        Note = "note",
    }
}

text_enum! {
    /// How an update ended.
    UpdateStatus {
        /// a candidate adapter was written
        Ok = "ok",
        /// stopped (non-finite loss or gradient); no adapter
        Rejected = "rejected",
    }
}

/// One row of the `turn_credit` view.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnCredit {
    /// index of the turn in its session
    pub turn_idx: i64,
    /// the first 60 characters
    pub snippet: String,
    /// V(s_t)
    pub value_before: Option<f64>,
    /// V(s_{t+1}), or the outcome after the last turn
    pub value_after: Option<f64>,
    /// success contribution
    pub contribution: Option<f64>,
    /// information gain
    pub info_gain: Option<f64>,
    /// the advantage of the last update that used the turn
    pub advantage: Option<f64>,
}

/// One annotation to write.
#[derive(Debug, Clone, PartialEq)]
pub struct NewAnnotation {
    /// the turn
    pub turn_id: i64,
    /// what the value measures
    pub kind: AnnotationKind,
    /// the value
    pub value: f64,
    /// what produced it (`value-head:<adapter id>`, `policy-frozen`, `update:<id>`)
    pub producer: String,
}

/// A registered adapter version.
#[derive(Debug, Clone, Serialize)]
pub struct AdapterRecord {
    /// id (also its directory name)
    pub id: i64,
    /// the adapter it was trained from
    pub parent_id: Option<i64>,
    /// creation time
    pub created_at: String,
    /// directory
    pub path: String,
    /// where it stands
    pub status: AdapterStatus,
    /// metrics JSON
    pub metrics: serde_json::Value,
    /// last activation time
    pub activated_at: Option<String>,
    /// the model file the policy ran on when it was made (JSON), if recorded
    pub model: Option<serde_json::Value>,
}

/// Where a session came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// the HTTP server
    Live,
    /// `turnwise chat`
    Chat,
    /// `turnwise import`
    Import,
    /// `turnwise demo`
    Demo,
}

impl Source {
    /// The name stored in `sessions.source`.
    pub fn as_str(self) -> &'static str {
        match self {
            Source::Live => "live",
            Source::Chat => "chat",
            Source::Import => "import",
            Source::Demo => "demo",
        }
    }
}

/// How an assistant turn's log-probs were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Behavior {
    /// sampled here; log-probs and features are from the sampling pass
    Sampled,
    /// not sampled here (import); scored once in a prefill by the frozen policy
    Rescored,
}

impl Behavior {
    fn as_str(self) -> &'static str {
        match self {
            Behavior::Sampled => "sampled",
            Behavior::Rescored => "rescored",
        }
    }
    fn parse(s: &str) -> Option<Self> {
        match s {
            "sampled" => Some(Behavior::Sampled),
            "rescored" => Some(Behavior::Rescored),
            _ => None,
        }
    }
}

/// A session to create.
#[derive(Debug, Clone, PartialEq)]
pub struct NewSession {
    /// origin
    pub source: Source,
    /// comparable sessions share a key (scenario, prompt, cluster)
    pub group_key: Option<String>,
    /// ground-truth final answer
    pub reference: Option<String>,
    /// hash of the imported content (duplicates are refused)
    pub content_hash: Option<String>,
    /// free-form JSON
    pub metadata: serde_json::Value,
}

impl NewSession {
    /// A session of the given source with nothing else set.
    pub fn new(source: Source) -> Self {
        NewSession {
            source,
            group_key: None,
            reference: None,
            content_hash: None,
            metadata: serde_json::json!({}),
        }
    }
}

/// Per-token data of an assistant turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// log-prob under the distribution each token was sampled from
    pub logp_behavior: Vec<f32>,
    /// log-prob under the full softmax at temperature 1
    pub logp_full: Vec<f32>,
    /// per token, where the behaviour distribution had its mass; empty: the whole tempered
    /// softmax for every token
    pub support: Vec<Support>,
}

/// Hidden states of an assistant turn's sampling positions.
#[derive(Debug, Clone, PartialEq)]
pub struct Features {
    /// width of one state
    pub n_embd: usize,
    /// storage encoding
    pub dtype: FeatureDtype,
    /// `n_tokens × n_embd` values, row-major
    pub values: Vec<f32>,
}

impl Features {
    /// The stored bytes.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the values do not fit the encoding's blocks.
    pub fn encode(&self) -> Result<Vec<u8>> {
        match self.dtype {
            FeatureDtype::Q8_0 => q8_0_blob(&self.values),
            FeatureDtype::F16 => Ok(f16_blob(&self.values)),
            FeatureDtype::F32 => Ok(f32_blob(&self.values)),
        }
    }
    /// Decodes stored bytes.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for an unknown dtype or a bad length.
    pub fn decode(n_embd: usize, dtype: &str, b: &[u8]) -> Result<Self> {
        let dtype = FeatureDtype::parse(dtype)
            .ok_or_else(|| Error::Corrupt(format!("feature dtype {dtype}")))?;
        let values = match dtype {
            FeatureDtype::Q8_0 => from_q8_0_blob(b)?,
            FeatureDtype::F16 => from_f16_blob(b)?,
            FeatureDtype::F32 => from_f32_blob(b)?,
        };
        Ok(Features {
            n_embd,
            dtype,
            values,
        })
    }
}

/// A turn to append.
#[derive(Debug, Clone, PartialEq)]
pub struct NewTurn {
    /// author
    pub role: Role,
    /// text
    pub text: String,
    /// tokens this turn appended to the context
    pub token_ids: Vec<i32>,
    /// context length before the turn
    pub context_len: usize,
    /// sampler settings (assistant turns)
    pub sampler: Option<SamplerParams>,
    /// sampled or rescored (assistant turns)
    pub behavior: Option<Behavior>,
    /// why generation ended
    pub stop_reason: Option<String>,
    /// adapter that produced it
    pub adapter_id: Option<i64>,
    /// chat template
    pub template: Option<String>,
    /// the template was not append-only here
    pub retokenized: bool,
    /// wall time to produce it
    pub latency_ms: Option<f64>,
    /// per-token log-probs (assistant turns)
    pub logprobs: Option<TokenLogprobs>,
    /// hidden states of the sampling positions
    pub hidden: Option<Features>,
    /// block inputs of the positions this turn's generation covered (block-capture engines)
    pub block: Option<BlockFeatures>,
}

impl NewTurn {
    /// A turn with only text and tokens (system, user and tool messages).
    pub fn message(
        role: Role,
        text: impl Into<String>,
        token_ids: Vec<i32>,
        context_len: usize,
    ) -> Self {
        NewTurn {
            role,
            text: text.into(),
            token_ids,
            context_len,
            sampler: None,
            behavior: None,
            stop_reason: None,
            adapter_id: None,
            template: None,
            retokenized: false,
            latency_ms: None,
            logprobs: None,
            hidden: None,
            block: None,
        }
    }
}

/// A stored session.
#[derive(Debug, Clone, Serialize)]
pub struct SessionRecord {
    /// id
    pub id: i64,
    /// creation time (UTC, ISO 8601)
    pub created_at: String,
    /// end time
    pub ended_at: Option<String>,
    /// origin
    pub source: String,
    /// group key
    pub group_key: Option<String>,
    /// outcome reward
    pub outcome_reward: Option<f64>,
    /// ground truth
    pub reference: Option<String>,
    /// metadata JSON
    pub metadata: serde_json::Value,
    /// last time learned from
    pub learned_at: Option<String>,
}

/// A stored turn.
#[derive(Debug, Clone, Serialize)]
pub struct TurnRecord {
    /// id
    pub id: i64,
    /// session
    pub session_id: i64,
    /// index in the session
    pub idx: i64,
    /// author
    pub role: Role,
    /// text
    pub text: String,
    /// tokens appended
    pub token_ids: Vec<i32>,
    /// context length before the turn
    pub context_len: usize,
    /// sampler settings
    pub sampler: Option<SamplerParams>,
    /// sampled or rescored
    pub behavior: Option<Behavior>,
    /// why generation ended
    pub stop_reason: Option<String>,
    /// adapter
    pub adapter_id: Option<i64>,
    /// template
    pub template: Option<String>,
    /// re-tokenised flag
    pub retokenized: bool,
    /// latency
    pub latency_ms: Option<f64>,
    /// creation time
    pub created_at: String,
}

/// A feedback row.
#[derive(Debug, Clone, Serialize)]
pub struct FeedbackRecord {
    /// turn it concerns, if any
    pub turn_idx: Option<i64>,
    /// what it says
    pub kind: FeedbackKind,
    /// value
    pub value: Option<f64>,
    /// note
    pub note: Option<String>,
}

/// Storage used by the log.
#[derive(Debug, Clone, Serialize)]
pub struct StorageStats {
    /// sessions
    pub sessions: i64,
    /// turns
    pub turns: i64,
    /// assistant tokens with log-probs
    pub sampled_tokens: i64,
    /// assistant tokens that still have features
    pub tokens_with_features: i64,
    /// bytes of feature blobs
    pub feature_bytes: i64,
    /// positions with stored block inputs
    pub block_positions: i64,
    /// bytes of block-input blobs
    pub block_bytes: i64,
    /// bytes of token ids and log-prob blobs
    pub token_bytes: i64,
    /// size of the database file(s)
    pub file_bytes: i64,
}

impl StorageStats {
    /// Bytes per sampled token that still has features (features + ids + log-probs).
    pub fn bytes_per_featured_token(&self) -> f64 {
        if self.tokens_with_features == 0 {
            return 0.0;
        }
        self.feature_bytes as f64 / self.tokens_with_features as f64
            + self.token_bytes as f64 / self.sampled_tokens.max(1) as f64
    }
}

/// The SQLite turn log.
pub struct Store {
    conn: Connection,
    /// the policy's model file (JSON), written into every adapter and update row
    model: Option<String>,
}

const TURN_COLUMNS: &str =
    "id, session_id, idx, role, text, token_ids, context_len, sampler, behavior, \
     stop_reason, adapter_id, template, retokenized, latency_ms, created_at";
const SESSION_COLUMNS: &str =
    "id, created_at, ended_at, source, group_key, outcome_reward, reference, metadata, learned_at";

impl Store {
    /// Opens (creating if needed) the database at `path` and applies pending migrations.
    ///
    /// # Errors
    /// SQLite errors, or [`Error::Migration`].
    pub fn open(path: &Path) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        // Switching a new file to WAL needs an exclusive lock, and SQLite answers `database is
        // locked` without calling the busy handler where waiting could deadlock — as when
        // another connection opens the same new file at that moment. Opening is retried then,
        // for at most the busy timeout.
        let start = std::time::Instant::now();
        loop {
            let once = Connection::open(path)
                .map_err(Error::from)
                .and_then(|conn| {
                    conn.busy_timeout(BUSY_TIMEOUT)?;
                    conn.pragma_update(None, "journal_mode", "WAL")?;
                    Self::setup(conn)
                });
            match once {
                Err(Error::Sqlite(rusqlite::Error::SqliteFailure(e, _)))
                    if e.code == rusqlite::ErrorCode::DatabaseBusy
                        && start.elapsed() < BUSY_TIMEOUT =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                other => return other,
            }
        }
    }

    /// A private in-memory database (tests).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn in_memory() -> Result<Self> {
        Self::setup(Connection::open_in_memory()?)
    }

    fn setup(mut conn: Connection) -> Result<Self> {
        conn.pragma_update(None, "synchronous", "FULL")?;
        conn.pragma_update(None, "foreign_keys", "ON")?;
        conn.busy_timeout(BUSY_TIMEOUT)?;
        migrate(&mut conn)?;
        Ok(Store { conn, model: None })
    }

    /// The schema version (number of migrations applied).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn schema_version(&self) -> Result<i64> {
        Ok(self
            .conn
            .pragma_query_value(None, "user_version", |r| r.get(0))?)
    }

    /// A write transaction that takes SQLite's write lock when it begins (`BEGIN IMMEDIATE`), so
    /// that a second connection writing at the same time waits for it (the busy timeout) instead
    /// of failing with `database is locked` when a deferred transaction upgrades its read lock.
    fn write(&mut self) -> rusqlite::Result<rusqlite::Transaction<'_>> {
        self.conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
    }

    /// Names the model file the policy runs on (a JSON object such as
    /// [`crate::assets::ModelStamp`]): every adapter and update row written through this store
    /// records it.
    pub fn set_policy_model(&mut self, model: &serde_json::Value) {
        self.model = Some(model.to_string());
    }

    /// The underlying connection, for read-only ad-hoc queries in tests. The library's own SQL
    /// lives in this module's files, one per table family: `sessions` (sessions, turns, tokens,
    /// feedback), `annotations` (credit and opening clusters), `features`, `adapters` (adapters
    /// and updates) and `experience`.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

fn migrate(conn: &mut Connection) -> Result<()> {
    for (i, (name, sql)) in MIGRATIONS.iter().enumerate() {
        let version = i as i64 + 1;
        let fail = |e: rusqlite::Error| Error::Migration {
            version,
            name: (*name).to_string(),
            reason: e.to_string(),
        };
        // the version is read under the write lock: two processes opening a new database at
        // once apply each migration once
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(fail)?;
        let current: i64 = tx
            .pragma_query_value(None, "user_version", |r| r.get(0))
            .map_err(fail)?;
        if version <= current {
            continue;
        }
        tx.execute_batch(sql).map_err(fail)?;
        tx.pragma_update(None, "user_version", version)
            .map_err(fail)?;
        tx.commit().map_err(fail)?;
        tracing::debug!(version, name, "migration applied");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assistant(ids: Vec<i32>, ctx: usize) -> NewTurn {
        let n = ids.len();
        NewTurn {
            behavior: Some(Behavior::Sampled),
            sampler: Some(SamplerParams::default()),
            logprobs: Some(TokenLogprobs {
                logp_behavior: vec![-0.5; n],
                logp_full: vec![-0.75; n],
                support: Vec::new(),
            }),
            hidden: Some(Features {
                n_embd: 4,
                dtype: FeatureDtype::F16,
                values: (0..n * 4).map(|i| i as f32 * 0.25).collect(),
            }),
            ..NewTurn::message(Role::Assistant, "ok", ids, ctx)
        }
    }

    #[test]
    fn turns_round_trip_with_logprobs_and_features() {
        let mut s = Store::in_memory().unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let sid = s.create_session(&NewSession::new(Source::Chat)).unwrap();
        let ids = s
            .append_turns(
                sid,
                &[
                    NewTurn::message(Role::User, "hi", vec![1, 2, 3], 0),
                    assistant(vec![7, 8], 3),
                ],
            )
            .unwrap();
        let turns = s.turns(sid).unwrap();
        assert_eq!(turns.len(), 2);
        assert_eq!(turns[0].token_ids, vec![1, 2, 3]);
        assert_eq!(turns[1].idx, 1);
        assert_eq!(turns[1].behavior, Some(Behavior::Sampled));
        let lp = s.token_logprobs(ids[1]).unwrap().unwrap();
        assert_eq!(lp.logp_full, vec![-0.75, -0.75]);
        let f = s.features(ids[1]).unwrap().unwrap();
        assert_eq!(f.n_embd, 4);
        assert_eq!(f.values[5], 1.25);
        // a second exchange continues the index
        s.append_turns(sid, &[NewTurn::message(Role::User, "more", vec![4], 5)])
            .unwrap();
        assert_eq!(s.turns(sid).unwrap()[2].idx, 2);
        let st = s.storage_stats().unwrap();
        assert_eq!((st.sampled_tokens, st.tokens_with_features), (2, 2));
        assert_eq!(st.feature_bytes, 2 * 4 * 2);
    }

    /// Two connections (the demo's engines log side by side) open a new file at once and append
    /// turns concurrently: every write waits for the other's lock instead of failing with
    /// `database is locked`, and the migrations run once.
    /// Looking a live session up by the client's id reads the index, not every session's JSON:
    /// the query plan names the index, and with 20 000 logged sessions the newest session of an
    /// id (and none for an unknown id) is found.
    #[test]
    fn sessions_are_found_by_client_id_through_the_index() {
        let mut s = Store::in_memory().unwrap();
        let tx = s.write().unwrap();
        for i in 0..20_000 {
            tx.execute(
                "INSERT INTO sessions (source, metadata) VALUES ('live', ?1)",
                [
                    serde_json::json!({"client_session_id": format!("c{}", i % 10_000)})
                        .to_string(),
                ],
            )
            .unwrap();
        }
        tx.execute("INSERT INTO sessions (source) VALUES ('chat')", [])
            .unwrap();
        tx.commit().unwrap();
        let plan: Vec<String> = s
            .conn
            .prepare(
                "EXPLAIN QUERY PLAN SELECT id FROM sessions WHERE client_session_id = ?1 AND source = 'live'
                 AND (?2 = 0 OR ended_at IS NULL) ORDER BY id DESC LIMIT 1",
            )
            .unwrap()
            .query_map(params!["c1", false], |r| r.get::<_, String>(3))
            .unwrap()
            .collect::<rusqlite::Result<_>>()
            .unwrap();
        assert!(
            plan.iter()
                .any(|l| l.contains("USING INDEX sessions_client")),
            "{plan:?}"
        );
        // c7 was written twice: ids 8 and 10 008 (rowids from 1)
        assert_eq!(s.session_of_client("c7", false).unwrap(), Some(10_008));
        assert_eq!(s.session_of_client("nobody", false).unwrap(), None);
        s.conn
            .execute("UPDATE sessions SET ended_at = 'x' WHERE id = 10008", [])
            .unwrap();
        assert_eq!(s.session_of_client("c7", true).unwrap(), Some(8));
    }

    #[test]
    fn two_connections_write_one_file_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let write = |_| {
            let mut s = Store::open(&path).unwrap();
            for k in 0..25 {
                let sid = s.create_session(&NewSession::new(Source::Demo)).unwrap();
                s.append_turns(sid, &[NewTurn::message(Role::User, "hi", vec![k], 0)])
                    .unwrap();
                s.append_turns(sid, &[assistant(vec![7, 8], 1)]).unwrap();
                s.add_feedback(sid, None, FeedbackKind::Outcome, Some(1.0), None)
                    .unwrap();
            }
        };
        std::thread::scope(|sc| {
            let workers: Vec<_> = (0..2).map(|w| sc.spawn(move || write(w))).collect();
            for w in workers {
                w.join().unwrap();
            }
        });
        let s = Store::open(&path).unwrap();
        assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
        let n: i64 = s
            .connection()
            .query_row("SELECT count(*) FROM turns", [], |r| r.get(0))
            .unwrap();
        assert_eq!(n, 2 * 25 * 2);
    }

    #[test]
    fn misaligned_turn_writes_nothing() {
        let mut s = Store::in_memory().unwrap();
        let sid = s.create_session(&NewSession::new(Source::Chat)).unwrap();
        let mut bad = assistant(vec![1, 2], 0);
        bad.hidden = Some(Features {
            n_embd: 4,
            dtype: FeatureDtype::F32,
            values: vec![0.0; 3],
        });
        let good = NewTurn::message(Role::User, "hi", vec![1], 0);
        assert!(s.append_turns(sid, &[good, bad]).is_err());
        assert!(
            s.turns(sid).unwrap().is_empty(),
            "the transaction must roll back"
        );
        assert!(matches!(s.append_turns(999, &[]), Err(Error::NotFound(_))));
    }

    #[test]
    fn feedback_sets_outcome_and_gc_keeps_text() {
        let mut s = Store::in_memory().unwrap();
        let sid = s.create_session(&NewSession::new(Source::Chat)).unwrap();
        let mut t = assistant(vec![5], 0);
        t.block = Some(BlockFeatures {
            layer: 27,
            n_embd: 2,
            first_pos: 0,
            values: vec![0.5, -1.0],
        });
        let ids = s.append_turns(sid, &[t]).unwrap();
        assert_eq!(
            s.block_features(ids[0]).unwrap().unwrap().values,
            vec![0.5, -1.0]
        );
        s.add_feedback(sid, None, FeedbackKind::Outcome, Some(1.0), None)
            .unwrap();
        s.add_feedback(sid, Some(0), FeedbackKind::Thumb, Some(-1.0), Some("rude"))
            .unwrap();
        assert_eq!(s.session(sid).unwrap().outcome_reward, Some(1.0));
        assert_eq!(s.feedback(sid).unwrap().len(), 2);
        // not learned yet: gc with only_learned keeps it
        assert_eq!(s.gc_features(0.0, true).unwrap(), 0);
        s.mark_learned(&[sid]).unwrap();
        assert_eq!(s.gc_features(0.0, true).unwrap(), 1);
        assert!(s.features(ids[0]).unwrap().is_none());
        assert!(s.block_features(ids[0]).unwrap().is_none());
        assert!(s.token_logprobs(ids[0]).unwrap().is_some());
        assert_eq!(s.turns(sid).unwrap()[0].text, "ok");
    }

    #[test]
    fn adapters_activate_and_roll_back() {
        let mut s = Store::in_memory().unwrap();
        let a = s.register_adapter(None, |id| format!("a/{id}")).unwrap();
        assert!(
            s.activate_adapter(a).is_err(),
            "a half-written adapter cannot be activated"
        );
        s.set_adapter_status(a, AdapterStatus::Candidate, None)
            .unwrap();
        s.activate_adapter(a).unwrap();
        let b = s.register_adapter(Some(a), |id| format!("a/{id}")).unwrap();
        s.set_adapter_status(b, AdapterStatus::Candidate, None)
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        s.activate_adapter(b).unwrap();
        assert_eq!(s.active_adapter().unwrap().unwrap().id, b);
        assert_eq!(s.adapter(a).unwrap().status, AdapterStatus::Retired);
        assert_eq!(s.rollback_adapter().unwrap(), Some(a));
        assert_eq!(s.active_adapter().unwrap().unwrap().id, a);
        assert_eq!(
            s.rollback_adapter().unwrap(),
            None,
            "before a there was the base model"
        );
        assert!(s.active_adapter().unwrap().is_none());
        assert_eq!(s.adapter(b).unwrap().path, format!("a/{b}"));
    }

    #[test]
    fn a_candidate_commits_whole_or_not_at_all() {
        let mut s = Store::in_memory().unwrap();
        let sid = s.create_session(&NewSession::new(Source::Demo)).unwrap();
        let tid = s.append_turns(sid, &[assistant(vec![1, 2], 0)]).unwrap()[0];
        let a = s.register_adapter(None, |id| format!("a/{id}")).unwrap();
        let (config, diag) = (
            serde_json::json!({"lr": 1}),
            serde_json::json!({"loss": 0.5}),
        );
        let (nan, finite, learned) = ([(tid, f64::NAN)], [(tid, 0.25)], [sid]);
        let commit = |advantages| CandidateCommit {
            adapter_id: a,
            algo: "grpo",
            config: &config,
            diagnostics: &diag,
            advantages,
            learned: &learned,
        };
        // a NaN advantage fails the annotation insert: nothing of the commit is written
        assert!(s.commit_candidate(&commit(&nan)).is_err());
        assert_eq!(s.adapter(a).unwrap().status, AdapterStatus::Writing);
        assert!(s.session(sid).unwrap().learned_at.is_none());
        let updates: i64 = s
            .connection()
            .query_row("SELECT COUNT(*) FROM updates", [], |r| r.get(0))
            .unwrap();
        assert_eq!(updates, 0);
        // a finite one writes all of it
        let u = s.commit_candidate(&commit(&finite)).unwrap();
        assert_eq!(s.adapter(a).unwrap().status, AdapterStatus::Candidate);
        assert_eq!(s.adapter(a).unwrap().metrics["loss"], 0.5);
        assert!(s.session(sid).unwrap().learned_at.is_some());
        assert_eq!(
            s.latest_annotation(tid, AnnotationKind::Advantage).unwrap(),
            Some((0.25, format!("update:{u}")))
        );
    }

    #[test]
    fn duplicate_content_hash_is_refused() {
        let s = Store::in_memory().unwrap();
        let mut n = NewSession::new(Source::Import);
        n.content_hash = Some("abc".into());
        s.create_session(&n).unwrap();
        assert!(s.create_session(&n).is_err());
        assert!(s.session_by_hash("abc").unwrap().is_some());
    }
}
