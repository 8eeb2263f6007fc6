//! The sampler: temperature, top-k, top-p over logits, with the log-probability of the sampled
//! token under the exact distribution it was drawn from (the *behaviour* log-prob) and under the
//! full softmax at temperature 1.
//!
//! Turnwise samples itself instead of using llama.cpp's sampler chain so that the behaviour
//! log-prob is computed by the same code that draws the token, and so that an adapter's logit
//! correction is applied before sampling. The random stream is a SplitMix64 generator: the same
//! seed gives the same draws on every platform and every version of this crate.

use serde::{Deserialize, Serialize};

/// Sampler settings; stored as JSON with every turn they produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplerParams {
    /// softmax temperature; `<= 0` means greedy
    pub temperature: f32,
    /// nucleus mass kept (1.0 disables)
    pub top_p: f32,
    /// number of highest logits kept (0 disables)
    pub top_k: usize,
    /// most tokens generated in one turn
    pub max_tokens: usize,
    /// seed of the random stream of this turn
    pub seed: u64,
    /// stop strings: generation ends once the reply contains one of them
    pub stop: Vec<String>,
    /// never sample end-of-generation tokens (benchmarks); their logits are masked
    pub ignore_eog: bool,
    /// where the arg-max token writes only digits, take it (a point mass, behaviour log-prob
    /// 0) instead of sampling: numbers such as order ids are copied as greedy decoding copies
    /// them, and the randomness stays on the words (RL rollouts explore decisions, not digit
    /// noise)
    pub greedy_digits: bool,
    /// the order-id slot of an `ACTION <verb> <id>` line may only spell one of these numbers
    /// (the numbers the conversation holds: a pointer into the context, as a tool schema with
    /// an enum argument constrains a call); `None`: unconstrained. See [`id_slot_allows`].
    pub id_slot: Option<Vec<String>>,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temperature: 0.8,
            top_p: 0.95,
            top_k: 40,
            max_tokens: 128,
            seed: 0,
            stop: Vec::new(),
            ignore_eog: false,
            greedy_digits: false,
            id_slot: None,
        }
    }
}

/// The verbs whose action line takes an order id (`ACTION <verb> <id>`).
const ID_VERBS: [&str; 4] = ["status", "refund", "cancel", "address"];

/// Whether `text` (a reply so far) respects the order-id slot: in its first `ACTION <verb> <id>`
/// line with an id-taking verb, the run of digits after the verb and its spaces must be a
/// prefix of one of `candidates` while it is still open and one of them once something else
/// follows it. A verb followed by no digits (words, a line end) is allowed: the line is then a
/// malformed call, answered with an error like any other. With no candidates no digit can be
/// written into the slot.
pub fn id_slot_allows(text: &str, candidates: &[String]) -> bool {
    let Some(at) = text.find("ACTION") else {
        return true;
    };
    let rest = text[at + "ACTION".len()..].trim_start_matches([' ', '\t']);
    let verb_len = rest
        .find(|c: char| !c.is_ascii_alphabetic())
        .unwrap_or(rest.len());
    let verb = rest[..verb_len].to_ascii_lowercase();
    if !ID_VERBS.contains(&verb.as_str()) {
        return true;
    }
    let after = &rest[verb_len..];
    let slot = after.trim_start_matches([' ', '\t']);
    if slot.len() == after.len() {
        // the verb runs on into something other than a space (or nothing yet)
        return true;
    }
    let n = slot
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(slot.len());
    let digits = &slot[..n];
    if digits.is_empty() {
        return true;
    }
    if n < slot.len() {
        candidates.iter().any(|c| c == digits)
    } else {
        candidates.iter().any(|c| c.starts_with(digits))
    }
}

/// Whether the next token can matter to the id slot of `text`: the first `ACTION` of the reply
/// is followed only by letters, spaces and digits so far (a verb being written, or the slot).
pub fn id_slot_open(text: &str) -> bool {
    text.find("ACTION").is_some_and(|at| {
        text[at + "ACTION".len()..]
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == ' ' || c == '\t')
    })
}

