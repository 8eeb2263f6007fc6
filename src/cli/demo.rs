//! `turnwise demo`: the simulated customer-service desk where the bot learns on this machine.

use std::io::IsTerminal as _;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use turnwise::demo::{report, wilson, Demo, DemoConfig, ProcessSignal, Progress};
use turnwise::learn::annotate::{IgContext, IgPolicy, IgSpace};
use turnwise::learn::Algo;
use turnwise::policy::{Engine, EngineCounters, OutputHead};

use super::learn_args::{LearnArgs, OnOff};
use super::ModelArgs;

/// Options of `turnwise demo`.
#[derive(Args)]
pub struct DemoArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    learn: LearnArgs,
    /// RL preset after the warm start
    #[arg(long, value_enum, default_value_t = Algo::A2tgpo)]
    algo: Algo,
    /// Seed of scenarios, sampling and the adapter
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A wall-time budget in minutes instead of an iteration count: as many RL iterations as
    /// fit (the result then depends on the machine's speed) [default: none]
    #[arg(long)]
    minutes: Option<f64>,
    /// A small configuration that finishes in a couple of minutes (checks the plumbing)
    #[arg(long)]
    quick: bool,
    /// Run directory (turn log, adapters, report, plots) [default: demo-runs/<algo>-seed<seed>-<time>]
    #[arg(long)]
    out: Option<PathBuf>,
    /// RL iterations [default: 5, 2 with --quick; with --minutes: as many as fit]
    #[arg(long)]
    iterations: Option<usize>,
    /// Held-out scenarios per evaluation
    #[arg(long)]
    eval: Option<usize>,
    /// Evaluate on the held-out set every N iterations too (0: only before and after RL)
    #[arg(long)]
    eval_every: Option<usize>,
    /// Skip the base-model evaluation
    #[arg(long)]
    no_base_eval: bool,
    /// Expert demonstrations for the warm start
    #[arg(long)]
    demos: Option<usize>,
    /// Warm-start epochs
    #[arg(long)]
    warm_epochs: Option<usize>,
    /// Training scenarios per iteration
    #[arg(long)]
    scenarios: Option<usize>,
    /// Rollouts per scenario (the group size)
    #[arg(long)]
    group: Option<usize>,
    /// Process signal of A²TGPO / ATPO: info-gain, contribution (value head) or none (outcome only)
    #[arg(long, value_enum)]
    process: Option<ProcessSignal>,
    /// Largest |approx KL| of an update that is activated
    #[arg(long)]
    gate_kl: Option<f64>,
    /// k3 KL coefficient towards the warm-start adapter (default 0: off)
    #[arg(long)]
    kl_warm: Option<f64>,
    /// Rollout temperature
    #[arg(long)]
    temperature: Option<f32>,
    /// Rollouts take the arg-max wherever it is a digit token (order ids copied as the greedy
    /// evaluations copy them; exploration stays on the words)
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    greedy_digits: OnOff,
    /// Order ids go through the id slot: the digits after `ACTION <verb>` may only spell a
    /// number the customer or the back office wrote in the session (rollouts, evaluations and
    /// the gate alike; the policy still picks which number, and whether to act before one was
    /// given)
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    id_slot: OnOff,
    /// Block warm start: also train a LoRA on q,v of the last K blocks on the demonstrations
    /// (served by llama.cpp; RL then trains the output LoRA on top of it)
    #[arg(long, value_name = "K", conflicts_with = "adapter")]
    block_warm: Option<usize>,
    /// Which LoRA RL trains: `output` (on the output projection, applied at every sampled
    /// token) or `block` (on q,v of the last --block-k blocks, r 8, served by llama.cpp; the
    /// warm start trains it alone on the demonstrations, with no output LoRA underneath, so
    /// `adapters export --format gguf` carries the whole policy; the sessions log their block
    /// inputs, and the gap between the graph and llama.cpp is TIS-corrected, cap 2)
    #[arg(long, value_enum)]
    adapter: Option<AdapterKind>,
    /// With --adapter block: how many of the model's last blocks carry the LoRA
    #[arg(long, default_value_t = 2, value_name = "K")]
    block_k: usize,
    /// Validation gate: activate a candidate only if its greedy success on N fresh
    /// validation-template scenarios (phrasings that neither the rollouts nor the held-out set
    /// use) is at least the active adapter's on the same ones (default 32, --quick 0; 0: the KL
    /// bound only)
    #[arg(long)]
    val: Option<usize>,
    /// RL gives digit tokens (copied order ids) no policy gradient, so that the reward trains
    /// the decisions and leaves number copying as the warm start taught it [default: off;
    /// measured on seed 1: no candidate passed the validation gate; with the id slot, -34 points:
    /// held-out cancellations became lookups]
    /// `negative`: digits learn only from turns with a positive advantage (a success
    /// reinforces the id it copied; a failure does not push the copied digits down)
    #[arg(long, value_enum)]
    mask_digits: Option<DigitMask>,
    /// What the warm start's cross-entropy asks of a digit of the demonstrations: `token`
    /// (that digit) or `class` (some digit: where an id goes is taught, copying it is left to
    /// the base model)
    #[arg(long, value_enum, default_value_t = WarmDigits::Token)]
    warm_digits: WarmDigits,
    /// llama.cpp engines that play sessions side by side; `--threads` is split between them
    /// (two one-thread engines decode about 1.4× faster than one two-thread engine on two cores)
    /// [default: 2, or 1 with `--threads 1`]
    #[arg(long)]
    engines: Option<usize>,
    /// The experience library (step-level retrieval of strategies and warnings): on or off
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    experience: OnOff,
    /// Rollout batches and validation-gate sets hold every intent equally often (a shuffled
    /// cycle of the five intents) instead of a random intent per scenario
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    stratify: OnOff,
    /// Rollout openings get a random greeting, closing or lower case (surface variation; the
    /// demonstrations, the gate and the held-out set keep the plain templates)
    #[arg(long, value_enum, default_value_t = OnOff::Off)]
    paraphrase: OnOff,
    /// Customers repeat their request when they give the order id ("It's order 89941. I'd like
    /// my money back."); off: the id alone (the earlier world)
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    restate: OnOff,
    /// The validation gate replays with the active adapter only the scenarios where its greedy
    /// choices differed from the candidate's (checked token by token while the candidate
    /// plays); off: the active adapter plays every gate scenario itself
    #[arg(long, value_enum, default_value_t = OnOff::On)]
    shadow_gate: OnOff,
    /// Where information gain scores a turn: after its reply and the tool result or customer
    /// answer it brought back (observation), or right after the reply (reply, the earlier
    /// versions)
    #[arg(long, value_enum, default_value_t = IgContext::Observation)]
    ig_context: IgContext,
    /// Which policy scores information gain: the active adapter that sampled the rollout
    /// (sampling, as the released A²TGPO code scores it) or the base model, adapter off (frozen)
    #[arg(long, value_enum, default_value_t = IgPolicy::Sampling)]
    ig_policy: IgPolicy,
    /// Whether information gain is the change of the reference's mean log-prob (logprob, the
    /// released code's) or of its probability (prob, the paper's: bounded by 1 per turn)
    #[arg(long, value_enum, default_value_t = IgSpace::Logprob)]
    ig_space: IgSpace,
}

