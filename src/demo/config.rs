//! What a demo run does: the preset, the budget, the world's switches and the learner's
//! settings ([`DemoConfig`]).

use super::*;

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
    /// information gain of the ground-truth action (teacher-forced, scored by the policy `ig_policy` names)
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
    /// which policy scores information gain: the active adapter that sampled the rollout
    /// (sampling, the default) or the base model (frozen)
    pub ig_policy: IgPolicy,
    /// information gain as a change of log-prob (the default) or of probability
    pub ig_space: IgSpace,
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
            ig_policy: IgPolicy::Sampling,
            ig_space: IgSpace::Logprob,
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

/// RL iterations of the default run: on an idle 2-core machine of the kind the results were
/// measured on (`--threads 2`, two engines) warm start and evaluations take ~3 minutes and an
/// iteration ~2.2 minutes, ~14 minutes in all (seed 4: 13.6 min; docs/results.md).
pub const DEFAULT_ITERATIONS: usize = 5;
