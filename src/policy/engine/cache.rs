//! The KV cache: which sequence a session takes, bringing it up to the session's tokens
//! (sharing another sequence's prefix), trimming it, decoding rows and the block LoRA that
//! llama.cpp applies.

use super::*;

impl Worker {
    /// Makes `block` the LoRA llama.cpp applies inside the blocks (loaded from a GGUF LoRA
    /// written to a temporary file), unless it already is. llama.cpp keeps the KV cache on a
    /// switch, so every cached position — computed under the other adapter — is dropped; the
    /// previous adapter is freed once the context no longer holds it. Runs only when no
    /// generation is in flight.
    pub(super) fn set_block(&mut self, block: Option<Vec<u8>>) -> Result<()> {
        let same = match (&self.lora, &block) {
            (None, None) => true,
            (Some((cur, _)), Some(new)) => cur == new,
            _ => false,
        };
        if same {
            return Ok(());
        }
        let loaded = match block {
            None => None,
            Some(gguf) => {
                let path = std::env::temp_dir().join(format!(
                    "turnwise-block-{}-{:x}.gguf",
                    std::process::id(),
                    self as *const Worker as usize
                ));
                std::fs::write(&path, &gguf).map_err(|e| Error::io(&path, e))?;
                let l = llama::LoraAdapter::load(&self.model, &path);
                let _ = std::fs::remove_file(&path);
                Some((gguf, l?))
            }
        };
        self.ctx.set_lora(loaded.as_ref().map(|(_, l)| l))?;
        for s in 0..self.slots.len() {
            self.truncate_cache(s, 0);
        }
        self.parked.clear();
        self.override_checked = None;
        self.lora = loaded;
        Ok(())
    }

    /// Appends messages to a copy of the session and checks the context budget (`reserve`
    /// tokens for the reply) before committing the copy.
    pub(super) fn append(
        &mut self,
        session: u64,
        messages: Vec<Message>,
        generation_prompt: bool,
        reserve: usize,
    ) -> Result<(Vec<PromptTurn>, Conversation)> {
        let mut conv = self.sessions.get(&session).cloned().unwrap_or_default();
        let before = conv.tokens.len();
        let n = messages.len();
        let mut turns = Vec::with_capacity(n);
        let roles: Vec<Role> = messages.iter().map(|m| m.role).collect();
        for (i, m) in messages.into_iter().enumerate() {
            let forced = m.role == Role::Assistant && !generation_prompt;
            if forced && conv.tokens.is_empty() {
                return Err(Error::Invalid(
                    "a conversation cannot open with an assistant message (nothing prompted it)"
                        .into(),
                ));
            }
            // the message before a forced assistant reply ends with the reply's opening markers,
            // exactly as it would have before a generation
            let next_is_forced = !generation_prompt && roles.get(i + 1) == Some(&Role::Assistant);
            let t = if forced {
                conv.push_forced_reply(&self.model, &m.content, self.turn_end)?
            } else {
                let open = next_is_forced || (generation_prompt && i + 1 == n);
                conv.append(&self.model, &self.info.template, m, open)?
            };
            turns.push(t);
        }
        let needed = conv.tokens.len() + reserve;
        if needed > self.n_ctx {
            return Err(Error::ContextOverflow {
                have: before,
                adding: needed - before,
                needed,
                n_ctx: self.n_ctx,
            });
        }
        self.sessions.insert(session, conv.clone());
        Ok((turns, conv))
    }

