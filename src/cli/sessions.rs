//! `turnwise sessions list | show ID | stats`.

use std::io::IsTerminal;
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

/// A one-line bar of a turn's contribution: green to the right for positive, red to the left
/// for negative, 20 cells per unit.
fn credit_bar(
    value: Option<f64>,
    contribution: Option<f64>,
    advantage: Option<f64>,
    color: bool,
) -> String {
    let Some(c) = contribution else {
        return format!(
            "credit: V {}",
            value
                .map(|v| format!("{v:.2}"))
                .unwrap_or_else(|| "-".into())
        );
    };
    let n = ((c.abs() * 20.0).round() as usize).clamp(1, 20);
    let (bar, pad) = ("█".repeat(n), " ".repeat(20 - n));
    let (left, right) = if c >= 0.0 {
        (" ".repeat(20), format!("{bar}{pad}"))
    } else {
        (format!("{pad}{bar}"), " ".repeat(20))
    };
    let (l, r) = if color {
        (
            format!("\x1b[31m{left}\x1b[0m"),
            format!("\x1b[32m{right}\x1b[0m"),
        )
    } else {
        (left, right)
    };
    format!(
        "credit: {l}|{r} {c:+.3}  V {}  advantage {}",
        value
            .map(|v| format!("{v:.2}"))
            .unwrap_or_else(|| "-".into()),
        advantage
            .map(|a| format!("{a:+.3}"))
            .unwrap_or_else(|| "-".into())
    )
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
            let color = std::io::stdout().is_terminal();
            println!(
                "session {id} · {} · group {} · outcome {:?}",
                s.source,
                s.group_key.as_deref().unwrap_or("-"),
                s.outcome_reward
            );
            let credit: std::collections::HashMap<i64, turnwise::store::TurnCredit> = store
                .turn_credit(id)?
                .into_iter()
                .map(|c| (c.turn_idx, c))
                .collect();
            for t in store.turns(id)? {
                let lp = store.token_logprobs(t.id)?;
                let extra = lp
                    .map(|l| {
                        let mean = l.logp_behavior.iter().map(|&x| x as f64).sum::<f64>()
                            / l.logp_behavior.len().max(1) as f64;
                        format!(
                            "  [{} tokens, mean logp {mean:.3}, {}, adapter {}]",
                            t.token_ids.len(),
                            t.behavior
                                .map(|b| format!("{b:?}").to_lowercase())
                                .unwrap_or_default(),
                            t.adapter_id
                                .map(|a| a.to_string())
                                .unwrap_or_else(|| "-".into())
                        )
                    })
                    .unwrap_or_default();
                println!(
                    "#{} {:<9} {}{extra}",
                    t.idx,
                    t.role.as_str(),
                    t.text.replace('\n', "\n            ")
                );
                if let Some(c) = credit.get(&t.idx) {
                    println!(
                        "            {}",
                        credit_bar(
                            c.value_before,
                            c.contribution.or(c.info_gain),
                            c.advantage,
                            color
                        )
                    );
                }
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
            if st.block_positions > 0 {
                println!(
                    "block inputs: {} positions, {:.0} bytes per position",
                    st.block_positions,
                    st.block_bytes as f64 / st.block_positions as f64
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
