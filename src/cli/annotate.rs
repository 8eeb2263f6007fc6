//! `turnwise annotate`: step-level annotations (information gain, contribution) of logged sessions.

use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use clap::Args;
use turnwise::adapter::Adapter;
use turnwise::assets;
use turnwise::learn::annotate::{
    annotate_sessions, AnnotateConfig, IgBaseline, IgContext, IgPolicy, IgSpace,
};
use turnwise::policy::OutputHead;
use turnwise::store::Store;

use super::train::{active_adapter, parse_source, save_candidate, SelectArgs};

/// Options of `turnwise annotate`.
#[derive(Args)]
pub struct AnnotateArgs {
    #[command(flatten)]
    sel: SelectArgs,
    /// Information gain in log-prob space (default, released code) or probability space (paper)
    #[arg(long, value_enum, default_value_t = IgSpace::Logprob)]
    ig_space: IgSpace,
    /// Baseline of the first turn's information gain
    #[arg(long, value_enum, default_value_t = IgBaseline::Opening)]
    ig_baseline: IgBaseline,
    /// Where a turn's reference score is taken: after its reply and what came back
    /// (observation) or right after the reply
    #[arg(long, value_enum, default_value_t = IgContext::Observation)]
    ig_context: IgContext,
    /// Which policy scores information gain: the base model (frozen) or the active adapter
    /// (sampling)
    #[arg(long, value_enum, default_value_t = IgPolicy::Frozen)]
    ig_policy: IgPolicy,
    /// Skip information gain (no model is loaded)
    #[arg(long)]
    no_ig: bool,
    /// First fit the value head on finished sessions (every fifth held out for its Brier score
    /// and AUC) and save it as a new candidate adapter version
    #[arg(long)]
    fit_value: bool,
    /// Full-batch Adam steps of `--fit-value`
    #[arg(long, default_value_t = 200)]
    value_steps: usize,
}

/// Writes step-level credit for the selected sessions.
///
/// # Errors
/// Store, model and engine errors.
pub fn annotate(args: AnnotateArgs, db: &Path, verbose: bool) -> anyhow::Result<ExitCode> {
    let mut store = Store::open(db).with_context(|| format!("opening {}", db.display()))?;
    let sessions = store.training_sessions(
        parse_source(args.sel.source.as_deref())?,
        args.sel.since.as_deref(),
        false,
        args.sel.limit,
    )?;
    let active = active_adapter(&store)?;
    let model = assets::resolve_model(args.sel.model.as_deref(), false)?;
    store.set_policy_model(&assets::model_stamp_json(&model));
    let head = OutputHead::from_gguf(&model)?;
    let fresh = Adapter::fresh(head.n_embd(), head.n_vocab(), 8, 16.0, 0, "");
    let (mut vid, mut value) = match &active {
        Some((id, a)) => (Some(*id), a.as_ref().clone()),
        None => (None, fresh),
    };
    let ids: Vec<i64> = sessions.iter().map(|s| s.id).collect();
    if args.fit_value {
        let fit = turnwise::learn::annotate::fit_value_head(
            &store,
            &ids,
            &mut value,
            args.value_steps,
            1e-2,
        )?;
        let metrics = serde_json::to_value(&fit)?;
        let id = save_candidate(&mut store, db, vid, &value, &metrics)?;
        store.record_update(
            Some(id),
            "value",
            &serde_json::json!({"steps": args.value_steps}),
            &metrics,
            turnwise::store::UpdateStatus::Ok,
        )?;
        println!(
            "value head fitted into candidate adapter {id}: {}",
            serde_json::to_string(&fit)?
        );
        vid = Some(id);
    }
    let needs_ig = !args.no_ig && sessions.iter().any(|s| s.reference.is_some());
    let mut scorer = None;
    let engine = if needs_ig {
        let mut c = turnwise::EngineConfig::new(model);
        c.verbose = verbose;
        let e = turnwise::Engine::start(c)?;
        if args.ig_policy == IgPolicy::Sampling {
            let active = active_adapter(&store)?;
            scorer = active.as_ref().map(|a| a.0);
            e.set_adapter(active)?;
        }
        Some(e)
    } else {
        None
    };
    let cfg = AnnotateConfig {
        ig_space: args.ig_space,
        ig_baseline: args.ig_baseline,
        ig_context: args.ig_context,
        ig_policy: args.ig_policy,
        ig_scorer: scorer,
    };
    let sum = annotate_sessions(&mut store, &ids, &value, vid, engine.as_ref(), &cfg)?;
    println!(
        "annotated {} sessions: {} assistant turns with success contribution, {} with information gain",
        sum.sessions, sum.turns, sum.info_gain_turns
    );
    Ok(ExitCode::SUCCESS)
}
