//! The handle other threads hold: [`Engine`] and its [`Lane`]s send commands to the engine
//! thread and wait for the reply.

use super::*;

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Envelope>,
    info: Arc<ModelInfo>,
    /// false once the engine thread has ended (returned or panicked)
    alive: Arc<std::sync::atomic::AtomicBool>,
    /// the lane this handle's requests belong to
    lane: Option<u32>,
    /// the next free lane id
    lane_ids: Arc<std::sync::atomic::AtomicU32>,
    stats: Arc<EngineStats>,
}

/// A handle whose requests the engine schedules deterministically with those of its sibling
/// lanes ([`Engine::lanes`]); dropping it tells the engine that the lane is finished.
pub struct Lane {
    engine: Engine,
    /// the first lane id of the group it was opened with (its ticket counter)
    group: u32,
}

impl std::ops::Deref for Lane {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
    }
}

impl Lane {
    /// The next number (0, 1, 2, …) of a counter shared by the lanes opened together: a queue
    /// of work its lanes take from as each gets free. Like every lane request it is answered in
    /// lane order among the lanes that ask before the same decoding step, so which lane draws
    /// which number is a function of what the lanes asked, not of thread timing: a seeded run
    /// that hands out jobs by ticket repeats exactly, and no lane sits idle while another still
    /// has a queue of its own.
    ///
    /// # Errors
    /// [`Error::EngineGone`].
    pub fn ticket(&self) -> Result<u64> {
        let group = self.group;
        Engine::wait(self.engine.call(|reply| Command::Ticket { group, reply }))
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        if let Some(lane) = self.engine.lane {
            let _ = self.engine.tx.send(Envelope {
                lane: None,
                cmd: Command::LaneDone { lane },
            });
        }
    }
}

/// Clears the liveness flag when the engine thread ends, however it ends.
struct AliveGuard(Arc<std::sync::atomic::AtomicBool>);

