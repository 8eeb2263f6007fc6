//! Adapter versions, their status and activation history, and update rows.

use super::*;

impl Store {
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
            "INSERT INTO adapters (parent_id, path, status, model) VALUES (?1, '', 'writing', ?2)",
            params![parent_id, self.model],
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
        status: AdapterStatus,
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
            "SELECT id, parent_id, created_at, path, status, metrics, activated_at, model FROM adapters ORDER BY id DESC",
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
                "SELECT id, parent_id, created_at, path, status, metrics, activated_at, model FROM adapters WHERE id = ?1",
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
                "SELECT id, parent_id, created_at, path, status, metrics, activated_at, model FROM adapters
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

    /// The candidate writer's commit: in one transaction, adapter `c.adapter_id` (its files
    /// already written) becomes a `candidate` with the diagnostics as metrics, the update row
    /// is recorded, each trained turn's advantage is annotated (producer `update:<id>`) and the
    /// sessions are stamped learned. A crash leaves either all of it or the `writing` row that
    /// start-up rejects. Returns the update id.
    ///
    /// # Errors
    /// SQLite errors and non-finite advantages (nothing is written then).
    pub fn commit_candidate(&mut self, c: &CandidateCommit<'_>) -> Result<i64> {
        let model = self.model.clone();
        let tx = self.write()?;
        let metrics = c.diagnostics.to_string();
        tx.execute(
            "UPDATE adapters SET status = ?2, metrics = ?3 WHERE id = ?1",
            params![c.adapter_id, AdapterStatus::Candidate, metrics],
        )?;
        tx.execute(
            "INSERT INTO updates (adapter_id, algo, config, diagnostics, status, model) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![c.adapter_id, c.algo, c.config.to_string(), metrics, UpdateStatus::Ok, model],
        )?;
        let update_id = tx.last_insert_rowid();
        let producer = format!("update:{update_id}");
        let rows: Vec<NewAnnotation> = c
            .advantages
            .iter()
            .map(|&(turn_id, value)| NewAnnotation {
                turn_id,
                kind: AnnotationKind::Advantage,
                value,
                producer: producer.clone(),
            })
            .collect();
        super::annotations::insert_annotations(&tx, &rows)?;
        super::sessions::set_learned(&tx, c.learned)?;
        tx.commit()?;
        Ok(update_id)
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
        status: UpdateStatus,
    ) -> Result<i64> {
        self.conn.execute(
            "INSERT INTO updates (adapter_id, algo, config, diagnostics, status, model) VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
            params![adapter_id, algo, config.to_string(), diagnostics.to_string(), status, self.model],
        )?;
        Ok(self.conn.last_insert_rowid())
    }
}

/// One row of `updates`.
#[derive(Debug, Clone)]
pub struct UpdateRecord {
    /// `updates.id`
    pub id: i64,
    /// when it was recorded (after the update ran)
    pub created_at: String,
    /// the candidate it wrote (None: rejected)
    pub adapter_id: Option<i64>,
    /// preset name
    pub algo: String,
    /// its `TrainConfig` as JSON
    pub config: serde_json::Value,
    /// its diagnostics as JSON
    pub diagnostics: serde_json::Value,
}

impl Store {
    /// Update `id`.
    ///
    /// # Errors
    /// [`Error::NotFound`](crate::Error) when there is none; SQLite errors.
    pub fn update_record(&self, id: i64) -> Result<UpdateRecord> {
        self.conn
            .query_row(
                "SELECT id, created_at, adapter_id, algo, config, diagnostics FROM updates WHERE id = ?1",
                params![id],
                |r| {
                    let c: String = r.get(4)?;
                    let d: String = r.get(5)?;
                    Ok(UpdateRecord {
                        id: r.get(0)?,
                        created_at: r.get(1)?,
                        adapter_id: r.get(2)?,
                        algo: r.get(3)?,
                        config: serde_json::from_str(&c).unwrap_or(serde_json::Value::Null),
                        diagnostics: serde_json::from_str(&d).unwrap_or(serde_json::Value::Null),
                    })
                },
            )
            .optional()?
            .ok_or_else(|| crate::Error::NotFound(format!("update {id}")))
    }
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
        model: r
            .get::<_, Option<String>>(7)?
            .and_then(|m| serde_json::from_str(&m).ok()),
    })
}

/// What [`Store::commit_candidate`] writes.
pub struct CandidateCommit<'a> {
    /// the adapter, registered and fully written
    pub adapter_id: i64,
    /// the update's algorithm
    pub algo: &'a str,
    /// its configuration
    pub config: &'a serde_json::Value,
    /// its diagnostics
    pub diagnostics: &'a serde_json::Value,
    /// (turn id, advantage) of every trained turn (empty for SFT)
    pub advantages: &'a [(i64, f64)],
    /// sessions it trained on
    pub learned: &'a [i64],
}
