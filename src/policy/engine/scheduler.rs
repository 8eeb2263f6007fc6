//! The engine thread's loop: loading the model, receiving commands, and deciding which request
//! runs next (lanes in a fixed order, generations joining between decoding steps).

use super::*;

impl Worker {
    pub(super) fn load(cfg: &EngineConfig, stats: Arc<EngineStats>) -> Result<Worker> {
        llama::init_backend(cfg.verbose);
        let model = Model::load(&cfg.model, 0)?;
        let n_ctx = cfg.n_ctx.min(model.n_ctx_train().max(256) as u32);
        let block_layer = match cfg.block_k {
            None => None,
            Some(k) => {
                let idx = crate::policy::gguf::GgufIndex::open(&cfg.model)?;
                let hp = crate::policy::blocks::Hparams::from_index(&idx)?;
                if k == 0 || k >= hp.n_layer {
                    return Err(Error::Invalid(format!(
                        "block capture of the last {k} of {} blocks",
                        hp.n_layer
                    )));
                }
                Some(hp.n_layer - k - 1)
            }
        };
        if cfg.n_seq == 0 || cfg.n_seq > 64 {
            return Err(Error::Invalid(format!(
                "{} sequences per engine (1 to 64)",
                cfg.n_seq
            )));
        }
        let ctx = Context::new(
            &model,
            ContextParams {
                n_ctx,
                n_batch: cfg.n_batch,
                n_threads: cfg.n_threads,
                capture_hidden: cfg.capture_hidden,
                capture_block: block_layer,
                // more sequences than replies in flight: the others keep idle sessions'
                // caches, within the same budget of cells (least recently used go first)
                n_seq: (cfg.n_seq * CACHE_SEQ_FACTOR).min(256),
                kv_cells: Some(n_ctx.saturating_mul(cfg.n_seq)),
            },
        )?;
        let template = match (&cfg.template, model.chat_template()) {
            (Some(t), _) => t.clone(),
            (None, Some(t)) => t,
            (None, None) => {
                tracing::warn!("model has no chat template; using chatml");
                "chatml".to_string()
            }
        };
        // fail now, not on the first message, if llama.cpp cannot render this template
        crate::policy::conversation::render(&template, &[Message::new(Role::User, "hi")], true)?;
        let (_, act_type) = output_types(&cfg.model)?;
        let turn_end = crate::policy::conversation::turn_end_token(&model, &template)?;
        let assistant_opening =
            crate::policy::conversation::assistant_opening(&model, &template, turn_end)?;
        let mut info = ModelInfo {
            path: cfg.model.clone(),
            name: model
                .meta("general.name")
                .unwrap_or_else(|| "unknown".into()),
            n_vocab: model.n_vocab(),
            n_embd: model.n_embd(),
            n_ctx: ctx.n_ctx(),
            n_seq: cfg.n_seq as usize,
            n_threads: cfg.n_threads,
            template,
            feature_dtype: FeatureDtype::for_activation(act_type),
            max_piece_bytes: 1,
        };
        tracing::info!(model = %info.name, n_ctx = info.n_ctx, n_seq = info.n_seq, "policy engine ready");
        let eog = (0..model.n_vocab() as Token)
            .filter(|&t| model.is_eog(t))
            .collect();
        let control = (0..model.n_vocab() as Token)
            .filter(|&t| model.is_control(t) && !model.is_eog(t))
            .collect();
        let mut digits = Vec::with_capacity(model.n_vocab());
        let mut digit_pieces = Vec::new();
        for t in 0..model.n_vocab() as Token {
            let bytes = model.piece(t, false);
            info.max_piece_bytes = info.max_piece_bytes.max(bytes.len());
            let piece = String::from_utf8_lossy(&bytes).into_owned();
            digits.push(is_digit_piece(&piece));
            if piece.bytes().any(|b| b.is_ascii_digit()) && !model.is_eog(t) {
                digit_pieces.push((t as usize, piece));
            }
        }
        Ok(Worker {
            lora: None,
            block_layer,
            block_given: HashMap::new(),
            assistant_opening,
            turn_end,
            act_type,
            eog,
            control,
            digits,
            digit_pieces,
            n_embd: model.n_embd(),
            n_ctx: ctx.n_ctx(),
            parallel: cfg.n_seq as usize,
            slots: (0..ctx.n_seq()).map(|_| Slot::default()).collect(),
            parked: Vec::new(),
            park_enabled: cfg.park_idle,
            clock: 0,
            active: Vec::new(),
            queue: VecDeque::new(),
            lanes: BTreeSet::new(),
            tickets: HashMap::new(),
            override_checked: None,
            ctx,
            model,
            info,
            sessions: HashMap::new(),
            adapter: None,
            shadow: None,
            stats,
        })
    }

