//! `turnwise demo`: the whole loop on the simulated customer-service desk of [`crate::env`].
//!
//! base evaluation → supervised warm start on scripted-expert demonstrations (training templates
//! only) → baseline evaluation → iterations of {roll out training scenarios several times each with
//! the active adapter, log them as `source = demo` sessions grouped by scenario, annotate, update,
//! gate, activate} → final evaluation. Evaluations are greedy, on one fixed set of held-out
//! scenarios (templates no training session ever used), so that every evaluation is paired.

pub mod report;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use serde::Serialize;
use serde_json::{json, Value};

use crate::adapter::{adapter_dir, Adapter};
use crate::env::{self, Desk, Observation, Scenario, Split};
use crate::error::{Error, Result};
use crate::experience::{EntryRow, Evolution, Library, LibraryConfig};
use crate::learn::annotate::{
    annotate_sessions_with, AnnotateConfig, IgContext, IgPolicy, InfoGainSource,
};
use crate::learn::{gate, run_update, Algo, Diagnostics, Selection, TrainConfig};
use crate::policy::sampler::Rng;
use crate::policy::{Engine, Message, OutputHead, Role, SamplerParams};
use crate::replay::{rescore_conversation, store_rescored, Conversation};
use crate::session::{Feedback, Recorder};
use crate::store::{NewSession, Source, Store};

/// The base model is evaluated on the first this-many held-out scenarios only: it never writes an
/// action (docs/findings.md), and its rambling replies make each session the slowest of the run.
pub const BASE_EVAL_SCENARIOS: usize = 20;

/// With the validation gate, the update after a rejection trains on the sessions of up to this
/// many iterations, all sampled with the same (still active) adapter.
pub const ON_POLICY_ITERATIONS: usize = 3;

/// Which per-turn process signal the A²TGPO advantage uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ProcessSignal {
    /// information gain of the ground-truth action (teacher-forced, frozen policy)
    InfoGain,
    /// the value head's success contribution V(s_t+1) − V(s_t)
    Contribution,
    /// none: outcome-only advantages (α = 0)
    None,
}

/// Settings of a demo run.
#[derive(Debug, Clone, Serialize)]
pub struct DemoConfig {
    /// the warm start's supervised update: the SFT preset with the demo's epochs, digit
    /// handling, learner threads and seed
    pub warm: TrainConfig,
    /// the RL updates: the preset of `--algo` with the demo's settings ([`DemoConfig::full`]
    /// says why each differs from the preset); a KL term, when its coefficient is set, pulls
    /// towards the warm-start adapter
    pub rl: TrainConfig,
    /// seed of scenarios, sampling and the fresh adapter
    pub seed: u64,
    /// wall-time budget of the whole run in minutes (the RL phase stops early enough to leave
    /// time for the final evaluation); None: no time limit, the iteration count decides
    pub minutes: Option<f64>,
    /// most RL iterations (None: as many as the time budget allows)
    pub max_iterations: Option<usize>,
    /// held-out scenarios per evaluation
    pub eval_scenarios: usize,
    /// evaluate the base model (no adapter) too
    pub eval_base: bool,
    /// expert demonstrations for the warm start
    pub demos: usize,
    /// training scenarios per iteration
    pub scenarios_per_iter: usize,
    /// rollouts per scenario (the group)
    pub group_size: usize,
    /// the customer leaves after this many agent replies
    pub patience: usize,
    /// most tokens per agent reply
    pub max_tokens: usize,
    /// rollout temperature (top-k and top-p are off); the learner optimises this tempered
    /// policy, as each turn's sampler settings record it
    pub temperature: f32,
    /// rollouts take the arg-max wherever it is a digit token
    /// ([`SamplerParams::greedy_digits`]): order ids are copied as the greedy evaluations copy
    /// them, and exploration stays on the words. At temperature 0.7 the warm-started model
    /// garbles about every other id it samples (`ACTION status 1721377777`), so rollouts that
    /// took the right decision fail on digit noise the greedy policy does not make, and the
    /// update blames the decision
    pub greedy_digits: bool,
    /// every agent reply (rollouts, evaluations, the gate) writes order ids through the id slot
    /// ([`SamplerParams::id_slot`]): the digits after `ACTION <verb>` must spell a number of
    /// the order-id format (5 digits) that the customer or the back office wrote in this
    /// session ([`env::order_ids_in`]), as a tool schema with a pattern and an enum of known
    /// ids constrains an argument. The warm-started model miscopies
    /// about a third of the ids it should copy (`ACTION status 1888 1888` for order 17694:
    /// digit biases the output-projection LoRA memorised from the demonstrations' ids), and
    /// the output-projection adapter cannot learn copying from the reward (it cannot change
    /// what the blocks attend to). With the slot, which action, whether to act before any id was
    /// given, and what to do with a tool result stay the policy's decisions. (Measured with
    /// every number of the conversation allowed: the warm start then wrote the distractor in
    /// most messages that held one, `ACTION status 59` for "I paid 59 dollars for order 94615",
    /// the choice docs/findings.md measured the output-projection adapter cannot learn.)
    pub id_slot: bool,
    /// rollout batches and validation-gate sets hold every intent equally often
    /// ([`env::stratified`]) instead of drawing each scenario's intent at random
    pub stratify: bool,
    /// rollout openings get a random greeting, closing or lower case ([`env::paraphrase`]);
    /// demonstrations, the validation gate and the held-out set keep the plain templates
    pub paraphrase: bool,
    /// customers repeat their request when they give the order id ([`Scenario::restates`]) in
    /// every scenario of the run: demonstrations, rollouts, the gate and the held-out set
    pub restate: bool,
    /// A²TGPO / ATPO process signal
    pub process: ProcessSignal,
    /// where information gain scores each turn: after its reply and the observation it
    /// brought back (the default: IGPO's and A²TGPO's interaction turn), or right after the
    /// reply (the earlier versions of this demo)
    pub ig_context: IgContext,
    /// which policy scores information gain: the base model (frozen, the default) or the
    /// active adapter that sampled the rollout
    pub ig_policy: IgPolicy,
    /// largest |approx KL| of an update that may be activated
    pub gate_kl: f64,
    /// evaluate on the held-out set every this many iterations (0: only at the end)
    pub eval_every: usize,
    /// the experience library: retrieval at every step, evolved after every update
    pub experience: bool,
    /// validation gate: a candidate is activated only if its greedy success (then mean reward)
    /// on this many fresh validation-template scenarios ([`Split::Validation`]: phrasings neither
    /// the rollouts nor the held-out set use) is at least the active adapter's on the
    /// same scenarios (0: off, the KL bound is the only check). While candidates are rejected the
    /// rollouts of the
    /// unchanged active adapter stay on-policy and are kept for the next update (at most
    /// [`ON_POLICY_ITERATIONS`] iterations' worth).
    pub val_scenarios: usize,
    /// the validation gate plays the candidate with the active adapter as the engines' shadow
    /// ([`Engine::set_shadow`]) and replays with the active adapter only the scenarios where its
    /// greedy choice differed somewhere (off: the active adapter plays every scenario itself;
    /// also when the two adapters have different block LoRAs, whose hidden states differ)
    pub shadow_gate: bool,
    /// block warm start: after the output-LoRA warm start, a LoRA on q,v (r = 8) of the last
    /// `k` blocks is trained on the same demonstrations (teacher-forced, block inputs captured
    /// with llama.cpp) and served by llama.cpp from then on; RL updates keep it and train the
    /// output LoRA on top — unless `rl.block` is set, when RL trains this block LoRA (the
    /// engines must then log block inputs: `EngineConfig::block_k`)
    pub block_warm: Option<usize>,
    /// llama.cpp engines that play sessions side by side (each with its own context and
    /// `threads / engines` threads): on two cores two one-thread engines decode about 1.4× the
    /// tokens per second of one two-thread engine (`turnwise bench --threads 1` twice at once)
    pub engines: usize,
}

