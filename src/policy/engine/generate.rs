//! One decoding step for every generation in flight: per-row sampling with the adapter's term,
//! the id slot and the shadow check, the behaviour log-probs and the feature capture, and
//! finishing a reply.

use super::*;

impl Worker {
    /// Takes a generation request: appends the messages, scores the reference, brings a free
    /// sequence up to the prompt and samples the first token; the request is then answered (it
    /// failed, or the reply ended at once) or in flight.
    pub(super) fn start_generation(
        &mut self,
        req: Request,
        reply: Reply1<Generation>,
        lane: Option<u32>,
    ) {
        let Request {
            session,
            messages,
            params,
            stream,
            reference,
            adapter,
        } = req;
        let previous = self.sessions.get(&session).cloned();
        let t_admit = Instant::now();
        let started = (|| {
            if params.max_tokens == 0 {
                return Err(Error::Invalid("max_tokens must be at least 1".into()));
            }
            if let Some((id, a)) = &adapter {
                // checked once per adapter and block LoRA: the check serialises the adapter's
                // block part, and a replay asks with the same adapter at every turn
                let known = self
                    .override_checked
                    .as_ref()
                    .is_some_and(|c| Arc::ptr_eq(c, a));
                if !known {
                    if a.block_gguf().as_ref() != self.lora.as_ref().map(|l| &l.0) {
                        return Err(Error::Invalid(format!(
                            "adapter {id} for one reply has another block LoRA than the engine serves"
                        )));
                    }
                    self.override_checked = Some(a.clone());
                }
            }
            let (prompt, conv) = self.append(session, messages, true, params.max_tokens)?;
            if self.park_enabled {
                // the session's own cache too: alone on the engine, a session then lays its
                // cells out as on a fresh one (restored from the start of the cache, in order)
                self.park_idle();
            }
            let slot = self.take_slot(Some(session), &conv.tokens);
            // room for the prompt, a reference scored after it, and the whole reply
            let need = conv.tokens.len() + params.max_tokens + REFERENCE_ROOM;
            self.make_room(slot, need);
            self.slots[slot].reserved = need;
            // the reference after the prompt: its tokens are decoded after the prompt and the
            // reply's sampling then keeps the prompt's cache (one row of it is decoded again)
            let reference_logp = match &reference {
                Some((r, a)) => {
                    Some(self.score_reference(slot, conv.tokens.clone(), false, r, *a)?)
                }
                None => None,
            };
            let t0 = Instant::now();
            let (h, logits, prefill_tokens) = self.sync(slot, &conv.tokens)?;
            Ok((
                prompt,
                conv,
                slot,
                reference_logp,
                h,
                logits,
                prefill_tokens,
                t0,
            ))
        })();
        let (prompt, conv, slot, reference_logp, h, logits, prefill_tokens, t0) = match started {
            Ok(s) => s,
            Err(e) => {
                self.restore_session(session, previous);
                let _ = reply.send(Err(e));
                return;
            }
        };
        let context_len = conv.tokens.len();
        tracing::debug!(
            session,
            slot,
            context_len,
            prefill_tokens,
            active = self.active.len(),
            "generation admitted"
        );
        {
            use std::sync::atomic::Ordering::Relaxed;
            self.stats
                .prefill_tokens
                .fetch_add(prefill_tokens as u64, Relaxed);
            self.stats
                .prefill_us
                .fetch_add(t_admit.elapsed().as_micros() as u64, Relaxed);
        }
        let mut g = Gen {
            session,
            lane,
            slot,
            previous,
            prompt,
            conv,
            rng: Rng::new(params.seed),
            stream,
            reference_logp,
            reply,
            utf8: Utf8Stream::default(),
            text: String::new(),
            rendered: Vec::new(),
            tokens: Vec::new(),
            logp_behavior: Vec::new(),
            logp_full: Vec::new(),
            support: Vec::new(),
            hidden: Vec::with_capacity(params.max_tokens.min(4096) * self.n_embd),
            visible_len: None,
            streamed: 0,
            adapter: adapter.or_else(|| self.adapter.clone()),
            shadow: self.shadow.clone().filter(|_| params.temperature <= 0.0),
            shadow_agrees: true,
            context_len,
            prefill_tokens,
            prefill_ms: t0.elapsed().as_secs_f64() * 1e3,
            t1: Instant::now(),
            next: (0, 0),
            params,
        };
        self.slots[slot].busy = true;
        self.slots[slot].session = Some(session);
        match self.sample(&mut g, h, logits) {
            Next::Decode => self.active.push(g),
            Next::Done(stop) => self.finish(g, stop),
        }
    }

