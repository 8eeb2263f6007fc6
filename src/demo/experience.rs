//! The experience library (SLEA-RL's step-level retrieval, behind `--experience on`).
//!
//! Every assistant step is keyed by its observation — the message the agent had just received
//! (the customer's words or the back office's result). Observations are embedded as hashed
//! character trigrams of their first [`HEAD_CHARS`] characters (lower-cased, digits folded to
//! `0`, so order ids do not split clusters) and grouped by leader clustering on cosine
//! similarity (0.75). A text embedding, not the policy's hidden state: the hidden state of the
//! new observation only exists after it is decoded, and retrieval has to change the context
//! before that. Per cluster the library keeps up to
//! `capacity` **strategy** entries, distilled from the best successful sessions, and `capacity`
//! **warning** entries from the worst failures.
//!
//! "Distil" is extractive here: an entry is the turn's own text with 5-digit order ids masked as
//! `<order id>`, plus the masked observation as its context. Admission is score based (a
//! strategy's score is its session's reward, a warning's is `1 − reward`), at most
//! `per_update` new entries per update; a near-duplicate of an existing entry raises that entry's
//! score instead; a full level replaces its lowest entry only for a strictly higher score (the
//! replaced entry is retired, not deleted, because injections cite it).
//!
//! At each step the agent's observation is looked up; the cluster's top strategies and its top
//! warning are appended to the observation message, capped in length. The appended text is part
//! of the logged turn (so training sees exactly the context that was sampled from), and
//! `experience_injections` records which entries it held.

use crate::error::Result;
use crate::learn::groups::{cosine, leader_assign};
use crate::policy::Role;
use crate::store::Store;

/// Where the injected text starts inside an observation message.
pub const MARKER: &str = "\n\n[experience]";

const DIM: usize = 256;

/// Settings of the library.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LibraryConfig {
    /// cosine similarity at which an observation joins a cluster
    pub threshold: f64,
    /// entries per cluster and kind
    pub capacity: usize,
    /// new entries admitted per update
    pub per_update: usize,
    /// strategies retrieved per step (plus one warning)
    pub top_strategies: usize,
    /// most characters of injected text
    pub max_chars: usize,
    /// a candidate this similar to an existing entry of its cluster and kind is a near-duplicate
    pub duplicate_similarity: f64,
}

impl Default for LibraryConfig {
    fn default() -> Self {
        LibraryConfig {
            threshold: 0.75,
            capacity: 3,
            per_update: 4,
            top_strategies: 2,
            max_chars: 200,
            duplicate_similarity: 0.9,
        }
    }
}

/// Characters of an observation that are embedded: its head carries what kind of message it is
/// ("order 0: processing", "It's order 0", "ERROR: …"); the tail (items, addresses) would
/// dominate the trigrams and merge observations that call for different steps.
pub const HEAD_CHARS: usize = 32;

/// Embeds an observation: hashed character trigrams of its lower-cased head (digits folded),
/// L2-normalised.
pub fn embed(text: &str) -> Vec<f32> {
    let folded: Vec<char> = text
        .to_lowercase()
        .chars()
        .take(HEAD_CHARS)
        .map(|c| if c.is_ascii_digit() { '0' } else { c })
        .collect();
    let mut v = vec![0f32; DIM];
    for w in folded.windows(3) {
        // FNV-1a over the trigram
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for c in w {
            h ^= *c as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        v[(h % DIM as u64) as usize] += 1.0;
    }
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
    if n > 0.0 {
        v.iter_mut().for_each(|x| *x /= n);
    }
    v
}

/// Masks 5-digit numbers (order ids) as `<order id>` and collapses whitespace.
pub fn mask(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut digits = String::new();
    let flush = |digits: &mut String, out: &mut String| {
        if digits.len() == 5 {
            out.push_str("<order id>");
        } else {
            out.push_str(digits);
        }
        digits.clear();
    };
    for c in text.chars() {
        if c.is_ascii_digit() {
            digits.push(c);
        } else {
            flush(&mut digits, &mut out);
            out.push(c);
        }
    }
    flush(&mut digits, &mut out);
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The observation part of a logged message (the injected text removed).
pub fn observation(message: &str) -> &str {
    message.split(MARKER).next().unwrap_or(message)
}

pub use crate::store::{ExperienceEntry as Entry, ExperienceRow as EntryRow};

/// What is appended to one observation.
#[derive(Debug, Clone, PartialEq)]
pub struct Injection {
    /// the text appended to the message (starts with [`MARKER`])
    pub text: String,
    /// the entries it holds
    pub entries: Vec<i64>,
}

/// A candidate step for the library, from a finished session.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// the assistant turn
    pub turn_id: i64,
    /// the observation before it (without injected text)
    pub observation: String,
    /// the turn's text
    pub text: String,
    /// the session's reward
    pub reward: f64,
    /// the session succeeded
    pub success: bool,
}

/// What one evolution step did.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Evolution {
    /// new entries
    pub admitted: usize,
    /// near-duplicates that raised an existing entry's score
    pub raised: usize,
    /// entries retired by a higher-scoring one
    pub replaced: usize,
    /// candidates refused (rate limit, or a full level with higher scores)
    pub refused: usize,
    /// clusters in the library
    pub clusters: usize,
}

