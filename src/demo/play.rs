//! Playing sessions: a greedy or sampled session of a scenario on an engine, logged or not,
//! several engines side by side ([`play`]), and the scripted expert's demonstrations.

use super::*;

/// `s` with the run's [`DemoConfig::restate`] setting.
pub(super) fn restating(mut s: Scenario, on: bool) -> Scenario {
    s.restates = on;
    s
}

/// A session to play: the scenario, how it is played and how it is logged.
pub(super) struct Job {
    pub(super) scenario: Scenario,
    pub(super) how: PlaySettings,
    pub(super) log: Option<LogMeta>,
}

/// How one played session went.
#[derive(Debug, Clone)]
pub struct Played {
    /// the desk at the end
    pub desk: Desk,
    /// (role, text) of every message after the system prompt
    pub transcript: Vec<(Role, String)>,
    /// the logged session
    pub session_id: Option<i64>,
    /// with [`PlaySettings::score_reference`]: the frozen policy's mean log-prob of the ground
    /// truth's action line before the first agent reply and after each one (what
    /// [`crate::learn::annotate::annotate_sessions`] would compute from the log)
    pub reference_logp: Option<Vec<f64>>,
    /// with a shadow adapter on the engine (greedy sessions): whether every reply agreed with
    /// the shadow's greedy choices ([`crate::policy::Reply::shadow_agrees`]), i.e. the shadow
    /// would have played this very session
    pub shadow_agrees: Option<bool>,
}

/// How the agent plays a session.
#[derive(Debug, Clone)]
pub struct PlaySettings {
    /// the customer leaves after this many agent replies
    pub patience: usize,
    /// sampler of the agent's replies (reply k uses `seed + k`)
    pub params: SamplerParams,
    /// the engine's session key (closed at the end)
    pub key: u64,
    /// score the ground truth's action line after every agent reply while the session is in
    /// the engine's KV cache: only the reference line is decoded, where annotating the log
    /// afterwards decodes the whole session again
    pub score_reference: bool,
    /// where each reply's score is taken ([`IgContext`]; `annotate_sessions` on the log
    /// computes the same numbers with the same setting,
    /// [`crate::learn::annotate::reference_scores`])
    pub ig_context: IgContext,
    /// which policy scores it ([`IgPolicy`]; `Sampling`: the engine's adapter, the one that
    /// samples the session)
    pub ig_policy: IgPolicy,
    /// constrain every reply's order-id slot to the order ids the conversation holds so far
    /// ([`DemoConfig::id_slot`], [`env::order_ids_in`])
    pub id_slot: bool,
    /// play the session canonically: on an engine reset first ([`Engine::reset`]) and with no
    /// other session beside it, so that its transcript depends only on the model file, the
    /// adapter, the scenario and the thread count (the held-out evaluations)
    pub canonical: bool,
    /// play with this output adapter instead of the engine's ([`Engine::generate_with`]; its
    /// block LoRA must be the engine's; not with `score_reference`)
    pub adapter: Option<(i64, Arc<Adapter>)>,
}

/// How a played session is logged.
pub struct LogMeta {
    /// group key (the scenario)
    pub group: String,
    /// metadata of the session
    pub metadata: Value,
}

