//! The turn log: every session, turn, sampled token and feature, in one SQLite file.
//!
//! All SQL of Turnwise lives in this module. The schema comes from the numbered files in
//! `migrations/`, applied on open (tracked by `PRAGMA user_version`); the database runs in WAL
//! mode with `synchronous = FULL`, and each logical write (a session's new turns, an import) is
//! one transaction, so a turn that was acknowledged survives a crash the next instant.

mod blob;

use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use serde::{Deserialize, Serialize};

pub use blob::{
    f16_blob, f32_blob, from_f16_blob, from_f32_blob, from_i32_blob, from_q8_0_blob, i32_blob,
    q8_0_blob,
};

use crate::error::{Error, Result};
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
];

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
    /// value_before | value_after | success_contribution | info_gain | advantage
    pub kind: String,
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
    /// writing | candidate | active | retired | rejected
    pub status: String,
    /// metrics JSON
    pub metrics: serde_json::Value,
    /// last activation time
    pub activated_at: Option<String>,
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
    /// thumb | outcome | note
    pub kind: String,
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
        Ok(Store { conn })
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

    /// Creates a session and returns its id.
    ///
    /// # Errors
    /// SQLite errors (a duplicate `content_hash` among them).
    pub fn create_session(&self, s: &NewSession) -> Result<i64> {
        insert_session(&self.conn, s)
    }

    /// Creates a session together with its turns in one transaction (imports).
    ///
    /// # Errors
    /// SQLite errors; nothing is written on error.
    pub fn create_session_with_turns(
        &mut self,
        s: &NewSession,
        turns: &[NewTurn],
    ) -> Result<(i64, Vec<i64>)> {
        let tx = self.write()?;
        let id = insert_session(&tx, s)?;
        let ids = insert_turns(&tx, id, turns)?;
        tx.commit()?;
        Ok((id, ids))
    }

    /// Appends turns to a session in one transaction and returns their ids.
    ///
    /// # Errors
    /// [`Error::NotFound`] for an unknown session; SQLite errors (nothing is written then).
    pub fn append_turns(&mut self, session_id: i64, turns: &[NewTurn]) -> Result<Vec<i64>> {
        let tx = self.write()?;
        let exists: Option<i64> = tx
            .query_row("SELECT id FROM sessions WHERE id = ?1", [session_id], |r| {
                r.get(0)
            })
            .optional()?;
        if exists.is_none() {
            return Err(Error::NotFound(format!("session {session_id}")));
        }
        let ids = insert_turns(&tx, session_id, turns)?;
        tx.commit()?;
        Ok(ids)
    }

    /// The session whose imported content has this hash.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn session_by_hash(&self, hash: &str) -> Result<Option<i64>> {
        Ok(self
            .conn
            .query_row(
                "SELECT id FROM sessions WHERE content_hash = ?1",
                [hash],
                |r| r.get(0),
            )
            .optional()?)
    }

    /// Records feedback; `kind = "outcome"` also sets the session's outcome reward.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn add_feedback(
        &mut self,
        session_id: i64,
        turn_idx: Option<i64>,
        kind: &str,
        value: Option<f64>,
        note: Option<&str>,
    ) -> Result<()> {
        let tx = self.write()?;
        let n = tx.execute(
            "UPDATE sessions SET outcome_reward = CASE WHEN ?2 = 'outcome' THEN ?3 ELSE outcome_reward END WHERE id = ?1",
            params![session_id, kind, value],
        )?;
        if n == 0 {
            return Err(Error::NotFound(format!("session {session_id}")));
        }
        tx.execute(
            "INSERT INTO feedback (session_id, turn_idx, kind, value, note) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![session_id, turn_idx, kind, value, note],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Marks a session ended.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn end_session(&self, session_id: i64) -> Result<()> {
        let n = self.conn.execute(
            "UPDATE sessions SET ended_at = COALESCE(ended_at, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) WHERE id = ?1",
            [session_id],
        )?;
        if n == 0 {
            return Err(Error::NotFound(format!("session {session_id}")));
        }
        Ok(())
    }

    /// Marks sessions as learned from (they become eligible for feature retention).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn mark_learned(&mut self, session_ids: &[i64]) -> Result<()> {
        let tx = self.write()?;
        {
            let mut st = tx.prepare(
                "UPDATE sessions SET learned_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
            )?;
            for id in session_ids {
                st.execute([id])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// One session.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn session(&self, id: i64) -> Result<SessionRecord> {
        let sql = format!("SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?1");
        self.conn
            .query_row(&sql, [id], session_row)
            .optional()?
            .ok_or_else(|| Error::NotFound(format!("session {id}")))
    }

    /// Sessions, newest first, optionally of one source.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn sessions(&self, source: Option<Source>, limit: usize) -> Result<Vec<SessionRecord>> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions WHERE (?1 IS NULL OR source = ?1) ORDER BY id DESC LIMIT ?2"
        );
        let mut st = self.conn.prepare(&sql)?;
        let rows = st.query_map(
            params![source.map(Source::as_str), limit as i64],
            session_row,
        )?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// The turns of a session in order.
    ///
    /// # Errors
    /// SQLite errors; [`Error::Corrupt`] for undecodable rows.
    pub fn turns(&self, session_id: i64) -> Result<Vec<TurnRecord>> {
        let sql = format!("SELECT {TURN_COLUMNS} FROM turns WHERE session_id = ?1 ORDER BY idx");
        let mut st = self.conn.prepare(&sql)?;
        let rows = st.query_map([session_id], turn_row)?;
        rows.map(|r| r.map_err(Error::from).and_then(|r| r))
            .collect()
    }

    /// Feedback rows of a session.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn feedback(&self, session_id: i64) -> Result<Vec<FeedbackRecord>> {
        let mut st = self.conn.prepare(
            "SELECT turn_idx, kind, value, note FROM feedback WHERE session_id = ?1 ORDER BY id",
        )?;
        let rows = st.query_map([session_id], |r| {
            Ok(FeedbackRecord {
                turn_idx: r.get(0)?,
                kind: r.get(1)?,
                value: r.get(2)?,
                note: r.get(3)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Writes annotations in one transaction.
    ///
    /// # Errors
    /// SQLite errors (nothing is written then); [`Error::Invalid`] for a non-finite value.
    pub fn add_annotations(&mut self, rows: &[NewAnnotation]) -> Result<()> {
        if let Some(bad) = rows.iter().find(|r| !r.value.is_finite()) {
            return Err(Error::Invalid(format!(
                "annotation {} of turn {} is not finite",
                bad.kind, bad.turn_id
            )));
        }
        let tx = self.write()?;
        {
            let mut st = tx.prepare(
                "INSERT INTO annotations (turn_id, kind, value, producer) VALUES (?1, ?2, ?3, ?4)",
            )?;
            for r in rows {
                st.execute(params![r.turn_id, r.kind, r.value, r.producer])?;
            }
        }
        tx.commit()?;
        Ok(())
    }

    /// The latest annotation of one kind for a turn: `(value, producer)`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn latest_annotation(&self, turn_id: i64, kind: &str) -> Result<Option<(f64, String)>> {
        Ok(self
            .conn
            .query_row(
                "SELECT value, producer FROM annotations WHERE turn_id = ?1 AND kind = ?2 ORDER BY id DESC LIMIT 1",
                params![turn_id, kind],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?)
    }

    /// Rows of the `turn_credit` view for a session, in turn order.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn turn_credit(&self, session_id: i64) -> Result<Vec<TurnCredit>> {
        let mut st = self.conn.prepare(
            "SELECT turn_idx, snippet, value_before, value_after, contribution, info_gain, advantage
             FROM turn_credit WHERE session_id = ?1 ORDER BY turn_idx",
        )?;
        let rows = st.query_map([session_id], |r| {
            Ok(TurnCredit {
                turn_idx: r.get(0)?,
                snippet: r.get(1)?,
                value_before: r.get(2)?,
                value_after: r.get(3)?,
                contribution: r.get(4)?,
                info_gain: r.get(5)?,
                advantage: r.get(6)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// All opening-state clusters: `(id, prototype, members)`.
    ///
    /// # Errors
    /// SQLite errors; [`Error::Corrupt`].
    pub fn opening_clusters(&self) -> Result<Vec<(i64, Vec<f32>, i64)>> {
        let mut st = self
            .conn
            .prepare("SELECT id, prototype, members FROM opening_clusters ORDER BY id")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })?;
        rows.map(|r| {
            let (id, b, n) = r?;
            Ok((id, from_f32_blob(&b)?, n))
        })
        .collect()
    }

    /// Saves clusters (new ones get ids) and sets the group key of sessions, in one
    /// transaction. `clusters`: `(id or None, prototype, members)`; `assign`: `(session, index
    /// into clusters)`. Returns the cluster ids.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn save_opening_clusters(
        &mut self,
        clusters: &[(Option<i64>, Vec<f32>, i64)],
        assign: &[(i64, usize)],
    ) -> Result<Vec<i64>> {
        let tx = self.write()?;
        let mut ids = Vec::with_capacity(clusters.len());
        for (id, proto, n) in clusters {
            match id {
                Some(id) => {
                    tx.execute(
                        "UPDATE opening_clusters SET prototype = ?2, members = ?3 WHERE id = ?1",
                        params![id, f32_blob(proto), n],
                    )?;
                    ids.push(*id);
                }
                None => {
                    tx.execute(
                        "INSERT INTO opening_clusters (n_embd, prototype, members) VALUES (?1, ?2, ?3)",
                        params![proto.len() as i64, f32_blob(proto), n],
                    )?;
                    ids.push(tx.last_insert_rowid());
                }
            }
        }
        for (sid, k) in assign {
            tx.execute(
                "UPDATE sessions SET group_key = ?2 WHERE id = ?1 AND group_key IS NULL",
                params![sid, format!("cluster:{}", ids[*k])],
            )?;
        }
        tx.commit()?;
        Ok(ids)
    }

    /// Annotations of a session's turns as JSON objects `{turn_idx, kind, value, producer}`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn annotations_of_session(&self, session_id: i64) -> Result<Vec<serde_json::Value>> {
        let mut st = self.conn.prepare(
            "SELECT t.idx, a.kind, a.value, a.producer FROM annotations a JOIN turns t ON t.id = a.turn_id
             WHERE t.session_id = ?1 ORDER BY t.idx, a.id",
        )?;
        let rows = st.query_map([session_id], |r| {
            Ok(serde_json::json!({
                "turn_idx": r.get::<_, i64>(0)?, "kind": r.get::<_, String>(1)?,
                "value": r.get::<_, f64>(2)?, "producer": r.get::<_, String>(3)?,
            }))
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// Per-token log-probs of an assistant turn.
    ///
    /// # Errors
    /// SQLite errors; [`Error::Corrupt`].
    pub fn token_logprobs(&self, turn_id: i64) -> Result<Option<TokenLogprobs>> {
        let row: Option<(Vec<u8>, Vec<u8>, Option<String>)> = self
            .conn
            .query_row(
                "SELECT logp_behavior, logp_full, support FROM tokens WHERE turn_id = ?1",
                [turn_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        row.map(|(b, f, sup)| {
            let support = match sup {
                Some(j) => serde_json::from_str::<Vec<Option<Support>>>(&j)
                    .map_err(|e| Error::Corrupt(format!("token support of turn {turn_id}: {e}")))?
                    .into_iter()
                    .map(Option::unwrap_or_default)
                    .collect(),
                None => Vec::new(),
            };
            Ok(TokenLogprobs {
                logp_behavior: from_f32_blob(&b)?,
                logp_full: from_f32_blob(&f)?,
                support,
            })
        })
        .transpose()
    }

    /// Hidden states of an assistant turn.
    ///
    /// # Errors
    /// SQLite errors; [`Error::Corrupt`].
    pub fn features(&self, turn_id: i64) -> Result<Option<Features>> {
        let row: Option<(i64, String, Vec<u8>)> = self
            .conn
            .query_row(
                "SELECT n_embd, dtype, hidden FROM features WHERE turn_id = ?1",
                [turn_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        row.map(|(n, d, b)| Features::decode(n as usize, &d, &b))
            .transpose()
    }

    /// Drops the features (not the text, tokens or log-probs) of sessions created more than
    /// `older_than_days` ago; with `only_learned`, only of sessions an update has used.
    /// Returns the number of turns whose features were dropped.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn gc_features(&mut self, older_than_days: f64, only_learned: bool) -> Result<usize> {
        let tx = self.write()?;
        let n = tx.execute(
            "DELETE FROM features WHERE turn_id IN (
                 SELECT t.id FROM turns t JOIN sessions s ON s.id = t.session_id
                 WHERE julianday(s.created_at) <= julianday('now') - ?1
                   AND (?2 = 0 OR s.learned_at IS NOT NULL))",
            params![older_than_days, only_learned],
        )?;
        tx.commit()?;
        Ok(n)
    }

    /// Reclaims free pages after a large deletion.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn vacuum(&self) -> Result<()> {
        self.conn.execute_batch("VACUUM")?;
        Ok(())
    }

    /// How much the log takes.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn storage_stats(&self) -> Result<StorageStats> {
        let q = |sql: &str| -> Result<i64> {
            Ok(self
                .conn
                .query_row(sql, [], |r| r.get::<_, Option<i64>>(0))?
                .unwrap_or(0))
        };
        let page_count = q("PRAGMA page_count")?;
        let page_size = q("PRAGMA page_size")?;
        Ok(StorageStats {
            sessions: q("SELECT COUNT(*) FROM sessions")?,
            turns: q("SELECT COUNT(*) FROM turns")?,
            sampled_tokens: q(
                "SELECT SUM(t.n_tokens) FROM turns t JOIN tokens k ON k.turn_id = t.id",
            )?,
            tokens_with_features: q(
                "SELECT SUM(t.n_tokens) FROM turns t JOIN features f ON f.turn_id = t.id",
            )?,
            feature_bytes: q("SELECT SUM(length(hidden)) FROM features")?,
            token_bytes: q(
                "SELECT SUM(length(k.logp_behavior) + length(k.logp_full) + length(t.token_ids))
                 FROM tokens k JOIN turns t ON t.id = k.turn_id",
            )?,
            file_bytes: page_count * page_size,
        })
    }

    /// Registers an adapter version that is about to be written (status `writing`).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn register_adapter(
        &self,
        parent_id: Option<i64>,
        path_of: impl FnOnce(i64) -> String,
    ) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO adapters (parent_id, path, status) VALUES (?1, '', 'writing')",
            params![parent_id],
        )?;
        let id = self.conn.last_insert_rowid();
        self.conn.execute(
            "UPDATE adapters SET path = ?2 WHERE id = ?1",
            params![id, path_of(id)],
        )?;
        Ok(id)
    }

    /// Marks adapter versions still `writing` as `rejected` (a process died while writing
    /// them) and returns their ids. Call it at start-up, before this process writes any.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn reject_unfinished_adapters(&self) -> Result<Vec<i64>> {
        let mut st = self
            .conn
            .prepare("SELECT id FROM adapters WHERE status = 'writing' ORDER BY id")?;
        let ids: Vec<i64> = st
            .query_map([], |r| r.get(0))?
            .collect::<rusqlite::Result<_>>()?;
        self.conn.execute(
            "UPDATE adapters SET status = 'rejected',
                 metrics = json_set(metrics, '$.error', 'interrupted while writing')
             WHERE status = 'writing'",
            [],
        )?;
        Ok(ids)
    }

    /// Sets an adapter's status and metrics (e.g. `candidate` once fully written).
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn set_adapter_status(
        &self,
        id: i64,
        status: &str,
        metrics: Option<&serde_json::Value>,
    ) -> Result<()> {
        let n = self.conn.execute(
            "UPDATE adapters SET status = ?2, metrics = COALESCE(?3, metrics) WHERE id = ?1",
            params![id, status, metrics.map(|m| m.to_string())],
        )?;
        if n == 0 {
            return Err(Error::NotFound(format!("adapter {id}")));
        }
        Ok(())
    }

    /// All adapters, newest first.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn adapters(&self) -> Result<Vec<AdapterRecord>> {
        let mut st = self.conn.prepare(
            "SELECT id, parent_id, created_at, path, status, metrics, activated_at FROM adapters ORDER BY id DESC",
        )?;
        let rows = st.query_map([], adapter_row)?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// One adapter.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn adapter(&self, id: i64) -> Result<AdapterRecord> {
        self.conn
            .query_row(
                "SELECT id, parent_id, created_at, path, status, metrics, activated_at FROM adapters WHERE id = ?1",
                [id],
                adapter_row,
            )
            .optional()?
            .ok_or_else(|| Error::NotFound(format!("adapter {id}")))
    }

    /// The active adapter, if any.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn active_adapter(&self) -> Result<Option<AdapterRecord>> {
        Ok(self
            .conn
            .query_row(
                "SELECT id, parent_id, created_at, path, status, metrics, activated_at FROM adapters
                 WHERE status = 'active' ORDER BY activated_at DESC LIMIT 1",
                [],
                adapter_row,
            )
            .optional()?)
    }

    /// Makes `id` the active adapter (the previous one becomes `retired`, kept for rollback).
    /// Only a fully written adapter (`candidate`, `retired` or `active`) can be activated.
    ///
    /// # Errors
    /// [`Error::NotFound`]; [`Error::Invalid`] for an adapter in another state.
    pub fn activate_adapter(&mut self, id: i64) -> Result<()> {
        let tx = self.write()?;
        let status: Option<String> = tx
            .query_row("SELECT status FROM adapters WHERE id = ?1", [id], |r| {
                r.get(0)
            })
            .optional()?;
        match status.as_deref() {
            None => return Err(Error::NotFound(format!("adapter {id}"))),
            Some("candidate" | "retired" | "active") => {}
            Some(other) => {
                return Err(Error::Invalid(format!(
                    "adapter {id} is {other}; it cannot be activated"
                )))
            }
        }
        let previous: Option<i64> = tx
            .query_row(
                "SELECT id FROM adapters WHERE status = 'active' AND id != ?1 ORDER BY activated_at DESC LIMIT 1",
                [id],
                |r| r.get(0),
            )
            .optional()?;
        tx.execute(
            "UPDATE adapters SET status = 'retired' WHERE status = 'active' AND id != ?1",
            [id],
        )?;
        tx.execute(
            "UPDATE adapters SET status = 'active', activated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now'),
                 previous_id = CASE WHEN status = 'active' THEN previous_id ELSE ?2 END
             WHERE id = ?1",
            params![id, previous],
        )?;
        tx.commit()?;
        Ok(())
    }

    /// Deactivates the active adapter and re-activates the one that was active before it (or
    /// none: the base model). Repeated rollbacks walk back the activation history. Returns the
    /// adapter now active.
    ///
    /// # Errors
    /// [`Error::Invalid`] when no adapter is active.
    pub fn rollback_adapter(&mut self) -> Result<Option<i64>> {
        let tx = self.write()?;
        let (current, previous): (i64, Option<i64>) = tx
            .query_row(
                "SELECT id, previous_id FROM adapters WHERE status = 'active' ORDER BY activated_at DESC LIMIT 1",
                [],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .optional()?
            .ok_or_else(|| Error::Invalid("no adapter is active".into()))?;
        tx.execute(
            "UPDATE adapters SET status = 'retired' WHERE id = ?1",
            [current],
        )?;
        if let Some(p) = previous {
            tx.execute(
                "UPDATE adapters SET status = 'active', activated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
                [p],
            )?;
        }
        tx.commit()?;
        Ok(previous)
    }

    /// Records an update and returns its id.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn record_update(
        &self,
        adapter_id: Option<i64>,
        algo: &str,
        config: &serde_json::Value,
        diagnostics: &serde_json::Value,
        status: &str,
    ) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO updates (adapter_id, algo, config, diagnostics, status) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![adapter_id, algo, config.to_string(), diagnostics.to_string(), status],
        )?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Finished sessions usable for training, oldest first: with an outcome unless
    /// `require_outcome` is false; optionally of one source, created at or after `since`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn training_sessions(
        &self,
        source: Option<Source>,
        since: Option<&str>,
        require_outcome: bool,
        limit: usize,
    ) -> Result<Vec<SessionRecord>> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions
             WHERE ended_at IS NOT NULL AND (?1 IS NULL OR source = ?1) AND (?2 IS NULL OR created_at >= ?2)
               AND (?3 = 0 OR outcome_reward IS NOT NULL)
             ORDER BY id DESC LIMIT ?4"
        );
        let mut st = self.conn.prepare(&sql)?;
        let rows = st.query_map(
            params![
                source.map(Source::as_str),
                since,
                require_outcome,
                limit as i64
            ],
            session_row,
        )?;
        let mut v: Vec<SessionRecord> = rows.collect::<rusqlite::Result<_>>()?;
        v.reverse();
        Ok(v)
    }

    /// A write transaction that takes SQLite's write lock when it begins (`BEGIN IMMEDIATE`), so
    /// that a second connection writing at the same time waits for it (the busy timeout) instead
    /// of failing with `database is locked` when a deferred transaction upgrades its read lock.
    fn write(&mut self) -> rusqlite::Result<rusqlite::Transaction<'_>> {
        self.conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
    }

    /// The underlying connection, for read-only ad-hoc queries in tests and reports.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The underlying connection for modules that keep their own tables (the experience
    /// library); they write in transactions.
    pub fn connection_mut(&mut self) -> &mut Connection {
        &mut self.conn
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

fn insert_session(conn: &Connection, s: &NewSession) -> Result<i64> {
    conn.execute(
        "INSERT INTO sessions (source, group_key, reference, content_hash, metadata) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            s.source.as_str(),
            s.group_key,
            s.reference,
            s.content_hash,
            s.metadata.to_string()
        ],
    )?;
    Ok(conn.last_insert_rowid())
}

