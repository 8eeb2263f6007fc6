//! The engine thread: the only owner of llama.cpp's model and context.
//!
//! Everything else talks to it through an [`Engine`] handle (a command channel with a reply
//! channel per request), from threads or from async code. The context holds `n_seq` KV
//! sequences in one unified cache. A generation takes a free sequence, which is brought up to
//! the session's tokens by keeping the longest common prefix it (or, shared by a cell copy,
//! another sequence) already holds and decoding the rest; then every decoding step advances
//! all generations in flight by one token in a single batch, and new requests join between
//! steps (continuous batching). Sampling, the output adapter's term, the behaviour log-probs
//! and the feature capture stay per row.

use super::head::ServedAdapter;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use super::conversation::{Conversation, Message, PromptTurn, Role, Utf8Stream};
use super::head::{is_digit_piece, output_types, FeatureDtype};
use super::llama::{self, Context, ContextParams, Model, Token};
use super::sampler::{self, Rng, SamplerParams};
use crate::error::{Error, Result};

/// How the engine is set up.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// the GGUF model
    pub model: PathBuf,
    /// context window in tokens
    pub n_ctx: u32,
    /// prefill batch size
    pub n_batch: u32,
    /// CPU threads (log-probs depend on it; keep it fixed for a deployment)
    pub n_threads: i32,
    /// chat template override (a llama.cpp built-in name such as `chatml`, or template text)
    pub template: Option<String>,
    /// capture hidden states of sampled positions (needed for learning)
    pub capture_hidden: bool,
    /// capture, for every position, the input of the last `k` blocks (block LoRA's training
    /// data; llama.cpp then runs without flash attention, whose rounding the graph does not
    /// reproduce)
    pub block_k: Option<usize>,
    /// sessions generated at once: each has its own KV sequence of `n_ctx` tokens, and every
    /// decoding step advances all of them in one batch (continuous batching)
    pub n_seq: u32,
    /// show llama.cpp's own log
    pub verbose: bool,
}

/// Default number of sessions an engine generates at once ([`EngineConfig::n_seq`]).
pub const DEFAULT_N_SEQ: u32 = 4;

impl EngineConfig {
    /// Defaults for a model path: 2048-token context, 512-token batches, 2 threads, 4
    /// sequences.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineConfig {
            model: model.into(),
            n_ctx: 2048,
            n_batch: 512,
            n_threads: 2,
            template: None,
            capture_hidden: true,
            block_k: None,
            n_seq: DEFAULT_N_SEQ,
            verbose: false,
        }
    }
}

/// Facts about the loaded model.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelInfo {
    /// model file
    pub path: PathBuf,
    /// `general.name`
    pub name: String,
    /// vocabulary size
    pub n_vocab: usize,
    /// hidden width
    pub n_embd: usize,
    /// context window of the engine (per session)
    pub n_ctx: usize,
    /// sessions generated at once ([`EngineConfig::n_seq`])
    #[serde(default = "one")]
    pub n_seq: usize,
    /// threads used
    pub n_threads: i32,
    /// the chat template in use (name or text)
    pub template: String,
    /// how hidden states are stored (see [`FeatureDtype`])
    pub feature_dtype: FeatureDtype,
    /// the longest piece of text one token stands for, in bytes: a text of `b` bytes takes at
    /// least `b / max_piece_bytes` tokens (a context check before any tokenising)
    pub max_piece_bytes: usize,
}

/// Why a reply ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// the model sampled an end-of-generation token
    EndOfTurn,
    /// `max_tokens` was reached
    MaxTokens,
    /// a stop string appeared
    StopString,
    /// the caller went away (stream receiver dropped)
    Cancelled,
}

