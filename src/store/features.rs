//! Hidden-state features of sampled tokens: reading, retention and storage accounting.

use super::*;

impl Store {
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
        // block inputs follow the same rule as the features; the count is of feature rows
        let mut n = 0;
        for table in ["features", "block_features"] {
            let dropped = tx.execute(
                &format!(
                    "DELETE FROM {table} WHERE turn_id IN (
                         SELECT t.id FROM turns t JOIN sessions s ON s.id = t.session_id
                         WHERE julianday(s.created_at) <= julianday('now') - ?1
                           AND (?2 = 0 OR s.learned_at IS NOT NULL))"
                ),
                params![older_than_days, only_learned],
            )?;
            if table == "features" {
                n = dropped;
            }
        }
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

    /// The block inputs stored with a turn, if any.
    ///
    /// # Errors
    /// [`Error::Corrupt`] for a bad blob; SQLite errors.
    pub fn block_features(&self, turn_id: i64) -> Result<Option<BlockFeatures>> {
        let row: Option<(i64, i64, String, i64, Vec<u8>)> = self
            .conn
            .query_row(
                "SELECT layer, n_embd, dtype, first_pos, activations FROM block_features
                 WHERE turn_id = ?1",
                [turn_id],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)),
            )
            .optional()?;
        let Some((layer, n_embd, dtype, first_pos, blob)) = row else {
            return Ok(None);
        };
        let values = match dtype.as_str() {
            "f16" => from_f16_blob(&blob)?,
            "f32" => from_f32_blob(&blob)?,
            other => return Err(Error::Corrupt(format!("block feature dtype {other}"))),
        };
        if n_embd <= 0 || values.len() % n_embd as usize != 0 {
            return Err(Error::Corrupt(format!(
                "block features of turn {turn_id}: {} values of width {n_embd}",
                values.len()
            )));
        }
        Ok(Some(BlockFeatures {
            layer: layer as usize,
            n_embd: n_embd as usize,
            first_pos: first_pos as usize,
            values,
        }))
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
            block_positions: q("SELECT SUM(n_pos) FROM block_features")?,
            block_bytes: q("SELECT SUM(length(activations)) FROM block_features")?,
            token_bytes: q(
                "SELECT SUM(length(k.logp_behavior) + length(k.logp_full) + length(t.token_ids))
                 FROM tokens k JOIN turns t ON t.id = k.turn_id",
            )?,
            file_bytes: page_count * page_size,
        })
    }
}