/// The numbers in `text` (maximal runs of ASCII digits), in order of first appearance, each
/// once: the candidates of [`SamplerParams::id_slot`].
pub fn numbers_in(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for run in text.split(|c: char| !c.is_ascii_digit()) {
        if !run.is_empty() && !out.iter().any(|o| o == run) {
            out.push(run.to_string());
        }
    }
    out
}

/// Where the behaviour distribution of one sampled token put its mass, relative to the
/// tempered softmax over the whole vocabulary: what the learner needs to recompute the
/// behaviour log-prob from the logits alone (docs/algorithms.md §6). Stored per token with the
/// turn; `Support::default()` (nothing kept, dropped or truncated) is the whole tempered softmax.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Support {
    /// the only tokens with mass, when there are few of them (top-k, a greedy digit, an id
    /// slot that only digits may fill); the distribution is the tempered softmax over them
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<Vec<u32>>,
    /// tokens masked before sampling (the id slot's disallowed digits, ignored end tokens)
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub drop: Vec<u32>,
    /// top-p kept the `n` highest tempered logits of those not dropped (large kept sets only;
    /// the learner recovers the set by rank from its own logits)
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_n: Option<u32>,
}

/// Kept sets of at most this many tokens are stored as a list ([`Support::keep`]).
pub const SUPPORT_KEEP_MAX: usize = 64;

impl Support {
    /// The whole tempered softmax.
    pub fn is_full(&self) -> bool {
        self.keep.is_none() && self.drop.is_empty() && self.top_n.is_none()
    }

    /// The support of `dist` (a [`distribution`] over `n_vocab` entries) drawn from logits where
    /// the entries `dropped` were masked.
    pub fn of(dist: &[(i32, f64)], n_vocab: usize, dropped: Vec<u32>) -> Support {
        let live = dist.iter().filter(|d| d.1 > 0.0).count();
        let avail = n_vocab.saturating_sub(dropped.len());
        if live <= SUPPORT_KEEP_MAX && live < avail {
            let mut keep: Vec<u32> = dist
                .iter()
                .filter(|d| d.1 > 0.0)
                .map(|d| d.0 as u32)
                .collect();
            keep.sort_unstable();
            return Support {
                keep: Some(keep),
                ..Support::default()
            };
        }
        let top_n = (live < avail).then_some(live as u32);
        Support {
            keep: None,
            drop: dropped,
            top_n,
        }
    }

    /// The entries of a logit row `z` (already divided by the temperature) outside the support:
    /// every index `i` with `out[i]` true gets no mass. `z` decides `top_n` by rank (ties: the
    /// lower id, as the sampler breaks them).
    pub fn excluded(&self, z: &[f32]) -> Vec<bool> {
        let n = z.len();
        if let Some(keep) = &self.keep {
            let mut out = vec![true; n];
            for &k in keep {
                if let Some(o) = out.get_mut(k as usize) {
                    *o = false;
                }
            }
            return out;
        }
        let mut out = vec![false; n];
        for &d in &self.drop {
            if let Some(o) = out.get_mut(d as usize) {
                *o = true;
            }
        }
        if let Some(top) = self.top_n {
            let mut idx: Vec<usize> = (0..n).filter(|&i| !out[i]).collect();
            let top = (top as usize).min(idx.len());
            if top < idx.len() {
                idx.select_nth_unstable_by(top, |&a, &b| z[b].total_cmp(&z[a]).then(a.cmp(&b)));
                for &i in &idx[top..] {
                    out[i] = true;
                }
            }
        }
        out
    }
}

/// A deterministic SplitMix64 random stream.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream from a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, 1)` with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    /// the token id
    pub token: i32,
    /// log-prob under the truncated, tempered distribution it was drawn from
    pub logp_behavior: f32,
    /// log-prob under the full softmax at temperature 1
    pub logp_full: f32,
}

