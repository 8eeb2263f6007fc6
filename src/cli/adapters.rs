//! `turnwise adapters`: list, show, activate, roll back, import and export adapter versions.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::{Args, Subcommand};
use turnwise::adapter::Adapter;
use turnwise::assets;
use turnwise::policy::OutputHead;
use turnwise::store::Store;

use super::train::{activate_checked, save_candidate};

/// Options of `turnwise adapters`.
#[derive(Args)]
pub struct AdaptersArgs {
    #[command(subcommand)]
    cmd: AdaptersCmd,
}

#[derive(Subcommand)]
enum AdaptersCmd {
    /// All adapter versions
    List,
    /// One adapter's record and metrics
    Show {
        /// adapter id
        id: i64,
    },
    /// Make an adapter the one the policy samples with (checked against the model first)
    Activate {
        /// adapter id
        id: i64,
        /// GGUF model it must fit [default: the default model]
        #[arg(long)]
        model: Option<std::path::PathBuf>,
    },
    /// Return to the adapter active before the current one (or the base model)
    Rollback,
    /// Import a block LoRA trained elsewhere: a PEFT directory (`adapter_config.json` +
    /// `adapter_model.safetensors`, e.g. from TRL or verl) or a GGUF LoRA file. It becomes a
    /// candidate version (output LoRA and value head fresh); activate it to serve it
    Import {
        /// PEFT directory or `.gguf` file
        path: std::path::PathBuf,
        /// GGUF model it must fit [default: the default model]
        #[arg(long)]
        model: Option<std::path::PathBuf>,
    },
    /// Write an adapter for other tools: `merged` (the model file with the output LoRA folded
    /// in, plus the block LoRA as a GGUF LoRA: everything the policy served, for llama.cpp,
    /// `llama-server`, Ollama), `gguf` (the block LoRA alone) or `peft` (Hugging Face names, for
    /// PEFT / TRL / vLLM)
    Export {
        /// adapter id
        id: i64,
        /// merged, gguf or peft
        #[arg(long, default_value = "peft")]
        format: String,
        /// output directory (created)
        #[arg(long)]
        out: std::path::PathBuf,
        /// GGUF model the adapter belongs to [default: the default model]
        #[arg(long)]
        model: Option<std::path::PathBuf>,
    },
}

/// Loads `block` into llama.cpp for `model` (its own loader checks architecture and shapes).
pub(super) fn check_block_loads(
    model: &Path,
    block: &turnwise::adapter::block::BlockLora,
) -> anyhow::Result<()> {
    use turnwise::policy::llama;
    llama::init_backend(false);
    let m = llama::Model::load(model, 0)?;
    let tmp = tempfile_path("check");
    std::fs::write(&tmp, block.to_gguf())?;
    let r = llama::LoraAdapter::load(&m, &tmp);
    let _ = std::fs::remove_file(&tmp);
    r.map(drop)
        .with_context(|| format!("llama.cpp refuses the block LoRA for {}", model.display()))
}

pub(super) fn tempfile_path(what: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("turnwise-{what}-{}.gguf", std::process::id()))
}

