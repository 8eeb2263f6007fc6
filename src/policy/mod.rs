//! The policy: the GGUF model on llama.cpp, owned by one engine thread.
//!
//! - [`engine`]: the thread and its [`Engine`] handle (generation, appends, rescoring);
//! - [`conversation`]: sessions as token sequences that only grow (token-in-token-out);
//! - [`sampler`]: temperature / top-k / top-p with exact behaviour log-probs;
//! - [`head`]: `base_logits(h)`, the output projection recomputed from stored hidden states;
//! - [`gguf`]: a small GGUF reader for validation and for the output weight;
//! - [`llama`]: the thin unsafe layer over llama.cpp's C API.

pub mod blocks;
pub mod conversation;
pub mod engine;
pub mod gguf;
pub mod head;
pub mod llama;
pub mod sampler;

pub use conversation::{Conversation, Message, PromptTurn, Role};
pub use engine::{
    Engine, EngineConfig, EngineCounters, EngineStats, Generation, Lane, ModelInfo, Reply,
    Rescored, StopReason, DEFAULT_N_SEQ,
};
pub use head::{FeatureDtype, OutputHead, ServedAdapter};
pub use sampler::SamplerParams;
