//! The engine thread: the only owner of llama.cpp's model and context.
//!
//! Everything else talks to it through an [`Engine`] handle (a command channel with a reply
//! channel per request), from threads or from async code. The context holds `n_seq` KV
//! sequences in one unified cache. A generation takes a free sequence, which is brought up to
//! the session's tokens by keeping the longest common prefix it (or, shared by a cell copy,
//! another sequence) already holds and decoding the rest; then every decoding step advances
//! all generations in flight by one token in a single batch, and new requests join between
//! steps (continuous batching). Sampling, the output adapter's term, the behaviour log-probs
//! and the feature capture stay per row. With [`EngineConfig::park_idle`], idle sequences'
//! caches are moved out of the context (into host memory) when a generation is admitted and
//! restored when their session returns, so that rows do not scan idle sessions' cells.
//!
//! - this file: the public types (config, replies, counters), the commands the handle sends and
//!   the engine thread's state;
//! - [`handle`]: [`Engine`] and [`Lane`], what other threads hold;
//! - `scheduler`: loading, the receive loop, which request runs next;
//! - `cache`: KV sequences, prefix sharing, decoding rows, llama.cpp's block LoRA;
//! - `generate`: one decoding step for every generation in flight, per-row sampling and capture;
//! - `scoring`: teacher-forced scoring of references and of chosen positions.

use super::head::ServedAdapter;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc::UnboundedSender, oneshot};

use super::head::{is_digit_piece, output_types, FeatureDtype};
use super::llama::{self, Context, ContextParams, Model, Token};
use super::sampler::{self, Rng, SamplerParams};
use crate::error::{Error, Result};
use crate::policy::conversation::{Conversation, Message, PromptTurn, Role, Utf8Stream};

mod cache;
mod generate;
pub mod handle;
mod scheduler;
mod scoring;

pub use handle::{Engine, Lane};

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
    /// move idle sessions' caches out of the context into host memory between their turns
    /// (restored when the session returns) instead of keeping them in the unified cache, where
    /// every held cell costs attention time in every row decoded
    pub park_idle: bool,
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
            n_ctx: crate::config::DEFAULT_CTX,
            n_batch: 512,
            n_threads: crate::config::DEFAULT_THREADS,
            template: None,
            capture_hidden: true,
            block_k: None,
            n_seq: DEFAULT_N_SEQ,
            park_idle: true,
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
    pub block: Option<crate::policy::blocks::BlockFeatures>,
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

/// What a generation request asks for (a [`Command::Generate`] less its reply channel).
struct Request {
    session: u64,
    messages: Vec<Message>,
    params: SamplerParams,
    stream: Option<UnboundedSender<String>>,
    /// a reference scored after the prompt (text, with the adapter)
    reference: Option<(String, bool)>,
    /// an output adapter for this reply instead of the engine's ([`Engine::generate_with`])
    adapter: Option<(i64, Arc<dyn ServedAdapter>)>,
}

impl Request {
    /// A reply on the engine's adapter, with no reference.
    fn new(
        session: u64,
        messages: Vec<Message>,
        params: SamplerParams,
        stream: Option<UnboundedSender<String>>,
    ) -> Self {
        Request {
            session,
            messages,
            params,
            stream,
            reference: None,
            adapter: None,
        }
    }
}

enum Command {
    Generate {
        req: Request,
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
    /// the next number of a lane group's counter ([`Lane::ticket`])
    Ticket {
        group: u32,
        reply: Reply1<u64>,
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
    /// idle sequences' caches moved out of the context into host memory
    pub parked: std::sync::atomic::AtomicU64,
    /// parked caches put back into a sequence (a prefix not decoded again)
    pub restored: std::sync::atomic::AtomicU64,
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
    /// idle caches parked in host memory
    pub parked: u64,
    /// parked caches restored
    pub restored: u64,
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
            parked: self.parked.saturating_sub(before.parked),
            restored: self.restored.saturating_sub(before.restored),
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
            parked: self.parked + other.parked,
            restored: self.restored + other.restored,
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
            parked: self.parked.load(Relaxed),
            restored: self.restored.load(Relaxed),
        }
    }

    /// `(steps, rows, max_rows)` now.
    pub fn snapshot(&self) -> (u64, u64, u64) {
        let c = self.counters();
        (c.steps, c.rows, c.max_rows)
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

/// An idle sequence's cache moved out of the context ([`Worker::park_idle`]): llama.cpp's
/// serialised cells and what they hold.
struct Parked {
    /// the tokens whose positions the state holds
    cached: Vec<Token>,
    /// their captured block inputs (block capture on)
    block: Vec<f32>,
    /// the session that last generated in it
    session: Option<u64>,
    /// when its sequence was last taken
    used: u64,
    /// [`Context::save_seq`]'s bytes
    state: Vec<u8>,
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
    /// idle caches moved out of the context, oldest first
    parked: Vec<Parked>,
    /// [`EngineConfig::park_idle`]
    park_enabled: bool,
    /// counts slot uses (for least-recently-used)
    clock: u64,
    /// generations in flight, in the order they joined
    active: Vec<Gen>,
    /// requests not yet taken, in the order they will be
    queue: VecDeque<Envelope>,
    /// open lanes ([`Engine::lanes`])
    lanes: BTreeSet<u32>,
    /// the last adapter of a single reply ([`Engine::generate_with`]) found to carry the block
    /// LoRA the engine serves (dropped when that changes)
    override_checked: Option<Arc<dyn ServedAdapter>>,
    /// per group of lanes (its first lane id): how many lanes it has and the next ticket
    tickets: HashMap<u32, (u32, u64)>,
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

/// Host memory parked caches may take in all (the default model's cells take about 23 KB each,
/// so its 8 192-cell context parks at most ~190 MB; a larger model's cells are bigger).
const PARKED_BYTES_MAX: usize = 1 << 30;

/// Cells set aside for a reference scored after a prompt.
const REFERENCE_ROOM: usize = 256;

/// Length of the common prefix of two token sequences.
fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}