/// An assistant reply with everything needed to learn from it.
#[derive(Debug, Clone)]
pub struct Reply {
    /// decoded text of all sampled tokens, control tokens excluded
    pub text: String,
    /// the text to show: `text` cut before a stop string
    pub visible: String,
    /// sampled token ids (the end-of-turn token included when sampled)
    pub tokens: Vec<Token>,
    /// log-prob of each token under the distribution it was sampled from
    pub logp_behavior: Vec<f32>,
    /// log-prob of each token under the full softmax at temperature 1
    pub logp_full: Vec<f32>,
    /// per token, where the behaviour distribution had its mass (what the learner masks)
    pub support: Vec<sampler::Support>,
    /// final hidden state of each sampling position, `tokens.len() × n_embd`
    pub hidden: Vec<f32>,
    /// block inputs (with `EngineConfig::block_k`) of the positions this generation covered
    /// that an earlier reply of the session did not: the session's token sequence from
    /// `first_pos` up to the last decoded position
    pub block: Option<super::blocks::BlockFeatures>,
    /// why generation ended
    pub stop: StopReason,
    /// context length (tokens) before the first sampled token
    pub context_len: usize,
    /// tokens decoded to bring the context up to date before sampling
    pub prefill_tokens: usize,
    /// milliseconds of prefill
    pub prefill_ms: f64,
    /// milliseconds from the first sampled token to the end
    pub decode_ms: f64,
    /// the adapter that was applied to every token of this reply
    pub adapter_id: Option<i64>,
    /// with a shadow adapter ([`Engine::set_shadow`]) on a greedy reply: whether the shadow's
    /// own greedy choice was the token taken at every position, each by a margin of more than
    /// [`SHADOW_MARGIN`] (then the shadow, given this reply's context, writes this reply)
    pub shadow_agrees: Option<bool>,
}

/// Logit margin by which a shadow adapter's arg-max must win at every position for
/// [`Reply::shadow_agrees`]: llama.cpp's logits of the same tokens differ by ~1e-5 between
/// cache states, so a nearer tie could go either way when the shadow plays the session itself.
pub const SHADOW_MARGIN: f32 = 1e-3;

/// The result of a generation request.
#[derive(Debug, Clone)]
pub struct Generation {
    /// the messages appended before generating, with their tokens
    pub prompt: Vec<PromptTurn>,
    /// the reply
    pub reply: Reply,
    /// with [`Engine::generate_scoring`]: the mean log-prob of the reference as the
    /// assistant's reply to the prompt (frozen policy, or with the adapter, as asked), scored
    /// before the reply was sampled
    pub reference_logp: Option<f64>,
}

/// Log-probs and hidden states of chosen positions of a token sequence, from one prefill.
#[derive(Debug, Clone)]
pub struct Rescored {
    /// the positions scored (each `j` is the token predicted by row `j − 1`)
    pub positions: Vec<usize>,
    /// `log softmax(logits)[tokens[j]]` at temperature 1
    pub logp: Vec<f32>,
    /// hidden state of row `j − 1`, `positions.len() × n_embd`
    pub hidden: Vec<f32>,
}

fn one() -> usize {
    1
}

type Reply1<T> = oneshot::Sender<Result<T>>;

/// A command and the lane it came from ([`Engine::lanes`]).
struct Envelope {
    lane: Option<u32>,
    cmd: Command,
}

enum Command {
    Generate {
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        stream: Option<UnboundedSender<String>>,
        reference: Option<(String, bool)>,
        reply: Reply1<Generation>,
    },
    Append {
        session: u64,
        messages: Vec<Message>,
        reply: Reply1<Vec<PromptTurn>>,
    },
    Rescore {
        tokens: Vec<Token>,
        positions: Vec<usize>,
        reply: Reply1<Rescored>,
    },
    Tokens {
        session: u64,
        reply: Reply1<Vec<Token>>,
    },
    Tokenize {
        text: String,
        reply: Reply1<Vec<Token>>,
    },
    Close {
        session: u64,
    },
    SetAdapter {
        adapter: Option<(i64, Arc<dyn ServedAdapter>)>,
        reply: Reply1<()>,
    },
    SetShadow {
        adapter: Option<Arc<dyn ServedAdapter>>,
        reply: Reply1<()>,
    },
    Restore {
        session: u64,
        tokens: Vec<Token>,
        messages: Vec<Message>,
        reply: Reply1<()>,
    },
    ScoreReference {
        prefix: Vec<Token>,
        after_assistant: bool,
        reference: String,
        with_adapter: bool,
        reply: Reply1<f64>,
    },
    Reset {
        reply: Reply1<()>,
    },
    /// lanes that will send requests from now on ([`Engine::lanes`])
    Lanes {
        ids: Vec<u32>,
    },
    /// a lane that will send nothing more
    LaneDone {
        lane: u32,
    },
}

