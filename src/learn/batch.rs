//! The first stage of an update: which sessions it learns from and how they are grouped.
//!
//! Finished sessions of the selection are loaded with their sampled turns (tokens, stored
//! features, behaviour log-probs, temperature and sampler support); live sessions without a
//! group key are clustered by their opening state; the batch is put in an order that does not
//! depend on when sessions were logged (by group, then content); groups too small to compare
//! within fall back to one batch-wide group (docs/learning.md, "Groups").

use ndarray::Array2;

use super::advantages::merge_small_groups;
use super::config::{Selection, TrainConfig, FALLBACK_GROUP};
use crate::error::{Error, Result};
use crate::learn::Algo;
use crate::policy::sampler::Support;
use crate::store::Store;

/// The sessions of one update, in batch order, with their groups.
pub(super) struct Batch {
    /// sessions, sorted by group and content
    pub(super) sessions: Vec<SessionData>,
    /// each session's group after small groups were merged
    pub(super) groups: Vec<String>,
    /// the session's own group was too small: it is in the fallback group
    pub(super) fell_back: Vec<bool>,
    /// how groups were formed (`group_key`, `batch`, `opening_clusters`, mixtures)
    pub(super) grouping: &'static str,
    /// a block-LoRA update: sessions of the selection left out because their block inputs
    /// were not logged (or not for these blocks)
    pub(super) without_block: usize,
    /// sessions of the selection left out because what they hold cannot be learned from (a
    /// reward beyond [`MAX_USABLE_REWARD`] or not finite, non-finite features or log-probs),
    /// with the reason: one such session must not poison the update of the others
    pub(super) unusable: Vec<(i64, String)>,
}

/// Largest |outcome| a session may have to be learned from. Rewards are centred (and scaled)
/// per group, so a session far beyond any real outcome would overflow them: 1.7e308 from one
/// client made every later update non-finite. The server refuses such feedback at the door
/// (`--reward-range`); imported logs and older databases are checked here.
pub const MAX_USABLE_REWARD: f64 = 1e6;

/// Loads and groups the batch.
///
/// # Errors
/// Store errors; no session matches the selection.
pub(super) fn select(
    store: &mut Store,
    sel: &Selection,
    cfg: &TrainConfig,
    block: Option<(usize, usize)>,
    mut progress: impl FnMut(&str, usize, usize),
) -> Result<Batch> {
    let sft = cfg.algo == Algo::Sft;
    progress("loading sessions", 0, 1);
    let (sessions, without_block, unusable) = load_sessions(
        store,
        sel,
        !sft,
        if sft { cfg.sft_min_outcome } else { None },
        block,
    )?;
    if sessions.is_empty() {
        let what = if block.is_some() {
            format!(
                "no finished sessions with features, an outcome and the block inputs of the \
                 adapter's blocks (logged with --block-capture) match the selection ({without_block} \
                 without them)"
            )
        } else {
            "no finished sessions with features (and an outcome, for RL) match the selection".into()
        };
        return Err(Error::NothingToLearn(what));
    }
    // ---- groups: live sessions without a key are clustered by their opening state ------------
    let mut sessions = sessions;
    let ungrouped: Vec<usize> = (0..sessions.len())
        .filter(|&i| sessions[i].keyless)
        .collect();
    let grouping = match cfg.cluster_threshold {
        Some(th) if !ungrouped.is_empty() && !sft => {
            let openings: Vec<(i64, Vec<f32>)> = ungrouped
                .iter()
                .map(|&i| (sessions[i].id, sessions[i].turns[0].h.row(0).to_vec()))
                .collect();
            super::groups::assign_group_keys(store, &openings, th)?;
            for &i in &ungrouped {
                if let Some(k) = store.session(sessions[i].id)?.group_key {
                    sessions[i].group = k;
                }
            }
            if ungrouped.len() == sessions.len() {
                "opening_clusters"
            } else {
                "group_key+opening_clusters"
            }
        }
        _ if ungrouped.len() == sessions.len() => "batch",
        _ if ungrouped.is_empty() => "group_key",
        _ => "group_key+batch",
    };
    // the batch in an order that does not depend on the order sessions were logged in (two
    // engines finish rollouts in a timing-dependent order): by group, then by content
    sessions.sort_by_cached_key(|s| (s.group.clone(), content_key(s)));
    // groups too small to compare within fall back to one batch-wide group (§7)
    let (groups, fell_back) = if sft {
        (
            sessions.iter().map(|s| s.group.clone()).collect(),
            vec![false; sessions.len()],
        )
    } else {
        let keys: Vec<String> = sessions.iter().map(|s| s.group.clone()).collect();
        merge_small_groups(&keys, cfg.min_group_size, FALLBACK_GROUP)
    };
    Ok(Batch {
        sessions,
        groups,
        fell_back,
        grouping,
        without_block,
        unusable,
    })
}

/// A key of a session's content (its turns' tokens) that does not depend on when it was logged.
pub(super) fn content_key(s: &SessionData) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for t in &s.turns {
        t.observation.hash(&mut h);
        t.tokens.hash(&mut h);
    }
    h.finish()
}

