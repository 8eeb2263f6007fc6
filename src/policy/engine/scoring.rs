//! Teacher-forced scoring: a reference answer's mean log-prob after a prefix, and the log-probs
//! and hidden states of chosen positions of any token sequence.

use super::*;

impl Worker {
    pub(super) fn score_reference(
        &mut self,
        slot: usize,
        mut tokens: Vec<Token>,
        after_assistant: bool,
        reference: &str,
        with_adapter: bool,
    ) -> Result<f64> {
        if after_assistant {
            tokens.extend(self.model.tokenize(&self.assistant_opening, false, true)?);
        }
        let start = tokens.len();
        tokens.extend(self.model.tokenize(reference, false, false)?);
        if tokens.len() == start || start == 0 {
            return Err(Error::Invalid(
                "an empty reference or context cannot be scored".into(),
            ));
        }
        let positions: Vec<usize> = (start..tokens.len()).collect();
        // the frozen policy unless asked for the adapter's; consecutive calls share the
        // session's prefix: only the new tail is decoded
        let adapter = self
            .adapter
            .as_ref()
            .filter(|_| with_adapter)
            .map(|a| a.1.clone());
        let r = self.rescore(slot, &tokens, &positions, true, adapter.as_deref())?;
        Ok(r.logp.iter().map(|&x| x as f64).sum::<f64>() / r.logp.len() as f64)
    }

    /// Log-probs and hidden states of `positions`, decoded in sequence `slot`. With
    /// `reuse_prefix` the cached prefix shared with `tokens` (up to the first scored row) is
    /// kept; without it everything is decoded from
    /// scratch in `n_batch` chunks, as an import's rescoring always is. With `adapter`, its
    /// low-rank term is added to every scored row's logits before the log-softmax.
    pub(super) fn rescore(
        &mut self,
        slot: usize,
        tokens: &[Token],
        positions: &[usize],
        reuse_prefix: bool,
        adapter: Option<&dyn ServedAdapter>,
    ) -> Result<Rescored> {
        if tokens.len() > self.n_ctx {
            return Err(Error::ContextOverflow {
                have: 0,
                adding: tokens.len(),
                needed: tokens.len(),
                n_ctx: self.n_ctx,
            });
        }
        let mut want = vec![false; tokens.len()];
        for &j in positions {
            if j == 0 || j >= tokens.len() {
                return Err(Error::Invalid(format!(
                    "position {j} cannot be scored in a sequence of {}",
                    tokens.len()
                )));
            }
            want[j - 1] = true;
        }
        let first_row = want.iter().position(|&w| w).unwrap_or(0);
        let keep = if reuse_prefix {
            self.reuse_prefix(slot, tokens, first_row)
        } else {
            0
        };
        self.truncate_cache(slot, keep);
        let mut by_row: HashMap<usize, (f32, Vec<f32>)> = HashMap::new();
        let nb = self.ctx.n_batch();
        let mut pos = keep;
        while pos < tokens.len() {
            let end = (pos + nb).min(tokens.len());
            let outputs = &want[pos..end];
            let h = self.decode(slot, &tokens[pos..end], pos, outputs)?;
            let rows = outputs
                .iter()
                .enumerate()
                .filter(|(_, &o)| o)
                .map(|(i, _)| i);
            for (k, i) in rows.enumerate() {
                let row = pos + i;
                let hs = h
                    .get(k * self.n_embd..(k + 1) * self.n_embd)
                    .unwrap_or(&[])
                    .to_vec();
                let adapted;
                let logits = match adapter {
                    Some(a) => {
                        let mut l = self.ctx.logits(i).to_vec();
                        a.apply(&hs, &mut l);
                        adapted = l;
                        &adapted[..]
                    }
                    None => self.ctx.logits(i),
                };
                let lp = logits[tokens[row + 1] as usize] as f64 - sampler::logsumexp(logits);
                by_row.insert(row, (lp as f32, hs));
            }
            pos = end;
        }
        let mut logp = Vec::with_capacity(positions.len());
        let mut hidden = Vec::with_capacity(positions.len() * self.n_embd);
        for &j in positions {
            let (lp, h) = &by_row[&(j - 1)];
            logp.push(*lp);
            hidden.extend_from_slice(h);
        }
        Ok(Rescored {
            positions: positions.to_vec(),
            logp,
            hidden,
        })
    }
}