impl DemoConfig {
    /// The full configuration (`turnwise demo`): [`DEFAULT_ITERATIONS`] RL iterations, no
    /// time limit, so that a seed gives the same result on a slower or faster machine.
    pub fn full(algo: Algo, seed: u64) -> Self {
        let mut warm = TrainConfig::preset(Algo::Sft);
        warm.epochs = 20;
        warm.threads = 2;
        warm.seed = seed;
        let mut rl = TrainConfig::preset(algo);
        rl.lr = 1e-3;
        rl.epochs = 2;
        rl.threads = 2;
        rl.seed = seed;
        // Dr.GRPO: centre each group's outcome without dividing by its std. The desk's reward
        // has a format term (−0.1 per malformed call), so in a group where every rollout
        // failed the rewards still differ by a tenth or two; dividing by that group's tiny std
        // turns "one malformed call fewer" into a full ±1 advantage, as large as a success —
        // about half the groups of a run are like that, and they taught `ACTION decline`
        // (always well-formed) on refunds. Centred only, such a group weighs a tenth of a group
        // with a success.
        rl.dr_grpo = true;
        // AdamW ε 1e-8 (1e-6 keeps tail tokens still; measured once with lr 2e-3: worse)
        rl.adam_eps = 1e-8;
        rl.keep_optimizer = false;
        DemoConfig {
            warm,
            rl,
            seed,
            minutes: None,
            max_iterations: Some(DEFAULT_ITERATIONS),
            eval_scenarios: 50,
            eval_base: true,
            demos: 40,
            scenarios_per_iter: 16,
            group_size: 4,
            patience: 5,
            max_tokens: 32,
            temperature: 0.7,
            greedy_digits: true,
            id_slot: true,
            stratify: false,
            paraphrase: false,
            restate: true,
            process: ProcessSignal::InfoGain,
            ig_context: IgContext::Observation,
            ig_policy: IgPolicy::Frozen,
            gate_kl: crate::learn::gate::DEFAULT_KL_BOUND,
            eval_every: 0,
            experience: false,
            val_scenarios: 32,
            shadow_gate: true,
            block_warm: None,
            engines: 2,
        }
    }

    /// A small configuration that finishes in a couple of minutes (plumbing, not learning).
    pub fn quick(algo: Algo, seed: u64) -> Self {
        let full = DemoConfig::full(algo, seed);
        let mut warm = full.warm.clone();
        warm.epochs = 2;
        DemoConfig {
            warm,
            max_iterations: Some(2),
            eval_scenarios: 4,
            demos: 8,
            scenarios_per_iter: 2,
            group_size: 2,
            patience: 3,
            max_tokens: 20,
            eval_every: 1,
            val_scenarios: 0,
            ..full
        }
    }
}

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