/// Counters of the engine's decoding steps (since it started).
#[derive(Debug, Default)]
pub struct EngineStats {
    /// batched decoding steps (one token of every generation in flight)
    pub steps: std::sync::atomic::AtomicU64,
    /// rows those steps decoded (sum of their batch sizes)
    pub rows: std::sync::atomic::AtomicU64,
    /// the largest batch of a step
    pub max_rows: std::sync::atomic::AtomicU64,
    /// microseconds spent in decoding steps
    pub step_us: std::sync::atomic::AtomicU64,
    /// prompt tokens decoded to admit requests (what a cached prefix did not cover)
    pub prefill_tokens: std::sync::atomic::AtomicU64,
    /// microseconds spent admitting requests (prefill, reference scoring, first sample)
    pub prefill_us: std::sync::atomic::AtomicU64,
}

/// [`EngineStats`]' counters at one moment, as plain numbers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// decoding steps
    pub steps: u64,
    /// rows those steps decoded
    pub rows: u64,
    /// the largest batch of a step (so far)
    pub max_rows: u64,
    /// microseconds in decoding steps
    pub step_us: u64,
    /// prompt tokens decoded at admission
    pub prefill_tokens: u64,
    /// microseconds admitting requests
    pub prefill_us: u64,
}

impl EngineCounters {
    /// What was counted between `before` and `self` (`max_rows` stays the largest so far).
    pub fn since(&self, before: &Self) -> Self {
        Self {
            steps: self.steps.saturating_sub(before.steps),
            rows: self.rows.saturating_sub(before.rows),
            max_rows: self.max_rows,
            step_us: self.step_us.saturating_sub(before.step_us),
            prefill_tokens: self.prefill_tokens.saturating_sub(before.prefill_tokens),
            prefill_us: self.prefill_us.saturating_sub(before.prefill_us),
        }
    }

    /// Two engines' counters together.
    pub fn plus(&self, other: &Self) -> Self {
        Self {
            steps: self.steps + other.steps,
            rows: self.rows + other.rows,
            max_rows: self.max_rows.max(other.max_rows),
            step_us: self.step_us + other.step_us,
            prefill_tokens: self.prefill_tokens + other.prefill_tokens,
            prefill_us: self.prefill_us + other.prefill_us,
        }
    }
}

impl EngineStats {
    /// Every counter now.
    pub fn counters(&self) -> EngineCounters {
        use std::sync::atomic::Ordering::Relaxed;
        EngineCounters {
            steps: self.steps.load(Relaxed),
            rows: self.rows.load(Relaxed),
            max_rows: self.max_rows.load(Relaxed),
            step_us: self.step_us.load(Relaxed),
            prefill_tokens: self.prefill_tokens.load(Relaxed),
            prefill_us: self.prefill_us.load(Relaxed),
        }
    }

    /// `(steps, rows, max_rows)` now.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        let c = self.counters();
        (c.steps, c.rows, c.max_rows)
    }
}

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
}