    /// One decoding step: the next token of every generation in flight, in one batch.
    pub(super) fn step(&mut self) {
        let rows: Vec<llama::Row> = self
            .active
            .iter()
            .map(|g| llama::Row {
                token: g.next.0,
                pos: g.next.1,
                seq: g.slot,
                output: true,
            })
            .collect();
        let gens = std::mem::take(&mut self.active);
        {
            use std::sync::atomic::Ordering::Relaxed;
            self.stats.steps.fetch_add(1, Relaxed);
            self.stats.rows.fetch_add(rows.len() as u64, Relaxed);
            self.stats.max_rows.fetch_max(rows.len() as u64, Relaxed);
        }
        let t = Instant::now();
        let decoded = self.decode_rows(&rows);
        self.stats.step_us.fetch_add(
            t.elapsed().as_micros() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let h = match decoded {
            Ok(h) => h,
            Err(e) => {
                let msg = e.to_string();
                for g in gens {
                    self.fail(g, Error::Llama(msg.clone()));
                }
                return;
            }
        };
        let n = self.n_embd;
        for (i, mut g) in gens.into_iter().enumerate() {
            let hs = h.get(i * n..(i + 1) * n).unwrap_or(&[]).to_vec();
            let logits = self.ctx.logits(i).to_vec();
            match self.sample(&mut g, hs, logits) {
                Next::Decode => self.active.push(g),
                Next::Done(stop) => self.finish(g, stop),
            }
        }
    }

    /// Samples one token of `g` from the logits (and hidden state) of its last row.
    pub(super) fn sample(&self, g: &mut Gen, h: Vec<f32>, mut logits: Vec<f32>) -> Next {
        let p = &g.params;
        // the shadow's logits: the same base logits with its own low-rank term
        let mut shadow_logits = g.shadow.as_ref().map(|sh| {
            let mut l = logits.clone();
            sh.apply(&h, &mut l);
            l
        });
        if let Some((_, a)) = &g.adapter {
            a.apply(&h, &mut logits);
        }
        let slotted = self.constrain(&mut logits, &g.text, p);
        let digits = &self.digits;
        let is_digit = |t: i32| usize::try_from(t).is_ok_and(|t| digits.get(t) == Some(&true));
        let drawn_from = slotted.as_deref().unwrap_or(&logits);
        let dist = sampler::distribution_with(drawn_from, p, &is_digit);
        let mut s = sampler::sample_dist(drawn_from, &dist, &mut g.rng);
        // what the learner must mask to recompute this distribution from the logits:
        // the ignored end tokens and what the id slot took out
        let mut dropped: Vec<u32> = self.control.iter().map(|&t| t as u32).collect();
        if p.ignore_eog {
            dropped.extend(self.eog.iter().map(|&t| t as u32));
        }
        if let Some(sl) = slotted.as_deref() {
            dropped.extend(
                sl.iter()
                    .zip(&logits)
                    .enumerate()
                    .filter(|(_, (m, l))| m.is_infinite() && l.is_finite())
                    .map(|(i, _)| i as u32),
            );
        }
        g.support
            .push(sampler::Support::of(&dist, logits.len(), dropped));
        if let Some(sl) = shadow_logits.as_mut() {
            let masked = self.constrain(sl, &g.text, p);
            let mut top = sampler::top_k(masked.as_deref().unwrap_or(sl), 2);
            top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let wins = match top.as_slice() {
                [best, second, ..] => best.0 == s.token && best.1 - second.1 > SHADOW_MARGIN,
                [best] => best.0 == s.token,
                [] => false,
            };
            g.shadow_agrees &= wins;
        }
        if slotted.is_some() {
            // the full log-prob stays that of the unconstrained softmax, as the learner
            // computes it; the behaviour log-prob is the constrained distribution's
            s.logp_full = (logits[s.token as usize] as f64 - sampler::logsumexp(&logits)) as f32;
        }
        g.tokens.push(s.token);
        g.logp_behavior.push(s.logp_behavior);
        g.logp_full.push(s.logp_full);
        g.hidden.extend_from_slice(&h);
        g.rendered.extend(self.model.piece(s.token, true));
        if self.model.is_eog(s.token) {
            return Next::Done(StopReason::EndOfTurn);
        }
        let piece = g.utf8.push(&self.model.piece(s.token, false));
        if !piece.is_empty() {
            g.text.push_str(&piece);
            let cut = p
                .stop
                .iter()
                .filter_map(|st| g.text.find(st.as_str()))
                .min();
            let upto = cut.unwrap_or(g.text.len());
            if let Some(tx) = g.stream.as_ref().filter(|_| upto > g.streamed) {
                if tx.send(g.text[g.streamed..upto].to_string()).is_err() {
                    return Next::Done(StopReason::Cancelled);
                }
                g.streamed = upto;
            }
            if cut.is_some() {
                g.visible_len = cut;
                return Next::Done(StopReason::StopString);
            }
        }
        if g.tokens.len() >= p.max_tokens {
            return Next::Done(StopReason::MaxTokens);
        }
        g.next = (s.token, g.context_len + g.tokens.len() - 1);
        Next::Decode
    }

    /// Completes a reply: the session takes it, the block inputs it covered are attached, and
    /// the caller gets it.
    pub(super) fn finish(&mut self, g: Gen, stop: StopReason) {
        let Gen {
            session,
            slot,
            prompt,
            mut conv,
            reference_logp,
            reply,
            mut utf8,
            mut text,
            rendered,
            tokens,
            logp_behavior,
            logp_full,
            support,
            hidden,
            visible_len,
            adapter,
            shadow,
            shadow_agrees,
            context_len,
            prefill_tokens,
            prefill_ms,
            t1,
            ..
        } = g;
        text.push_str(&utf8.finish());
        let visible = text[..visible_len.unwrap_or(text.len())].to_string();
        conv.push_reply(text.clone(), &tokens, &String::from_utf8_lossy(&rendered));
        let block = self.block_layer.map(|layer| {
            // the sequence holds exactly this session's decoded positions now
            let s = &self.slots[slot];
            let end = s.cached.len();
            let first = self
                .block_given
                .get(&session)
                .copied()
                .unwrap_or(0)
                .min(end);
            let n = self.n_embd;
            crate::policy::blocks::BlockFeatures {
                layer,
                n_embd: n,
                first_pos: first,
                values: s
                    .block
                    .get(first * n..end * n)
                    .map(<[f32]>::to_vec)
                    .unwrap_or_default(),
            }
        });
        if let Some(b) = &block {
            self.block_given
                .insert(session, b.first_pos + b.values.len() / self.n_embd);
        }
        self.slots[slot].busy = false;
        self.sessions.insert(session, conv);
        let reply_value = Reply {
            text,
            visible,
            tokens,
            logp_behavior,
            logp_full,
            support,
            hidden,
            block,
            stop,
            context_len,
            prefill_tokens,
            prefill_ms,
            decode_ms: t1.elapsed().as_secs_f64() * 1e3,
            adapter_id: adapter.map(|(id, _)| id),
            shadow_agrees: shadow.map(|_| shadow_agrees),
        };
        let _ = reply.send(Ok(Generation {
            prompt,
            reply: reply_value,
            reference_logp,
        }));
    }

    /// Ends a generation with an error; its session is left as it was before the request.
    pub(super) fn fail(&mut self, g: Gen, e: Error) {
        self.slots[g.slot].busy = false;
        self.restore_session(g.session, g.previous);
        let _ = g.reply.send(Err(e));
    }

    pub(super) fn restore_session(&mut self, session: u64, previous: Option<Conversation>) {
        match previous {
            Some(c) => self.sessions.insert(session, c),
            None => self.sessions.remove(&session),
        };
    }

    /// Applies the request's constraints to `logits`: control tokens other than the end of a
    /// turn always and end-of-generation tokens with `ignore_eog` masked in place, and the id
    /// slot's mask as a masked copy (`None`: nothing masked).
    pub(super) fn constrain(
        &self,
        logits: &mut [f32],
        text: &str,
        p: &SamplerParams,
    ) -> Option<Vec<f32>> {
        for &t in &self.control {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        if p.ignore_eog {
            for &t in &self.eog {
                logits[t as usize] = f32::NEG_INFINITY;
            }
        }
        match &p.id_slot {
            Some(c) if sampler::id_slot_open(text) => self.mask_id_slot(logits, text, c),
            _ => None,
        }
    }

    /// `logits` with every token masked that would put a number outside `candidates` into the
    /// order-id slot of `text` ([`sampler::id_slot_allows`]); `None` when nothing is masked or
    /// everything would be. A token without a digit cannot write into the slot, only end it,
    /// so all of them share one verdict (that of ending the line here); only the tokens with a
    /// digit are checked one by one.
    pub(super) fn mask_id_slot(
        &self,
        logits: &[f32],
        text: &str,
        candidates: &[String],
    ) -> Option<Vec<f32>> {
        let end_ok = sampler::id_slot_allows(&format!("{text}\n"), candidates);
        let mut masked = if end_ok {
            logits.to_vec()
        } else {
            vec![f32::NEG_INFINITY; logits.len()]
        };
        // what changed and what is left, tracked while masking (no second pass over the
        // vocabulary): the tokens without a digit keep their logits exactly when `end_ok`
        let mut changed = !end_ok && logits.iter().any(|l| *l != f32::NEG_INFINITY);
        let mut any_left = end_ok && logits.iter().any(|l| l.is_finite());
        let mut buf = String::with_capacity(text.len() + 16);
        for (t, piece) in &self.digit_pieces {
            buf.clear();
            buf.push_str(text);
            buf.push_str(piece);
            let keep = sampler::id_slot_allows(&buf, candidates);
            let l = logits[*t];
            masked[*t] = if keep { l } else { f32::NEG_INFINITY };
            changed |= !keep && l != f32::NEG_INFINITY;
            any_left |= keep && l.is_finite();
        }
        (changed && any_left).then_some(masked)
    }
}