    /// Brings sequence `slot` to `tokens` and returns the hidden state and logits of the last
    /// row, and how many tokens were decoded. A longer prefix of `tokens` held by another
    /// sequence is shared (its cells copied) instead of decoded again.
    pub(super) fn sync(
        &mut self,
        slot: usize,
        tokens: &[Token],
    ) -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let mut keep = self.reuse_prefix(slot, tokens, tokens.len());
        if keep == tokens.len() {
            keep = keep.saturating_sub(1); // we need the last row's logits again
        }
        self.truncate_cache(slot, keep);
        let mut last = (Vec::new(), Vec::new());
        let nb = self.ctx.n_batch();
        let mut pos = keep;
        while pos < tokens.len() {
            let end = (pos + nb).min(tokens.len());
            let chunk = &tokens[pos..end];
            let mut outputs = vec![false; chunk.len()];
            let is_last = end == tokens.len();
            if is_last {
                outputs[chunk.len() - 1] = true;
            }
            let h = self.decode(slot, chunk, pos, &outputs)?;
            if is_last {
                last = (h, self.ctx.logits(chunk.len() - 1).to_vec());
            }
            pos = end;
        }
        Ok((last.0, last.1, tokens.len() - keep))
    }

    /// The longest prefix of `tokens` (up to `cap`) that sequence `slot` can hold without
    /// decoding: its own cache's, another sequence's (shared) or a parked cache's (restored).
    pub(super) fn reuse_prefix(&mut self, slot: usize, tokens: &[Token], cap: usize) -> usize {
        let own = common_prefix(&self.slots[slot].cached, tokens).min(cap);
        let keep = self.share_prefix(slot, tokens, own, cap);
        match self.unpark(slot, tokens, keep, cap) {
            Some(n) => n,
            // a failed restore emptied the sequence: share what another one holds
            None => self.share_prefix(slot, tokens, 0, cap),
        }
    }

    /// Parks every idle sequence's cache that holds cells of its own (beyond the prefix a
    /// busy sequence shares with it), least recently used first. Runs when a generation is
    /// admitted: the rows decoded from then on scan only the cells of replies in flight.
    pub(super) fn park_idle(&mut self) {
        let busy: Vec<usize> = (0..self.slots.len())
            .filter(|&i| self.slots[i].busy)
            .collect();
        let mut idle: Vec<usize> = (0..self.slots.len())
            .filter(|&i| {
                let c = &self.slots[i].cached;
                !self.slots[i].busy
                    && !c.is_empty()
                    && busy
                        .iter()
                        .all(|&j| common_prefix(c, &self.slots[j].cached) < c.len())
            })
            .collect();
        idle.sort_by_key(|&i| (self.slots[i].used, i));
        for i in idle {
            self.park(i);
        }
    }

    /// Moves sequence `slot`'s cache into host memory and empties the sequence; parked
    /// caches beyond the context's own number of cells or [`PARKED_BYTES_MAX`] go, oldest
    /// first. A cache that cannot be saved is dropped (its session's prompt is decoded again).
    pub(super) fn park(&mut self, slot: usize) {
        let state = self.ctx.save_seq(slot);
        let s = &mut self.slots[slot];
        let cached = std::mem::take(&mut s.cached);
        let block = std::mem::take(&mut s.block);
        let session = s.session.take();
        let used = s.used;
        self.ctx.truncate_seq(slot, 0);
        match state {
            Ok(state) => {
                self.parked.push(Parked {
                    cached,
                    block,
                    session,
                    used,
                    state,
                });
                self.stats
                    .parked
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => tracing::debug!(slot, error = %e, "idle cache dropped"),
        }
        let budget = self.ctx.kv_cells();
        let mut cells: usize = self.parked.iter().map(|p| p.cached.len()).sum();
        let mut bytes: usize = self.parked.iter().map(|p| p.state.len()).sum();
        while cells > budget || bytes > PARKED_BYTES_MAX {
            let Some(i) = (0..self.parked.len()).min_by_key(|&i| (self.parked[i].used, i)) else {
                break;
            };
            let p = self.parked.remove(i);
            cells -= p.cached.len();
            bytes -= p.state.len();
        }
    }

    /// When a parked cache holds a longer prefix of `tokens` (up to `cap`) than the `keep`
    /// positions sequence `slot` holds, restores it into `slot` (it stays parked unless
    /// `tokens` extend all of it) and returns the prefix `slot` now holds; `None` when the
    /// restore failed and left `slot` empty.
    pub(super) fn unpark(
        &mut self,
        slot: usize,
        tokens: &[Token],
        keep: usize,
        cap: usize,
    ) -> Option<usize> {
        let best = self
            .parked
            .iter()
            .enumerate()
            .map(|(i, p)| (common_prefix(&p.cached, tokens).min(cap), i))
            .max_by_key(|&(n, i)| (n, std::cmp::Reverse(i)));
        let Some((n, i)) = best.filter(|&(n, _)| n > keep) else {
            return Some(keep);
        };
        let whole = n == self.parked[i].cached.len();
        let restored = self.ctx.restore_seq(slot, &self.parked[i].state);
        let s = &mut self.slots[slot];
        match restored {
            Ok(()) => {
                // taken whole it leaves the parked list (moved, not copied); a shared prefix
                // stays parked for the others
                (s.cached, s.block) = if whole {
                    let p = self.parked.remove(i);
                    (p.cached, p.block)
                } else {
                    let p = &self.parked[i];
                    (p.cached.clone(), p.block.clone())
                };
                self.stats
                    .restored
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some(n)
            }
            Err(e) => {
                tracing::debug!(slot, error = %e, "parked cache not restored");
                s.cached.clear();
                s.block.clear();
                self.parked.remove(i);
                None
            }
        }
    }

    /// When another sequence holds a longer prefix of `tokens` (up to `cap`) than the `own`
    /// prefix sequence `slot` holds, shares its cells into `slot`; returns the prefix `slot`
    /// now holds. The same tokens are then decoded in the same chunks as on one sequence.
    pub(super) fn share_prefix(
        &mut self,
        slot: usize,
        tokens: &[Token],
        own: usize,
        cap: usize,
    ) -> usize {
        let donor = (0..self.slots.len())
            .filter(|&s| s != slot)
            .map(|s| (common_prefix(&self.slots[s].cached, tokens).min(cap), s))
            .max_by_key(|&(n, s)| (n, std::cmp::Reverse(s)));
        match donor.filter(|&(n, _)| n > own) {
            Some((n, src)) => {
                self.ctx.copy_prefix(src, slot, n);
                let b = self.slots[src].block.len().min(n * self.n_embd);
                let (cached, block) = (
                    self.slots[src].cached[..n].to_vec(),
                    self.slots[src].block[..b].to_vec(),
                );
                self.slots[slot].cached = cached;
                self.slots[slot].block = block;
                n
            }
            None => own,
        }
    }

    /// Drops sequence `slot`'s KV-cache entries (and captured block inputs) from `keep` on.
    pub(super) fn truncate_cache(&mut self, slot: usize, keep: usize) {
        self.ctx.truncate_seq(slot, keep);
        let s = &mut self.slots[slot];
        s.cached.truncate(keep);
        s.block.truncate(keep * self.n_embd);
    }

    /// Decodes consecutive tokens of one sequence ([`Worker::decode_rows`]).
    pub(super) fn decode(
        &mut self,
        slot: usize,
        tokens: &[Token],
        start: usize,
        outputs: &[bool],
    ) -> Result<Vec<f32>> {
        let rows: Vec<llama::Row> = tokens
            .iter()
            .zip(outputs)
            .enumerate()
            .map(|(i, (&token, &output))| llama::Row {
                token,
                pos: start + i,
                seq: slot,
                output,
            })
            .collect();
        self.decode_rows(&rows)
    }

    /// Decodes a batch of rows and keeps each sequence's cache record; returns the output rows'
    /// hidden states rounded as the output matmul rounds them. On failure every sequence in the
    /// batch is dropped (its cache state is unknown).
    pub(super) fn decode_rows(&mut self, rows: &[llama::Row]) -> Result<Vec<f32>> {
        match self.ctx.decode_rows(rows) {
            Ok(h) => {
                let block = if self.block_layer.is_some() {
                    self.ctx.take_block_rows()
                } else {
                    Vec::new()
                };
                let n = self.n_embd;
                for (i, r) in rows.iter().enumerate() {
                    let s = &mut self.slots[r.seq];
                    s.cached.push(r.token);
                    if let Some(b) = block.get(i * n..(i + 1) * n) {
                        s.block.extend_from_slice(b);
                    }
                }
                // store exactly what the output matmul multiplied with
                let mut out = Vec::with_capacity(h.len());
                for row in h.chunks_exact(n) {
                    out.extend(llama::round_through(self.act_type, row)?);
                }
                Ok(out)
            }
            Err(e) => {
                let mut seqs: Vec<usize> = rows.iter().map(|r| r.seq).collect();
                seqs.dedup();
                for s in seqs {
                    self.truncate_cache(s, 0);
                }
                Err(e)
            }
        }
    }
}
