//! `turnwise import FILE` and `turnwise export`.

use std::fs::File;
use std::io::{BufReader, BufWriter};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use turnwise::replay;
use turnwise::store::Store;

use super::ModelArgs;

/// Options of `turnwise import`.
#[derive(Args)]
pub struct ImportArgs {
    /// JSON Lines file, one conversation per line (`-` for stdin)
    file: PathBuf,
    #[command(flatten)]
    model: ModelArgs,
}

/// Options of `turnwise export`.
#[derive(Args)]
pub struct ExportArgs {
    /// Output file (default: stdout)
    #[arg(long, short)]
    out: Option<PathBuf>,
    /// Only sessions of this source (live, chat, import, demo)
    #[arg(long)]
    source: Option<String>,
}

/// Imports a file; exits 1 when any line was skipped.
///
/// # Errors
/// Unreadable input, model or database errors.
pub fn run(args: ImportArgs, db: &Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let (reader, len): (Box<dyn std::io::BufRead>, u64) = if args.file.as_os_str() == "-" {
        (Box::new(std::io::stdin().lock()), 0)
    } else {
        let f =
            File::open(&args.file).with_context(|| format!("opening {}", args.file.display()))?;
        let len = f.metadata().map(|m| m.len()).unwrap_or(0);
        (Box::new(BufReader::new(f)), len)
    };
    let engine = args.model.start(verbose)?;
    let pb = ProgressBar::new(len);
    pb.set_style(
        ProgressStyle::with_template("importing [{bar:30}] {bytes}/{total_bytes} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    let sum = replay::import_jsonl(&engine, &mut store, reader, |lines, bytes| {
        pb.set_position(bytes);
        pb.set_message(format!("{lines} lines"));
    })?;
    pb.finish_and_clear();
    for (line, reason) in &sum.skipped {
        eprintln!("line {line}: skipped: {reason}");
    }
    println!(
        "imported {} sessions, {} already present, {} lines skipped",
        sum.imported,
        sum.duplicates,
        sum.skipped.len()
    );
    Ok(if sum.skipped.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    })
}

/// Exports sessions as JSON Lines.
///
/// # Errors
/// Database and I/O errors; an unknown source name.
pub fn export(args: ExportArgs, db: &Path) -> anyhow::Result<ExitCode> {
    let store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let source = super::train::parse_source(args.source.as_deref())?;
    let n = match &args.out {
        Some(p) => {
            let f = File::create(p).with_context(|| format!("creating {}", p.display()))?;
            replay::export_jsonl(&store, source, BufWriter::new(f))?
        }
        None => replay::export_jsonl(&store, source, std::io::stdout().lock())?,
    };
    eprintln!("exported {n} sessions");
    Ok(ExitCode::SUCCESS)
}