/// Plays one session of `scenario` with the engine's current adapter. With `log`, the session
/// is logged in `store` (turns appended as they happen, outcome and end at the end). With
/// `library`, each observation gets the experience library's injection appended before the agent
/// replies, and logged sessions record which entries were injected.
///
/// # Errors
/// Engine and store errors.
pub fn play(
    engine: &Engine,
    store: &mut Store,
    scenario: &Scenario,
    how: &PlaySettings,
    log: Option<LogMeta>,
    library: Option<&Library>,
) -> Result<Played> {
    let (patience, params, key) = (how.patience, &how.params, how.key);
    if how.adapter.is_some() && how.score_reference {
        return Err(Error::Invalid(
            "a session played on its own adapter does not score the reference".into(),
        ));
    }
    if how.canonical {
        engine.reset()?;
    }
    let mut desk = Desk::new(scenario.clone(), patience);
    let opening = scenario.opening();
    let mut pending = vec![
        Message::new(Role::System, env::SYSTEM_PROMPT),
        Message::new(Role::User, opening),
    ];
    let mut transcript = Vec::new();
    let reference = env::action_line(&scenario.ground_truth);
    // the session's tokens as the log will hold them (every turn's tokens, in order)
    let mut context: Vec<crate::policy::llama::Token> = Vec::new();
    let mut reference_logp = how.score_reference.then(Vec::new);
    let after_observation = how.ig_context == IgContext::Observation;
    let adapted = how.ig_policy == IgPolicy::Sampling;
    let mut shadow_agrees: Option<bool> = None;
    let recorder = match &log {
        Some(l) => Some(Recorder::open(
            store,
            &NewSession {
                source: Source::Demo,
                group_key: Some(l.group.clone()),
                reference: Some(reference.clone()),
                content_hash: None,
                metadata: l.metadata.clone(),
            },
        )?),
        None => None,
    };
    let session_id = recorder.map(|r| r.id());
    let result = (|| {
        for turn in 0.. {
            let injection = match (library, pending.last_mut()) {
                (Some(lib), Some(m)) => {
                    let inj = lib.retrieve(store, &m.content)?;
                    if let Some(i) = &inj {
                        m.content.push_str(&i.text);
                    }
                    inj
                }
                _ => None,
            };
            if let Some(m) = pending.last() {
                transcript.push((m.role, m.content.clone()));
            }
            let mut p = params.clone();
            p.seed = params.seed.wrapping_add(turn);
            if how.id_slot {
                let said: Vec<&str> = transcript
                    .iter()
                    .filter(|(r, _)| matches!(r, Role::User | Role::Tool))
                    .map(|(_, t)| t.as_str())
                    .collect();
                p.id_slot = Some(env::order_ids_in(&said.join("\n")));
            }
            // the reference is scored on the prompt before the reply is sampled: p_0 on the
            // opening, and with IgContext::Observation p_{k} after reply k and its observation
            let msgs = std::mem::take(&mut pending);
            let gen = match &reference_logp {
                Some(lp) if after_observation || lp.is_empty() => {
                    engine.generate_scoring(key, msgs, p.clone(), &reference, adapted)?
                }
                _ => match &how.adapter {
                    Some((id, a)) => {
                        engine.generate_with(key, msgs, p.clone(), (*id, a.clone()))?
                    }
                    None => engine.generate(key, msgs, p.clone(), None)?,
                },
            };
            if let (Some(lp), Some(x)) = (reference_logp.as_mut(), gen.reference_logp) {
                lp.push(x);
            }
            for t in &gen.prompt {
                context.extend_from_slice(&t.tokens);
            }
            context.extend_from_slice(&gen.reply.tokens);
            if let Some(a) = gen.reply.shadow_agrees {
                shadow_agrees = Some(shadow_agrees.unwrap_or(true) && a);
            }
            if let Some(lp) = reference_logp.as_mut().filter(|_| !after_observation) {
                lp.push(engine.score_reference_by(context.clone(), true, &reference, adapted)?);
            }
            if let Some(rec) = recorder {
                let ids = rec.generation(store, &gen, &p, engine.info())?;
                if let (Some(inj), Some(&msg)) = (&injection, ids.iter().rev().nth(1)) {
                    Library::record(store, msg, inj)?;
                }
            }
            let text = gen.reply.text.trim().to_string();
            transcript.push((Role::Assistant, text.clone()));
            match desk.step(&text) {
                Observation::Customer(t) => pending.push(Message::new(Role::User, t)),
                Observation::Tool(t) => pending.push(Message::new(Role::Tool, t)),
                Observation::End => {
                    // nothing comes back after the last reply: its score is after the reply
                    if let Some(lp) = reference_logp.as_mut().filter(|_| after_observation) {
                        let c = context.clone();
                        lp.push(engine.score_reference_by(c, true, &reference, adapted)?);
                    }
                    break;
                }
            }
        }
        Ok::<_, Error>(())
    })();
    engine.close(key);
    result?;
    if let Some(rec) = recorder {
        let outcome = Feedback::Outcome {
            value: desk.reward(),
            note: Some("demo"),
        };
        rec.feedback(store, &outcome)?;
        rec.end(store)?;
    }
    Ok(Played {
        desk,
        transcript,
        session_id,
        reference_logp,
        shadow_agrees,
    })
}

/// A job waiting in a queue of [`on_engines`] with its index; taken (`None`) once a lane drew it.
type Queued<J> = Mutex<Option<(usize, J)>>;

