//! Open a turn log, run one turn on the default model, and print what was logged.
//!
//! ```text
//! cargo run --release --example log_one_turn -- /tmp/example.db "Where is my order 48213?"
//! ```

use turnwise::session::turns_from_generation;
use turnwise::store::{NewSession, Source, Store};
use turnwise::{assets, Engine, EngineConfig, Message, Role, SamplerParams};

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let db = args.next().unwrap_or_else(|| "example.db".into());
    let question = args
        .next()
        .unwrap_or_else(|| "Hello! Where is my order 48213?".into());

    let mut store = Store::open(db.as_ref())?;
    let engine = Engine::start(EngineConfig::new(assets::resolve_model(None, false)?))?;
    let session = store.create_session(&NewSession::new(Source::Chat))?;

    let params = SamplerParams {
        seed: 42,
        max_tokens: 48,
        ..Default::default()
    };
    let messages = vec![
        Message::new(
            Role::System,
            "You are a helpful customer-service assistant.",
        ),
        Message::new(Role::User, question),
    ];
    let gen = engine.generate(session as u64, messages, params.clone(), None)?;
    let ids = store.append_turns(
        session,
        &turns_from_generation(&gen, &params, engine.info()),
    )?;

    println!("session {session} in {db}");
    for t in store.turns(session)? {
        println!(
            "#{} {:<9} {:>3} tokens  {:?}",
            t.idx,
            t.role.as_str(),
            t.token_ids.len(),
            t.text
        );
    }
    let reply = ids[ids.len() - 1];
    if let Some(lp) = store.token_logprobs(reply)? {
        let mean = lp.logp_behavior.iter().sum::<f32>() / lp.logp_behavior.len() as f32;
        println!(
            "reply: {} sampled tokens, mean behaviour log-prob {mean:.3}",
            lp.logp_behavior.len()
        );
    }
    if let Some(f) = store.features(reply)? {
        println!(
            "features: {} x {} stored as {}",
            f.values.len() / f.n_embd,
            f.n_embd,
            f.dtype.as_str()
        );
    }
    Ok(())
}