/// Which digit tokens get no policy gradient.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum DigitMask {
    /// every digit token learns
    Off,
    /// no digit token learns
    On,
    /// digit tokens of turns with a non-positive advantage do not learn
    Negative,
}

/// The warm start's target for a digit token.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum WarmDigits {
    /// the demonstration's digit
    Token,
    /// any digit (the digit class)
    Class,
}

/// The LoRA RL trains.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum AdapterKind {
    /// on the output projection
    Output,
    /// on q,v of the last blocks
    Block,
}

impl DemoArgs {
    fn config(&self) -> DemoConfig {
        let mut c = if self.quick {
            DemoConfig::quick(self.algo, self.seed)
        } else {
            DemoConfig::full(self.algo, self.seed)
        };
        if let Some(m) = self.minutes {
            c.minutes = Some(m);
            c.max_iterations = None;
        }
        macro_rules! set {
            ($($f:ident => $g:ident),*) => {$(if let Some(v) = self.$f { c.$g = v; })*};
        }
        set!(eval => eval_scenarios, eval_every => eval_every, demos => demos,
             scenarios => scenarios_per_iter, group => group_size,
             process => process, gate_kl => gate_kl,
             temperature => temperature, val => val_scenarios);
        // the learner's settings go into the embedded TrainConfigs
        if let Some(v) = self.warm_epochs {
            c.warm.epochs = v;
        }
        if let Some(v) = self.kl_warm {
            c.rl.objective.kl_coef = v;
        }
        if self.iterations.is_some() {
            c.max_iterations = self.iterations;
        }
        c.experience = self.experience == OnOff::On;
        c.greedy_digits = self.greedy_digits == OnOff::On;
        c.id_slot = self.id_slot == OnOff::On;
        c.block_warm = self.block_warm;
        if self.adapter == Some(AdapterKind::Block) {
            let spec = turnwise::graph::block::BlockSpec {
                k: self.block_k,
                targets: vec!["q".into(), "v".into()],
                r: 8,
                alpha: 16.0,
            };
            c.block_warm = Some(spec.k);
            c.rl.block = Some(spec);
            c.rl.objective.tis_cap = Some(2.0);
        }
        c.stratify = self.stratify == OnOff::On;
        c.paraphrase = self.paraphrase == OnOff::On;
        c.restate = self.restate == OnOff::On;
        c.shadow_gate = self.shadow_gate == OnOff::On;
        c.ig_context = self.ig_context;
        c.ig_policy = self.ig_policy;
        c.ig_space = self.ig_space;
        self.learn.apply(&mut c.rl);
        c.warm.sft_digit_class = self.warm_digits == WarmDigits::Class;
        if let Some(m) = self.mask_digits {
            c.rl.mask_digits = m == DigitMask::On;
            c.rl.mask_negative_digits = m == DigitMask::Negative;
        }
        let threads = usize::try_from(self.model.threads.max(1)).unwrap_or(1);
        (c.rl.threads, c.warm.threads) = (threads, threads);
        if self.no_base_eval {
            c.eval_base = false;
        }
        c
    }
}

