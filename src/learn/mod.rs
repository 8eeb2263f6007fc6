//! The learner: from logged sessions to a better adapter.
//!
//! - [`advantages`]: GRPO / Dr.GRPO outcome normalisation, DAPO filtering, A²TGPO turn-level
//!   advantages — pure functions with hand-computed tests;
//! - [`annotate`]: step-level credit — value-head success contribution, information gain;
//! - [`diagnostics`]: the typed record of what an update measured;
//! - [`gate`]: the gate a candidate passes and the one function that activates an adapter;
//! - [`groups`]: group keys for live traffic by leader clustering of opening states;
//! - [`objective`]: the clipped surrogate (token / sequence / turn ratios; fixed / adaptive /
//!   advantage-scaled clips; four aggregations; TIS; k3 KL) and the output-LoRA backward,
//!   checked against finite differences;
//! - [`update`]: one update over the store (`turnwise train`), presets and diagnostics.

pub mod advantages;
pub mod annotate;
pub mod diagnostics;
pub mod gate;
pub mod groups;
pub mod objective;
pub mod update;

pub use diagnostics::Diagnostics;
pub use update::{
    run_update, AdvantageMode, Algo, Backend, Selection, TrainConfig, UpdateReport, OPTIMIZER_FILE,
};