    /// The scheduler: takes requests, starts what can start, and advances every generation in
    /// flight by one token per step, all in one batch.
    pub(super) fn run(&mut self, rx: mpsc::Receiver<Envelope>) {
        let mut open = true;
        loop {
            // wait for a lane that is between requests, or for work when there is none
            let idle = self.active.is_empty() && self.queue.is_empty();
            if open && (idle || self.lane_working()) {
                match rx.recv() {
                    Ok(e) => self.receive(e),
                    Err(_) => {
                        open = false;
                        self.lanes.clear();
                    }
                }
                continue;
            }
            if !open && idle {
                return;
            }
            while let Ok(e) = rx.try_recv() {
                self.receive(e);
            }
            if self.lane_working() {
                continue;
            }
            if !self.lanes.is_empty() {
                // every lane has sent what it will send before this step: take the requests
                // in lane order, not arrival order
                self.queue
                    .make_contiguous()
                    .sort_by_key(|e| e.lane.map_or(0, |l| u64::from(l) + 1));
            }
            while self.queue.front().is_some_and(|e| self.can_start(&e.cmd)) {
                if let Some(e) = self.queue.pop_front() {
                    self.execute(e);
                }
            }
            // a lane just answered (a ticket, a tokenisation, …) sends its next request before
            // the step, so that it joins it instead of the next one
            if !self.active.is_empty() && !self.lane_working() {
                self.step();
            }
        }
    }

    pub(super) fn receive(&mut self, e: Envelope) {
        match e.cmd {
            Command::Lanes { ids } => {
                if let Some(&first) = ids.first() {
                    self.tickets.insert(first, (ids.len() as u32, 0));
                }
                self.lanes.extend(ids);
            }
            Command::LaneDone { lane } => {
                self.lanes.remove(&lane);
                let lanes = &self.lanes;
                self.tickets
                    .retain(|&first, &mut (n, _)| lanes.range(first..first + n).next().is_some());
            }
            cmd => self.queue.push_back(Envelope { lane: e.lane, cmd }),
        }
    }

    /// Whether an open lane is between requests: nothing of it that it waits for is in the
    /// queue and no reply of it is being generated, so it will send something (or finish) —
    /// the engine waits. A queued `Close` does not count: a lane sends it without waiting and
    /// goes on to its next request, and a step taken before that request arrives would make
    /// which batch the next session joins depend on thread timing (seen as evaluations that
    /// differed between two runs of one seed after a session ended on a lane).
    pub(super) fn lane_working(&self) -> bool {
        self.lanes.iter().any(|&l| {
            !self
                .queue
                .iter()
                .any(|e| e.lane == Some(l) && !matches!(e.cmd, Command::Close { .. }))
                && !self.active.iter().any(|g| g.lane == Some(l))
        })
    }

    pub(super) fn generating(&self, session: u64) -> bool {
        self.active.iter().any(|g| g.session == session)
    }

    pub(super) fn free_slot(&self) -> bool {
        self.active.len() < self.parallel && self.slots.iter().any(|s| !s.busy)
    }