pub(super) struct TurnData {
    pub(super) turn_id: i64,
    /// what the environment said since the previous assistant turn (GiGPO's step groups)
    pub(super) observation: Vec<i32>,
    pub(super) tokens: Vec<usize>,
    /// the session's tokens before the turn (its first token's position)
    pub(super) context_len: usize,
    pub(super) h: Array2<f32>,
    pub(super) logp_behavior: Vec<f32>,
    /// the temperature the turn was sampled at (1 for rescored turns)
    pub(super) temperature: f32,
    /// per token, where the behaviour distribution had its mass (empty: the whole softmax)
    pub(super) support: Vec<Support>,
    pub(super) adapter_id: Option<i64>,
    /// not sampled here: an import, scored once by the frozen base model
    pub(super) rescored: bool,
}

pub(super) struct SessionData {
    pub(super) id: i64,
    /// the session had no group key
    pub(super) keyless: bool,
    /// no earlier update has used this session
    pub(super) unseen: bool,
    pub(super) group: String,
    pub(super) outcome: f64,
    pub(super) turns: Vec<TurnData>,
    /// a block-LoRA update: the block input of every position `0 .. n` of the session
    pub(super) block_x: Option<Array2<f32>>,
}

/// What [`load_sessions`] returns: the sessions, how many lacked block inputs, and the
/// sessions left out as unusable with the reason.
pub(super) type Loaded = (Vec<SessionData>, usize, Vec<(i64, String)>);

/// Loads the selection's sessions; with `block = (layer, n_embd)` only those whose block
/// inputs cover every position that produced an assistant token, and returns how many were
/// left out for lacking them, and which were left out as unusable (and why).
pub(super) fn load_sessions(
    store: &Store,
    sel: &Selection,
    require_outcome: bool,
    min_outcome: Option<f64>,
    block: Option<(usize, usize)>,
) -> Result<Loaded> {
    let (mut out, mut without_block) = (Vec::new(), 0);
    let mut unusable = Vec::new();
    for s in store.training_sessions_before(
        sel.source,
        sel.since.as_deref(),
        sel.until.as_deref(),
        require_outcome,
        sel.limit.max(1),
    )? {
        let outcome = s.outcome_reward.unwrap_or(0.0);
        if !outcome.is_finite() || outcome.abs() > MAX_USABLE_REWARD {
            unusable.push((
                s.id,
                format!("outcome {outcome:e} beyond ±{MAX_USABLE_REWARD:e}"),
            ));
            continue;
        }
        if min_outcome.is_some_and(|m| outcome < m) {
            continue;
        }
        let mut turns = Vec::new();
        let mut observation = Vec::new();
        for t in store.turns(s.id)? {
            if t.role != crate::Role::Assistant {
                observation.extend_from_slice(&t.token_ids);
                continue;
            }
            let observed = std::mem::take(&mut observation);
            let (Some(lp), Some(f)) = (store.token_logprobs(t.id)?, store.features(t.id)?) else {
                continue; // features dropped by gc, or never captured
            };
            let n = t.token_ids.len();
            let h = Array2::from_shape_vec((n, f.n_embd), f.values)
                .map_err(|e| Error::Corrupt(e.to_string()))?;
            let (temperature, support) = behaviour_of(&t, lp.support);
            turns.push(TurnData {
                observation: observed,
                turn_id: t.id,
                context_len: t.context_len,
                tokens: t.token_ids.iter().map(|&x| x as usize).collect(),
                h,
                logp_behavior: lp.logp_behavior,
                temperature,
                support,
                adapter_id: t.adapter_id,
                rescored: t.behavior == Some(crate::store::Behavior::Rescored),
            });
        }
        if turns.is_empty() {
            continue;
        }
        if let Some(t) = turns.iter().find(|t| {
            t.h.iter().any(|x| !x.is_finite()) || t.logp_behavior.iter().any(|x| !x.is_finite())
        }) {
            unusable.push((
                s.id,
                format!("turn {}: non-finite features or log-probs", t.turn_id),
            ));
            continue;
        }
        let block_x = match block {
            Some((layer, n_embd)) => {
                // the last token of the last turn is a target only: positions up to it
                let needed = turns
                    .iter()
                    .map(|t| t.context_len + t.tokens.len() - 1)
                    .max()
                    .unwrap_or(0);
                match super::block::session_block_inputs(store, s.id, layer, n_embd)? {
                    Some(x) if x.nrows() >= needed && turns.iter().all(|t| t.context_len > 0) => {
                        Some(x)
                    }
                    _ => {
                        without_block += 1;
                        continue;
                    }
                }
            }
            None => None,
        };
        out.push(SessionData {
            id: s.id,
            keyless: s.group_key.is_none(),
            unseen: s.learned_at.is_none(),
            group: s.group_key.clone().unwrap_or_else(|| "batch".into()),
            outcome,
            turns,
            block_x,
        });
    }
    Ok((out, without_block, unusable))
}

/// The temperature and per-token support a logged turn was sampled with: rescored turns (and
/// turns without sampler settings) were scored by the whole softmax at temperature 1; a greedy
/// turn is a point mass on every token, whatever was stored.
pub(super) fn behaviour_of(
    t: &crate::store::TurnRecord,
    support: Vec<Support>,
) -> (f32, Vec<Support>) {
    let sampled = t.behavior != Some(crate::store::Behavior::Rescored);
    match t.sampler.as_ref().filter(|_| sampled) {
        Some(p) if p.temperature <= 0.0 => (
            1.0,
            t.token_ids
                .iter()
                .map(|&k| Support {
                    keep: Some(vec![k as u32]),
                    ..Support::default()
                })
                .collect(),
        ),
        Some(p) => (p.temperature, support),
        None => (1.0, Vec::new()),
    }
}
