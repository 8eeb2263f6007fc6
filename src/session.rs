//! How sessions are written: [`Recorder`] (open → turns → feedback → end) is the one path by
//! which chat, the server, the demo and imports log a session, and
//! [`turns_from_generation`] turns an engine generation into the rows that log it.

use crate::error::Result;
use crate::policy::{Generation, ModelInfo, SamplerParams, StopReason};
use crate::store::{Behavior, Features, FeedbackKind, NewSession, NewTurn, Store, TokenLogprobs};

/// Feedback on a session.
#[derive(Debug, Clone, PartialEq)]
pub enum Feedback<'a> {
    /// thumbs up (stored as 1) or down (−1) on a turn
    Thumb {
        /// turn index
        turn: Option<i64>,
        /// up
        up: bool,
        /// optional note
        note: Option<&'a str>,
    },
    /// the session's outcome reward
    Outcome {
        /// reward
        value: f64,
        /// where it came from
        note: Option<&'a str>,
    },
    /// free text about the session or a turn
    Note {
        /// turn index
        turn: Option<i64>,
        /// the text
        text: &'a str,
    },
}

/// One session being logged. Every write is its own transaction, committed before the caller
/// acknowledges anything (a reply is in the log before it is sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Recorder {
    id: i64,
}

impl Recorder {
    /// Opens a new session.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn open(store: &Store, session: &NewSession) -> Result<Self> {
        Ok(Recorder {
            id: store.create_session(session)?,
        })
    }

    /// Continues a session already in the log (a conversation restored after a restart).
    pub fn resume(session_id: i64) -> Self {
        Recorder { id: session_id }
    }

    /// A whole finished session at once (imports): session, turns, outcome and end in one
    /// transaction. Returns the recorder and the turn ids.
    ///
    /// # Errors
    /// SQLite errors and misaligned turns (nothing is written then).
    pub fn finished(
        store: &mut Store,
        session: &NewSession,
        turns: &[NewTurn],
        outcome: Option<(f64, &str)>,
    ) -> Result<(Self, Vec<i64>)> {
        let (id, ids) = store.create_finished_session(session, turns, outcome)?;
        Ok((Recorder { id }, ids))
    }

    /// The session's id in the store.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// Appends turns; returns their ids.
    ///
    /// # Errors
    /// SQLite errors and misaligned turns (nothing is written then).
    pub fn turns(&self, store: &mut Store, turns: &[NewTurn]) -> Result<Vec<i64>> {
        store.append_turns(self.id, turns)
    }

    /// Appends the turns of one engine generation (the new prompt messages, then the reply);
    /// returns their ids.
    ///
    /// # Errors
    /// As [`Recorder::turns`].
    pub fn generation(
        &self,
        store: &mut Store,
        gen: &Generation,
        params: &SamplerParams,
        info: &ModelInfo,
    ) -> Result<Vec<i64>> {
        self.turns(store, &turns_from_generation(gen, params, info))
    }

    /// Records feedback.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn feedback(&self, store: &mut Store, f: &Feedback<'_>) -> Result<()> {
        match *f {
            Feedback::Thumb { turn, up, note } => store.add_feedback(
                self.id,
                turn,
                FeedbackKind::Thumb,
                Some(if up { 1.0 } else { -1.0 }),
                note,
            ),
            Feedback::Outcome { value, note } => {
                store.add_feedback(self.id, None, FeedbackKind::Outcome, Some(value), note)
            }
            Feedback::Note { turn, text } => {
                store.add_feedback(self.id, turn, FeedbackKind::Note, None, Some(text))
            }
        }
    }

    /// Ends the session (idempotent).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn end(&self, store: &Store) -> Result<()> {
        store.end_session(self.id)
    }
}

