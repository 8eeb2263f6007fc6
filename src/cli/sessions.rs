//! `turnwise sessions list | show ID | stats`.

use std::path::Path;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use turnwise::store::Store;

/// Options of `turnwise sessions`.
#[derive(Args)]
pub struct SessionsArgs {
    #[command(subcommand)]
    cmd: SessionsCmd,
}

#[derive(Subcommand)]
enum SessionsCmd {
    /// The most recent sessions
    List {
        /// how many
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// One session's turns
    Show {
        /// session id
        id: i64,
    },
    /// Storage used by the log, bytes per sampled token
    Stats,
}

/// Prints sessions or statistics.
///
/// # Errors
/// Database errors; unknown session.
pub fn run(args: SessionsArgs, db: &Path) -> anyhow::Result<ExitCode> {
    let store = Store::open(db)?;
    match args.cmd {
        SessionsCmd::List { limit } => {
            for s in store.sessions(None, limit)? {
                let turns = store.turns(s.id)?;
                let first = turns
                    .iter()
                    .find(|t| t.role == turnwise::Role::User)
                    .map(|t| t.text.chars().take(50).collect::<String>())
                    .unwrap_or_default();
                println!(
                    "{:>6}  {}  {:<6}  {:>3} turns  outcome {:<5}  {}",
                    s.id,
                    &s.created_at[..19.min(s.created_at.len())],
                    s.source,
                    turns.len(),
                    s.outcome_reward
                        .map(|o| format!("{o:.2}"))
                        .unwrap_or_else(|| "-".into()),
                    first.replace('\n', " ")
                );
            }
        }
        SessionsCmd::Show { id } => {
            let s = store.session(id)?;
            println!(
                "session {id} · {} · group {} · outcome {:?}",
                s.source,
                s.group_key.as_deref().unwrap_or("-"),
                s.outcome_reward
            );
            for t in store.turns(id)? {
                let lp = store.token_logprobs(t.id)?;
                let extra = lp
                    .map(|l| {
                        let mean = l.logp_behavior.iter().map(|&x| x as f64).sum::<f64>()
                            / l.logp_behavior.len().max(1) as f64;
                        format!(
                            "  [{} tokens, mean logp {mean:.3}, {}]",
                            t.token_ids.len(),
                            t.behavior
                                .map(|b| format!("{b:?}").to_lowercase())
                                .unwrap_or_default()
                        )
                    })
                    .unwrap_or_default();
                println!(
                    "#{} {:<9} {}{extra}",
                    t.idx,
                    t.role.as_str(),
                    t.text.replace('\n', "\n            ")
                );
            }
            for f in store.feedback(id)? {
                println!(
                    "feedback: {} {:?} turn {:?} {}",
                    f.kind,
                    f.value,
                    f.turn_idx,
                    f.note.unwrap_or_default()
                );
            }
        }
        SessionsCmd::Stats => {
            let st = store.storage_stats()?;
            println!("{}", serde_json::to_string_pretty(&st)?);
            println!(
                "bytes per sampled token with features: {:.0}",
                st.bytes_per_featured_token()
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