/// `e^x` for `x <= 0` in f32, branch-free so the compiler vectorises loops over it: split
/// `x = n·ln2 + r` with |r| <= ln2/2, a degree-6 Taylor polynomial for `e^r` (relative error
/// below 3e-7 on the whole range, tested), and `2^n` built in the exponent bits.
#[inline]
fn exp_nonpositive(x: f32) -> f32 {
    let x = x.max(-87.0);
    // round to nearest by the 1.5·2^23 trick (no libm call, so the loop vectorises)
    const MAGIC: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + MAGIC) - MAGIC;
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// `log Σ exp(x)`: f32 partial sums over blocks of 256 (eight lanes of 32 terms), added in f64.
pub fn logsumexp(x: &[f32]) -> f64 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !m.is_finite() {
        return m as f64;
    }
    let mut total = 0f64;
    for block in x.chunks(256) {
        let mut lanes = [0f32; 8];
        let chunks = block.chunks_exact(8);
        let tail: f32 = chunks
            .remainder()
            .iter()
            .map(|&v| exp_nonpositive(v - m))
            .sum();
        for c in chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += exp_nonpositive(v - m);
            }
        }
        total += lanes.iter().map(|&l| f64::from(l)).sum::<f64>() + f64::from(tail);
    }
    m as f64 + total.ln()
}

/// The distribution the sampler draws from: candidates in descending logit order with their
/// renormalised probabilities. Greedy (`temperature <= 0`) is the single arg-max.
pub fn distribution(logits: &[f32], p: &SamplerParams) -> Vec<(i32, f64)> {
    let desc = |a: &(i32, f32), b: &(i32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    if p.temperature <= 0.0 {
        let best = top_k(logits, 1).first().copied().unwrap_or((0, 0.0));
        return vec![(best.0, 1.0)];
    }
    let mut cand = if p.top_k > 0 && p.top_k < logits.len() {
        top_k(logits, p.top_k)
    } else {
        logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as i32, l))
            .collect()
    };
    cand.sort_unstable_by(desc);
    let t = p.temperature as f64;
    let m = cand[0].1 as f64 / t;
    let mut probs: Vec<f64> = cand.iter().map(|c| (c.1 as f64 / t - m).exp()).collect();
    let z: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|q| *q /= z);
    let mut keep = probs.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, q) in probs.iter().enumerate() {
            cum += q;
            if cum >= p.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    let z: f64 = probs[..keep].iter().sum();
    cand[..keep]
        .iter()
        .zip(&probs[..keep])
        .map(|(c, q)| (c.0, q / z))
        .collect()
}

/// The `k` largest logits (ties broken by the lower token id), in no particular order, in one
/// pass: a candidate replaces the current minimum of the kept set only when it beats it.
/// The `k` largest logits with their token ids (ties: the lower id), in no particular order.
pub(crate) fn top_k(logits: &[f32], k: usize) -> Vec<(i32, f32)> {
    let better = |a: (i32, f32), b: (i32, f32)| a.1 > b.1 || (a.1 == b.1 && a.0 < b.0);
    let mut kept: Vec<(i32, f32)> = logits
        .iter()
        .take(k)
        .enumerate()
        .map(|(i, &l)| (i as i32, l))
        .collect();
    let argmin = |v: &[(i32, f32)]| {
        (0..v.len())
            .reduce(|m, i| if better(v[m], v[i]) { i } else { m })
            .unwrap_or(0)
    };
    let mut worst = argmin(&kept);
    for (i, &l) in logits.iter().enumerate().skip(k) {
        if l > kept[worst].1 {
            kept[worst] = (i as i32, l);
            worst = argmin(&kept);
        }
    }
    kept
}

/// [`distribution`] with [`SamplerParams::greedy_digits`]: the single arg-max when it is a token
/// for which `is_digit` holds, else the usual distribution.
pub fn distribution_with(
    logits: &[f32],
    p: &SamplerParams,
    is_digit: &dyn Fn(i32) -> bool,
) -> Vec<(i32, f64)> {
    if p.greedy_digits && p.temperature > 0.0 {
        if let Some(&(best, _)) = top_k(logits, 1).first() {
            if is_digit(best) {
                return vec![(best, 1.0)];
            }
        }
    }
    distribution(logits, p)
}

/// Draws one token from `logits` with settings `p`.
pub fn sample(logits: &[f32], p: &SamplerParams, rng: &mut Rng) -> Sampled {
    sample_with(logits, p, rng, &|_| false)
}

