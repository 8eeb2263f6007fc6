//! Step-level annotations (credit per turn) and the opening-state clusters that group live sessions.

use super::*;

impl Store {
    /// Writes annotations in one transaction.
    ///
    /// # Errors
    /// SQLite errors (nothing is written then); [`Error::Invalid`] for a non-finite value.
    pub fn add_annotations(&mut self, rows: &[NewAnnotation]) -> Result<()> {
        let tx = self.write()?;
        insert_annotations(&tx, rows)?;
        tx.commit()?;
        Ok(())
    }

    /// The latest annotation of one kind for a turn: `(value, producer)`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn latest_annotation(
        &self,
        turn_id: i64,
        kind: AnnotationKind,
    ) -> Result<Option<(f64, String)>> {
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
}

/// Inserts annotations on `conn` (a transaction of the caller's).
pub(super) fn insert_annotations(conn: &Connection, rows: &[NewAnnotation]) -> Result<()> {
    if let Some(bad) = rows.iter().find(|r| !r.value.is_finite()) {
        return Err(Error::Invalid(format!(
            "annotation {} of turn {} is not finite",
            bad.kind, bad.turn_id
        )));
    }
    let mut st = conn.prepare(
        "INSERT INTO annotations (turn_id, kind, value, producer) VALUES (?1, ?2, ?3, ?4)",
    )?;
    for r in rows {
        st.execute(params![r.turn_id, r.kind, r.value, r.producer])?;
    }
    Ok(())
}
