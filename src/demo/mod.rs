//! `turnwise demo`: the whole loop on the simulated customer-service desk of [`crate::env`].
//!
//! base evaluation → supervised warm start on scripted-expert demonstrations (training templates
//! only) → baseline evaluation → iterations of {roll out training scenarios several times each with
//! the active adapter, log them as `source = demo` sessions grouped by scenario, annotate, update,
//! gate, activate} → final evaluation. Evaluations are greedy, on one fixed set of held-out
//! scenarios (templates no training session ever used), so that every evaluation is paired.
//!
//! - this file: what a run measures ([`Evaluation`], [`Iteration`], [`DemoResult`]) and the
//!   [`Demo`] itself;
//! - [`config`]: [`DemoConfig`]; [`play`]: playing and logging sessions on several engines, the
//!   scripted expert; [`stats`]: bootstrap and Wilson intervals (also used by `compare`);
//! - `run`: the RL iteration and the run's phases; `evaluate`: held-out evaluations and the
//!   validation gate; `warm`: the warm start; [`experience`]: the experience library;
//!   [`report`]: the report and the plots.

pub mod config;
mod evaluate;
pub mod experience;
pub mod play;
pub mod report;
mod run;
pub mod stats;
mod warm;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

use crate::adapter::{adapter_dir, Adapter};
use crate::demo::experience::{EntryRow, Evolution, Library, LibraryConfig};
use crate::env::{self, Desk, Observation, Scenario, Split};
use crate::error::{Error, Result};
use crate::learn::annotate::{
    annotate_sessions_with, AnnotateConfig, IgContext, IgPolicy, IgSpace, InfoGainSource,
};
use crate::learn::{gate, run_update, Algo, Diagnostics, Selection, TrainConfig};
use crate::policy::sampler::Rng;
use crate::policy::{Engine, Message, OutputHead, Role, SamplerParams};
use crate::replay::{rescore_conversation, store_rescored, Conversation};
use crate::session::{Feedback, Recorder};
use crate::store::{NewSession, Source, Store};

pub use config::{
    DemoConfig, ProcessSignal, BASE_EVAL_SCENARIOS, DEFAULT_ITERATIONS, ON_POLICY_ITERATIONS,
};
pub use play::{expert_conversation, play, scripted_conversation, LogMeta, PlaySettings, Played};
use play::{on_engines, restating, Job};
use stats::mean;
pub use stats::{hierarchical_bootstrap, paired_bootstrap, stratified_bootstrap, wilson};

/// One greedy evaluation on the held-out set.
#[derive(Debug, Clone, Serialize)]
pub struct Evaluation {
    /// `base`, `warm start`, `iteration N`, `final`
    pub label: String,
    /// RL iterations done when it ran
    pub iteration: usize,
    /// the adapter evaluated
    pub adapter_id: Option<i64>,
    /// success per held-out scenario (same order in every evaluation)
    pub success: Vec<bool>,
    /// reward per scenario
    pub reward: Vec<f64>,
    /// mean agent replies per session
    pub mean_turns: f64,
    /// malformed action lines per session
    pub malformed_per_session: f64,
    /// every session as (role, text) pairs after the system prompt
    pub transcripts: Vec<Vec<(String, String)>>,
    /// the earlier evaluation whose play this one repeats instead of playing again: same
    /// adapter, same scenarios, no experience library (evaluations are canonical, so playing
    /// them again would give the same transcripts)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub same_as: Option<String>,
}

impl Evaluation {
    /// Share of sessions with an agent reply that repeats a word trigram (`is refund 42 is
    /// refund 42`): the loops a policy update can drift into.
    pub fn repeated_trigram_share(&self) -> f64 {
        let looping = |t: &Vec<(String, String)>| {
            t.iter().filter(|(r, _)| r == "assistant").any(|(_, text)| {
                let w: Vec<&str> = text.split_whitespace().collect();
                let mut seen = std::collections::HashSet::new();
                w.windows(3).any(|g| !seen.insert(g))
            })
        };
        let n = self.transcripts.len();
        self.transcripts.iter().filter(|t| looping(t)).count() as f64 / n.max(1) as f64
    }

    /// Success rate.
    pub fn rate(&self) -> f64 {
        mean(
            &self
                .success
                .iter()
                .map(|&b| f64::from(u8::from(b)))
                .collect::<Vec<_>>(),
        )
    }
}

