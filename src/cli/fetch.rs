//! `turnwise fetch`: provision the default assets ahead of time.

use std::process::ExitCode;

use clap::Args;
use turnwise::assets;

/// Options of `turnwise fetch`.
#[derive(Args)]
pub struct FetchArgs {
    /// Also fetch the ONNX Runtime library (used by the learner)
    #[arg(long)]
    all: bool,
}

/// Fetches and verifies the assets, printing their paths.
///
/// # Errors
/// Provisioning errors (missing pip, failed download, checksum mismatch).
pub fn run(args: FetchArgs) -> anyhow::Result<ExitCode> {
    let dir = assets::cache_dir();
    let mut names = vec![assets::DEFAULT_MODEL];
    if args.all {
        names.push(assets::ONNXRUNTIME);
    }
    for name in names {
        let a = assets::asset(name)?;
        let p = assets::ensure(&a, &dir, false)?;
        println!("{name}: {} (sha256 {} verified)", p.display(), a.sha256);
    }
    Ok(ExitCode::SUCCESS)
}