fn insert_turns(conn: &Connection, session_id: i64, turns: &[NewTurn]) -> Result<Vec<i64>> {
    let next: i64 = conn.query_row(
        "SELECT COALESCE(MAX(idx) + 1, 0) FROM turns WHERE session_id = ?1",
        [session_id],
        |r| r.get(0),
    )?;
    let mut ids = Vec::with_capacity(turns.len());
    for (k, t) in turns.iter().enumerate() {
        if let Some(lp) = &t.logprobs {
            if lp.logp_behavior.len() != t.token_ids.len()
                || lp.logp_full.len() != t.token_ids.len()
                || !(lp.support.is_empty() || lp.support.len() == t.token_ids.len())
            {
                return Err(Error::Invalid("log-probs do not align with tokens".into()));
            }
        }
        if let Some(f) = &t.hidden {
            if f.values.len() != f.n_embd * t.token_ids.len() {
                return Err(Error::Invalid(
                    "hidden states do not align with tokens".into(),
                ));
            }
        }
        let sampler = t.sampler.as_ref().map(serde_json::to_string).transpose()?;
        conn.execute(
            "INSERT INTO turns (session_id, idx, role, text, token_ids, n_tokens, context_len, sampler,
                 behavior, stop_reason, adapter_id, template, retokenized, latency_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)",
            params![
                session_id,
                next + k as i64,
                t.role.as_str(),
                t.text,
                i32_blob(&t.token_ids),
                t.token_ids.len() as i64,
                t.context_len as i64,
                sampler,
                t.behavior.map(Behavior::as_str),
                t.stop_reason,
                t.adapter_id,
                t.template,
                t.retokenized,
                t.latency_ms
            ],
        )?;
        let id = conn.last_insert_rowid();
        if let Some(lp) = &t.logprobs {
            // the whole softmax for every token is stored as NULL, a full token as null
            let support = (!lp.support.iter().all(Support::is_full))
                .then(|| {
                    let sparse: Vec<Option<&Support>> = lp
                        .support
                        .iter()
                        .map(|s| (!s.is_full()).then_some(s))
                        .collect();
                    serde_json::to_string(&sparse)
                })
                .transpose()?;
            conn.execute(
                "INSERT INTO tokens (turn_id, logp_behavior, logp_full, support) VALUES (?1, ?2, ?3, ?4)",
                params![id, f32_blob(&lp.logp_behavior), f32_blob(&lp.logp_full), support],
            )?;
        }
        if let Some(f) = &t.hidden {
            conn.execute(
                "INSERT INTO features (turn_id, n_embd, dtype, hidden) VALUES (?1, ?2, ?3, ?4)",
                params![id, f.n_embd as i64, f.dtype.as_str(), f.encode()?],
            )?;
        }
        ids.push(id);
    }
    Ok(ids)
}