/// One RL iteration.
#[derive(Debug, Clone, Serialize)]
pub struct Iteration {
    /// 1-based
    pub iteration: usize,
    /// the adapter the rollouts were sampled with
    pub sampled_with: Option<i64>,
    /// success rate of the rollouts
    pub train_success: f64,
    /// mean reward of the rollouts
    pub train_reward: f64,
    /// sessions logged
    pub sessions: usize,
    /// the `updates` row
    pub update_id: Option<i64>,
    /// the candidate adapter
    pub candidate: Option<i64>,
    /// the candidate passed the gate and is active
    pub activated: bool,
    /// why the update or the gate failed
    pub note: Option<String>,
    /// sessions the update trained on (this iteration's plus kept on-policy ones)
    pub trained_on: usize,
    /// validation gate: (success, mean reward) of the candidate and of the active adapter
    pub validation: Option<[(f64, f64); 2]>,
    /// validation gate: (scenarios the active adapter played itself, scenarios); with the
    /// shadow check the others are the candidate's sessions, which it would have played alike
    pub gate_replayed: Option<(usize, usize)>,
    /// the update's diagnostics (None when it failed)
    pub diagnostics: Option<Diagnostics>,
    /// what the experience library did with this iteration's sessions
    pub experience: Option<Evolution>,
    /// seconds since the start of the run
    pub elapsed_s: f64,
}

/// The machine and settings a run's times belong to.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    /// CPU model (`/proc/cpuinfo`), empty where unknown
    pub cpu: String,
    /// cores this process may use
    pub cores: usize,
    /// physical memory in GiB (0 where unknown)
    pub memory_gib: f64,
    /// llama.cpp engines that played sessions side by side
    pub engines: usize,
    /// llama.cpp threads of each engine
    pub threads_per_engine: i32,
    /// sessions each engine generates at once
    pub sequences_per_engine: usize,
    /// threads of the learner
    pub train_threads: usize,
    /// Turnwise's version
    pub version: String,
}

impl Machine {
    /// This machine, with the run's engines and learner threads.
    pub fn this(engines: &[Engine], train_threads: usize) -> Self {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name")?.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let kib = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .unwrap_or(0.0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            memory_gib: (kib / (1024.0 * 1024.0) * 10.0).round() / 10.0,
            engines: engines.len(),
            threads_per_engine: engines.first().map_or(0, |e| e.info().n_threads),
            sequences_per_engine: engines.first().map_or(1, |e| e.info().n_seq),
            train_threads,
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// One line: `2 cores (AMD EPYC …), 23.4 GiB; 2 engines × 1 thread × 4 sequences, learner 2
    /// threads`.
    pub fn line(&self) -> String {
        let cpu = if self.cpu.is_empty() {
            String::new()
        } else {
            format!(" ({})", self.cpu)
        };
        format!(
            "{} cores{cpu}, {} GiB; {} engine(s) × {} thread(s) × {} sequence(s), learner {} thread(s); turnwise {}",
            self.cores,
            self.memory_gib,
            self.engines,
            self.threads_per_engine,
            self.sequences_per_engine,
            self.train_threads,
            self.version
        )
    }
}

/// Everything a run measured.
#[derive(Debug, Clone, Serialize)]
pub struct DemoResult {
    /// settings
    pub config: DemoConfig,
    /// the model
    pub model: String,
    /// the model file the policy ran on (name, SHA-256, file type, origin)
    #[serde(default)]
    pub model_file: serde_json::Value,
    /// where the times were measured
    pub machine: Machine,
    /// evaluations in order
    pub evals: Vec<Evaluation>,
    /// RL iterations
    pub iterations: Vec<Iteration>,
    /// the warm-start adapter
    pub warm_adapter: Option<i64>,
    /// the active adapter at the end
    pub final_adapter: Option<i64>,
    /// seconds per phase
    pub phase_seconds: Vec<(String, f64)>,
    /// total wall time
    pub wall_s: f64,
    /// paired bootstrap of final − warm-start held-out success: (difference, 2.5 %, 97.5 %)
    pub rl_gain: (f64, f64, f64),
    /// the experience library's live entries at the end
    pub experience_entries: Vec<EntryRow>,
    /// injections recorded in logged turns
    pub experience_injections: i64,
    /// the process's peak resident memory in MiB at the end (`VmHWM`; 0 where unknown)
    #[serde(default)]
    pub peak_rss_mib: f64,
}

/// Progress events for the front end.
pub enum Progress<'a> {
    /// a phase starts with this many steps
    Phase(&'a str, usize),
    /// one more step is done
    Tick(&'a str),
    /// the phase is over
    Done(&'a str),
}

/// The process's peak resident set (`VmHWM` of `/proc/self/status`) in MiB; 0 where unknown.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}
/// The run: owns the engine handle, the run's store and the measurements.
pub struct Demo<'a> {
    /// the engines sessions are played and demonstrations rescored on; all hold the same
    /// adapter
    engines: &'a [Engine],
    head: &'a OutputHead,
    store: Store,
    db: PathBuf,
    cfg: DemoConfig,
    held_out: Vec<Scenario>,
    /// draws each gate's fresh validation scenarios (validation templates)
    val_rng: Rng,
    /// sessions sampled with the active adapter since it was activated
    on_policy: usize,
    /// the last gate's (replayed, scenarios)
    gate_replayed: Option<(usize, usize)>,
    active: Option<(i64, Arc<Adapter>)>,
    library: Option<Library>,
    start: Instant,
    next_key: u64,
    /// measurements so far
    pub result: DemoResult,
}