/// `s` with the run's [`DemoConfig::restate`] setting.
fn restating(mut s: Scenario, on: bool) -> Scenario {
    s.restates = on;
    s
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Paired bootstrap of `mean(b) − mean(a)`: (point estimate, 2.5 % and 97.5 % quantiles).
pub fn paired_bootstrap(a: &[bool], b: &[bool], reps: usize, seed: u64) -> (f64, f64, f64) {
    let n = a.len().min(b.len());
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let d: Vec<f64> = (0..n)
        .map(|i| f64::from(u8::from(b[i])) - f64::from(u8::from(a[i])))
        .collect();
    let point = mean(&d);
    let mut rng = Rng::new(seed);
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            (0..n)
                .map(|_| d[(rng.next_u64() % n as u64) as usize])
                .sum::<f64>()
                / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Stratified paired bootstrap of a pooled mean: `strata[k]` holds the paired differences of
/// stratum k (a seed's held-out scenarios); each replicate resamples within every stratum, so
/// the interval reflects scenario noise, not how the seeds happened to be mixed. Returns
/// (pooled mean over all items, 2.5 %, 97.5 %).
pub fn stratified_bootstrap(strata: &[Vec<f64>], reps: usize, seed: u64) -> (f64, f64, f64) {
    let n: usize = strata.iter().map(Vec::len).sum();
    if n == 0 || reps == 0 {
        return (0.0, 0.0, 0.0);
    }
    let point = strata.iter().flatten().sum::<f64>() / n as f64;
    let mut rng = Rng::new(seed);
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            let mut total = 0.0;
            for s in strata.iter().filter(|s| !s.is_empty()) {
                for _ in 0..s.len() {
                    total += s[(rng.next_u64() % s.len() as u64) as usize];
                }
            }
            total / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Hierarchical paired bootstrap of a pooled mean: each replicate draws as many strata (seeds)
/// as there are, with replacement, then resamples the items (held-out scenarios) within each
/// drawn stratum. Runs of one seed differ by more than its scenarios say (the rollouts, the
/// updates), so an interval that resamples only scenarios inside fixed seeds is too narrow for
/// a claim about a method; this one counts seeds. With one stratum it is the stratified
/// bootstrap. Returns (pooled mean over all items, 2.5 %, 97.5 %).
pub fn hierarchical_bootstrap(strata: &[Vec<f64>], reps: usize, seed: u64) -> (f64, f64, f64) {
    let strata: Vec<&Vec<f64>> = strata.iter().filter(|s| !s.is_empty()).collect();
    let n: usize = strata.iter().map(|s| s.len()).sum();
    if n == 0 || reps == 0 {
        return (0.0, 0.0, 0.0);
    }
    let point = strata.iter().copied().flatten().sum::<f64>() / n as f64;
    let mut rng = Rng::new(seed);
    let k = strata.len() as u64;
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            let (mut total, mut count) = (0.0, 0usize);
            for _ in 0..k {
                let s = strata[(rng.next_u64() % k) as usize];
                for _ in 0..s.len() {
                    total += s[(rng.next_u64() % s.len() as u64) as usize];
                }
                count += s.len();
            }
            total / count as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Wilson 95 % interval of a success rate.
pub fn wilson(successes: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.96f64, n as f64);
    let p = successes as f64 / nf;
    let den = 1.0 + z * z / nf;
    let c = (p + z * z / (2.0 * nf)) / den;
    let h = z * ((p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt()) / den;
    ((c - h).max(0.0), (c + h).min(1.0))
}

/// A session to play: the scenario, how it is played and how it is logged.
struct Job {
    scenario: Scenario,
    how: PlaySettings,
    log: Option<LogMeta>,
}

/// How one played session went.
#[derive(Debug, Clone)]
pub struct Played {
    /// the desk at the end
    pub desk: Desk,
    /// (role, text) of every message after the system prompt
    pub transcript: Vec<(Role, String)>,
    /// the logged session
    pub session_id: Option<i64>,
    /// with [`PlaySettings::score_reference`]: the frozen policy's mean log-prob of the ground
    /// truth's action line before the first agent reply and after each one (what
    /// [`crate::learn::annotate::annotate_sessions`] would compute from the log)
    pub reference_logp: Option<Vec<f64>>,
    /// with a shadow adapter on the engine (greedy sessions): whether every reply agreed with
    /// the shadow's greedy choices ([`crate::policy::Reply::shadow_agrees`]), i.e. the shadow
    /// would have played this very session
    pub shadow_agrees: Option<bool>,
}

/// How the agent plays a session.
#[derive(Debug, Clone)]
pub struct PlaySettings {
    /// the customer leaves after this many agent replies
    pub patience: usize,
    /// sampler of the agent's replies (reply k uses `seed + k`)
    pub params: SamplerParams,
    /// the engine's session key (closed at the end)
    pub key: u64,
    /// score the ground truth's action line after every agent reply while the session is in
    /// the engine's KV cache: only the reference line is decoded, where annotating the log
    /// afterwards decodes the whole session again
    pub score_reference: bool,
    /// where each reply's score is taken ([`IgContext`]; `annotate_sessions` on the log
    /// computes the same numbers with the same setting,
    /// [`crate::learn::annotate::reference_scores`])
    pub ig_context: IgContext,
    /// which policy scores it ([`IgPolicy`]; `Sampling`: the engine's adapter, the one that
    /// samples the session)
    pub ig_policy: IgPolicy,
    /// constrain every reply's order-id slot to the order ids the conversation holds so far
    /// ([`DemoConfig::id_slot`], [`env::order_ids_in`])
    pub id_slot: bool,
    /// play the session canonically: on an engine reset first ([`Engine::reset`]) and with no
    /// other session beside it, so that its transcript depends only on the model file, the
    /// adapter, the scenario and the thread count (the held-out evaluations)
    pub canonical: bool,
}

/// How a played session is logged.
pub struct LogMeta {
    /// group key (the scenario)
    pub group: String,
    /// metadata of the session
    pub metadata: Value,
}

/// Plays one session of `scenario` with the engine's current adapter. With `log`, the session
/// is logged in `store` (turns appended as they happen, outcome and end at the end). With
/// `library`, each observation gets the experience library's injection appended before the agent
/// replies, and logged sessions record which entries were injected.
///
/// # Errors
/// Engine and store errors.
pub fn play(
    engine: &Engine,
    store: &mut Store,
    scenario: &Scenario,
    how: &PlaySettings,
    log: Option<LogMeta>,
    library: Option<&Library>,
) -> Result<Played> {
    let (patience, params, key) = (how.patience, &how.params, how.key);
    if how.canonical {
        engine.reset()?;
    }
    let mut desk = Desk::new(scenario.clone(), patience);
    let opening = scenario.opening();
    let mut pending = vec![
        Message::new(Role::System, env::SYSTEM_PROMPT),
        Message::new(Role::User, opening),
    ];
    let mut transcript = Vec::new();
    let reference = env::action_line(&scenario.ground_truth);
    // the session's tokens as the log will hold them (every turn's tokens, in order)
    let mut context: Vec<crate::policy::llama::Token> = Vec::new();
    let mut reference_logp = how.score_reference.then(Vec::new);
    let after_observation = how.ig_context == IgContext::Observation;
    let adapted = how.ig_policy == IgPolicy::Sampling;
    let mut shadow_agrees: Option<bool> = None;
    let recorder = match &log {
        Some(l) => Some(Recorder::open(
            store,
            &NewSession {
                source: Source::Demo,
                group_key: Some(l.group.clone()),
                reference: Some(reference.clone()),
                content_hash: None,
                metadata: l.metadata.clone(),
            },
        )?),
        None => None,
    };
    let session_id = recorder.map(|r| r.id());
    let result = (|| {
        for turn in 0.. {
            let injection = match (library, pending.last_mut()) {
                (Some(lib), Some(m)) => {
                    let inj = lib.retrieve(store, &m.content)?;
                    if let Some(i) = &inj {
                        m.content.push_str(&i.text);
                    }
                    inj
                }
                _ => None,
            };
            if let Some(m) = pending.last() {
                transcript.push((m.role, m.content.clone()));
            }
            let mut p = params.clone();
            p.seed = params.seed.wrapping_add(turn);
            if how.id_slot {
                let said: Vec<&str> = transcript
                    .iter()
                    .filter(|(r, _)| matches!(r, Role::User | Role::Tool))
                    .map(|(_, t)| t.as_str())
                    .collect();
                p.id_slot = Some(env::order_ids_in(&said.join("\n")));
            }
            // the reference is scored on the prompt before the reply is sampled: p_0 on the
            // opening, and with IgContext::Observation p_{k} after reply k and its observation
            let msgs = std::mem::take(&mut pending);
            let gen = match &reference_logp {
                Some(lp) if after_observation || lp.is_empty() => {
                    engine.generate_scoring(key, msgs, p.clone(), &reference, adapted)?
                }
                _ => engine.generate(key, msgs, p.clone(), None)?,
            };
            if let (Some(lp), Some(x)) = (reference_logp.as_mut(), gen.reference_logp) {
                lp.push(x);
            }
            for t in &gen.prompt {
                context.extend_from_slice(&t.tokens);
            }
            context.extend_from_slice(&gen.reply.tokens);
            if let Some(a) = gen.reply.shadow_agrees {
                shadow_agrees = Some(shadow_agrees.unwrap_or(true) && a);
            }
            if let Some(lp) = reference_logp.as_mut().filter(|_| !after_observation) {
                lp.push(engine.score_reference_by(context.clone(), true, &reference, adapted)?);
            }
            if let Some(rec) = recorder {
                let ids = rec.generation(store, &gen, &p, engine.info())?;
                if let (Some(inj), Some(&msg)) = (&injection, ids.iter().rev().nth(1)) {
                    Library::record(store, msg, inj)?;
                }
            }
            let text = gen.reply.text.trim().to_string();
            transcript.push((Role::Assistant, text.clone()));
            match desk.step(&text) {
                Observation::Customer(t) => pending.push(Message::new(Role::User, t)),
                Observation::Tool(t) => pending.push(Message::new(Role::Tool, t)),
                Observation::End => {
                    // nothing comes back after the last reply: its score is after the reply
                    if let Some(lp) = reference_logp.as_mut().filter(|_| after_observation) {
                        let c = context.clone();
                        lp.push(engine.score_reference_by(c, true, &reference, adapted)?);
                    }
                    break;
                }
            }
        }
        Ok::<_, Error>(())
    })();
    engine.close(key);
    result?;
    if let Some(rec) = recorder {
        let outcome = Feedback::Outcome {
            value: desk.reward(),
            note: Some("demo"),
        };
        rec.feedback(store, &outcome)?;
        rec.end(store)?;
    }
    Ok(Played {
        desk,
        transcript,
        session_id,
        reference_logp,
        shadow_agrees,
    })
}

/// Runs `work` on every job and returns the results in the order of `jobs`, calling `tick`
/// after each. Every engine opens as many lanes as it generates sessions at once
/// ([`Engine::lanes`]), each on its own thread with its own `init()` state (a store
/// connection); with `n` lanes in all, lane `w` takes jobs `w, w + n, …` in that order, and
/// lane `w` belongs to engine `w mod engines`. The assignment is fixed, not first-free, and
/// the engines schedule lanes by what they ask, not by timing: llama.cpp's numbers depend on
/// which sessions share a batch and on what the KV cache holds, so this keeps a seeded run
/// reproducible. With `one_lane`, every engine plays one session at a time (canonical play,
/// [`PlaySettings::canonical`]). The first error stops the other lanes and is returned.
fn on_engines<J: Send, R: Send, S>(
    engines: &[Engine],
    jobs: Vec<J>,
    one_lane: bool,
    init: impl Fn() -> Result<S> + Sync,
    work: impl Fn(&Engine, &mut S, J) -> Result<R> + Sync,
    tick: &mut dyn FnMut(),
) -> Result<Vec<R>> {
    let per_engine = engines
        .iter()
        .map(|e| if one_lane { 1 } else { e.info().n_seq.max(1) })
        .min()
        .unwrap_or(1);
    // no more lanes than jobs: an idle lane would only hold the others up
    let per_engine = per_engine.min(jobs.len().div_ceil(engines.len().max(1)).max(1));
    let mut lanes: Vec<_> = engines
        .iter()
        .map(|e| e.lanes(per_engine).into_iter())
        .collect();
    // lane w = engine w mod E, its (w div E)-th lane
    let mut ordered = Vec::with_capacity(engines.len() * per_engine);
    for _ in 0..per_engine {
        ordered.extend(lanes.iter_mut().filter_map(Iterator::next));
    }
    let workers = ordered.len().max(1);
    let mut shares: Vec<Vec<(usize, J)>> = (0..workers).map(|_| Vec::new()).collect();
    for (i, job) in jobs.into_iter().enumerate() {
        shares[i % workers].push((i, job));
    }
    let mut out: Vec<Option<R>> = shares.iter().flatten().map(|_| None).collect();
    let stop = AtomicBool::new(false);
    let (init, work) = (&init, &work);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let results = std::thread::scope(|sc| {
        let handles: Vec<_> = ordered
            .into_iter()
            .zip(shares)
            .map(|(lane, share)| {
                let (tx, stop) = (tx.clone(), &stop);
                sc.spawn(move || -> Result<Vec<(usize, R)>> {
                    let run = || {
                        let mut state = init()?;
                        let mut done = Vec::with_capacity(share.len());
                        for (i, job) in share {
                            if stop.load(Ordering::SeqCst) {
                                break;
                            }
                            done.push((i, work(&lane, &mut state, job)?));
                            let _ = tx.send(());
                        }
                        Ok(done)
                    };
                    let r = run();
                    // the engine stops waiting for this lane
                    drop(lane);
                    if r.is_err() {
                        stop.store(true, Ordering::SeqCst);
                    }
                    r
                })
            })
            .collect();
        drop(tx);
        for () in rx {
            tick();
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("an engine worker panicked".into())))
            })
            .collect::<Vec<_>>()
    });
    for r in results {
        for (i, v) in r? {
            out[i] = Some(v);
        }
    }
    out.into_iter()
        .map(|v| v.ok_or_else(|| Error::Invalid("a job was not run".into())))
        .collect()
}

/// The scripted expert's session of `scenario` as a conversation to import.
pub fn expert_conversation(scenario: &Scenario, patience: usize) -> Conversation {
    let mut c = scripted_conversation(scenario, patience.max(6), env::expert_reply);
    c.group = Some(format!("expert:{:?}", scenario.intent).to_lowercase());
    c.metadata["demo"] = json!("expert");
    c
}

/// A session of `scenario` played by a scripted agent (`agent(desk, observations so far)`),
/// as a conversation to import, with its reward as the outcome.
pub fn scripted_conversation(
    scenario: &Scenario,
    patience: usize,
    agent: impl Fn(&Desk, &[Observation]) -> String,
) -> Conversation {
    let mut desk = Desk::new(scenario.clone(), patience);
    let mut messages = vec![
        Message::new(Role::System, env::SYSTEM_PROMPT),
        Message::new(Role::User, scenario.opening()),
    ];
    let mut seen = Vec::new();
    loop {
        let reply = agent(&desk, &seen);
        messages.push(Message::new(Role::Assistant, reply.clone()));
        let obs = desk.step(&reply);
        match &obs {
            Observation::Customer(t) => messages.push(Message::new(Role::User, t.clone())),
            Observation::Tool(t) => messages.push(Message::new(Role::Tool, t.clone())),
            Observation::End => break,
        }
        seen.push(obs);
    }
    Conversation {
        messages,
        outcome: Some(desk.reward()),
        reference: Some(env::action_line(&scenario.ground_truth)),
        group: None,
        metadata: json!({"demo": "scripted", "intent": format!("{:?}", scenario.intent), "template": scenario.template}),
    }
}

/// RL iterations of the default run: on an idle 2-core machine of the kind the results were
/// measured on (`--threads 2`, two engines) warm start and evaluations take ~3 minutes and an
/// iteration ~2.2 minutes, ~14 minutes in all (seed 4: 13.6 min; docs/results.md).
pub const DEFAULT_ITERATIONS: usize = 5;

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

impl<'a> Demo<'a> {
    /// A run logging to `db` (a fresh file in the run directory), playing its sessions on
    /// `engines` (at least one; [`DemoConfig::engines`] is set to their number).
    ///
    /// # Errors
    /// Store errors; no engine.
    pub fn new(
        engines: &'a [Engine],
        head: &'a OutputHead,
        db: &Path,
        mut cfg: DemoConfig,
    ) -> Result<Self> {
        if engines.is_empty() {
            return Err(Error::Invalid("the demo needs at least one engine".into()));
        }
        cfg.engines = engines.len();
        let mut store = Store::open(db)?;
        store.set_policy_model(&crate::assets::model_stamp_json(&engines[0].info().path));
        let library = if cfg.experience {
            Some(Library::load(&store, LibraryConfig::default())?)
        } else {
            None
        };
        let mut rng = Rng::new(cfg.seed ^ 0x4845_4c44_4f55_5421);
        let held_out = (0..cfg.eval_scenarios)
            .map(|_| restating(env::scenario(&mut rng, Split::HeldOut), cfg.restate))
            .collect();
        Ok(Demo {
            engines,
            head,
            store,
            db: db.to_path_buf(),
            held_out,
            val_rng: Rng::new(cfg.seed ^ 0x5641_4c49_4441_5445),
            on_policy: 0,
            gate_replayed: None,
            active: None,
            library,
            start: Instant::now(),
            next_key: 1 << 40,
            result: DemoResult {
                config: cfg.clone(),
                model: engines[0].info().name.clone(),
                model_file: crate::assets::model_stamp_json(&engines[0].info().path),
                machine: Machine::this(engines, cfg.rl.threads),
                evals: Vec::new(),
                iterations: Vec::new(),
                warm_adapter: None,
                final_adapter: None,
                phase_seconds: Vec::new(),
                wall_s: 0.0,
                rl_gain: (0.0, 0.0, 0.0),
                experience_entries: Vec::new(),
                experience_injections: 0,
                peak_rss_mib: 0.0,
            },
            cfg,
        })
    }

    /// The run's store (read access for reports and tests).
    pub fn store(&self) -> &Store {
        &self.store
    }

    fn key(&mut self) -> u64 {
        self.next_key += 1;
        self.next_key
    }

    /// Puts `adapter` on every engine.
    fn set_adapter(&self, adapter: Option<(i64, Arc<Adapter>)>) -> Result<()> {
        for e in self.engines {
            e.set_adapter(adapter.clone())?;
        }
        Ok(())
    }

    fn set_shadow(&self, adapter: Option<Arc<Adapter>>) -> Result<()> {
        for e in self.engines {
            e.set_shadow(adapter.clone())?;
        }
        Ok(())
    }

    /// Plays `jobs` and returns their sessions in the order of `jobs`, ticking `label` once per
    /// session ([`on_engines`]; with several engines each logs through its own connection to the
    /// run's database). Consecutive rollouts of a scenario still share their prefix on each
    /// engine.
    fn play_all(
        &mut self,
        jobs: Vec<Job>,
        label: &str,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<Vec<Played>> {
        if jobs.len() < 2 {
            let mut out = Vec::with_capacity(jobs.len());
            for j in jobs {
                let lib = self.library.as_ref();
                out.push(play(
                    &self.engines[0],
                    &mut self.store,
                    &j.scenario,
                    &j.how,
                    j.log,
                    lib,
                )?);
                progress(Progress::Tick(label));
            }
            return Ok(out);
        }
        let (db, library) = (&self.db, self.library.as_ref());
        let one_lane = jobs.iter().any(|j| j.how.canonical);
        on_engines(
            self.engines,
            jobs,
            one_lane,
            || Store::open(db),
            |engine, store, job| play(engine, store, &job.scenario, &job.how, job.log, library),
            &mut || progress(Progress::Tick(label)),
        )
    }

    fn activate(&mut self, id: i64) -> Result<()> {
        let (engines, previous) = (self.engines, self.active.clone());
        let on_all = |a: Option<(i64, Arc<Adapter>)>| {
            engines.iter().try_for_each(|e| e.set_adapter(a.clone()))
        };
        let ad = gate::activate(
            &mut self.store,
            id,
            |a| on_all(Some((id, a))),
            || on_all(previous),
        )?;
        self.active = Some((id, ad));
        self.on_policy = 0;
        Ok(())
    }

    /// A greedy, unlogged session of `scenario` with the engines' current adapter.
    fn greedy_job(&mut self, scenario: &Scenario) -> Job {
        let how = PlaySettings {
            patience: self.cfg.patience,
            params: SamplerParams {
                temperature: 0.0,
                top_k: 0,
                top_p: 1.0,
                max_tokens: self.cfg.max_tokens,
                ..Default::default()
            },
            key: self.key(),
            score_reference: false,
            ig_context: self.cfg.ig_context,
            ig_policy: self.cfg.ig_policy,
            id_slot: self.cfg.id_slot,
            canonical: false,
        };
        Job {
            scenario: scenario.clone(),
            how,
            log: None,
        }
    }

    /// Greedy (success, reward, shadow agreed) of the engines' current adapter on each of
    /// `scenarios`.
    fn validate(&mut self, scenarios: &[Scenario]) -> Result<Vec<(bool, f64, bool)>> {
        let jobs = scenarios.iter().map(|s| self.greedy_job(s)).collect();
        Ok(self
            .play_all(jobs, "validation", &mut |_| {})?
            .into_iter()
            .map(|p| {
                let agrees = p.shadow_agrees == Some(true);
                (p.desk.success(), p.desk.reward(), agrees)
            })
            .collect())
    }

    /// The validation gate: greedy (success, reward) of the candidate and of the active adapter
    /// on the same fresh validation-template scenarios (unseen phrasings: a candidate that got
    /// better on the training phrasings and worse on new ones is measured, and rejected, as the
    /// held-out set would see it). Fresh at every gate, because an adapter
    /// that was activated for its score on a fixed set carries that set's luck with it (the
    /// winner's curse): measured, a fixed 16-scenario set rejected every later candidate. With
    /// [`DemoConfig::shadow_gate`] the active adapter plays only the scenarios where it would
    /// have chosen another token somewhere along the candidate's session (the rest are the
    /// same sessions); the iteration's `gate_replayed` says how many. The engine is back on the
    /// active adapter, without a shadow, afterwards.
    fn validation_gate(&mut self, candidate: i64) -> Result<gate::Validation> {
        let mut scenarios: Vec<Scenario> = if self.cfg.stratify {
            env::stratified(&mut self.val_rng, Split::Validation, self.cfg.val_scenarios)
        } else {
            (0..self.cfg.val_scenarios)
                .map(|_| env::scenario(&mut self.val_rng, Split::Validation))
                .collect()
        };
        for s in &mut scenarios {
            s.restates = self.cfg.restate;
        }
        let ad = Arc::new(Adapter::load(&adapter_dir(&self.db, candidate))?);
        self.set_adapter(Some((candidate, ad.clone())))?;
        // with the shadow check, the active adapter's greedy choices are checked along the
        // candidate's sessions: where it agreed at every token it would have played the same
        // session, and only the others are replayed with it
        // (only between adapters with the same block LoRA: the shadow reads the candidate's
        // hidden states, which another block LoRA would have made differently)
        let shadow = if self.cfg.shadow_gate {
            self.active
                .as_ref()
                .filter(|a| a.1.block == ad.block)
                .map(|a| a.1.clone())
        } else {
            None
        };
        let cand = self
            .set_shadow(shadow.clone())
            .and_then(|()| self.validate(&scenarios));
        let restored = self
            .set_shadow(None)
            .and_then(|()| self.set_adapter(self.active.clone()));
        let cand = cand?;
        restored?;
        let replay: Vec<usize> = (0..scenarios.len())
            .filter(|&i| shadow.is_none() || !cand[i].2)
            .collect();
        let again: Vec<Scenario> = replay.iter().map(|&i| scenarios[i].clone()).collect();
        let mut current: Vec<(bool, f64)> = cand.iter().map(|c| (c.0, c.1)).collect();
        for (&i, r) in replay.iter().zip(self.validate(&again)?) {
            current[i] = (r.0, r.1);
        }
        self.gate_replayed = Some((replay.len(), scenarios.len()));
        let mean = |v: &[(bool, f64)]| {
            let n = v.len().max(1) as f64;
            let s = v.iter().filter(|x| x.0).count() as f64;
            gate::Score {
                success: s / n,
                reward: v.iter().map(|x| x.1).sum::<f64>() / n,
            }
        };
        Ok(gate::Validation {
            candidate: mean(&cand.iter().map(|c| (c.0, c.1)).collect::<Vec<_>>()),
            active: mean(&current),
            scenarios: scenarios.len(),
        })
    }

    /// Greedy evaluation of the current adapter on the held-out set.
    ///
    /// # Errors
    /// Engine errors.
    pub fn evaluate(&mut self, label: &str, progress: &mut dyn FnMut(Progress)) -> Result<f64> {
        let n = if label == "base" {
            self.held_out.len().min(BASE_EVAL_SCENARIOS)
        } else {
            self.held_out.len()
        };
        self.evaluate_first(label, n, progress)
    }

    fn evaluate_first(
        &mut self,
        label: &str,
        n: usize,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<f64> {
        let t = Instant::now();
        let adapter_id = self.active.as_ref().map(|a| a.0);
        if self.library.is_none() {
            let earlier = self
                .result
                .evals
                .iter()
                .find(|e| e.adapter_id == adapter_id && e.success.len() == n && e.same_as.is_none())
                .cloned();
            if let Some(e) = earlier {
                let rate = e.rate();
                self.result.evals.push(Evaluation {
                    label: label.to_string(),
                    iteration: self.result.iterations.len(),
                    same_as: Some(e.label),
                    ..e
                });
                self.phase(&format!("evaluation: {label}"), t);
                progress(Progress::Phase(label, 0));
                progress(Progress::Done(label));
                return Ok(rate);
            }
        }
        progress(Progress::Phase(label, n));
        let mut ev = Evaluation {
            label: label.to_string(),
            iteration: self.result.iterations.len(),
            adapter_id,
            success: Vec::new(),
            reward: Vec::new(),
            mean_turns: 0.0,
            malformed_per_session: 0.0,
            transcripts: Vec::new(),
            same_as: None,
        };
        let (mut turns, mut malformed) = (0usize, 0usize);
        let scenarios: Vec<Scenario> = self.held_out.iter().take(n).cloned().collect();
        // canonical play: an evaluation's transcripts depend only on the model file, the
        // adapter, the scenario and the thread count, whatever the preset did before
        let jobs = scenarios
            .iter()
            .map(|s| {
                let mut j = self.greedy_job(s);
                j.how.canonical = true;
                j
            })
            .collect();
        for p in self.play_all(jobs, label, progress)? {
            ev.success.push(p.desk.success());
            ev.reward.push(p.desk.reward());
            turns += p.desk.agent_turns;
            malformed += p.desk.malformed;
            ev.transcripts.push(
                p.transcript
                    .iter()
                    .map(|(r, t)| (r.as_str().to_string(), t.clone()))
                    .collect(),
            );
        }
        let n = n.max(1) as f64;
        ev.mean_turns = turns as f64 / n;
        ev.malformed_per_session = malformed as f64 / n;
        let rate = ev.rate();
        self.result.evals.push(ev);
        self.phase(&format!("evaluation: {label}"), t);
        progress(Progress::Done(label));
        Ok(rate)
    }

    fn phase(&mut self, name: &str, t: Instant) {
        self.result
            .phase_seconds
            .push((name.to_string(), t.elapsed().as_secs_f64()));
    }

    /// Imports the expert's demonstrations (training templates only) and fits the warm-start
    /// adapter on them; it becomes active.
    ///
    /// # Errors
    /// Engine, store and update errors.
    pub fn warm_start(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<i64> {
        let t = Instant::now();
        let mut rng = Rng::new(self.cfg.seed ^ 0x5741_524d);
        progress(Progress::Phase("demonstrations", self.cfg.demos));
        let demos: Vec<Conversation> = (0..self.cfg.demos)
            .map(|_| {
                let s = restating(env::scenario(&mut rng, Split::Train), self.cfg.restate);
                expert_conversation(&s, self.cfg.patience)
            })
            .collect();
        // rescored on every engine, stored in the order they were drawn (the warm start's
        // batches follow session order)
        let rescored = on_engines(
            self.engines,
            demos,
            false,
            || Ok(()),
            |engine, (), c| rescore_conversation(engine, &c),
            &mut || progress(Progress::Tick("demonstrations")),
        )?;
        for r in &rescored {
            store_rescored(&mut self.store, r)?;
        }
        progress(Progress::Done("demonstrations"));
        self.phase("demonstrations", t);
        let t = Instant::now();
        let cfg = self.cfg.warm.clone();
        let sel = Selection {
            source: Some(Source::Import),
            since: None,
            until: None,
            limit: self.cfg.demos,
        };
        progress(Progress::Phase("warm start", 1));
        let r = run_update(
            &mut self.store,
            &self.db,
            self.head,
            None,
            &cfg,
            &sel,
            |_, _, _| {},
        )?;
        let id = r
            .adapter_id
            .ok_or_else(|| Error::Invalid("the warm start wrote no adapter".into()))?;
        let id = match self.cfg.block_warm {
            Some(k) => self.block_warm_start(id, k, progress)?,
            None => id,
        };
        self.activate(id)?;
        self.result.warm_adapter = Some(id);
        progress(Progress::Done("warm start"));
        self.phase("warm start", t);
        Ok(id)
    }

    /// Trains a block LoRA (q,v, r = 8, last `k` blocks) on the imported demonstrations, on top
    /// of the output-LoRA warm start `parent` (fixed: the policy trained is the one served), and
    /// writes it, with `parent`'s other parts, as a new version.
    fn block_warm_start(
        &mut self,
        parent: i64,
        k: usize,
        progress: &mut dyn FnMut(Progress),
    ) -> Result<i64> {
        use crate::adapter::block::BlockLora;
        use crate::graph::block::{BlockGraphKind, BlockSpec, OrtBlock};
        use crate::graph::step::StepKind;
        use crate::learn::block::{assistant_positions, capture_sequence, train_sft, Captured};
        use crate::policy::blocks::TailModel;
        use crate::policy::llama::{Context, ContextParams, Model};

        let t = Instant::now();
        let path = self.engines[0].info().path.clone();
        let tail = TailModel::from_gguf(&path, k)?;
        let n_embd = tail.hp.n_embd;
        let model = Model::load(&path, 0)?;
        let mut ctx = Context::new(
            &model,
            ContextParams {
                n_ctx: 2048,
                n_batch: 512,
                n_threads: self.cfg.warm.threads as i32,
                capture_hidden: false,
                capture_block: Some(tail.input_layer()),
                n_seq: 1,
                kv_cells: None,
            },
        )?;
        let sessions =
            self.store
                .training_sessions(Some(Source::Import), None, false, self.cfg.demos)?;
        let mut data = Vec::new();
        for s in &sessions {
            if let Some((tokens, scored)) = assistant_positions(&self.store, s.id)? {
                let x = capture_sequence(&mut ctx, &tokens, n_embd)?;
                let scored = scored.into_iter().filter(|&p| p < x.nrows()).collect();
                data.push(Captured {
                    tokens,
                    x,
                    scored,
                    logits: ndarray::Array2::zeros((0, 0)),
                    hidden: Vec::new(),
                });
            }
        }
        drop(ctx);
        let spec = BlockSpec {
            k,
            targets: vec!["q".into(), "v".into()],
            r: 8,
            alpha: 16.0,
        };
        let mut lora = BlockLora::fresh(&tail.hp, spec.clone(), self.cfg.seed);
        let batch = 4;
        let steps = (self.cfg.warm.epochs * data.len().div_ceil(batch)).min(150);
        progress(Progress::Phase("block warm start", steps));
        let mut g = OrtBlock::new(
            tail,
            spec,
            BlockGraphKind::Step(StepKind::CrossEntropy { digit_class: false }),
            true,
            crate::graph::Device::Cpu,
            self.cfg.warm.threads,
        )?;
        // served on top of the parent's output LoRA: trained on top of it
        let rec = self.store.adapter(parent)?;
        let mut adapter = Adapter::load(Path::new(&rec.path))?;
        let losses = train_sft(
            &mut g,
            &data,
            &mut lora,
            Some(adapter.output_lora()),
            crate::learn::block::SftConfig {
                steps,
                batch,
                lr: 2e-3,
                seed: self.cfg.seed,
            },
            |_, _| progress(Progress::Tick("block warm start")),
        )?;
        adapter.block = Some(lora);
        let metrics = serde_json::json!({
            "algo": "sft-block",
            "block": {"k": k, "targets": ["q", "v"], "r": 8},
            "sessions": data.len(),
            "steps": steps,
            "first_loss": losses.first(),
            "final_loss": losses.last(),
        });
        let id = crate::learn::candidate::write_candidate(
            &mut self.store,
            &self.db,
            Some(parent),
            &adapter,
            &metrics,
        )?;
        progress(Progress::Done("block warm start"));
        self.phase("block warm start", t);
        Ok(id)
    }

    /// One RL iteration: rollouts, annotation, update, gate, activation.
    ///
    /// # Errors
    /// Engine and store errors (a rejected update is recorded, not an error).
    pub fn iteration(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<&Iteration> {
        let it = self.result.iterations.len() + 1;
        let label = format!("iteration {it}");
        let n = self.cfg.scenarios_per_iter * self.cfg.group_size;
        progress(Progress::Phase(&label, n + 2));
        let mut rng = Rng::new(
            self.cfg
                .seed
                .wrapping_mul(0x9E37_79B9)
                .wrapping_add(it as u64),
        );
        let params = SamplerParams {
            temperature: self.cfg.temperature,
            top_k: 0,
            top_p: 1.0,
            max_tokens: self.cfg.max_tokens,
            greedy_digits: self.cfg.greedy_digits,
            ..Default::default()
        };
        let sampled_with = self.active.as_ref().map(|a| a.0);
        let (mut ids, mut succ, mut rew) = (Vec::new(), 0usize, 0.0);
        // step-level credit: information gain of the ground truth with the frozen policy,
        // scored during the rollouts (the session is still in the KV cache)
        let uses_process = matches!(self.cfg.rl.algo, Algo::A2tgpo | Algo::Atpo)
            && self.cfg.process != ProcessSignal::None;
        let score_reference = uses_process && self.cfg.process == ProcessSignal::InfoGain;
        let mut jobs = Vec::with_capacity(n);
        // balanced batches: the k-th scenario takes the k-th intent of a shuffled cycle
        let order = self.cfg.stratify.then(|| env::shuffled_intents(&mut rng));
        for k in 0..self.cfg.scenarios_per_iter {
            let mut s = restating(
                match &order {
                    Some(o) => env::scenario_for(&mut rng, Split::Train, o[k % o.len()]),
                    None => env::scenario(&mut rng, Split::Train),
                },
                self.cfg.restate,
            );
            if self.cfg.paraphrase {
                env::paraphrase(&mut rng, &mut s);
            }
            for g in 0..self.cfg.group_size {
                let mut p = params.clone();
                p.seed = rng.next_u64();
                let key = self.key();
                let log = LogMeta {
                    group: format!("it{it}:s{k}"),
                    metadata: json!({"iteration": it, "intent": format!("{:?}", s.intent), "template": s.template, "rollout": g}),
                };
                let how = PlaySettings {
                    patience: self.cfg.patience,
                    params: p,
                    key,
                    score_reference,
                    ig_context: self.cfg.ig_context,
                    ig_policy: self.cfg.ig_policy,
                    id_slot: self.cfg.id_slot,
                    canonical: false,
                };
                jobs.push(Job {
                    scenario: s.clone(),
                    how,
                    log: Some(log),
                });
            }
        }
        let mut scored = HashMap::new();
        for played in self.play_all(jobs, &label, progress)? {
            succ += usize::from(played.desk.success());
            rew += played.desk.reward();
            if let (Some(id), Some(lp)) = (played.session_id, played.reference_logp) {
                scored.insert(id, lp);
            }
            ids.extend(played.session_id);
        }
        if score_reference {
            // information gain only: the update's credit stage writes the value head's success
            // contribution (one writer per annotation)
            annotate_sessions_with(
                &mut self.store,
                &ids,
                None,
                self.active.as_ref().map(|a| a.0),
                InfoGainSource::Scored(&scored),
                &AnnotateConfig {
                    ig_context: self.cfg.ig_context,
                    ig_policy: self.cfg.ig_policy,
                    ig_scorer: self.active.as_ref().map(|a| a.0),
                    ..AnnotateConfig::default()
                },
            )?;
        }
        progress(Progress::Tick(&label));
        let mut cfg = self.cfg.rl.clone();
        if cfg.objective.kl_coef > 0.0 && cfg.kl_ref_adapter.is_none() {
            cfg.kl_ref_adapter = self.result.warm_adapter;
        }
        if self.cfg.process == ProcessSignal::None {
            cfg.alpha = 0.0;
        }
        // the learner optimises the policy the rollouts were sampled from (logits / T over the
        // sampler's support), so no importance correction is needed for the temperature
        // with the validation gate, rollouts of earlier iterations whose candidates were
        // rejected were sampled with the same active adapter: still on-policy, kept
        self.on_policy = if self.cfg.val_scenarios > 0 {
            (self.on_policy + ids.len()).min(ON_POLICY_ITERATIONS * n)
        } else {
            ids.len()
        };
        let trained_on = self.on_policy;
        let sel = Selection {
            source: Some(Source::Demo),
            since: None,
            until: None,
            limit: trained_on,
        };
        let (mut update_id, mut candidate, mut activated, mut note, mut diagnostics) =
            (None, None, false, None, None);
        let mut validation = None;
        match run_update(
            &mut self.store,
            &self.db,
            self.head,
            self.active.clone(),
            &cfg,
            &sel,
            |_, _, _| {},
        ) {
            Ok(r) => {
                update_id = Some(r.update_id);
                candidate = r.adapter_id;
                let kl = r.diagnostics.approx_kl;
                diagnostics = Some(r.diagnostics);
                if let Some(id) = candidate {
                    // the KL bound first (free), then the validation comparison (played)
                    let mut v = None;
                    let verdict = gate::decide(
                        kl,
                        self.cfg.gate_kl,
                        || Ok(None),
                        || {
                            if self.cfg.val_scenarios > 0 {
                                v = Some(self.validation_gate(id)?);
                            }
                            Ok(v)
                        },
                    )?;
                    validation = v.map(|v| {
                        [
                            (v.candidate.success, v.candidate.reward),
                            (v.active.success, v.active.reward),
                        ]
                    });
                    gate::record(&self.store, id, &verdict)?;
                    if verdict.passed {
                        self.activate(id)?;
                        activated = true;
                    } else {
                        note = verdict.reason.map(|r| format!("gate: {r}"));
                    }
                }
            }
            Err(Error::Invalid(m)) => note = Some(m),
            Err(e) => return Err(e),
        }
        let experience = match self.library.as_mut() {
            Some(lib) => {
                let cands = Library::candidates(&self.store, &ids, 1.0)?;
                Some(lib.evolve(&mut self.store, &cands, update_id)?)
            }
            None => None,
        };
        progress(Progress::Tick(&label));
        progress(Progress::Done(&label));
        let total = n.max(1) as f64;
        self.result.iterations.push(Iteration {
            iteration: it,
            sampled_with,
            train_success: succ as f64 / total,
            train_reward: rew / total,
            sessions: ids.len(),
            update_id,
            candidate,
            activated,
            note,
            trained_on,
            validation,
            gate_replayed: validation.and(self.gate_replayed.take()),
            diagnostics,
            experience,
            elapsed_s: self.start.elapsed().as_secs_f64(),
        });
        Ok(self.result.iterations.last().expect("just pushed"))
    }

    /// The whole run within the time budget.
    ///
    /// # Errors
    /// Engine, store and update errors.
    pub fn run(mut self, progress: &mut dyn FnMut(Progress)) -> Result<DemoResult> {
        let budget = self.cfg.minutes.map_or(f64::INFINITY, |m| m * 60.0);
        if self.cfg.eval_base {
            self.evaluate("base", progress)?;
        }
        self.warm_start(progress)?;
        let t_eval = Instant::now();
        self.evaluate("warm start", progress)?;
        let eval_s = t_eval.elapsed().as_secs_f64();
        let t_rl = Instant::now();
        // the next iteration is budgeted at 1.2 × the longest so far and the final evaluation
        // at 1.25 × the warm start's: an update over kept on-policy sessions takes longer than
        // one over a single batch, and a trained policy writes longer sessions (measured on
        // seed 1 with the last iteration's time and 1.1 × the evaluation: iteration 10 took
        // 137 s against 116 s before it, the final evaluation 36 s against 31 s, 18 s over)
        let mut longest_iter_s = 0.0f64;
        loop {
            let done = self.result.iterations.len();
            if self.cfg.max_iterations.is_some_and(|m| done >= m) {
                break;
            }
            let elapsed = self.start.elapsed().as_secs_f64();
            let left = budget - elapsed - eval_s * 1.25;
            if done > 0 && left < longest_iter_s * 1.2
                || done == 0 && left <= 0.0 && self.cfg.max_iterations.is_none()
            {
                break;
            }
            let t = Instant::now();
            self.iteration(progress)?;
            longest_iter_s = longest_iter_s.max(t.elapsed().as_secs_f64());
            let it = self.result.iterations.len();
            if self.cfg.eval_every > 0
                && it.is_multiple_of(self.cfg.eval_every)
                && self.cfg.max_iterations != Some(it)
            {
                self.evaluate(&format!("iteration {it}"), progress)?;
            }
        }
        self.phase("RL iterations", t_rl);
        self.evaluate("final", progress)?;
        self.result.final_adapter = self.active.as_ref().map(|a| a.0);
        let warm = self
            .result
            .evals
            .iter()
            .find(|e| e.label == "warm start")
            .map(|e| e.success.clone())
            .unwrap_or_default();
        let fin = self
            .result
            .evals
            .last()
            .map(|e| e.success.clone())
            .unwrap_or_default();
        self.result.rl_gain = paired_bootstrap(&warm, &fin, 10_000, self.cfg.seed);
        if self.library.is_some() {
            self.result.experience_entries = Library::listing(&self.store)?;
            self.result.experience_injections = Library::injections(&self.store)?;
        }
        self.result.wall_s = self.start.elapsed().as_secs_f64();
        self.result.peak_rss_mib = peak_rss_mib();
        Ok(self.result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_and_wilson_intervals() {
        // identical outcomes: no difference, zero-width interval
        let a = vec![true, false, true, false];
        assert_eq!(paired_bootstrap(&a, &a, 200, 1), (0.0, 0.0, 0.0));
        // every pair improves: difference 1 with certainty
        let b = vec![false; 6];
        let c = vec![true; 6];
        assert_eq!(paired_bootstrap(&b, &c, 200, 1), (1.0, 1.0, 1.0));
        // half the pairs improve: point 0.5, interval inside [0, 1] and around 0.5
        let d: Vec<bool> = (0..40).map(|i| i % 2 == 0).collect();
        let (p, lo, hi) = paired_bootstrap(&[false; 40], &d, 2000, 3);
        assert_eq!(p, 0.5);
        assert!(lo > 0.3 && lo < 0.5 && hi > 0.5 && hi < 0.7, "{lo} {hi}");
        // Wilson: 0 of 10 → [0, 0.2775]; 5 of 10 → [0.2366, 0.7634]
        let (l, h) = wilson(0, 10);
        assert!(l.abs() < 1e-12 && (h - 0.2775).abs() < 1e-3, "{h}");
        let (l, h) = wilson(5, 10);
        assert!((l - 0.2366).abs() < 1e-3 && (h - 0.7634).abs() < 1e-3);
    }

    #[test]
    fn stratified_bootstrap_resamples_within_each_stratum() {
        // constant strata keep their means in every replicate: a zero-width interval at the
        // pooled mean (1 + 1 + 0 + 0) / 4
        let (p, lo, hi) = stratified_bootstrap(&[vec![1.0, 1.0], vec![0.0, 0.0]], 500, 1);
        assert_eq!((p, lo, hi), (0.5, 0.5, 0.5));
        // strata of different sizes weigh by their items: (3·1 + 1·0) / 4
        let (p, ..) = stratified_bootstrap(&[vec![1.0; 3], vec![0.0]], 100, 2);
        assert_eq!(p, 0.75);
        // a mixed stratum widens the interval around the point
        let (p, lo, hi) =
            stratified_bootstrap(&[vec![1.0, -1.0, 1.0, -1.0], vec![0.0; 4]], 2000, 3);
        assert_eq!(p, 0.0);
        assert!(lo < 0.0 && hi > 0.0 && lo >= -0.5 && hi <= 0.5, "{lo} {hi}");
        assert_eq!(stratified_bootstrap(&[], 100, 1), (0.0, 0.0, 0.0));
    }

    /// Seeds that disagree: +1 on every scenario of one seed, −1 on every scenario of the
    /// other. Resampling scenarios inside the seeds sees no noise at all; resampling the seeds
    /// draws (+1, +1), (−1, −1) or a mix, so the interval spans [−1, +1].
    #[test]
    fn hierarchical_bootstrap_counts_the_spread_between_seeds() {
        let strata = [vec![1.0; 10], vec![-1.0; 10]];
        assert_eq!(stratified_bootstrap(&strata, 2000, 1), (0.0, 0.0, 0.0));
        let (p, lo, hi) = hierarchical_bootstrap(&strata, 2000, 1);
        assert_eq!((p, lo, hi), (0.0, -1.0, 1.0));
        // one seed: the stratified bootstrap's behaviour
        let (p, lo, hi) = hierarchical_bootstrap(&[vec![1.0, 1.0]], 500, 1);
        assert_eq!((p, lo, hi), (1.0, 1.0, 1.0));
        // seeds that agree keep a narrow interval
        let (_, lo, hi) = hierarchical_bootstrap(&[vec![1.0, 0.0], vec![0.0, 1.0]], 2000, 4);
        assert!(lo >= 0.0 && hi <= 1.0 && lo < 0.5 && hi > 0.5, "{lo} {hi}");
        assert_eq!(hierarchical_bootstrap(&[vec![]], 100, 1), (0.0, 0.0, 0.0));
    }

    #[test]
    fn the_expert_solves_every_training_scenario() {
        let mut rng = Rng::new(11);
        for _ in 0..200 {
            let s = env::scenario(&mut rng, Split::Train);
            let c = expert_conversation(&s, 5);
            assert_eq!(c.outcome, Some(1.0), "{s:?}\n{:#?}", c.messages);
            assert!(c.messages.len() <= 2 + 2 * 5, "{:#?}", c.messages);
        }
    }
}