/// The turns that record one generation: the appended prompt messages, then the reply with its
/// sampler settings, behaviour log-probs and hidden states.
pub fn turns_from_generation(
    gen: &Generation,
    params: &SamplerParams,
    info: &ModelInfo,
) -> Vec<NewTurn> {
    let template = info.template.as_str();
    let r = &gen.reply;
    let mut ctx = r.context_len - gen.prompt.iter().map(|t| t.tokens.len()).sum::<usize>();
    let mut out = Vec::with_capacity(gen.prompt.len() + 1);
    for t in &gen.prompt {
        let mut nt = NewTurn::message(
            t.message.role,
            t.message.content.clone(),
            t.tokens.clone(),
            ctx,
        );
        nt.template = Some(template.to_string());
        nt.retokenized = t.retokenized;
        ctx += t.tokens.len();
        out.push(nt);
    }
    let stop = match r.stop {
        StopReason::EndOfTurn => "end_of_turn",
        StopReason::MaxTokens => "max_tokens",
        StopReason::StopString => "stop_string",
        StopReason::Cancelled => "cancelled",
    };
    out.push(NewTurn {
        sampler: Some(params.clone()),
        behavior: Some(Behavior::Sampled),
        stop_reason: Some(stop.into()),
        adapter_id: r.adapter_id,
        template: Some(template.to_string()),
        latency_ms: Some(r.prefill_ms + r.decode_ms),
        logprobs: Some(TokenLogprobs {
            logp_behavior: r.logp_behavior.clone(),
            logp_full: r.logp_full.clone(),
            support: r.support.clone(),
        }),
        hidden: (!r.hidden.is_empty()).then(|| Features {
            n_embd: info.n_embd,
            dtype: info.feature_dtype,
            values: r.hidden.clone(),
        }),
        block: r.block.clone().filter(|b| !b.values.is_empty()),
        ..NewTurn::message(
            crate::policy::Role::Assistant,
            r.text.clone(),
            r.tokens.clone(),
            r.context_len,
        )
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::Role;
    use crate::store::Source;

    #[test]
    fn a_recorder_writes_turns_feedback_and_the_end() {
        let mut store = Store::in_memory().unwrap();
        let rec = Recorder::open(&store, &NewSession::new(Source::Chat)).unwrap();
        let ids = rec
            .turns(
                &mut store,
                &[
                    NewTurn::message(Role::User, "hi", vec![1, 2], 0),
                    NewTurn::message(Role::Assistant, "hello", vec![3], 2),
                ],
            )
            .unwrap();
        assert_eq!(ids.len(), 2);
        for f in [
            Feedback::Thumb {
                turn: Some(1),
                up: false,
                note: None,
            },
            Feedback::Outcome {
                value: 0.75,
                note: Some("agent"),
            },
            Feedback::Note {
                turn: None,
                text: "polite",
            },
        ] {
            rec.feedback(&mut store, &f).unwrap();
        }
        rec.end(&store).unwrap();
        let s = store.session(rec.id()).unwrap();
        assert!(s.ended_at.is_some());
        assert_eq!(s.outcome_reward, Some(0.75));
        let fb = store.feedback(rec.id()).unwrap();
        let kinds: Vec<FeedbackKind> = fb.iter().map(|f| f.kind).collect();
        assert_eq!(
            kinds,
            [
                FeedbackKind::Thumb,
                FeedbackKind::Outcome,
                FeedbackKind::Note
            ]
        );
        assert_eq!(fb[0].value, Some(-1.0));
        // a resumed recorder writes to the same session
        let again = Recorder::resume(rec.id());
        again
            .turns(
                &mut store,
                &[NewTurn::message(Role::User, "bye", vec![4], 3)],
            )
            .unwrap();
        assert_eq!(store.turns(rec.id()).unwrap().len(), 3);
    }

    #[test]
    fn a_finished_session_is_written_whole_or_not_at_all() {
        let mut store = Store::in_memory().unwrap();
        let mut bad = NewTurn::message(Role::Assistant, "x", vec![1, 2], 0);
        bad.hidden = Some(Features {
            n_embd: 4,
            dtype: crate::policy::FeatureDtype::F32,
            values: vec![0.0; 4], // 2 tokens need 8 values
        });
        let s = NewSession::new(Source::Import);
        assert!(Recorder::finished(&mut store, &s, &[bad], Some((1.0, "import"))).is_err());
        assert!(store.sessions(None, 10).unwrap().is_empty());
        let ok = NewTurn::message(Role::User, "x", vec![1, 2], 0);
        let (rec, ids) = Recorder::finished(&mut store, &s, &[ok], Some((1.0, "import"))).unwrap();
        assert_eq!(ids.len(), 1);
        let back = store.session(rec.id()).unwrap();
        assert!(back.ended_at.is_some());
        assert_eq!(back.outcome_reward, Some(1.0));
    }
}
