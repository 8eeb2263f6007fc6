//! The engine thread: the only owner of llama.cpp's model and context.
//!
//! Everything else talks to it through an [`Engine`] handle (a command channel with a reply
//! channel per request), from threads or from async code. The context holds one sequence; a
//! session's tokens are synchronised into it by keeping the longest common prefix of what is
//! cached and decoding the rest, so switching between sessions costs only their divergent tail.

use std::collections::HashMap;
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
use crate::adapter::Adapter;
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
    /// show llama.cpp's own log
    pub verbose: bool,
}

impl EngineConfig {
    /// Defaults for a model path: 2048-token context, 512-token batches, 2 threads.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        EngineConfig {
            model: model.into(),
            n_ctx: 2048,
            n_batch: 512,
            n_threads: 2,
            template: None,
            capture_hidden: true,
            block_k: None,
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
    /// context window of the engine
    pub n_ctx: usize,
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
    pub block: Option<crate::store::BlockFeatures>,
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

type Reply1<T> = oneshot::Sender<Result<T>>;

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
        adapter: Option<(i64, Arc<Adapter>)>,
        reply: Reply1<()>,
    },
    SetShadow {
        adapter: Option<Arc<Adapter>>,
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
}

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    info: Arc<ModelInfo>,
    /// false once the engine thread has ended (returned or panicked)
    alive: Arc<std::sync::atomic::AtomicBool>,
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
        std::thread::Builder::new()
            .name("turnwise-engine".into())
            .spawn(move || {
                let _guard = guard;
                match Worker::load(&cfg) {
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
        })
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
        let _ = self.tx.send(make(tx));
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
    /// hidden state that predicted it, for each `j` in `positions` (each `>= 1`).
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
    pub fn set_adapter(&self, adapter: Option<(i64, Arc<Adapter>)>) -> Result<()> {
        if let Some((_, a)) = &adapter {
            a.check_model(self.info.n_embd, self.info.n_vocab)?;
        }
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
    pub fn set_shadow(&self, adapter: Option<Arc<Adapter>>) -> Result<()> {
        if let Some(a) = &adapter {
            a.check_model(self.info.n_embd, self.info.n_vocab)?;
        }
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

    /// Forgets a session's in-memory state (its log stays in the store).
    pub fn close(&self, session: u64) {
        let _ = self.tx.send(Command::Close { session });
    }
}

struct Worker {
    // field order matters: the context must drop before the LoRA it uses, both before the model
    ctx: Context,
    /// the block LoRA llama.cpp applies (the adapter's `block` part), as loaded
    lora: Option<(crate::adapter::block::BlockLora, llama::LoraAdapter)>,
    model: Model,
    info: ModelInfo,
    n_embd: usize,
    sessions: HashMap<u64, Conversation>,
    /// the token that closes an assistant message in the template
    turn_end: Token,
    /// template text that opens an assistant message right after a closed one
    assistant_opening: String,
    /// ggml type hidden states are rounded through (the output matmul's activation type)
    act_type: u32,
    /// end-of-generation tokens (masked when `ignore_eog`)
    eog: Vec<Token>,
    /// per token id: its piece writes only digits (for `greedy_digits`)
    digits: Vec<bool>,
    /// the tokens whose text holds an ASCII digit, with that text: the only ones that can
    /// write into the id slot of `SamplerParams::id_slot` (every other token can only end it)
    digit_pieces: Vec<(usize, String)>,
    /// tokens currently in the KV cache
    cached: Vec<Token>,
    /// N of the captured `l_out-N` (block capture on)
    block_layer: Option<usize>,
    /// the captured block input of every cached position, `cached.len() × n_embd`
    cached_block: Vec<f32>,
    /// per session: positions whose block inputs an earlier reply already returned
    block_given: HashMap<u64, usize>,
    /// adapter applied to the logits before sampling
    adapter: Option<(i64, Arc<Adapter>)>,
    /// adapter whose greedy choices are checked against greedy replies
    shadow: Option<Arc<Adapter>>,
}

impl Worker {
    fn load(cfg: &EngineConfig) -> Result<Worker> {
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
        let ctx = Context::new(
            &model,
            ContextParams {
                n_ctx,
                n_batch: cfg.n_batch,
                n_threads: cfg.n_threads,
                capture_hidden: cfg.capture_hidden,
                capture_block: block_layer,
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
            n_threads: cfg.n_threads,
            template,
            feature_dtype: FeatureDtype::for_activation(act_type),
            max_piece_bytes: 1,
        };
        tracing::info!(model = %info.name, n_ctx = info.n_ctx, "policy engine ready");
        let eog = (0..model.n_vocab() as Token)
            .filter(|&t| model.is_eog(t))
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
            cached_block: Vec::new(),
            block_given: HashMap::new(),
            assistant_opening,
            turn_end,
            act_type,
            eog,
            digits,
            digit_pieces,
            n_embd: model.n_embd(),
            ctx,
            model,
            info,
            sessions: HashMap::new(),
            cached: Vec::new(),
            adapter: None,
            shadow: None,
        })
    }

    fn run(&mut self, rx: mpsc::Receiver<Command>) {
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Command::Generate {
                    session,
                    messages,
                    params,
                    stream,
                    reference,
                    reply,
                } => {
                    let r = self.generate(
                        session,
                        messages,
                        &params,
                        stream.as_ref(),
                        reference.as_ref().map(|(r, a)| (r.as_str(), *a)),
                    );
                    let _ = reply.send(r);
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
                    let _ = reply.send(self.rescore(&tokens, &positions, false, None));
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
                }
                Command::Restore {
                    session,
                    tokens,
                    messages,
                    reply,
                } => {
                    let r = if tokens.len() > self.ctx.n_ctx() {
                        Err(Error::ContextOverflow {
                            have: tokens.len(),
                            adding: 0,
                            needed: tokens.len(),
                            n_ctx: self.ctx.n_ctx(),
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
                    let r = self.score_reference(prefix, after_assistant, &reference, with_adapter);
                    let _ = reply.send(r);
                }
                Command::SetAdapter { adapter, reply } => {
                    let r = self.set_block(adapter.as_ref().and_then(|(_, a)| a.block.as_ref()));
                    if r.is_ok() {
                        self.adapter = adapter;
                    }
                    let _ = reply.send(r);
                }
                Command::SetShadow { adapter, reply } => {
                    self.shadow = adapter;
                    let _ = reply.send(Ok(()));
                }
            }
        }
    }

    /// Makes `block` the LoRA llama.cpp applies inside the blocks (loaded from a GGUF LoRA
    /// written to a temporary file), unless it already is. llama.cpp keeps the KV cache on a
    /// switch, so every cached position — computed under the other adapter — is dropped; the
    /// previous adapter is freed once the context no longer holds it.
    fn set_block(&mut self, block: Option<&crate::adapter::block::BlockLora>) -> Result<()> {
        let same = match (&self.lora, block) {
            (None, None) => true,
            (Some((cur, _)), Some(new)) => cur == new,
            _ => false,
        };
        if same {
            return Ok(());
        }
        let loaded = match block {
            None => None,
            Some(b) => {
                let path = std::env::temp_dir().join(format!(
                    "turnwise-block-{}-{:x}.gguf",
                    std::process::id(),
                    self as *const Worker as usize
                ));
                std::fs::write(&path, b.to_gguf()).map_err(|e| Error::io(&path, e))?;
                let l = llama::LoraAdapter::load(&self.model, &path);
                let _ = std::fs::remove_file(&path);
                Some((b.clone(), l?))
            }
        };
        self.ctx.set_lora(loaded.as_ref().map(|(_, l)| l))?;
        self.truncate_cache(0);
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
        if needed > self.ctx.n_ctx() {
            return Err(Error::ContextOverflow {
                have: before,
                adding: needed - before,
                needed,
                n_ctx: self.ctx.n_ctx(),
            });
        }
        self.sessions.insert(session, conv.clone());
        Ok((turns, conv))
    }

    /// Brings the KV cache to `tokens` and returns the hidden state and logits of the last row.
    fn sync(&mut self, tokens: &[Token]) -> Result<(Vec<f32>, Vec<f32>, usize)> {
        let mut keep = self
            .cached
            .iter()
            .zip(tokens)
            .take_while(|(a, b)| a == b)
            .count();
        if keep == tokens.len() {
            keep = keep.saturating_sub(1); // we need the last row's logits again
        }
        self.truncate_cache(keep);
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
            let h = self.decode(chunk, pos, &outputs)?;
            if is_last {
                last = (h, self.ctx.logits(chunk.len() - 1).to_vec());
            }
            pos = end;
        }
        Ok((last.0, last.1, tokens.len() - keep))
    }

    /// Drops KV-cache entries (and their captured block inputs) from position `keep` on.
    fn truncate_cache(&mut self, keep: usize) {
        self.ctx.truncate(keep);
        self.cached.truncate(keep);
        self.cached_block.truncate(keep * self.n_embd);
    }

    fn decode(&mut self, tokens: &[Token], start: usize, outputs: &[bool]) -> Result<Vec<f32>> {
        match self.ctx.decode(tokens, start, outputs) {
            Ok(h) => {
                self.cached.extend_from_slice(tokens);
                if self.block_layer.is_some() {
                    let rows = self.ctx.take_block_rows();
                    self.cached_block.extend_from_slice(&rows);
                }
                // store exactly what the output matmul multiplied with
                let mut out = Vec::with_capacity(h.len());
                for row in h.chunks_exact(self.n_embd) {
                    out.extend(llama::round_through(self.act_type, row)?);
                }
                Ok(out)
            }
            Err(e) => {
                // the cache state is unknown after a failed decode: start over next time
                self.truncate_cache(0);
                Err(e)
            }
        }
    }

    fn generate(
        &mut self,
        session: u64,
        messages: Vec<Message>,
        p: &SamplerParams,
        stream: Option<&UnboundedSender<String>>,
        reference: Option<(&str, bool)>,
    ) -> Result<Generation> {
        if p.max_tokens == 0 {
            return Err(Error::Invalid("max_tokens must be at least 1".into()));
        }
        let previous = self.sessions.get(&session).cloned();
        let (prompt, conv) = self.append(session, messages, true, p.max_tokens)?;
        // the reference after the prompt: its tokens are decoded after the prompt and the
        // reply's sampling then keeps the prompt's cache (one row of it is decoded again)
        let scored = match reference {
            Some((r, a)) => self
                .score_reference(conv.tokens.clone(), false, r, a)
                .map(Some),
            None => Ok(None),
        };
        let result = scored.and_then(|lp| self.sample_reply(conv, p, stream).map(|r| (r, lp)));
        match result {
            Ok(((conv, mut reply), reference_logp)) => {
                if let Some(layer) = self.block_layer {
                    // the cache holds exactly this session's decoded positions now
                    let end = self.cached.len();
                    let first = self
                        .block_given
                        .get(&session)
                        .copied()
                        .unwrap_or(0)
                        .min(end);
                    let n = self.n_embd;
                    reply.block = Some(crate::store::BlockFeatures {
                        layer,
                        n_embd: n,
                        first_pos: first,
                        values: self.cached_block[first * n..end * n].to_vec(),
                    });
                    self.block_given.insert(session, end);
                }
                self.sessions.insert(session, conv);
                Ok(Generation {
                    prompt,
                    reply,
                    reference_logp,
                })
            }
            Err(e) => {
                // leave the session as it was before this request
                match previous {
                    Some(c) => self.sessions.insert(session, c),
                    None => self.sessions.remove(&session),
                };
                Err(e)
            }
        }
    }

    fn sample_reply(
        &mut self,
        mut conv: Conversation,
        p: &SamplerParams,
        stream: Option<&UnboundedSender<String>>,
    ) -> Result<(Conversation, Reply)> {
        let t0 = Instant::now();
        let context_len = conv.tokens.len();
        let (mut h, mut logits, prefill_tokens) = self.sync(&conv.tokens)?;
        let prefill_ms = t0.elapsed().as_secs_f64() * 1e3;
        let t1 = Instant::now();
        let mut rng = Rng::new(p.seed);
        let mut utf8 = Utf8Stream::default();
        let (mut text, mut rendered) = (String::new(), Vec::<u8>::new());
        let mut tokens = Vec::new();
        let (mut lb, mut lf) = (Vec::new(), Vec::new());
        let mut support = Vec::new();
        let mut hidden = Vec::with_capacity(p.max_tokens * self.n_embd);
        let mut visible_len = None;
        let mut streamed = 0usize;
        let adapter = self.adapter.clone();
        let shadow = self.shadow.clone().filter(|_| p.temperature <= 0.0);
        let mut shadow_agrees = true;
        let stop = loop {
            // the shadow's logits: the same base logits with its own low-rank term
            let mut shadow_logits = shadow.as_ref().map(|sh| {
                let mut l = logits.clone();
                sh.apply(&h, &mut l);
                l
            });
            if let Some((_, a)) = &adapter {
                a.apply(&h, &mut logits);
            }
            let slotted = self.constrain(&mut logits, &text, p);
            let digits = &self.digits;
            let is_digit = |t: i32| usize::try_from(t).is_ok_and(|t| digits.get(t) == Some(&true));
            let drawn_from = slotted.as_deref().unwrap_or(&logits);
            let dist = sampler::distribution_with(drawn_from, p, &is_digit);
            let mut s = sampler::sample_dist(drawn_from, &dist, &mut rng);
            // what the learner must mask to recompute this distribution from the logits:
            // the ignored end tokens and what the id slot took out
            let mut dropped: Vec<u32> = Vec::new();
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
            support.push(sampler::Support::of(&dist, logits.len(), dropped));
            if let Some(sl) = shadow_logits.as_mut() {
                let masked = self.constrain(sl, &text, p);
                let mut top = sampler::top_k(masked.as_deref().unwrap_or(sl), 2);
                top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
                let wins = match top.as_slice() {
                    [best, second, ..] => best.0 == s.token && best.1 - second.1 > SHADOW_MARGIN,
                    [best] => best.0 == s.token,
                    [] => false,
                };
                shadow_agrees &= wins;
            }
            if slotted.is_some() {
                // the full log-prob stays that of the unconstrained softmax, as the learner
                // computes it; the behaviour log-prob is the constrained distribution's
                s.logp_full =
                    (logits[s.token as usize] as f64 - sampler::logsumexp(&logits)) as f32;
            }
            tokens.push(s.token);
            lb.push(s.logp_behavior);
            lf.push(s.logp_full);
            hidden.extend_from_slice(&h);
            rendered.extend(self.model.piece(s.token, true));
            if self.model.is_eog(s.token) {
                break StopReason::EndOfTurn;
            }
            let piece = utf8.push(&self.model.piece(s.token, false));
            if !piece.is_empty() {
                text.push_str(&piece);
                let cut = p.stop.iter().filter_map(|st| text.find(st.as_str())).min();
                let upto = cut.unwrap_or(text.len());
                if let Some(tx) = stream.filter(|_| upto > streamed) {
                    if tx.send(text[streamed..upto].to_string()).is_err() {
                        break StopReason::Cancelled;
                    }
                    streamed = upto;
                }
                if cut.is_some() {
                    visible_len = cut;
                    break StopReason::StopString;
                }
            }
            if tokens.len() >= p.max_tokens {
                break StopReason::MaxTokens;
            }
            let pos = context_len + tokens.len() - 1;
            h = self.decode(&[s.token], pos, &[true])?;
            logits = self.ctx.logits(0).to_vec();
        };
        text.push_str(&utf8.finish());
        let visible = text[..visible_len.unwrap_or(text.len())].to_string();
        conv.push_reply(text.clone(), &tokens, &String::from_utf8_lossy(&rendered));
        let reply = Reply {
            text,
            visible,
            tokens,
            logp_behavior: lb,
            logp_full: lf,
            support,
            hidden,
            block: None,
            stop,
            context_len,
            prefill_tokens,
            prefill_ms,
            decode_ms: t1.elapsed().as_secs_f64() * 1e3,
            adapter_id: adapter.map(|(id, _)| id),
            shadow_agrees: shadow.map(|_| shadow_agrees),
        };
        Ok((conv, reply))
    }

    /// Applies the request's constraints to `logits`: end-of-generation tokens masked in place
    /// with `ignore_eog`, and the id slot's mask as a masked copy (`None`: nothing masked).
    fn constrain(&self, logits: &mut [f32], text: &str, p: &SamplerParams) -> Option<Vec<f32>> {
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
        let r = self.rescore(&tokens, &positions, true, adapter.as_deref())?;
        Ok(r.logp.iter().map(|&x| x as f64).sum::<f64>() / r.logp.len() as f64)
    }

    /// Log-probs and hidden states of `positions`. With `reuse_prefix` the cached prefix shared
    /// with `tokens` (up to the first scored row) is kept; without it everything is decoded from
    /// scratch in `n_batch` chunks, as an import's rescoring always is. With `adapter`, its
    /// low-rank term is added to every scored row's logits before the log-softmax.
    fn rescore(
        &mut self,
        tokens: &[Token],
        positions: &[usize],
        reuse_prefix: bool,
        adapter: Option<&Adapter>,
    ) -> Result<Rescored> {
        if tokens.len() > self.ctx.n_ctx() {
            return Err(Error::ContextOverflow {
                have: 0,
                adding: tokens.len(),
                needed: tokens.len(),
                n_ctx: self.ctx.n_ctx(),
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
            self.cached
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(first_row)
        } else {
            0
        };
        self.truncate_cache(keep);
        let mut by_row: HashMap<usize, (f32, Vec<f32>)> = HashMap::new();
        let nb = self.ctx.n_batch();
        let mut pos = keep;
        while pos < tokens.len() {
            let end = (pos + nb).min(tokens.len());
            let outputs = &want[pos..end];
            let h = self.decode(&tokens[pos..end], pos, outputs)?;
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