impl Drop for AliveGuard {
    fn drop(&mut self) {
        self.0.store(false, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Engine {
    /// Loads the model on a new thread and returns a handle once it is ready.
    ///
    /// # Errors
    /// [`Error::BadModel`] for a file that is not a loadable GGUF model; context errors.
    pub fn start(cfg: EngineConfig) -> Result<Engine> {
        crate::policy::gguf::GgufIndex::open(&cfg.model)?;
        let (tx, rx) = mpsc::channel();
        let (ready_tx, ready_rx) = mpsc::channel();
        let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let guard = AliveGuard(alive.clone());
        let stats = Arc::new(EngineStats::default());
        let worker_stats = stats.clone();
        std::thread::Builder::new()
            .name("turnwise-engine".into())
            .spawn(move || {
                let _guard = guard;
                match Worker::load(&cfg, worker_stats) {
                    Ok(mut w) => {
                        let _ = ready_tx.send(Ok(w.info.clone()));
                        w.run(rx);
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| Error::Llama(format!("cannot spawn engine thread: {e}")))?;
        let info = ready_rx.recv().map_err(|_| Error::EngineGone)??;
        Ok(Engine {
            tx,
            info: Arc::new(info),
            alive,
            lane: None,
            lane_ids: Arc::new(std::sync::atomic::AtomicU32::new(0)),
            stats,
        })
    }

    /// Counters of the batched decoding steps.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// `n` lanes: handles, one per thread, whose requests the engine schedules as a function
    /// of what they ask, not of when it arrives. While lanes are open the engine takes a
    /// decoding step only when every lane is either waiting for a reply or finished, and it
    /// takes waiting requests in lane order; so which sessions share a batch, which KV sequence
    /// each uses and which cells it gets repeat exactly when the lanes' requests do (a seeded
    /// run plays the same tokens), however the threads are timed. A lane must keep calling the
    /// engine until it is dropped: the engine waits for it.
    pub fn lanes(&self, n: usize) -> Vec<Lane> {
        let first = self
            .lane_ids
            .fetch_add(n as u32, std::sync::atomic::Ordering::SeqCst);
        let ids: Vec<u32> = (first..first + n as u32).collect();
        let _ = self.tx.send(Envelope {
            lane: None,
            cmd: Command::Lanes { ids: ids.clone() },
        });
        ids.into_iter()
            .map(|id| Lane {
                engine: Engine {
                    lane: Some(id),
                    ..self.clone()
                },
                group: first,
            })
            .collect()
    }

    /// Whether the engine thread is still running (it ends only by panicking, or when every
    /// handle is dropped).
    pub fn is_alive(&self) -> bool {
        self.alive.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Facts about the loaded model.
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn call<T>(&self, make: impl FnOnce(Reply1<T>) -> Command) -> oneshot::Receiver<Result<T>> {
        let (tx, rx) = oneshot::channel();
        // a send error drops `tx`, so the receiver reports EngineGone
        let _ = self.tx.send(Envelope {
            lane: self.lane,
            cmd: make(tx),
        });
        rx
    }

    fn request(&self, req: Request) -> oneshot::Receiver<Result<Generation>> {
        self.call(|reply| Command::Generate { req, reply })
    }

    fn wait<T>(rx: oneshot::Receiver<Result<T>>) -> Result<T> {
        rx.blocking_recv().map_err(|_| Error::EngineGone)?
    }

    /// Appends `messages` to a session (created on first use) and generates the assistant's
    /// reply. Text pieces are sent to `stream` as they are produced; dropping its receiver
    /// cancels generation. Blocking; see [`Engine::generate_async`] for async callers.
    ///
    /// # Errors
    /// [`Error::ContextOverflow`] when the prompt plus `max_tokens` does not fit (the session is
    /// left unchanged); llama.cpp and template errors.
    pub fn generate(
        &self,
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        stream: Option<UnboundedSender<String>>,
    ) -> Result<Generation> {
        Self::wait(self.request(Request::new(session, messages, params, stream)))
    }

    /// [`Engine::generate`] that first scores `reference` as the assistant's reply to the
    /// prompt, while the prompt is in the KV cache ([`Generation::reference_logp`]; the same
    /// number as [`Engine::score_reference_by`] on the prompt's tokens, frozen policy or with
    /// the adapter). Only the reference's tokens are decoded for it; the reply is sampled after
    /// it as it would have been without.
    ///
    /// # Errors
    /// As [`Engine::generate`]; [`Error::Invalid`] for an empty reference.
    pub fn generate_scoring(
        &self,
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        reference: &str,
        with_adapter: bool,
    ) -> Result<Generation> {
        let reference = Some((reference.to_string(), with_adapter));
        Self::wait(self.request(Request {
            reference,
            ..Request::new(session, messages, params, None)
        }))
    }

    /// [`Engine::generate`] with `adapter`'s output term instead of the engine's current
    /// adapter, for this reply only: replies on two adapters can then share decoding steps (the
    /// demo's validation gate replays the active adapter beside the candidate's sessions). The
    /// adapter's block LoRA, if any, must be the one the engine serves: llama.cpp applies that
    /// to every row of a step alike.
    ///
    /// # Errors
    /// As [`Engine::generate`]; [`Error::Invalid`] when the adapter does not fit the model or
    /// its block LoRA is not the engine's.
    pub fn generate_with<A: ServedAdapter + 'static>(
        &self,
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        adapter: (i64, Arc<A>),
    ) -> Result<Generation> {
        adapter.1.check_model(self.info.n_embd, self.info.n_vocab)?;
        let adapter = Some((adapter.0, adapter.1 as Arc<dyn ServedAdapter>));
        Self::wait(self.request(Request {
            adapter,
            ..Request::new(session, messages, params, None)
        }))
    }

    /// Async form of [`Engine::generate`].
    ///
    /// # Errors
    /// As [`Engine::generate`].
    pub async fn generate_async(
        &self,
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        stream: Option<UnboundedSender<String>>,
    ) -> Result<Generation> {
        let rx = self.request(Request::new(session, messages, params, stream));
        rx.await.map_err(|_| Error::EngineGone)?
    }

    /// Appends messages without generating. Assistant messages are appended as the tokens the
    /// model would have sampled for them (content, then the end-of-turn token).
    ///
    /// # Errors
    /// Template and tokenizer errors; [`Error::ContextOverflow`].
    pub fn append(&self, session: u64, messages: Vec<Message>) -> Result<Vec<PromptTurn>> {
        Self::wait(self.call(|reply| Command::Append {
            session,
            messages,
            reply,
        }))
    }

    /// One prefill over `tokens`, returning the temperature-1 log-prob of `tokens[j]` and the
    /// hidden state that predicted it, for each `j` in `positions` (each `>= 1`). It runs on an
    /// emptied KV cache (after the generations in flight), so the numbers do not depend on the
    /// engine's history.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a bad position; [`Error::ContextOverflow`]; llama.cpp errors.
    pub fn rescore(&self, tokens: Vec<Token>, positions: Vec<usize>) -> Result<Rescored> {
        Self::wait(self.call(|reply| Command::Rescore {
            tokens,
            positions,
            reply,
        }))
    }

    /// The context tokens of a session.
    ///
    /// # Errors
    /// [`Error::UnknownSession`].
    pub fn session_tokens(&self, session: u64) -> Result<Vec<Token>> {
        Self::wait(self.call(|reply| Command::Tokens { session, reply }))
    }

    /// Tokenises plain text (no control tokens parsed, no BOS).
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn tokenize(&self, text: &str) -> Result<Vec<Token>> {
        let text = text.to_string();
        Self::wait(self.call(|reply| Command::Tokenize { text, reply }))
    }

    /// Switches the adapter applied at sampling time (`None`: the base model). The switch takes
    /// effect between requests: a generation in progress finishes on the adapter it started with.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the adapter's shapes do not fit the model.
    pub fn set_adapter<A: ServedAdapter + 'static>(
        &self,
        adapter: Option<(i64, Arc<A>)>,
    ) -> Result<()> {
        if let Some((_, a)) = &adapter {
            a.check_model(self.info.n_embd, self.info.n_vocab)?;
        }
        let adapter = adapter.map(|(id, a)| (id, a as Arc<dyn ServedAdapter>));
        Self::wait(self.call(|reply| Command::SetAdapter { adapter, reply }))
    }

    /// Sets a shadow adapter (`None`: none), checked on greedy replies only: at every position
    /// the engine also takes the shadow's arg-max over the same base logits and the same masks,
    /// and [`Reply::shadow_agrees`] says whether it was the token taken every time. A greedy
    /// session whose every reply agrees is the session the shadow would have played itself, so
    /// a comparison of two adapters on the same scenarios only has to replay the others. Like
    /// [`Engine::set_adapter`], it takes effect between requests.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the adapter's shapes do not fit the model.
    pub fn set_shadow<A: ServedAdapter + 'static>(&self, adapter: Option<Arc<A>>) -> Result<()> {
        if let Some(a) = &adapter {
            a.check_model(self.info.n_embd, self.info.n_vocab)?;
        }
        let adapter = adapter.map(|a| a as Arc<dyn ServedAdapter>);
        Self::wait(self.call(|reply| Command::SetShadow { adapter, reply }))
    }

    /// Teacher-forced score of a ground-truth answer: the mean log-prob of `reference`'s tokens
    /// as the assistant's reply after the context `prefix` (the frozen policy, adapter off). When
    /// `prefix` ends with an assistant turn, the template's opening of a new assistant message is
    /// inserted first. One prefill; used for information gain.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an empty reference; [`Error::ContextOverflow`]; llama.cpp errors.
    pub fn score_reference(
        &self,
        prefix: Vec<Token>,
        after_assistant: bool,
        reference: &str,
    ) -> Result<f64> {
        self.score_reference_by(prefix, after_assistant, reference, false)
    }

    /// [`Engine::score_reference`] by the frozen policy (`with_adapter` false: adapter off) or
    /// by the policy that samples (`true`: with the engine's current adapter applied to every
    /// scored position's logits, as sampling applies it).
    ///
    /// # Errors
    /// As [`Engine::score_reference`].
    pub fn score_reference_by(
        &self,
        prefix: Vec<Token>,
        after_assistant: bool,
        reference: &str,
        with_adapter: bool,
    ) -> Result<f64> {
        let reference = reference.to_string();
        Self::wait(self.call(|reply| Command::ScoreReference {
            prefix,
            after_assistant,
            reference,
            with_adapter,
            reply,
        }))
    }

    /// Restores a session from its stored tokens and messages (e.g. after a restart), so that it
    /// continues token-exact: the rendered text is the tokens' own text, control tokens included.
    ///
    /// # Errors
    /// [`Error::ContextOverflow`] when the tokens do not fit.
    pub fn restore(&self, session: u64, tokens: Vec<Token>, messages: Vec<Message>) -> Result<()> {
        Self::wait(self.call(|reply| Command::Restore {
            session,
            tokens,
            messages,
            reply,
        }))
    }

    /// Brings the engine's cache to its canonical state: waits for the generations in flight,
    /// then drops every cached cell of every sequence and forgets which sequence was used last,
    /// so the next request decodes from cell 0 of sequence 0. A session started after a reset,
    /// with nothing else generating beside it, gets numbers that depend only on its own tokens
    /// (llama.cpp's sums depend on where cells sit and on what else shares a batch); the
    /// demo's evaluations run that way. Sessions keep their token history and are re-decoded
    /// when they ask again.
    ///
    /// # Errors
    /// [`Error::EngineGone`].
    pub fn reset(&self) -> Result<()> {
        Self::wait(self.call(|reply| Command::Reset { reply }))
    }

    /// Forgets a session's in-memory state (its log stays in the store).
    pub fn close(&self, session: u64) {
        let _ = self.tx.send(Envelope {
            lane: self.lane,
            cmd: Command::Close { session },
        });
    }
}