fn adapter_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<AdapterRecord> {
    let m: String = r.get(5)?;
    Ok(AdapterRecord {
        id: r.get(0)?,
        parent_id: r.get(1)?,
        created_at: r.get(2)?,
        path: r.get(3)?,
        status: r.get(4)?,
        metrics: serde_json::from_str(&m).unwrap_or(serde_json::Value::Null),
        activated_at: r.get(6)?,
    })
}

fn session_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<SessionRecord> {
    let meta: String = r.get(7)?;
    Ok(SessionRecord {
        id: r.get(0)?,
        created_at: r.get(1)?,
        ended_at: r.get(2)?,
        source: r.get(3)?,
        group_key: r.get(4)?,
        outcome_reward: r.get(5)?,
        reference: r.get(6)?,
        metadata: serde_json::from_str(&meta).unwrap_or(serde_json::Value::Null),
        learned_at: r.get(8)?,
    })
}

fn turn_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<Result<TurnRecord>> {
    let role: String = r.get(3)?;
    let ids: Vec<u8> = r.get(5)?;
    let sampler: Option<String> = r.get(7)?;
    let behavior: Option<String> = r.get(8)?;
    let build = || -> Result<TurnRecord> {
        Ok(TurnRecord {
            id: r.get(0)?,
            session_id: r.get(1)?,
            idx: r.get(2)?,
            role: Role::parse(&role).map_err(|_| Error::Corrupt(format!("role {role}")))?,
            text: r.get(4)?,
            token_ids: from_i32_blob(&ids)?,
            context_len: r.get::<_, i64>(6)? as usize,
            sampler: sampler.as_deref().map(serde_json::from_str).transpose()?,
            behavior: behavior.as_deref().and_then(Behavior::parse),
            stop_reason: r.get(9)?,
            adapter_id: r.get(10)?,
            template: r.get(11)?,
            retokenized: r.get(12)?,
            latency_ms: r.get(13)?,
            created_at: r.get(14)?,
        })
    };
    Ok(build())
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
                s.add_feedback(sid, None, "outcome", Some(1.0), None)
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
        let ids = s.append_turns(sid, &[assistant(vec![5], 0)]).unwrap();
        s.add_feedback(sid, None, "outcome", Some(1.0), None)
            .unwrap();
        s.add_feedback(sid, Some(0), "thumb", Some(-1.0), Some("rude"))
            .unwrap();
        assert_eq!(s.session(sid).unwrap().outcome_reward, Some(1.0));
        assert_eq!(s.feedback(sid).unwrap().len(), 2);
        // not learned yet: gc with only_learned keeps it
        assert_eq!(s.gc_features(0.0, true).unwrap(), 0);
        s.mark_learned(&[sid]).unwrap();
        assert_eq!(s.gc_features(0.0, true).unwrap(), 1);
        assert!(s.features(ids[0]).unwrap().is_none());
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
        s.set_adapter_status(a, "candidate", None).unwrap();
        s.activate_adapter(a).unwrap();
        let b = s.register_adapter(Some(a), |id| format!("a/{id}")).unwrap();
        s.set_adapter_status(b, "candidate", None).unwrap();
        std::thread::sleep(std::time::Duration::from_millis(5));
        s.activate_adapter(b).unwrap();
        assert_eq!(s.active_adapter().unwrap().unwrap().id, b);
        assert_eq!(s.adapter(a).unwrap().status, "retired");
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
    fn duplicate_content_hash_is_refused() {
        let s = Store::in_memory().unwrap();
        let mut n = NewSession::new(Source::Import);
        n.content_hash = Some("abc".into());
        s.create_session(&n).unwrap();
        assert!(s.create_session(&n).is_err());
        assert!(s.session_by_hash("abc").unwrap().is_some());
    }
}
