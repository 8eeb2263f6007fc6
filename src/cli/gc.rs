//! `turnwise gc`: the feature retention policy.

use std::path::Path;
use std::process::ExitCode;

use clap::Args;
use turnwise::config;
use turnwise::store::Store;

/// Options of `turnwise gc`.
#[derive(Args)]
pub struct GcArgs {
    /// Drop features of sessions older than this many days
    #[arg(long, default_value_t = config::FEATURE_RETENTION_DAYS)]
    older_than_days: f64,
    /// Also drop features of sessions no update has learned from yet
    #[arg(long)]
    include_unlearned: bool,
    /// Reclaim the freed space afterwards (rewrites the database file)
    #[arg(long)]
    vacuum: bool,
}

/// Drops old features, keeping text, tokens and log-probs.
///
/// # Errors
/// Database errors.
pub fn run(args: GcArgs, db: &Path) -> anyhow::Result<ExitCode> {
    let mut store = Store::open(db)?;
    let before = store.storage_stats()?;
    let n = store.gc_features(args.older_than_days, !args.include_unlearned)?;
    if args.vacuum {
        store.vacuum()?;
    }
    let after = store.storage_stats()?;
    println!(
        "dropped features of {n} turns; feature bytes {} -> {}; block-input bytes {} -> {}; database {} -> {} bytes",
        before.feature_bytes,
        after.feature_bytes,
        before.block_bytes,
        after.block_bytes,
        before.file_bytes,
        after.file_bytes
    );
    Ok(ExitCode::SUCCESS)
}