/// The engines' counters, summed.
fn engine_counters(engines: &[Engine]) -> EngineCounters {
    engines.iter().fold(EngineCounters::default(), |a, e| {
        a.plus(&e.stats().counters())
    })
}

/// Runs the demo and prints the summary.
///
/// # Errors
/// Model, engine, store and report errors.
pub fn run(args: DemoArgs, verbose: bool) -> anyhow::Result<ExitCode> {
    let cfg = args.config();
    if cfg.demos == 0
        || cfg.scenarios_per_iter == 0
        || cfg.group_size == 0
        || cfg.eval_scenarios == 0
    {
        anyhow::bail!("--demos, --scenarios, --group and --eval must be at least 1");
    }
    if cfg.minutes.is_some_and(|m| !(m.is_finite() && m > 0.0)) {
        anyhow::bail!("--minutes must be a positive number of minutes");
    }
    cfg.rl
        .validate()
        .and_then(|()| cfg.warm.validate())
        .context("the demo's learner settings (--lr, --epochs, --eps-low, --eps-high, --adam-eps, --kl-warm)")?;
    let threads = usize::try_from(args.model.threads).unwrap_or(0);
    let n_engines = args.engines.unwrap_or(threads.clamp(1, 2));
    if n_engines == 0 || n_engines > threads {
        anyhow::bail!(
            "--engines must be between 1 and --threads ({}): each engine needs a thread",
            args.model.threads
        );
    }
    let algo = format!("{:?}", cfg.rl.algo).to_lowercase();
    let out = args.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        PathBuf::from("demo-runs").join(format!("{algo}-seed{}-{t}", cfg.seed))
    });
    let db = out.join("turnwise.db");
    if db.exists() {
        anyhow::bail!(
            "{} already holds a demo run; choose another --out",
            out.display()
        );
    }
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    eprintln!(
        "Turnwise demo: {algo}, seed {}, {} → run directory {}",
        cfg.seed,
        match (args.quick, cfg.minutes, cfg.max_iterations) {
            (true, ..) => "quick configuration".to_string(),
            (false, Some(m), None) => format!("as many RL iterations as fit in {m} minutes"),
            (false, Some(m), Some(n)) => format!("{n} RL iterations, at most {m} minutes"),
            (false, None, n) => format!("{} RL iterations", n.unwrap_or(0)),
        },
        out.display()
    );
    let mut ecfg = args.model.engine_config(verbose)?;
    ecfg.n_threads = i32::try_from(threads / n_engines).unwrap_or(1);
    // the demo's sessions give up their cells when they end (its lanes close them), and its
    // one-thread engines ran no faster with idle caches parked (parked at every step: RL
    // iteration 77 s against 75 s on seed 1); kept resident, every recorded run repeats as
    // it was
    ecfg.park_idle = false;
    if let Some(b) = &cfg.rl.block {
        ecfg.block_k = Some(b.k);
    }
    let engines = (0..n_engines)
        .map(|_| Engine::start(ecfg.clone()))
        .collect::<turnwise::Result<Vec<_>>>()?;
    let head = OutputHead::from_gguf(&engines[0].info().path)?;
    let demo = Demo::new(&engines, &head, &db, cfg)?;
    let style =
        ProgressStyle::with_template("{prefix:>16} [{bar:30}] {pos}/{len} {elapsed_precise} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
    let mut bar: Option<ProgressBar> = None;
    // without a terminal the bars draw nothing: one line per phase instead, with its time
    let lines = !std::io::stderr().is_terminal();
    let (t0, mut phase_start) = (std::time::Instant::now(), std::time::Instant::now());
    let mut phase_engines = engine_counters(&engines);
    let mut on = |p: Progress| match p {
        Progress::Phase(name, n) => {
            if lines {
                eprintln!(
                    "[{:>6.1} min] {name}: {n} steps",
                    t0.elapsed().as_secs_f64() / 60.0
                );
                phase_start = std::time::Instant::now();
                phase_engines = engine_counters(&engines);
            }
            let b = ProgressBar::new(n as u64);
            b.set_style(style.clone());
            b.set_prefix(name.to_string());
            bar = Some(b);
        }
        Progress::Tick(_) => {
            if let Some(b) = &bar {
                b.inc(1);
            }
        }
        Progress::Done(name) => {
            if lines {
                let e = engine_counters(&engines).since(&phase_engines);
                eprintln!(
                    "[{:>6.1} min] {name}: done in {:.0} s{}",
                    t0.elapsed().as_secs_f64() / 60.0,
                    phase_start.elapsed().as_secs_f64(),
                    if e.steps > 0 || e.prefill_tokens > 0 {
                        format!(
                            " (engines: {} decoding steps of {:.2} rows, {:.0} s; {} prompt tokens, {:.0} s)",
                            e.steps,
                            e.rows as f64 / e.steps.max(1) as f64,
                            e.step_us as f64 / 1e6,
                            e.prefill_tokens,
                            e.prefill_us as f64 / 1e6
                        )
                    } else {
                        String::new()
                    }
                );
            }
            if let Some(b) = bar.take() {
                b.finish();
            }
        }
    };
    let result = demo.run(&mut on)?;
    let files = report::write(&result, &out)?;

    println!();
    println!(
        "{:<14} {:>9} {:>17} {:>12}",
        "evaluation", "success", "95 % interval", "mean reward"
    );
    for e in &result.evals {
        let k = e.success.iter().filter(|&&b| b).count();
        let (lo, hi) = wilson(k, e.success.len());
        println!(
            "{:<14} {:>8.1}% {:>7.1}% – {:>5.1}% {:>12.3}",
            e.label,
            100.0 * e.rate(),
            100.0 * lo,
            100.0 * hi,
            e.reward.iter().sum::<f64>() / e.reward.len().max(1) as f64
        );
    }
    let (d, lo, hi) = result.rl_gain;
    let activated = result.iterations.iter().filter(|i| i.activated).count();
    println!(
        "\nRL iterations: {} ({} activated); RL's gain on held-out success: {:+.1} points (95 % bootstrap [{:+.1}, {:+.1}]); wall time {:.1} min",
        result.iterations.len(),
        activated,
        100.0 * d,
        100.0 * lo,
        100.0 * hi,
        result.wall_s / 60.0
    );
    println!("machine: {}", result.machine.line());
    let phases: Vec<String> = result
        .phase_seconds
        .iter()
        .map(|(p, t)| format!("{p} {:.1} min", t / 60.0))
        .collect();
    println!("time per phase: {}", phases.join(", "));
    for f in files {
        println!("  {}", f.display());
    }
    Ok(ExitCode::SUCCESS)
}
