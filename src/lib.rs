//! # Turnwise
//!
//! A chat agent that learns from its own conversations on the device it runs on.
//!
//! - [`policy`]: the GGUF model on llama.cpp, owned by one engine thread; sessions as token
//!   sequences that only grow; a sampler that records exact behaviour log-probs and the hidden
//!   state of every sampled position; `base_logits(h)` to recompute logits without llama.cpp.
//! - [`adapter`]: the output-projection LoRA and value head, PEFT safetensors, applied at sampling.
//! - [`store`]: the SQLite turn log (sessions, turns, tokens, features, feedback, annotations,
//!   adapters), migrations applied on open.
//! - [`env`]: the demo world — back office, scenarios, customer simulator, action syntax, rewards.
//! - [`graph`]: ONNX graphs built and differentiated in Rust, run by ONNX Runtime (CPU / CUDA).
//! - [`learn`]: advantages, the clipped surrogate and the update that trains the adapter.
//! - [`server`]: the OpenAI-compatible HTTP API, feedback, adapters admin, background learner.
//! - [`session`]: glue that turns an engine generation into store rows.
//! - [`replay`]: import and export of JSON Lines chat logs (offline replay).
//! - [`assets`]: first-use provisioning of the default model and ONNX Runtime from PyPI wheels.
//! - [`config`]: resolved paths and defaults.

pub mod adapter;
pub mod assets;
pub mod config;
pub mod demo;
pub mod env;
pub mod error;
pub mod graph;
pub mod learn;
pub mod policy;
pub mod replay;
pub mod server;
pub mod session;
pub mod store;

pub use error::{Error, Result};
pub use policy::{Engine, EngineConfig, Message, Role, SamplerParams};
pub use store::{AdapterStatus, AnnotationKind, FeedbackKind, Source, Store, UpdateStatus};
