//! `turnwise convert`: requantise a GGUF model with llama.cpp's own quantizer, once.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Args;
use turnwise::assets;
use turnwise::policy::llama::FileType;

/// Options of `turnwise convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// The GGUF model to convert
    pub model: PathBuf,
    /// Target type: IQ4_NL_M (the default model's: IQ4_NL, ffn_down in Q4_K), Q4_0_M, Q4_0,
    /// IQ4_NL, Q8_0, Q4_K_M or Q4_1
    #[arg(long = "type", value_name = "TYPE", default_value = "IQ4_NL_M", value_parser = parse_type)]
    pub ty: FileType,
    /// Directory for the converted file [default: beside the model]
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

fn parse_type(s: &str) -> Result<FileType, String> {
    FileType::parse(s).ok_or_else(|| {
        let names: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
        format!("unknown type {s:?}; one of {}", names.join(", "))
    })
}

/// Converts the model (or reuses a cached conversion) and prints where it is.
///
/// # Errors
/// A missing or unreadable model; llama.cpp's quantizer failing; I/O errors.
pub fn run(args: ConvertArgs) -> anyhow::Result<ExitCode> {
    if !args.model.is_file() {
        anyhow::bail!("{}: no such file", args.model.display());
    }
    // fails early, with a clear message, on a file that is not GGUF
    turnwise::policy::gguf::GgufIndex::open(&args.model)?;
    let c = assets::convert_cached(&args.model, "", args.ty, args.out_dir.as_deref(), false)?;
    println!(
        "{} ({}, {} bytes, sha256 {}; from {} sha256 {})",
        c.path.display(),
        c.file_type,
        c.bytes,
        c.sha256,
        c.source,
        c.source_sha256
    );
    println!("serve it with: turnwise serve --model {}", c.path.display());
    Ok(ExitCode::SUCCESS)
}
