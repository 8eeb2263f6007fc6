//! Command-line interface: one file per subcommand, each with a `run`.

mod adapters;
mod annotate;
mod bench;
mod bench_formats;
mod bench_load;
mod bench_serve;
mod chat;
mod compare;
mod convert;
mod demo;
mod fetch;
mod gc;
mod import;
mod learn_args;
mod serve;
mod sessions;
mod train;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use turnwise::{assets, config, Engine, EngineConfig};

/// Turnwise: a chat agent that learns from its own conversations, on your device.
#[derive(Parser)]
#[command(name = "turnwise", version, about)]
pub struct Cli {
    /// SQLite database of the turn log [env: TURNWISE_DB; default: ~/.local/share/turnwise/turnwise.db]
    #[arg(long, global = true)]
    db: Option<PathBuf>,
    /// Show debug logs, llama.cpp's included
    #[arg(short, long, global = true)]
    verbose: bool,
    /// Which file of the default model the policy runs on: `converted` (requantised once to
    /// IQ4_NL_M, which llama.cpp's CPU backend runs with batched kernels) or `shipped` (the Q4_1
    /// file as published). A --model path is always used as it is
    #[arg(
        long,
        global = true,
        value_enum,
        env = "TURNWISE_MODEL_FORMAT",
        default_value = "converted"
    )]
    model_format: assets::ModelFormat,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// The main job: a simulated customer-service desk where the bot is trained on its own sessions and measured on held-out ones (warm start, RL, report)
    Demo(Box<demo::DemoArgs>),
    /// Compare demo runs: each run's held-out gain, each preset's gain pooled over seeds, the pooled difference between presets
    Compare(compare::CompareArgs),
    /// Chat with the model in the terminal; every turn is logged (input may be piped)
    Chat(chat::ChatArgs),
    /// Import JSON Lines chat logs for offline replay
    Import(import::ImportArgs),
    /// Export logged sessions as JSON Lines (the import format, with outcomes and annotations)
    Export(import::ExportArgs),
    /// Download and verify the default model (and convert it) and ONNX Runtime into the cache
    Fetch(fetch::FetchArgs),
    /// Requantise a GGUF model with llama.cpp's quantizer (e.g. to IQ4_NL_M, batched on the CPU)
    Convert(convert::ConvertArgs),
    /// Drop the hidden-state features of old sessions that have been learned from
    Gc(gc::GcArgs),
    /// List or show logged sessions, and storage statistics
    Sessions(sessions::SessionsArgs),
    /// Run one update of the adapter over logged sessions (offline replay)
    Train(Box<train::TrainArgs>),
    /// Write step-level credit (value before/after, success contribution, information gain)
    Annotate(annotate::AnnotateArgs),
    /// List, show, activate or roll back adapter versions
    Adapters(adapters::AdaptersArgs),
    /// Serve an OpenAI-compatible API that logs every turn and learns in the background
    Serve(Box<serve::ServeArgs>),
    /// Measure prefill and decode speed: Turnwise's engine against plain llama.cpp
    Bench(bench::BenchArgs),
}

/// Options shared by every command that loads the model.
#[derive(Args, Clone)]
pub struct ModelArgs {
    /// GGUF model file, served as it is [env: TURNWISE_MODEL; default: SmolLM2-135M-Instruct,
    /// fetched on first use and converted to IQ4_NL_M (see --model-format)]
    #[arg(long)]
    model: Option<PathBuf>,
    /// Context window in tokens
    #[arg(long, default_value_t = config::DEFAULT_CTX)]
    ctx: u32,
    /// CPU threads for llama.cpp (log-probs depend on it; keep it fixed)
    #[arg(long, default_value_t = config::DEFAULT_THREADS)]
    threads: i32,
    /// Chat template override: a llama.cpp built-in name (e.g. chatml) or template text
    #[arg(long)]
    template: Option<String>,
    /// Log, for every position, the input of the last K blocks (block-LoRA training data, 1 152
    /// bytes per position at f16 for the default model; llama.cpp then runs without flash
    /// attention)
    #[arg(long, value_name = "K")]
    block_capture: Option<usize>,
    /// Sessions the engine generates at once (continuous batching: each has its own KV
    /// sequence of --ctx tokens and every decoding step advances all of them in one batch)
    #[arg(long, value_name = "N", default_value_t = turnwise::policy::DEFAULT_N_SEQ)]
    parallel: u32,
}

impl ModelArgs {
    fn engine_config(&self, verbose: bool) -> turnwise::Result<EngineConfig> {
        let path = assets::resolve_model(self.model.as_deref(), false)?;
        let mut c = EngineConfig::new(path);
        c.n_ctx = self.ctx;
        c.n_threads = self.threads;
        c.template = self.template.clone();
        c.block_k = self.block_capture;
        c.n_seq = self.parallel;
        c.verbose = verbose;
        Ok(c)
    }

    fn start(&self, verbose: bool) -> turnwise::Result<Engine> {
        Engine::start(self.engine_config(verbose)?)
    }
}

fn db_path(cli_db: &Option<PathBuf>) -> PathBuf {
    cli_db.clone().unwrap_or_else(config::default_db)
}

/// Runs the CLI and returns the process exit code.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = if cli.verbose { "debug" } else { "warn" };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TURNWISE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(filter)),
        )
        .with_writer(std::io::stderr)
        .init();
    assets::set_model_format(cli.model_format);
    let db = db_path(&cli.db);
    let result = match cli.cmd {
        // the demo writes its own turn log in its run directory: a --db would be ignored
        Cmd::Demo(_) if cli.db.is_some() => Err(anyhow::anyhow!(
            "demo writes its turn log to its own run directory (<--out>/turnwise.db); --db does not apply to it, use --out DIR"
        )),
        Cmd::Demo(a) => demo::run(*a, cli.verbose),
        Cmd::Chat(a) => chat::run(a, &db, cli.verbose),
        Cmd::Compare(a) => compare::run(a),
        Cmd::Import(a) => import::run(a, &db, cli.verbose),
        Cmd::Export(a) => import::export(a, &db),
        Cmd::Fetch(a) => fetch::run(a),
        Cmd::Convert(a) => convert::run(a),
        Cmd::Gc(a) => gc::run(a, &db),
        Cmd::Sessions(a) => sessions::run(a, &db),
        Cmd::Bench(a) => bench::run(a, cli.verbose),
        Cmd::Train(a) => train::run(*a, &db),
        Cmd::Serve(a) => serve::run(*a, &db, cli.verbose),
        Cmd::Adapters(a) => adapters::adapters(a, &db),
        Cmd::Annotate(a) => annotate::annotate(a, &db, cli.verbose),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}
