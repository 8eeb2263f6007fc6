//! Sessions, turns, their tokens and log-probs, and feedback.

use super::*;

impl Store {
    /// Creates a session and returns its id.
    ///
    /// # Errors
    /// SQLite errors (a duplicate `content_hash` among them).
    pub fn create_session(&self, s: &NewSession) -> Result<i64> {
        insert_session(&self.conn, s)
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

    /// Records feedback; an outcome also sets the session's outcome reward.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn add_feedback(
        &mut self,
        session_id: i64,
        turn_idx: Option<i64>,
        kind: FeedbackKind,
        value: Option<f64>,
        note: Option<&str>,
    ) -> Result<()> {
        let tx = self.write()?;
        insert_feedback(&tx, session_id, turn_idx, kind, value, note)?;
        tx.commit()?;
        Ok(())
    }

    /// Marks a session ended.
    ///
    /// # Errors
    /// [`Error::NotFound`]; SQLite errors.
    pub fn end_session(&self, session_id: i64) -> Result<()> {
        set_ended(&self.conn, session_id)
    }

    /// A whole finished session in one transaction (imports, rescored demonstrations): the
    /// session, its turns, its outcome (with a note) when known, and its end. A crash leaves
    /// all of it or nothing.
    ///
    /// # Errors
    /// SQLite errors and misaligned turns (nothing is written then).
    pub fn create_finished_session(
        &mut self,
        s: &NewSession,
        turns: &[NewTurn],
        outcome: Option<(f64, &str)>,
    ) -> Result<(i64, Vec<i64>)> {
        let tx = self.write()?;
        let id = insert_session(&tx, s)?;
        let ids = insert_turns(&tx, id, turns)?;
        if let Some((value, note)) = outcome {
            insert_feedback(
                &tx,
                id,
                None,
                FeedbackKind::Outcome,
                Some(value),
                Some(note),
            )?;
        }
        set_ended(&tx, id)?;
        tx.commit()?;
        Ok((id, ids))
    }

    /// Marks sessions as learned from (they become eligible for feature retention).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn mark_learned(&mut self, session_ids: &[i64]) -> Result<()> {
        let tx = self.write()?;
        set_learned(&tx, session_ids)?;
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
        self.training_sessions_before(source, since, None, require_outcome, limit)
    }

    /// [`Store::training_sessions`] created before `until` as well: the batch an update saw
    /// when it ran (replayed with `turnwise train --replay`).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn training_sessions_before(
        &self,
        source: Option<Source>,
        since: Option<&str>,
        until: Option<&str>,
        require_outcome: bool,
        limit: usize,
    ) -> Result<Vec<SessionRecord>> {
        let sql = format!(
            "SELECT {SESSION_COLUMNS} FROM sessions
             WHERE ended_at IS NOT NULL AND held_out = 0
               AND (?1 IS NULL OR source = ?1) AND (?2 IS NULL OR created_at >= ?2)
               AND (?3 = 0 OR outcome_reward IS NOT NULL) AND (?5 IS NULL OR created_at < ?5)
             ORDER BY id DESC LIMIT ?4"
        );
        let mut st = self.conn.prepare(&sql)?;
        let rows = st.query_map(
            params![
                source.map(Source::as_str),
                since,
                require_outcome,
                limit as i64,
                until
            ],
            session_row,
        )?;
        let mut v: Vec<SessionRecord> = rows.collect::<rusqlite::Result<_>>()?;
        v.reverse();
        Ok(v)
    }
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
        if let Some(b) = &t.block {
            conn.execute(
                "INSERT INTO block_features (turn_id, layer, n_embd, dtype, first_pos, n_pos, activations)
                 VALUES (?1, ?2, ?3, 'f16', ?4, ?5, ?6)",
                params![
                    id,
                    b.layer as i64,
                    b.n_embd as i64,
                    b.first_pos as i64,
                    b.n_pos() as i64,
                    f16_blob(&b.values)
                ],
            )?;
        }
        ids.push(id);
    }
    Ok(ids)
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

impl Store {
    /// The newest live session of a client's session id (`metadata.client_session_id`, an
    /// indexed column); `open_only`: only one that has not ended.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn session_of_client(&self, client_id: &str, open_only: bool) -> Result<Option<i64>> {
        Ok(self
            .conn
            .query_row(
                "SELECT id FROM sessions WHERE client_session_id = ?1 AND source = 'live'
                 AND (?2 = 0 OR ended_at IS NULL) ORDER BY id DESC LIMIT 1",
                params![client_id, open_only],
                |r| r.get(0),
            )
            .optional()?)
    }
}

impl Store {
    /// Holds a session out of learning from now on (`metadata.held_out`): no update selects it
    /// again ([`Store::training_sessions`] skips it). Idempotent.
    ///
    /// # Errors
    /// SQLite errors; [`Error::NotFound`] for an unknown session.
    pub fn set_held_out(&self, session_id: i64) -> Result<()> {
        let n = self.conn.execute(
            "UPDATE sessions SET metadata = json_set(metadata, '$.held_out', json('true'))
             WHERE id = ?1",
            [session_id],
        )?;
        if n == 0 {
            return Err(Error::NotFound(format!("session {session_id}")));
        }
        Ok(())
    }

    /// Whether a session is held out of learning.
    ///
    /// # Errors
    /// SQLite errors; [`Error::NotFound`] for an unknown session.
    pub fn is_held_out(&self, session_id: i64) -> Result<bool> {
        self.conn
            .query_row(
                "SELECT held_out FROM sessions WHERE id = ?1",
                [session_id],
                |r| r.get::<_, i64>(0),
            )
            .optional()?
            .map(|v| v != 0)
            .ok_or_else(|| Error::NotFound(format!("session {session_id}")))
    }
}

/// Stamps `learned_at` on sessions, on `conn` (a transaction of the caller's).
pub(super) fn set_learned(conn: &Connection, session_ids: &[i64]) -> Result<()> {
    let mut st = conn.prepare(
        "UPDATE sessions SET learned_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
    )?;
    for id in session_ids {
        st.execute([id])?;
    }
    Ok(())
}

fn insert_feedback(
    conn: &Connection,
    session_id: i64,
    turn_idx: Option<i64>,
    kind: FeedbackKind,
    value: Option<f64>,
    note: Option<&str>,
) -> Result<()> {
    let n = conn.execute(
        "UPDATE sessions SET outcome_reward = CASE WHEN ?2 = 'outcome' THEN ?3 ELSE outcome_reward END WHERE id = ?1",
        params![session_id, kind, value],
    )?;
    if n == 0 {
        return Err(Error::NotFound(format!("session {session_id}")));
    }
    conn.execute(
        "INSERT INTO feedback (session_id, turn_idx, kind, value, note) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![session_id, turn_idx, kind, value, note],
    )?;
    Ok(())
}

fn set_ended(conn: &Connection, session_id: i64) -> Result<()> {
    let n = conn.execute(
        "UPDATE sessions SET ended_at = COALESCE(ended_at, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) WHERE id = ?1",
        [session_id],
    )?;
    if n == 0 {
        return Err(Error::NotFound(format!("session {session_id}")));
    }
    Ok(())
}
