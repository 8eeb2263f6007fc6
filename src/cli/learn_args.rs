//! The learner's settings that `turnwise train` (and `train --replay`) and `turnwise demo` share:
//! one flag set, flattened into each command, that writes the flags given over a
//! [`TrainConfig`] (a preset's, a recorded update's, or the demo's RL settings). A flag not given
//! leaves the value it is written over.

use clap::Args;
use turnwise::learn::objective::{Aggregation, ClipMode, Granularity};
use turnwise::learn::{AdvantageMode, ProcessScale, TrainConfig};

/// A switch (`--flag` alone means `on`).
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnOff {
    On,
    Off,
}

impl OnOff {
    /// `on` as true.
    pub fn on(self) -> bool {
        self == OnOff::On
    }
}

/// Settings of the policy update; unset ones keep the preset's (train), the recorded update's
/// (train --replay) or the demo's.
#[derive(Args, Clone, Default)]
pub struct LearnArgs {
    /// Passes over the batch per update [preset: 2, sft 20]
    #[arg(long)]
    pub epochs: Option<usize>,
    /// AdamW learning rate [preset: 1e-3, sft 5e-3]
    #[arg(long)]
    pub lr: Option<f64>,
    /// AdamW ε [1e-8]; larger values keep parameters with tiny gradients still
    #[arg(long)]
    pub adam_eps: Option<f64>,
    /// Carry the parent adapter's AdamW moments into the update (saved with each adapter)
    /// instead of a fresh optimizer at every update [off]
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "on")]
    pub keep_optimizer: Option<OnOff>,
    /// Ratio granularity: token, turn or sequence [preset]
    #[arg(long, value_enum)]
    pub granularity: Option<Granularity>,
    /// Clip mode: fixed or adaptive [preset]
    #[arg(long, value_enum)]
    pub clip: Option<ClipMode>,
    /// Lower clip width ε_low: the ratio's lower bound is 1 − ε_low [preset: a2tgpo, atpo,
    /// grpo 0.2; gspo 3e-3]
    #[arg(long)]
    pub eps_low: Option<f64>,
    /// Upper clip width ε_high [preset: a2tgpo, atpo, grpo 0.28; gspo 4e-3]
    #[arg(long)]
    pub eps_high: Option<f64>,
    /// Token guard inside turn / sequence ratios, `LOW,HIGH` (e.g. 0.2,0.28) or `off`: a token
    /// whose own ratio has left [1 − LOW, 1 + HIGH] on its advantage's side stops getting
    /// gradient while its turn's ratio is still inside the turn clip [preset: a2tgpo 0.2,0.28;
    /// others off]
    #[arg(long, value_parser = parse_guard)]
    pub token_guard: Option<Guard>,
    /// Loss aggregation [preset]
    #[arg(long, value_enum)]
    pub aggregation: Option<Aggregation>,
    /// Advantage: outcome, a2tgpo, gigpo, windowed-gae [preset]
    #[arg(long, value_enum)]
    pub advantage: Option<AdvantageMode>,
    /// Dr.GRPO: centre each group's outcomes without dividing by their std [train: off; demo:
    /// on, the format term would otherwise make groups where every rollout failed look as
    /// informative as groups with a success]
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "on")]
    pub dr_grpo: Option<OnOff>,
    /// A²TGPO / ATPO α, the weight of the process term [0.3, the released script's; the
    /// paper's 1.0 lets the process signal outweigh the outcome]
    #[arg(long)]
    pub alpha: Option<f64>,
    /// Whether the process signal is divided by its turn group's std: `as-outcome` follows
    /// --dr-grpo (one switch for both terms, as the released code), `std` always, `centre` never
    /// [as-outcome]
    #[arg(long, value_enum)]
    pub process_scale: Option<ProcessScale>,
}

/// `--token-guard`: the widths, or None for `off`.
#[derive(Clone, Copy)]
pub struct Guard(Option<(f64, f64)>);

fn parse_guard(s: &str) -> Result<Guard, String> {
    if s == "off" {
        return Ok(Guard(None));
    }
    let bad = || format!("expected LOW,HIGH (two widths, e.g. 0.2,0.28) or off, got {s:?}");
    let (lo, hi) = s.split_once(',').ok_or_else(bad)?;
    let w = |x: &str| x.trim().parse::<f64>().map_err(|_| bad());
    Ok(Guard(Some((w(lo)?, w(hi)?))))
}

impl LearnArgs {
    /// Writes the settings given over `cfg`.
    pub fn apply(&self, cfg: &mut TrainConfig) {
        if let Some(v) = self.epochs {
            cfg.epochs = v;
        }
        if let Some(v) = self.lr {
            cfg.lr = v;
        }
        if let Some(v) = self.adam_eps {
            cfg.adam_eps = v;
        }
        if let Some(v) = self.keep_optimizer {
            cfg.keep_optimizer = v.on();
        }
        if let Some(v) = self.granularity {
            cfg.objective.granularity = v;
        }
        if let Some(v) = self.clip {
            cfg.objective.clip = v;
        }
        if let Some(v) = self.eps_low {
            cfg.objective.eps_low = v;
        }
        if let Some(v) = self.eps_high {
            cfg.objective.eps_high = v;
        }
        if let Some(Guard(v)) = self.token_guard {
            cfg.objective.token_guard = v;
        }
        if let Some(v) = self.aggregation {
            cfg.objective.aggregation = v;
        }
        if let Some(v) = self.advantage {
            cfg.advantage = v;
        }
        if let Some(v) = self.dr_grpo {
            cfg.dr_grpo = v.on();
        }
        if let Some(v) = self.alpha {
            cfg.alpha = v;
        }
        if let Some(v) = self.process_scale {
            cfg.process_scale = v;
        }
    }
}