impl std::ops::Deref for Lane {
    type Target = Engine;
    fn deref(&self) -> &Engine {
        &self.engine
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
        super::gguf::GgufIndex::open(&cfg.model)?;
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
        Self::wait(self.call(|reply| Command::Generate {
            session,
            messages,
            params,
            stream,
            reference: None,
            reply,
        }))
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
        Self::wait(self.call(|reply| Command::Generate {
            session,
            messages,
            params,
            stream: None,
            reference,
            reply,
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
        let rx = self.call(|reply| Command::Generate {
            session,
            messages,
            params,
            stream,
            reference: None,
            reply,
        });
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

/// One KV sequence of the context and what its cache holds.
#[derive(Default)]
struct Slot {
    /// tokens in this sequence's KV cache
    cached: Vec<Token>,
    /// the captured block input of every cached position, `cached.len() × n_embd`
    block: Vec<f32>,
    /// the session that last generated here (its prefix is most likely still cached)
    session: Option<u64>,
    /// a generation is running in it
    busy: bool,
    /// while busy: the length its generation may reach (its share of the cell budget)
    reserved: usize,
    /// when it was last taken (the least recently used free slot is taken first)
    used: u64,
}

/// A generation in flight: the state of one reply between decoding steps.
struct Gen {
    session: u64,
    lane: Option<u32>,
    slot: usize,
    /// the session before this request (restored if it fails)
    previous: Option<Conversation>,
    prompt: Vec<PromptTurn>,
    conv: Conversation,
    params: SamplerParams,
    stream: Option<UnboundedSender<String>>,
    reference_logp: Option<f64>,
    reply: Reply1<Generation>,
    rng: Rng,
    utf8: Utf8Stream,
    text: String,
    rendered: Vec<u8>,
    tokens: Vec<Token>,
    logp_behavior: Vec<f32>,
    logp_full: Vec<f32>,
    support: Vec<sampler::Support>,
    hidden: Vec<f32>,
    visible_len: Option<usize>,
    streamed: usize,
    adapter: Option<(i64, Arc<dyn ServedAdapter>)>,
    shadow: Option<Arc<dyn ServedAdapter>>,
    shadow_agrees: bool,
    context_len: usize,
    prefill_tokens: usize,
    prefill_ms: f64,
    /// when the first token was sampled
    t1: Instant,
    /// the sampled token to decode next, at this position
    next: (Token, usize),
}

/// What a sampling step leaves to do.
enum Next {
    /// decode `Gen::next` and sample again
    Decode,
    /// the reply is complete
    Done(StopReason),
}

struct Worker {
    // field order matters: the context must drop before the LoRA it uses, both before the model
    ctx: Context,
    /// the block LoRA llama.cpp applies (the adapter's `block` part), as loaded
    lora: Option<(Vec<u8>, llama::LoraAdapter)>,
    model: Model,
    info: ModelInfo,
    n_embd: usize,
    /// tokens per session
    n_ctx: usize,
    /// replies generated at once (the context has more sequences: the rest keep caches)
    parallel: usize,
    sessions: HashMap<u64, Conversation>,
    /// the token that closes an assistant message in the template
    turn_end: Token,
    /// template text that opens an assistant message right after a closed one
    assistant_opening: String,
    /// ggml type hidden states are rounded through (the output matmul's activation type)
    act_type: u32,
    /// end-of-generation tokens (masked when `ignore_eog`)
    eog: Vec<Token>,
    /// control tokens that do not end a turn (`<|im_start|>`, …): never sampled, so that what
    /// the engine appends is exactly what the client sees and the log holds
    control: Vec<Token>,
    /// per token id: its piece writes only digits (for `greedy_digits`)
    digits: Vec<bool>,
    /// the tokens whose text holds an ASCII digit, with that text: the only ones that can
    /// write into the id slot of `SamplerParams::id_slot` (every other token can only end it)
    digit_pieces: Vec<(usize, String)>,
    /// the context's KV sequences
    slots: Vec<Slot>,
    /// counts slot uses (for least-recently-used)
    clock: u64,
    /// generations in flight, in the order they joined
    active: Vec<Gen>,
    /// requests not yet taken, in the order they will be
    queue: VecDeque<Envelope>,
    /// open lanes ([`Engine::lanes`])
    lanes: BTreeSet<u32>,
    /// N of the captured `l_out-N` (block capture on)
    block_layer: Option<usize>,
    /// per session: positions whose block inputs an earlier reply already returned
    block_given: HashMap<u64, usize>,
    /// adapter applied to the logits before sampling
    adapter: Option<(i64, Arc<dyn ServedAdapter>)>,
    /// adapter whose greedy choices are checked against greedy replies
    shadow: Option<Arc<dyn ServedAdapter>>,
    stats: Arc<EngineStats>,
}

/// Sequences per reply in flight: the extra ones hold idle sessions' KV caches.
const CACHE_SEQ_FACTOR: u32 = 8;

/// Cells set aside for a reference scored after a prompt.
const REFERENCE_ROOM: usize = 256;

/// Length of the common prefix of two token sequences.
fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Worker {
    fn load(cfg: &EngineConfig, stats: Arc<EngineStats>) -> Result<Worker> {
        llama::init_backend(cfg.verbose);
        let model = Model::load(&cfg.model, 0)?;
        let n_ctx = cfg.n_ctx.min(model.n_ctx_train().max(256) as u32);
        let block_layer = match cfg.block_k {
            None => None,
            Some(k) => {
                let idx = super::gguf::GgufIndex::open(&cfg.model)?;
                let hp = super::blocks::Hparams::from_index(&idx)?;
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
        super::conversation::render(&template, &[Message::new(Role::User, "hi")], true)?;
        let (_, act_type) = output_types(&cfg.model)?;
        let turn_end = super::conversation::turn_end_token(&model, &template)?;
        let assistant_opening =
            super::conversation::assistant_opening(&model, &template, turn_end)?;
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
            clock: 0,
            active: Vec::new(),
            queue: VecDeque::new(),
            lanes: BTreeSet::new(),
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
    fn run(&mut self, rx: mpsc::Receiver<Envelope>) {
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
            if !self.active.is_empty() {
                self.step();
            }
        }
    }

    fn receive(&mut self, e: Envelope) {
        match e.cmd {
            Command::Lanes { ids } => self.lanes.extend(ids),
            Command::LaneDone { lane } => {
                self.lanes.remove(&lane);
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
    fn lane_working(&self) -> bool {
        self.lanes.iter().any(|&l| {
            !self
                .queue
                .iter()
                .any(|e| e.lane == Some(l) && !matches!(e.cmd, Command::Close { .. }))
                && !self.active.iter().any(|g| g.lane == Some(l))
        })
    }

    fn generating(&self, session: u64) -> bool {
        self.active.iter().any(|g| g.session == session)
    }

    fn free_slot(&self) -> bool {
        self.active.len() < self.parallel && self.slots.iter().any(|s| !s.busy)
    }

    /// Empties idle sequences, least recently used first, until `need` more cells fit in the
    /// cache next to what the others hold (a busy sequence counts what it may still grow to).
    fn make_room(&mut self, slot: usize, need: usize) {
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
                Some(v) => self.truncate_cache(v, 0),
                None => return,
            }
        }
    }

    /// Whether a request can be taken now: a generation needs a free sequence and its session
    /// idle; a switch of adapter waits until every generation in flight has finished (they end
    /// on the adapter they started with).
    fn can_start(&self, cmd: &Command) -> bool {
        match cmd {
            Command::Generate { session, .. } => !self.generating(*session) && self.free_slot(),
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
            Command::Tokenize { .. } | Command::Lanes { .. } | Command::LaneDone { .. } => true,
        }
    }

    fn execute(&mut self, e: Envelope) {
        let lane = e.lane;
        match e.cmd {
            Command::Generate {
                session,
                messages,
                params,
                stream,
                reference,
                reply,
            } => {
                self.start_generation(session, messages, params, stream, reference, reply, lane);
            }
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
            Command::Lanes { .. } | Command::LaneDone { .. } => {}
        }
    }

    /// Picks the free sequence for a request on `tokens`: one whose whole cache is a prefix of
    /// them (nothing in it is lost), the longest such; otherwise the least recently used (ties
    /// by index, so the choice is a function of the request history alone). A prefix that
    /// another sequence holds is shared into the chosen one by [`Worker::sync`], so no
    /// session's cache is taken over just for a common system prompt.
    fn take_slot(&mut self, session: Option<u64>, tokens: &[Token]) -> usize {
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

    /// Makes `block` the LoRA llama.cpp applies inside the blocks (loaded from a GGUF LoRA
    /// written to a temporary file), unless it already is. llama.cpp keeps the KV cache on a
    /// switch, so every cached position — computed under the other adapter — is dropped; the
    /// previous adapter is freed once the context no longer holds it. Runs only when no
    /// generation is in flight.
    fn set_block(&mut self, block: Option<Vec<u8>>) -> Result<()> {
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
        self.lora = loaded;
        Ok(())
    }

    /// Appends messages to a copy of the session and checks the context budget (`reserve`
    /// tokens for the reply) before committing the copy.
    fn append(
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
    fn sync(&mut self, slot: usize, tokens: &[Token]) -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let own = common_prefix(&self.slots[slot].cached, tokens);
        let mut keep = self.share_prefix(slot, tokens, own, tokens.len());
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

    /// When another sequence holds a longer prefix of `tokens` (up to `cap`) than the `own`
    /// prefix sequence `slot` holds, shares its cells into `slot`; returns the prefix `slot`
    /// now holds. The same tokens are then decoded in the same chunks as on one sequence.
    fn share_prefix(&mut self, slot: usize, tokens: &[Token], own: usize, cap: usize) -> usize {
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
    fn truncate_cache(&mut self, slot: usize, keep: usize) {
        self.ctx.truncate_seq(slot, keep);
        let s = &mut self.slots[slot];
        s.cached.truncate(keep);
        s.block.truncate(keep * self.n_embd);
    }

    /// Decodes consecutive tokens of one sequence ([`Worker::decode_rows`]).
    fn decode(
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
    fn decode_rows(&mut self, rows: &[llama::Row]) -> Result<Vec<f32>> {
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

    /// Takes a generation request: appends the messages, scores the reference, brings a free
    /// sequence up to the prompt and samples the first token; the request is then answered (it
    /// failed, or the reply ended at once) or in flight.
    #[allow(clippy::too_many_arguments)]
    fn start_generation(
        &mut self,
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        stream: Option<UnboundedSender<String>>,
        reference: Option<(String, bool)>,
        reply: Reply1<Generation>,
        lane: Option<u32>,
    ) {
        let previous = self.sessions.get(&session).cloned();
        let t_admit = Instant::now();
        let started = (|| {
            if params.max_tokens == 0 {
                return Err(Error::Invalid("max_tokens must be at least 1".into()));
            }
            let (prompt, conv) = self.append(session, messages, true, params.max_tokens)?;
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
            adapter: self.adapter.clone(),
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
    fn step(&mut self) {
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
    fn sample(&self, g: &mut Gen, h: Vec<f32>, mut logits: Vec<f32>) -> Next {
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
    fn finish(&mut self, g: Gen, stop: StopReason) {
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
            super::blocks::BlockFeatures {
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
    fn fail(&mut self, g: Gen, e: Error) {
        self.slots[g.slot].busy = false;
        self.restore_session(g.session, g.previous);
        let _ = g.reply.send(Err(e));
    }

    fn restore_session(&mut self, session: u64, previous: Option<Conversation>) {
        match previous {
            Some(c) => self.sessions.insert(session, c),
            None => self.sessions.remove(&session),
        };
    }

    /// Applies the request's constraints to `logits`: control tokens other than the end of a
    /// turn always and end-of-generation tokens with `ignore_eog` masked in place, and the id
    /// slot's mask as a masked copy (`None`: nothing masked).
    fn constrain(&self, logits: &mut [f32], text: &str, p: &SamplerParams) -> Option<Vec<f32>> {
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
    fn mask_id_slot(&self, logits: &[f32], text: &str, candidates: &[String]) -> Option<Vec<f32>> {
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

    fn score_reference(
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
    fn rescore(
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
            let own = common_prefix(&self.slots[slot].cached, tokens).min(first_row);
            self.share_prefix(slot, tokens, own, first_row)
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
