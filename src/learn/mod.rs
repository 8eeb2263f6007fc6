//! The learner: from logged sessions to a better adapter, in stages a reader can follow.
//!
//! One update ([`update::run_update`], used by the server's background learner, the demo and
//! `turnwise train`) runs:
//!
//! 1. **batch** — which finished sessions it learns from, in an order independent of logging
//!    time, and their groups (small groups merged into a fallback group);
//! 2. **credit** — outcome normalisation per group, the process signal per turn group and the
//!    advantage estimator; the one writer of the value head's credit annotations;
//! 3. **minibatches** (`minibatch.rs`) — base logits tempered and restricted to each token's
//!    sampling support, old and reference log-probs from the step's own backend;
//! 4. **step** — AdamW steps of the clipped surrogate (`update.rs`'s `train_steps`); one
//!    `StepBackend` trait over ONNX Runtime and the ndarray reference ([`objective`],
//!    `graph::step`);
//! 5. **diagnostics** — one typed [`Diagnostics`] record;
//! 6. **candidate** — the adapter written atomically, then status, update row, advantages and
//!    learned stamps committed in one transaction (`Store::commit_candidate`);
//! 7. **gate** and **activate** ([`gate`]) — the checks a candidate passes and the one function
//!    that makes an adapter active.
//!
//! Alongside: [`advantages`] (pure advantage functions with hand-computed tests), [`annotate`]
//! (information gain and success contribution for `turnwise annotate` and the demo's
//! rollouts), [`groups`] (opening-state clusters for live traffic).

pub mod advantages;
pub mod annotate;
mod batch;
pub mod block;
pub mod candidate;
pub mod config;
mod credit;
pub mod diagnostics;
pub mod gate;
pub mod groups;
mod minibatch;
pub mod objective;
mod optim;
mod step;
pub mod update;

pub use config::{
    AdvantageMode, Algo, Backend, ProcessScale, Selection, TrainConfig, DEFAULT_ALPHA, TURN_EPS,
};
pub use diagnostics::Diagnostics;
pub use optim::OPTIMIZER_FILE;
pub use update::{run_update, UpdateReport};
