//! `turnwise chat`: an interactive terminal chat that logs every turn.

use std::io::{BufRead, IsTerminal, Write};
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use turnwise::policy::{Message, Role, SamplerParams};
use turnwise::session::{Feedback, Recorder};
use turnwise::store::{NewSession, Source, Store};

use super::ModelArgs;

/// Options of `turnwise chat`.
#[derive(Args)]
pub struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// System prompt of each new session
    #[arg(
        long,
        default_value = "You are a helpful customer-service assistant. Answer briefly."
    )]
    system: String,
    /// Seed of the first reply (reply k of a session uses seed + k)
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Sampling temperature (0 = greedy)
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Nucleus mass
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Top-k (0 disables)
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Most tokens per reply
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
}

const HELP: &str = "commands: /good /bad (rate the last reply), /resolved /unresolved (outcome, ends the session), /new, /quit";

struct Chat<'a> {
    engine: turnwise::Engine,
    store: Store,
    args: &'a ChatArgs,
    session: Option<Recorder>,
    replies: u64,
    last_assistant_idx: Option<i64>,
    adapter_id: Option<i64>,
}

impl Chat<'_> {
    fn end(&mut self) -> anyhow::Result<()> {
        if let Some(rec) = self.session.take() {
            rec.end(&self.store)?;
            self.engine.close(rec.id() as u64);
        }
        self.replies = 0;
        self.last_assistant_idx = None;
        Ok(())
    }

    /// Hot-swaps to the store's active adapter when it changed (e.g. `turnwise adapters
    /// activate` or a `train --activate` in another process), between turns.
    fn follow_active_adapter(&mut self) -> anyhow::Result<()> {
        let active = self.store.active_adapter()?.map(|a| a.id);
        if active != self.adapter_id {
            self.engine
                .set_adapter(super::train::active_adapter(&self.store)?)?;
            self.adapter_id = active;
            eprintln!(
                "(now sampling with adapter {})",
                active
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| "none".into())
            );
        }
        Ok(())
    }

    fn say(&mut self, text: &str, out: &mut impl Write) -> anyhow::Result<()> {
        self.follow_active_adapter()?;
        let mut messages = Vec::new();
        let rec = match self.session {
            Some(rec) => rec,
            None => {
                let mut s = NewSession::new(Source::Chat);
                s.metadata = serde_json::json!({"model": self.engine.info().name});
                let rec = Recorder::open(&self.store, &s)?;
                self.session = Some(rec);
                if !self.args.system.is_empty() {
                    messages.push(Message::new(Role::System, self.args.system.clone()));
                }
                rec
            }
        };
        let id = rec.id();
        messages.push(Message::new(Role::User, text));
        let params = SamplerParams {
            temperature: self.args.temperature,
            top_p: self.args.top_p,
            top_k: self.args.top_k,
            max_tokens: self.args.max_tokens,
            seed: self.args.seed.wrapping_add(self.replies),
            ..Default::default()
        };
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let engine = self.engine.clone();
        let p2 = params.clone();
        let worker = std::thread::spawn(move || engine.generate(id as u64, messages, p2, Some(tx)));
        while let Some(piece) = rx.blocking_recv() {
            write!(out, "{piece}")?;
            out.flush()?;
        }
        let gen = worker
            .join()
            .map_err(|_| anyhow::anyhow!("engine call panicked"))??;
        // the turn is durable before we acknowledge it with the newline
        let ids = rec.generation(&mut self.store, &gen, &params, self.engine.info())?;
        self.replies += 1;
        let n = self.store.turns(id)?.len() as i64;
        self.last_assistant_idx = Some(n - 1);
        writeln!(out)?;
        tracing::debug!(session = id, turn = ids[ids.len() - 1], "turn logged");
        Ok(())
    }
}

/// Runs the chat loop on stdin/stdout.
///
/// # Errors
/// Model loading and database errors; per-line problems are reported and the loop continues.
pub fn run(args: ChatArgs, db: &Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let engine = args.model.start(verbose)?;
    let tty = std::io::stdin().is_terminal();
    if tty {
        eprintln!(
            "turnwise chat — {} — log: {}\n{HELP}",
            engine.info().name,
            db.display()
        );
    }
    let mut chat = Chat {
        engine,
        store,
        args: &args,
        session: None,
        replies: 0,
        last_assistant_idx: None,
        adapter_id: None,
    };
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut buf = Vec::new();
    loop {
        if tty {
            write!(out, "> ")?;
            out.flush()?;
        }
        buf.clear();
        if input.read_until(b'\n', &mut buf)? == 0 {
            break;
        }
        let Ok(line) = std::str::from_utf8(&buf) else {
            eprintln!("error: that line is not valid UTF-8; it was ignored");
            continue;
        };
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let feedback = |chat: &mut Chat, f: Feedback| -> anyhow::Result<()> {
            match chat.session {
                Some(rec) => {
                    rec.feedback(&mut chat.store, &f)?;
                    eprintln!("(recorded {f:?} on session {})", rec.id());
                }
                None => eprintln!("(no session yet: say something first)"),
            }
            Ok(())
        };
        match line {
            "/quit" | "/exit" => break,
            "/help" => eprintln!("{HELP}"),
            "/new" => {
                chat.end()?;
                eprintln!("(new session)");
            }
            "/good" | "/bad" => {
                let turn = chat.last_assistant_idx;
                feedback(
                    &mut chat,
                    Feedback::Thumb {
                        turn,
                        up: line == "/good",
                        note: None,
                    },
                )?;
            }
            "/resolved" | "/unresolved" => {
                feedback(
                    &mut chat,
                    Feedback::Outcome {
                        value: if line == "/resolved" { 1.0 } else { 0.0 },
                        note: None,
                    },
                )?;
                chat.end()?;
            }
            l if l.starts_with('/') => eprintln!("unknown command {l}; {HELP}"),
            text => {
                if let Err(e) = chat.say(text, &mut out) {
                    writeln!(out)?;
                    eprintln!("error: {e:#}");
                    if chat
                        .session
                        .is_some_and(|_| e.to_string().contains("context budget"))
                    {
                        eprintln!("(type /new to start a fresh session)");
                    }
                }
            }
        }
    }
    chat.end()?;
    Ok(ExitCode::SUCCESS)
}