/// [`sample`] from [`distribution_with`].
pub fn sample_with(
    logits: &[f32],
    p: &SamplerParams,
    rng: &mut Rng,
    is_digit: &dyn Fn(i32) -> bool,
) -> Sampled {
    sample_dist(logits, &distribution_with(logits, p, is_digit), rng)
}

/// Draws one token from `dist`, the distribution [`distribution_with`] made of `logits`.
pub fn sample_dist(logits: &[f32], dist: &[(i32, f64)], rng: &mut Rng) -> Sampled {
    let u = rng.next_f64();
    let mut cum = 0.0;
    let mut pick = dist[dist.len() - 1];
    for &(tok, q) in dist {
        cum += q;
        if u < cum {
            pick = (tok, q);
            break;
        }
    }
    let lse = logsumexp(logits);
    Sampled {
        token: pick.0,
        logp_behavior: pick.1.ln() as f32,
        logp_full: (logits[pick.0 as usize] as f64 - lse) as f32,
    }
}

/// The behaviour log-prob of `token` under settings `p` (`None` when truncation excludes it).
pub fn behavior_logprob(logits: &[f32], p: &SamplerParams, token: i32) -> Option<f64> {
    behavior_logprob_with(logits, p, token, &|_| false)
}

/// [`behavior_logprob`] under [`distribution_with`].
pub fn behavior_logprob_with(
    logits: &[f32],
    p: &SamplerParams,
    token: i32,
    is_digit: &dyn Fn(i32) -> bool,
) -> Option<f64> {
    distribution_with(logits, p, is_digit)
        .into_iter()
        .find(|&(t, _)| t == token)
        .map(|(_, q)| q.ln())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f32, top_p: f32, top_k: usize) -> SamplerParams {
        SamplerParams {
            temperature: t,
            top_p,
            top_k,
            ..Default::default()
        }
    }

    #[test]
    fn hand_computed_distribution() {
        // logits ln(4), ln(2), ln(1), ln(1): softmax = .5 .25 .125 .125
        let l = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
        let d = distribution(&l, &params(1.0, 1.0, 0));
        assert_eq!(d.iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!((d[0].1 - 0.5).abs() < 1e-9 && (d[3].1 - 0.125).abs() < 1e-9);
        // top-p 0.7: keeps .5 + .25 (cum .75 >= .7) -> renormalised 2/3, 1/3
        let d = distribution(&l, &params(1.0, 0.7, 0));
        assert_eq!(d.len(), 2);
        assert!((d[0].1 - 2.0 / 3.0).abs() < 1e-9);
        // top-k 3 then T = 0.5: weights 16, 4, 1 over 21
        let d = distribution(&l, &params(0.5, 1.0, 3));
        assert_eq!(d.len(), 3);
        assert!((d[0].1 - 16.0 / 21.0).abs() < 1e-6 && (d[2].1 - 1.0 / 21.0).abs() < 1e-6);
        // greedy
        assert_eq!(distribution(&l, &params(0.0, 1.0, 0)), vec![(0, 1.0)]);
    }

    #[test]
    fn sampled_logprobs_match_the_distribution() {
        let l = [1.0f32, 3.0, 2.0, -1.0, 0.5];
        let p = params(0.7, 0.9, 4);
        let mut rng = Rng::new(7);
        for _ in 0..50 {
            let s = sample(&l, &p, &mut rng);
            let b = behavior_logprob(&l, &p, s.token).unwrap();
            assert!((s.logp_behavior as f64 - b).abs() < 1e-6);
            let full = l[s.token as usize] as f64 - logsumexp(&l);
            assert!((s.logp_full as f64 - full).abs() < 1e-6);
        }
        assert_eq!(behavior_logprob(&l, &p, 3), None, "excluded by top-k");
    }

    #[test]
    fn same_seed_same_draws_and_frequencies_follow_probabilities() {
        let l = [0.0f32, 1.0f32.ln() + 1.0, 2.0];
        let p = params(1.0, 1.0, 0);
        let draws = |seed| {
            let mut r = Rng::new(seed);
            (0..20)
                .map(|_| sample(&l, &p, &mut r).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(draws(3), draws(3));
        assert_ne!(draws(3), draws(4));
        let mut r = Rng::new(1);
        let n = 20000;
        let hits = (0..n).filter(|_| sample(&l, &p, &mut r).token == 2).count();
        let want = 2f64.exp() / (1.0 + 1f64.exp() + 2f64.exp());
        assert!(((hits as f64 / n as f64) - want).abs() < 0.015);
    }

    #[test]
    fn top_k_keeps_the_largest_and_the_lowest_id_on_ties() {
        let l = [0.5f32, 3.0, -1.0, 3.0, 2.0, 0.5];
        let mut k = top_k(&l, 3);
        k.sort_by_key(|c| c.0);
        assert_eq!(k, vec![(1, 3.0), (3, 3.0), (4, 2.0)]);
        let d = distribution(&l, &params(1.0, 1.0, 5));
        assert_eq!(
            d.iter().map(|c| c.0).collect::<Vec<_>>(),
            vec![1, 3, 4, 0, 5]
        );
        assert_eq!(distribution(&l, &params(0.0, 1.0, 0))[0].0, 1);
    }

    #[test]
    fn id_slot_takes_only_numbers_of_the_conversation() {
        let c = numbers_in("It's order 17694, I paid 23 dollars for 2 lamps (order 17694).");
        assert_eq!(c, vec!["17694", "23", "2"]);
        // outside an id-taking action line anything goes
        for t in [
            "Could you give me 99999?",
            "ACTION decline 55555",
            "ACTIONS 3",
            "",
        ] {
            assert!(id_slot_allows(t, &c), "{t}");
        }
        // an open slot: prefixes of a candidate only
        assert!(id_slot_allows("ACTION status 1769", &c));
        assert!(id_slot_allows("ACTION  refund\t2", &c));
        assert!(!id_slot_allows("ACTION status 1768", &c));
        assert!(!id_slot_allows("ACTION status 8", &c));
        // a closed slot: a whole candidate only
        assert!(id_slot_allows("ACTION cancel 17694\nThanks", &c));
        assert!(id_slot_allows("ACTION cancel 23.", &c));
        assert!(!id_slot_allows("ACTION cancel 1769.", &c));
        assert!(!id_slot_allows("ACTION status 176944", &c));
        // only the first digit run is the slot (an address's street number is free)
        assert!(id_slot_allows("ACTION address 17694 7 Harbour Road", &c));
        // no digits in the slot: a malformed call, allowed
        assert!(id_slot_allows("ACTION status please", &c));
        assert!(id_slot_allows("ACTION status", &c));
        assert!(id_slot_allows("ACTION status\n", &c));
        // no candidates: no digit at all
        assert!(!id_slot_allows("ACTION status 1", &[]));
        assert!(id_slot_allows("ACTION status ", &[]));
        // only the first ACTION line counts, as for the parser
        assert!(id_slot_allows("ACTION status 17694\nACTION refund 5", &c));
        assert!(id_slot_open("Sure. ACTION stat"));
        assert!(id_slot_open("ACTION status 176"));
        assert!(!id_slot_open("ACTION status 17694."));
        assert!(!id_slot_open("no action here"));
    }

    /// The support recorded for each kind of sampler, and the behaviour log-prob recomputed
    /// from it: `log_softmax(z / T)` over the entries [`Support::excluded`] leaves.
    #[test]
    fn support_recovers_the_behaviour_distribution() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 3.0, 0.0];
        let recompute = |logits: &[f32], p: &SamplerParams, sup: &Support, tok: usize| {
            // a greedy turn is learned at temperature 1 over its one kept token
            let t = if p.temperature > 0.0 {
                p.temperature
            } else {
                1.0
            };
            let z: Vec<f32> = logits.iter().map(|l| l / t).collect();
            let ex = sup.excluded(&z);
            let kept: Vec<f32> = z
                .iter()
                .zip(&ex)
                .filter(|(_, e)| !**e)
                .map(|(z, _)| *z)
                .collect();
            f64::from(z[tok]) - logsumexp(&kept)
        };
        let cases = [
            (params(0.7, 1.0, 0), vec![]),     // whole tempered softmax
            (params(0.7, 1.0, 3), vec![]),     // top-k: kept set stored
            (params(0.7, 0.8, 0), vec![]),     // top-p: kept by rank
            (params(0.7, 1.0, 0), vec![1, 3]), // masked entries (an id slot)
            (params(0.0, 1.0, 0), vec![]),     // greedy: a point mass
        ];
        for (p, dropped) in cases {
            let mut masked = logits;
            for &d in &dropped {
                masked[d as usize] = f32::NEG_INFINITY;
            }
            let dist = distribution(&masked, &p);
            let sup = Support::of(&dist, logits.len(), dropped.clone());
            for &(tok, q) in dist.iter().filter(|d| d.1 > 0.0) {
                let got = recompute(&logits, &p, &sup, tok as usize);
                assert!(
                    (got - q.ln()).abs() < 1e-6,
                    "{p:?} {sup:?}: {got} vs {}",
                    q.ln()
                );
            }
        }
        // what is stored: nothing for the whole softmax, a list for small kept sets
        let full = distribution(&logits, &params(0.7, 1.0, 0));
        assert!(Support::of(&full, 6, vec![]).is_full());
        let top = Support::of(&distribution(&logits, &params(0.7, 1.0, 3)), 6, vec![]);
        assert_eq!(top.keep, Some(vec![0, 1, 4]));
        let greedy = Support::of(&distribution(&logits, &params(0.0, 1.0, 0)), 6, vec![]);
        assert_eq!(greedy.keep, Some(vec![4]));
        // a large top-p kept set is stored as its size
        let wide: Vec<f32> = (0..200).map(|i| -(i as f32) * 0.01).collect();
        let nucleus = Support::of(&distribution(&wide, &params(1.0, 0.9, 0)), 200, vec![]);
        assert!(nucleus.keep.is_none() && nucleus.top_n.is_some_and(|n| n > 64 && n < 200));
        for &(tok, q) in &distribution(&wide, &params(1.0, 0.9, 0)) {
            let got = recompute(&wide, &params(1.0, 0.9, 0), &nucleus, tok as usize);
            assert!((got - q.ln()).abs() < 1e-5, "nucleus: {got} vs {}", q.ln());
        }
    }

    #[test]
    fn greedy_digits_take_the_argmax_digit_and_sample_the_rest() {
        // tokens 0..4; token 2 is a digit
        let digit = |t: i32| t == 2;
        let mut p = params(0.7, 1.0, 0);
        p.greedy_digits = true;
        // arg-max is the digit: a point mass, behaviour log-prob 0, full log-prob unchanged
        let l = [0.0f32, 1.0, 3.0, 0.5];
        assert_eq!(distribution_with(&l, &p, &digit), vec![(2, 1.0)]);
        let mut rng = Rng::new(5);
        for _ in 0..20 {
            let s = sample_with(&l, &p, &mut rng, &digit);
            assert_eq!((s.token, s.logp_behavior), (2, 0.0));
            assert!((s.logp_full as f64 - (3.0 - logsumexp(&l))).abs() < 1e-6);
        }
        assert_eq!(behavior_logprob_with(&l, &p, 1, &digit), None);
        // arg-max is a word: the tempered distribution, digits included
        let l = [0.0f32, 3.0, 2.5, 0.5];
        assert_eq!(distribution_with(&l, &p, &digit), distribution(&l, &p));
        let b = behavior_logprob_with(&l, &p, 2, &digit).unwrap();
        let want = (2.5f64 / 0.7) - logsumexp(&l.map(|x| x / 0.7));
        assert!((b - want).abs() < 1e-6, "{b} {want}");
        // off: the usual distribution even at a digit arg-max
        p.greedy_digits = false;
        let l = [0.0f32, 1.0, 3.0, 0.5];
        assert_eq!(distribution_with(&l, &p, &digit), distribution(&l, &p));
    }

    #[test]
    fn fast_exp_is_accurate() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x <= 0.0 {
            let want = (x as f64).exp();
            let got = exp_nonpositive(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.001_3;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert!(exp_nonpositive(-1000.0) < 1e-37);
    }

    #[test]
    fn logsumexp_is_stable() {
        assert!((logsumexp(&[1000.0, 1000.0]) - (1000.0 + 2f64.ln())).abs() < 1e-9);
    }
}
