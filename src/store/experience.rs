//! The experience library's clusters, entries and injections.

use super::*;

/// A live entry of the experience library.
#[derive(Debug, Clone, PartialEq)]
pub struct ExperienceEntry {
    /// `experience_entries.id`
    pub id: i64,
    /// `strategy` or `warning`
    pub kind: String,
    /// the distilled step
    pub text: String,
    /// its score
    pub score: f64,
}

/// A live entry as reports show it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ExperienceRow {
    /// cluster id
    pub cluster: i64,
    /// `strategy` or `warning`
    pub kind: String,
    /// the distilled step
    pub text: String,
    /// the observation it followed
    pub context: String,
    /// its score
    pub score: f64,
}

/// The writes of one library evolution, in one transaction ([`Store::evolve_experience`]).
pub struct ExperienceWriter<'a> {
    tx: rusqlite::Transaction<'a>,
}

impl ExperienceWriter<'_> {
    /// Moves cluster `id` to a new prototype and member count.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn update_cluster(&self, id: i64, prototype: &[f32], members: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE experience_clusters SET prototype = ?2, members = ?3 WHERE id = ?1",
            params![id, f32_blob(prototype), members],
        )?;
        Ok(())
    }

    /// A new cluster; returns its id.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn insert_cluster(&self, prototype: &[f32], members: i64) -> Result<i64> {
        self.tx.execute(
            "INSERT INTO experience_clusters (prototype, members) VALUES (?1, ?2)",
            params![f32_blob(prototype), members],
        )?;
        Ok(self.tx.last_insert_rowid())
    }

    /// Live entries of one cluster and kind, lowest score first.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn live_entries(&self, cluster: i64, kind: &str) -> Result<Vec<ExperienceEntry>> {
        live_entries(&self.tx, cluster, kind, "score, id")
    }

    /// Raises an entry's score by `by`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn raise_entry(&self, id: i64, by: f64) -> Result<()> {
        self.tx.execute(
            "UPDATE experience_entries SET score = score + ?2,
             updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
            params![id, by],
        )?;
        Ok(())
    }

    /// Retires an entry (it stays in the table for the record).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn retire_entry(&self, id: i64) -> Result<()> {
        self.tx.execute(
            "UPDATE experience_entries SET retired_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE id = ?1",
            [id],
        )?;
        Ok(())
    }

    /// A new live entry.
    ///
    /// # Errors
    /// SQLite errors.
    #[allow(clippy::too_many_arguments)]
    pub fn insert_entry(
        &self,
        cluster: i64,
        kind: &str,
        text: &str,
        context: &str,
        score: f64,
        source_turn: i64,
        update_id: Option<i64>,
    ) -> Result<()> {
        self.tx.execute(
            "INSERT INTO experience_entries (cluster_id, kind, text, context, score, source_turn, update_id)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![cluster, kind, text, context, score, source_turn, update_id],
        )?;
        Ok(())
    }
}

fn live_entries(
    conn: &Connection,
    cluster: i64,
    kind: &str,
    order: &str,
) -> Result<Vec<ExperienceEntry>> {
    let mut st = conn.prepare(&format!(
        "SELECT id, kind, text, score FROM experience_entries
         WHERE cluster_id = ?1 AND kind = ?2 AND retired_at IS NULL ORDER BY {order}"
    ))?;
    let rows = st.query_map(params![cluster, kind], |r| {
        Ok(ExperienceEntry {
            id: r.get(0)?,
            kind: r.get(1)?,
            text: r.get(2)?,
            score: r.get(3)?,
        })
    })?;
    Ok(rows.collect::<rusqlite::Result<_>>()?)
}

impl Store {
    /// The library's clusters: (id, prototype, members), by id.
    ///
    /// # Errors
    /// SQLite errors, a malformed prototype blob.
    pub fn experience_clusters(&self) -> Result<Vec<(i64, Vec<f32>, i64)>> {
        let mut st = self
            .conn
            .prepare("SELECT id, prototype, members FROM experience_clusters ORDER BY id")?;
        let rows = st.query_map([], |r| {
            Ok((
                r.get::<_, i64>(0)?,
                r.get::<_, Vec<u8>>(1)?,
                r.get::<_, i64>(2)?,
            ))
        })?;
        let mut clusters = Vec::new();
        for r in rows {
            let (id, b, n) = r?;
            clusters.push((id, from_f32_blob(&b)?, n));
        }
        Ok(clusters)
    }

    /// Live entries of one cluster and kind, best first.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn experience_entries(&self, cluster: i64, kind: &str) -> Result<Vec<ExperienceEntry>> {
        live_entries(&self.conn, cluster, kind, "score DESC, id")
    }

    /// Records which entries were injected into the logged message `turn_id`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn record_injection(&mut self, turn_id: i64, entries: &[i64]) -> Result<()> {
        let tx = self.write()?;
        for e in entries {
            tx.execute(
                "INSERT OR IGNORE INTO experience_injections (turn_id, entry_id) VALUES (?1, ?2)",
                params![turn_id, e],
            )?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Runs `f` over one write transaction of the library's tables; commits when it returns
    /// `Ok`, rolls everything back otherwise.
    ///
    /// # Errors
    /// SQLite errors and `f`'s.
    pub fn evolve_experience<T>(
        &mut self,
        f: impl FnOnce(&ExperienceWriter<'_>) -> Result<T>,
    ) -> Result<T> {
        let w = ExperienceWriter { tx: self.write()? };
        let out = f(&w)?;
        w.tx.commit()?;
        Ok(out)
    }

    /// Live entries, by cluster and kind, best first (for reports).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn experience_listing(&self) -> Result<Vec<ExperienceRow>> {
        let mut st = self.conn.prepare(
            "SELECT cluster_id, kind, text, context, score FROM experience_entries
             WHERE retired_at IS NULL ORDER BY cluster_id, kind, score DESC",
        )?;
        let rows = st.query_map([], |r| {
            Ok(ExperienceRow {
                cluster: r.get(0)?,
                kind: r.get(1)?,
                text: r.get(2)?,
                context: r.get(3)?,
                score: r.get(4)?,
            })
        })?;
        Ok(rows.collect::<rusqlite::Result<_>>()?)
    }

    /// How many injections were recorded.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn experience_injections(&self) -> Result<i64> {
        Ok(self
            .conn
            .query_row("SELECT COUNT(*) FROM experience_injections", [], |r| {
                r.get(0)
            })?)
    }
}