    /// Empties idle sequences, least recently used first, until `need` more cells fit in the
    /// cache next to what the others hold (a busy sequence counts what it may still grow to).
    pub(super) fn make_room(&mut self, slot: usize, need: usize) {
        let budget = self.ctx.kv_cells();
        loop {
            let held: usize = self
                .slots
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != slot)
                .map(|(_, s)| {
                    if s.busy {
                        s.reserved.max(s.cached.len())
                    } else {
                        s.cached.len()
                    }
                })
                .sum();
            if held + need <= budget {
                return;
            }
            let victim = self
                .slots
                .iter()
                .enumerate()
                .filter(|&(i, s)| i != slot && !s.busy && !s.cached.is_empty())
                .min_by_key(|&(i, s)| (s.used, i))
                .map(|(i, _)| i);
            match victim {
                Some(v) if self.park_enabled => self.park(v),
                Some(v) => self.truncate_cache(v, 0),
                None => return,
            }
        }
    }

    /// Whether a request can be taken now: a generation needs a free sequence and its session
    /// idle; a switch of adapter waits until every generation in flight has finished (they end
    /// on the adapter they started with).
    pub(super) fn can_start(&self, cmd: &Command) -> bool {
        match cmd {
            Command::Generate { req, .. } => !self.generating(req.session) && self.free_slot(),
            Command::Append { session, .. }
            | Command::Tokens { session, .. }
            | Command::Close { session }
            | Command::Restore { session, .. } => !self.generating(*session),
            Command::ScoreReference { .. } => self.free_slot(),
            // a rescoring starts from an empty cache, so it waits for the generations too
            Command::Rescore { .. }
            | Command::Reset { .. }
            | Command::SetAdapter { .. }
            | Command::SetShadow { .. } => self.active.is_empty(),
            Command::Tokenize { .. }
            | Command::Ticket { .. }
            | Command::Lanes { .. }
            | Command::LaneDone { .. } => true,
        }
    }

    pub(super) fn execute(&mut self, e: Envelope) {
        let lane = e.lane;
        match e.cmd {
            Command::Generate { req, reply } => self.start_generation(req, reply, lane),
            Command::Append {
                session,
                messages,
                reply,
            } => {
                let _ = reply.send(self.append(session, messages, false, 0).map(|(t, _)| t));
            }
            Command::Rescore {
                tokens,
                positions,
                reply,
            } => {
                // from an empty cache: its numbers do not depend on what was cached before
                self.ctx.clear();
                for s in &mut self.slots {
                    s.cached.clear();
                    s.block.clear();
                }
                self.parked.clear();
                let slot = self.take_slot(None, &[]);
                let _ = reply.send(self.rescore(slot, &tokens, &positions, false, None));
            }
            Command::Reset { reply } => {
                self.ctx.clear();
                for s in &mut self.slots {
                    s.cached.clear();
                    s.block.clear();
                    s.used = 0;
                }
                self.parked.clear();
                self.clock = 0;
                let _ = reply.send(Ok(()));
            }
            Command::Tokens { session, reply } => {
                let r = self
                    .sessions
                    .get(&session)
                    .map(|c| c.tokens.clone())
                    .ok_or(Error::UnknownSession(session));
                let _ = reply.send(r);
            }
            Command::Tokenize { text, reply } => {
                let _ = reply.send(self.model.tokenize(&text, false, false));
            }
            Command::Close { session } => {
                self.sessions.remove(&session);
                self.block_given.remove(&session);
                self.parked.retain(|p| p.session != Some(session));
                // its cache goes now, all but the prefix another sequence shares (a system
                // prompt, a common opening): in a unified cache every held cell costs attention
                // time in every row decoded after it, whichever sequence it belongs to
                for i in 0..self.slots.len() {
                    if self.slots[i].session == Some(session) && !self.slots[i].busy {
                        self.slots[i].used = 0;
                        self.slots[i].session = None;
                        let shared = (0..self.slots.len())
                            .filter(|&j| j != i)
                            .map(|j| common_prefix(&self.slots[i].cached, &self.slots[j].cached))
                            .max()
                            .unwrap_or(0);
                        self.truncate_cache(i, shared);
                    }
                }
            }
            Command::Restore {
                session,
                tokens,
                messages,
                reply,
            } => {
                let r = if tokens.len() > self.n_ctx {
                    Err(Error::ContextOverflow {
                        have: tokens.len(),
                        adding: 0,
                        needed: tokens.len(),
                        n_ctx: self.n_ctx,
                    })
                } else {
                    // a BOS the tokenizer added has no text in the rendered template
                    let skip = usize::from(self.model.add_bos() && !tokens.is_empty());
                    let bytes: Vec<u8> = tokens[skip..]
                        .iter()
                        .flat_map(|&t| self.model.piece(t, true))
                        .collect();
                    let rendered = String::from_utf8_lossy(&bytes).into_owned();
                    self.block_given.remove(&session);
                    self.sessions.insert(
                        session,
                        Conversation {
                            messages,
                            tokens,
                            rendered,
                        },
                    );
                    Ok(())
                };
                let _ = reply.send(r);
            }
            Command::ScoreReference {
                prefix,
                after_assistant,
                reference,
                with_adapter,
                reply,
            } => {
                let slot = self.take_slot(None, &prefix);
                self.make_room(slot, prefix.len() + REFERENCE_ROOM);
                let r =
                    self.score_reference(slot, prefix, after_assistant, &reference, with_adapter);
                let _ = reply.send(r);
            }
            Command::SetAdapter { adapter, reply } => {
                let r = self.set_block(adapter.as_ref().and_then(|(_, a)| a.block_gguf()));
                if r.is_ok() {
                    self.adapter = adapter;
                }
                let _ = reply.send(r);
            }
            Command::SetShadow { adapter, reply } => {
                self.shadow = adapter;
                let _ = reply.send(Ok(()));
            }
            Command::Ticket { group, reply } => {
                let r = match self.tickets.get_mut(&group) {
                    Some((_, next)) => {
                        *next += 1;
                        Ok(*next - 1)
                    }
                    None => Err(Error::Invalid(format!("no open lane group {group}"))),
                };
                let _ = reply.send(r);
            }
            Command::Lanes { .. } | Command::LaneDone { .. } => {}
        }
    }

    /// Picks the free sequence for a request on `tokens`: one whose whole cache is a prefix of
    /// them (nothing in it is lost), the longest such; otherwise the least recently used (ties
    /// by index, so the choice is a function of the request history alone). A prefix that
    /// another sequence holds is shared into the chosen one by [`Worker::sync`], so no
    /// session's cache is taken over just for a common system prompt.
    pub(super) fn take_slot(&mut self, session: Option<u64>, tokens: &[Token]) -> usize {
        let best = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.busy)
            .max_by_key(|(i, s)| {
                let lcp = common_prefix(&s.cached, tokens);
                let extends = lcp == s.cached.len();
                (
                    extends,
                    if extends { lcp } else { 0 },
                    session.is_some() && s.session == session,
                    std::cmp::Reverse(s.used),
                    std::cmp::Reverse(*i),
                )
            })
            .map(|(i, _)| i)
            .unwrap_or(0);
        self.clock += 1;
        self.slots[best].used = self.clock;
        best
    }
}