/// Runs `work` on every job and returns the results in the order of `jobs`, calling `tick`
/// after each. Every engine opens as many lanes as it generates sessions at once
/// ([`Engine::lanes`]), each on its own thread with its own `init()` state (a store
/// connection). With `E` engines, engine `e` plays jobs `e, e + E, …`, and its lanes take them
/// in that order as each gets free, by [`Lane::ticket`]: the engine hands the tickets out in
/// lane order among the lanes that ask before the same decoding step, so which lane plays which
/// job, which sessions share a batch and which KV cells each gets follow from the jobs, not
/// from thread timing (llama.cpp's numbers depend on all three; a seeded run repeats exactly),
/// and no lane idles at the end while a sibling still works through a longer share. With
/// `one_lane`, every engine plays one session at a time (canonical play,
/// [`PlaySettings::canonical`]), whose results do not depend on the engine that plays it: the
/// engines then take jobs from one shared queue. The first error stops the other lanes and is
/// returned.
pub(super) fn on_engines<J: Send, R: Send, S>(
    engines: &[Engine],
    jobs: Vec<J>,
    one_lane: bool,
    init: impl Fn() -> Result<S> + Sync,
    work: impl Fn(&Engine, &mut S, J) -> Result<R> + Sync,
    tick: &mut dyn FnMut(),
) -> Result<Vec<R>> {
    let n_engines = engines.len().max(1);
    let per_engine = engines
        .iter()
        .map(|e| if one_lane { 1 } else { e.info().n_seq.max(1) })
        .min()
        .unwrap_or(1);
    // no more lanes than jobs: an idle lane would only hold the others up
    let per_engine = per_engine.min(jobs.len().div_ceil(n_engines).max(1));
    let n_jobs = jobs.len();
    // each engine's queue (one shared queue for canonical play), in job order
    let queues: Vec<Vec<Queued<J>>> = if one_lane {
        vec![jobs
            .into_iter()
            .enumerate()
            .map(|j| Mutex::new(Some(j)))
            .collect()]
    } else {
        let mut q: Vec<Vec<_>> = (0..n_engines).map(|_| Vec::new()).collect();
        for (i, job) in jobs.into_iter().enumerate() {
            q[i % n_engines].push(Mutex::new(Some((i, job))));
        }
        q
    };
    let shared_next = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let (init, work, queues, shared_next) = (&init, &work, &queues, &shared_next);
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let results = std::thread::scope(|sc| {
        let mut handles = Vec::with_capacity(n_engines * per_engine);
        for (e, engine) in engines.iter().enumerate() {
            for lane in engine.lanes(per_engine) {
                let (tx, stop) = (tx.clone(), &stop);
                let queue = &queues[if one_lane { 0 } else { e }];
                handles.push(sc.spawn(move || -> Result<Vec<(usize, R)>> {
                    let run = || {
                        let mut state = init()?;
                        let mut done = Vec::new();
                        while !stop.load(Ordering::SeqCst) {
                            let t = if one_lane {
                                shared_next.fetch_add(1, Ordering::SeqCst)
                            } else {
                                usize::try_from(lane.ticket()?).unwrap_or(usize::MAX)
                            };
                            let Some(slot) = queue.get(t) else { break };
                            let taken = slot.lock().ok().and_then(|mut j| j.take());
                            let Some((i, job)) = taken else { break };
                            done.push((i, work(&lane, &mut state, job)?));
                            let _ = tx.send(());
                        }
                        Ok(done)
                    };
                    let r = run();
                    // the engine stops waiting for this lane
                    drop(lane);
                    if r.is_err() {
                        stop.store(true, Ordering::SeqCst);
                    }
                    r
                }));
            }
        }
        drop(tx);
        for () in rx {
            tick();
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(Error::Invalid("an engine worker panicked".into())))
            })
            .collect::<Vec<_>>()
    });
    let mut out: Vec<Option<R>> = (0..n_jobs).map(|_| None).collect();
    for r in results {
        for (i, v) in r? {
            out[i] = Some(v);
        }
    }
    out.into_iter()
        .map(|v| v.ok_or_else(|| Error::Invalid("a job was not run".into())))
        .collect()
}

/// The scripted expert's session of `scenario` as a conversation to import.
pub fn expert_conversation(scenario: &Scenario, patience: usize) -> Conversation {
    let mut c = scripted_conversation(scenario, patience.max(6), env::expert_reply);
    c.group = Some(format!("expert:{:?}", scenario.intent).to_lowercase());
    c.metadata["demo"] = json!("expert");
    c
}

/// A session of `scenario` played by a scripted agent (`agent(desk, observations so far)`),
/// as a conversation to import, with its reward as the outcome.
pub fn scripted_conversation(
    scenario: &Scenario,
    patience: usize,
    agent: impl Fn(&Desk, &[Observation]) -> String,
) -> Conversation {
    let mut desk = Desk::new(scenario.clone(), patience);
    let mut messages = vec![
        Message::new(Role::System, env::SYSTEM_PROMPT),
        Message::new(Role::User, scenario.opening()),
    ];
    let mut seen = Vec::new();
    loop {
        let reply = agent(&desk, &seen);
        messages.push(Message::new(Role::Assistant, reply.clone()));
        let obs = desk.step(&reply);
        match &obs {
            Observation::Customer(t) => messages.push(Message::new(Role::User, t.clone())),
            Observation::Tool(t) => messages.push(Message::new(Role::Tool, t.clone())),
            Observation::End => break,
        }
        seen.push(obs);
    }
    Conversation {
        messages,
        outcome: Some(desk.reward()),
        reference: Some(env::action_line(&scenario.ground_truth)),
        group: None,
        metadata: json!({"demo": "scripted", "intent": format!("{:?}", scenario.intent), "template": scenario.template}),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::{self, Split};
    use crate::policy::sampler::Rng;

    #[test]
    fn the_expert_solves_every_training_scenario() {
        let mut rng = Rng::new(11);
        for _ in 0..200 {
            let s = env::scenario(&mut rng, Split::Train);
            let c = expert_conversation(&s, 5);
            assert_eq!(c.outcome, Some(1.0), "{s:?}\n{:#?}", c.messages);
            assert!(c.messages.len() <= 2 + 2 * 5, "{:#?}", c.messages);
        }
    }
}