pub(super) fn import_block(
    store: &mut Store,
    db: &Path,
    path: &Path,
    model: &Path,
) -> anyhow::Result<i64> {
    use turnwise::adapter::block::BlockLora;
    use turnwise::policy::blocks::Hparams;
    use turnwise::policy::gguf::GgufIndex;
    let hp = Hparams::from_index(&GgufIndex::open(model)?)?;
    let block = if path.is_dir() {
        BlockLora::from_peft(path, &hp)?
    } else {
        let b = BlockLora::from_gguf(path)?;
        if b.arch != hp.arch {
            anyhow::bail!(
                "{} is a LoRA for `{}`, the model is `{}`",
                path.display(),
                b.arch,
                hp.arch
            );
        }
        b
    };
    check_block_loads(model, &block)?;
    let head = OutputHead::from_gguf(model)?;
    let mut adapter = Adapter::fresh(
        head.n_embd(),
        head.n_vocab(),
        8,
        16.0,
        0,
        &model
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let summary = serde_json::json!({
        "imported": path.display().to_string(),
        "block": {
            "layers": block.layers,
            "targets": block.spec.targets,
            "r": block.spec.r,
            "alpha": block.spec.alpha,
        },
    });
    adapter.block = Some(block);
    save_candidate(store, db, None, &adapter, &summary)
}

pub(super) fn export_adapter(
    store: &Store,
    id: i64,
    format: &str,
    out: &Path,
    model: &Path,
) -> anyhow::Result<Vec<std::path::PathBuf>> {
    use turnwise::policy::blocks::Hparams;
    use turnwise::policy::gguf::GgufIndex;
    let rec = store.adapter(id)?;
    let a = Adapter::load(Path::new(&rec.path))
        .with_context(|| format!("adapter {id} is not loadable"))?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut written = Vec::new();
    let output_lora_is_zero = a.b.iter().all(|&x| x == 0.0);
    let carries_all = |what: &str| -> anyhow::Result<()> {
        if output_lora_is_zero {
            return Ok(());
        }
        anyhow::bail!(
            "adapter {id} also has a LoRA on the output projection (the warm start's or the \
             updates'), which {what} cannot carry: llama.cpp has no output tensor to attach it \
             to when the model ties it to the token embeddings (SmolLM2), so the export would \
             answer like another policy. Use --format merged (the model file with the output \
             LoRA folded in, plus the block LoRA as adapter.gguf)"
        )
    };
    match format {
        "merged" => {
            let stamp = assets::model_stamp(model)?;
            let recorded = |key: &str| rec.model.as_ref()?.get(key)?.as_str();
            if let Some(want) = recorded("sha256") {
                anyhow::ensure!(
                    want == stamp.sha256,
                    "adapter {id} was trained on the model file with SHA-256 {want} ({}), not \
                     {} ({}): pass that file with --model",
                    recorded("file").unwrap_or("?"),
                    model.display(),
                    stamp.sha256
                );
            }
            let p = out.join("model.gguf");
            let provenance = format!(
                "adapter {id} (output LoRA r={} alpha={}) folded into {} (SHA-256 {})",
                a.config.r, a.config.lora_alpha, stamp.file, stamp.sha256
            );
            let m = turnwise::adapter::merge::write_merged_model(model, &a, &p, &provenance)?;
            eprintln!(
                "{}: output.weight {} in f16, largest LoRA term {:.3}, largest f16 rounding {:.1e}, \
                 {:.0} MB",
                p.display(),
                if m.replaced { "replaced" } else { "added (the model ties it to token_embd)" },
                m.max_delta,
                m.max_rounding,
                m.bytes as f64 / 1e6
            );
            written.push(p);
            if let Some(b) = &a.block {
                let p = out.join("adapter.gguf");
                std::fs::write(&p, b.to_gguf())?;
                written.push(p);
            }
        }
        "gguf" => {
            let b = a.block.as_ref().ok_or_else(|| {
                anyhow::anyhow!(
                    "adapter {id} has no block LoRA: its LoRA is on the output projection, which \
                     llama.cpp cannot load for models that tie it to the token embeddings \
                     (SmolLM2); export it with --format merged (a model file with it folded in) \
                     or --format peft"
                )
            })?;
            carries_all("a GGUF LoRA")?;
            let p = out.join("adapter.gguf");
            std::fs::write(&p, b.to_gguf())?;
            written.push(p);
        }
        "peft" => {
            let p = out.join(turnwise::adapter::WEIGHTS_FILE);
            let c = out.join(turnwise::adapter::CONFIG_FILE);
            match &a.block {
                Some(b) => {
                    carries_all("a PEFT block LoRA export")?;
                    let hp = Hparams::from_index(&GgufIndex::open(model)?)?;
                    let (st, cfg) = b.to_peft(&hp, &a.config.base_model_name_or_path)?;
                    std::fs::write(&p, st)?;
                    std::fs::write(&c, cfg)?;
                }
                None => {
                    let (st, cfg) = a.to_peft()?;
                    std::fs::write(&p, st)?;
                    std::fs::write(&c, cfg)?;
                }
            }
            written.push(p);
            written.push(c);
        }
        other => anyhow::bail!("unknown format {other:?} (merged, gguf, peft)"),
    }
    Ok(written)
}

/// Lists, shows, activates or rolls back adapters.
///
/// # Errors
/// Store errors; activating an adapter that is not fully written.
pub fn adapters(args: AdaptersArgs, db: &Path) -> anyhow::Result<ExitCode> {
    let mut store = Store::open(db)?;
    match args.cmd {
        AdaptersCmd::List => {
            for a in store.adapters()? {
                println!(
                    "{:>5}  {:<9}  parent {:>5}  {}  {}",
                    a.id,
                    a.status,
                    a.parent_id
                        .map(|p| p.to_string())
                        .unwrap_or_else(|| "-".into()),
                    &a.created_at[..19.min(a.created_at.len())],
                    a.path
                );
            }
        }
        AdaptersCmd::Show { id } => {
            println!("{}", serde_json::to_string_pretty(&store.adapter(id)?)?)
        }
        AdaptersCmd::Activate { id, model } => {
            let model = assets::resolve_model(model.as_deref(), false)?;
            let head = OutputHead::from_gguf(&model)?;
            activate_checked(&mut store, id, &head, &model)?;
            println!("adapter {id} is active");
        }
        AdaptersCmd::Rollback => match store.rollback_adapter()? {
            Some(id) => println!("adapter {id} is active again"),
            None => println!("no adapter is active: the base model samples"),
        },
        AdaptersCmd::Import { path, model } => {
            let model = assets::resolve_model(model.as_deref(), false)?;
            let id = import_block(&mut store, db, &path, &model)?;
            println!(
                "imported {} as adapter {id} (candidate); serve it with `turnwise adapters activate {id}`",
                path.display()
            );
        }
        AdaptersCmd::Export {
            id,
            format,
            out,
            model,
        } => {
            let model = assets::resolve_model(model.as_deref(), false)?;
            for p in export_adapter(&store, id, &format, &out, &model)? {
                println!("{}", p.display());
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