/// The library: clusters and live entries, mirrored from SQLite.
pub struct Library {
    cfg: LibraryConfig,
    clusters: Vec<(i64, Vec<f32>, i64)>,
}

impl Library {
    /// Loads the clusters from the store.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn load(store: &Store, cfg: LibraryConfig) -> Result<Self> {
        let clusters = store.experience_clusters()?;
        Ok(Library { cfg, clusters })
    }

    /// Settings.
    pub fn config(&self) -> &LibraryConfig {
        &self.cfg
    }

    fn nearest(&self, e: &[f32]) -> Option<i64> {
        self.clusters
            .iter()
            .map(|(id, p, _)| (*id, cosine(p, e)))
            .filter(|&(_, s)| s >= self.cfg.threshold)
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map(|(id, _)| id)
    }

    /// The injection for an observation: its cluster's top strategies and top warning, capped at
    /// `max_chars`; `None` when the observation matches no cluster or the cluster is empty.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn retrieve(&self, store: &Store, observation: &str) -> Result<Option<Injection>> {
        let Some(c) = self.nearest(&embed(observation)) else {
            return Ok(None);
        };
        let strategies = store.experience_entries(c, "strategy")?;
        let warnings = store.experience_entries(c, "warning")?;
        let mut text = String::from(MARKER);
        let mut ids = Vec::new();
        let mut add = |prefix: &str, e: &Entry, text: &mut String| {
            let piece = format!(" {prefix}: \"{}\".", e.text);
            if text.len() + piece.len() <= self.cfg.max_chars + MARKER.len() {
                text.push_str(&piece);
                ids.push(e.id);
            }
        };
        for e in strategies.iter().take(self.cfg.top_strategies) {
            add("Worked before", e, &mut text);
        }
        if let Some(w) = warnings.first() {
            add("Avoid", w, &mut text);
        }
        Ok((!ids.is_empty()).then_some(Injection { text, entries: ids }))
    }

    /// Records which entries were injected into the logged message `turn_id`.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn record(store: &mut Store, turn_id: i64, injection: &Injection) -> Result<()> {
        store.record_injection(turn_id, &injection.entries)
    }

    /// Candidates of finished sessions: every assistant turn with the observation before it.
    ///
    /// # Errors
    /// Store errors.
    pub fn candidates(store: &Store, sessions: &[i64], success_at: f64) -> Result<Vec<Candidate>> {
        let mut out = Vec::new();
        for &sid in sessions {
            let s = store.session(sid)?;
            let Some(reward) = s.outcome_reward else {
                continue;
            };
            let turns = store.turns(sid)?;
            for (i, t) in turns.iter().enumerate() {
                if t.role != Role::Assistant || i == 0 {
                    continue;
                }
                let prev = &turns[i - 1];
                if prev.role == Role::Assistant || prev.role == Role::System {
                    continue;
                }
                out.push(Candidate {
                    turn_id: t.id,
                    observation: observation(&prev.text).to_string(),
                    text: t.text.trim().to_string(),
                    reward,
                    success: reward >= success_at,
                });
            }
        }
        Ok(out)
    }

    /// Evolves the library with the steps of one update's sessions: strategies from successful
    /// sessions (best first), warnings from failed ones (worst first), under the admission rules
    /// of the module documentation. One transaction.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn evolve(
        &mut self,
        store: &mut Store,
        candidates: &[Candidate],
        update_id: Option<i64>,
    ) -> Result<Evolution> {
        let mut ev = Evolution::default();
        // cluster every observation (the library's clusters grow with what the agent sees)
        let points: Vec<Vec<f32>> = candidates.iter().map(|c| embed(&c.observation)).collect();
        let mut protos: Vec<(Vec<f32>, i64)> = self
            .clusters
            .iter()
            .map(|(_, p, n)| (p.clone(), *n))
            .collect();
        let known = protos.len();
        let idx = leader_assign(&mut protos, &points, self.cfg.threshold);
        let ids = store.evolve_experience(|w| {
            let mut ids: Vec<i64> = self.clusters.iter().map(|c| c.0).collect();
            for (k, (p, n)) in protos.iter().enumerate() {
                if k < known {
                    w.update_cluster(ids[k], p, *n)?;
                } else {
                    ids.push(w.insert_cluster(p, *n)?);
                }
            }
            // strategies best first, then warnings worst first
            let mut order: Vec<(usize, &'static str, f64)> = candidates
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if c.success {
                        (i, "strategy", c.reward)
                    } else {
                        (i, "warning", 1.0 - c.reward)
                    }
                })
                .collect();
            order.sort_by(|a, b| {
                (a.1 == "warning")
                    .cmp(&(b.1 == "warning"))
                    .then(b.2.total_cmp(&a.2))
            });
            for (i, kind, score) in order {
                let c = &candidates[i];
                let cluster = ids[idx[i]];
                let text = mask(&c.text);
                if text.is_empty() {
                    continue;
                }
                let live = w.live_entries(cluster, kind)?;
                let e = embed(&text);
                let dup = live.iter().find(|l| {
                    l.text == text || cosine(&embed(&l.text), &e) >= self.cfg.duplicate_similarity
                });
                if let Some(d) = dup {
                    w.raise_entry(d.id, 0.5 * score)?;
                    ev.raised += 1;
                    continue;
                }
                if ev.admitted >= self.cfg.per_update {
                    ev.refused += 1;
                    continue;
                }
                if live.len() >= self.cfg.capacity {
                    let low = &live[0];
                    if score <= low.score {
                        ev.refused += 1;
                        continue;
                    }
                    w.retire_entry(low.id)?;
                    ev.replaced += 1;
                }
                let context: String = mask(&c.observation).chars().take(80).collect();
                w.insert_entry(cluster, kind, &text, &context, score, c.turn_id, update_id)?;
                ev.admitted += 1;
            }
            Ok(ids)
        })?;
        self.clusters = ids
            .into_iter()
            .zip(protos)
            .map(|(id, (p, n))| (id, p, n))
            .collect();
        ev.clusters = self.clusters.len();
        Ok(ev)
    }

    /// Live entries, by cluster and kind, best first (for reports).
    ///
    /// # Errors
    /// SQLite errors.
    pub fn listing(store: &Store) -> Result<Vec<EntryRow>> {
        store.experience_listing()
    }

    /// How many injections were recorded.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn injections(store: &Store) -> Result<i64> {
        store.experience_injections()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{NewSession, NewTurn, Source};

    #[test]
    fn masking_embedding_and_observations() {
        assert_eq!(
            mask("ACTION refund  48213 now"),
            "ACTION refund <order id> now"
        );
        assert_eq!(mask("I paid 42 dollars"), "I paid 42 dollars");
        // ids are folded: the same sentence with another id embeds identically
        let a = embed("It's order 48213.");
        let b = embed("It's order 10442.");
        assert!((cosine(&a, &b) - 1.0).abs() < 1e-6);
        assert!(cosine(&a, &embed("Can you just take care of it, please?")) < 0.5);
        let n: f32 = a.iter().map(|x| x * x).sum();
        assert!((n - 1.0).abs() < 1e-5);
        assert_eq!(
            observation("hello\n\n[experience] Worked before: \"x\"."),
            "hello"
        );
    }

    fn candidate(turn_id: i64, obs: &str, text: &str, reward: f64) -> Candidate {
        Candidate {
            turn_id,
            observation: obs.into(),
            text: text.into(),
            reward,
            success: reward >= 1.0,
        }
    }

    #[test]
    fn admission_duplicates_rate_limit_and_replacement() {
        let mut store = Store::in_memory().unwrap();
        // real turns for the source_turn foreign key
        let sid = store
            .create_session(&NewSession::new(Source::Demo))
            .unwrap();
        let turns: Vec<NewTurn> = (0..12)
            .map(|i| NewTurn::message(Role::Assistant, format!("t{i}"), vec![i], i as usize))
            .collect();
        let tids = store.append_turns(sid, &turns).unwrap();
        let cfg = LibraryConfig {
            capacity: 2,
            per_update: 3,
            ..Default::default()
        };
        let mut lib = Library::load(&store, cfg.clone()).unwrap();
        let obs = "order 12345: processing, blue jacket, to 12 oak street";
        let ev = lib
            .evolve(
                &mut store,
                &[
                    candidate(tids[0], obs, "ACTION decline", 1.0),
                    candidate(tids[1], obs, "ACTION decline", 0.9 + 0.1), // exact duplicate
                    candidate(tids[2], obs, "ACTION refund 12345", 0.0),
                    candidate(
                        tids[3],
                        "Please cancel order 55555.",
                        "ACTION cancel 55555",
                        1.0,
                    ),
                    candidate(
                        tids[4],
                        "Please cancel order 55555.",
                        "Order 55555 is gone",
                        0.0,
                    ),
                ],
                None,
            )
            .unwrap();
        // decline admitted, its duplicate raises it; cancel admitted; then the rate limit (3)
        // admits the first warning (refund, score 1) and refuses the second
        assert_eq!(
            ev,
            Evolution {
                admitted: 3,
                raised: 1,
                replaced: 0,
                refused: 1,
                clusters: 2
            }
        );
        let inj = lib
            .retrieve(
                &store,
                "order 99999: processing, desk lamp, to 7 harbour road",
            )
            .unwrap()
            .unwrap();
        assert!(inj.text.starts_with(MARKER));
        assert!(
            inj.text.contains("Worked before: \"ACTION decline\""),
            "{}",
            inj.text
        );
        assert!(
            inj.text.contains("Avoid: \"ACTION refund <order id>\""),
            "{}",
            inj.text
        );
        assert_eq!(inj.entries.len(), 2);
        // the duplicate raised the score by half of its own: 1 + 0.5
        let l = Library::listing(&store).unwrap();
        let decline = l.iter().find(|e| e.text == "ACTION decline").unwrap();
        assert!((decline.score - 1.5).abs() < 1e-12);
        assert!(lib
            .retrieve(&store, "something entirely different, unseen")
            .unwrap()
            .is_none());

        // a full level (capacity 2) replaces its lowest entry only for a strictly higher score
        let mut lib = Library::load(&store, cfg).unwrap();
        let ev = lib
            .evolve(
                &mut store,
                &[
                    candidate(tids[5], obs, "ACTION status 12345 first", 1.0),
                    candidate(tids[6], obs, "Let me look that order up for you now", 1.0),
                ],
                None,
            )
            .unwrap();
        assert_eq!((ev.admitted, ev.replaced, ev.refused), (1, 0, 1), "{ev:?}");
        let ev = lib
            .evolve(
                &mut store,
                &[candidate(
                    tids[7],
                    obs,
                    "Checking: ACTION status 12345 then decide",
                    2.0,
                )],
                None,
            )
            .unwrap();
        assert_eq!((ev.admitted, ev.replaced), (1, 1), "{ev:?}");
        Library::record(&mut store, tids[8], &inj).unwrap();
        assert_eq!(Library::injections(&store).unwrap(), 2);
    }
}
