//! Advantages (docs/algorithms.md §1, §3): pure functions over plain arrays.

use std::collections::HashMap;
use std::hash::Hash;

pub use super::diagnostics::{AdvantageBalance, KindBalance};

/// `z(x)` inside groups: `(x − mean) / (sqrt(var + 1e-8) + 1e-6)`; a group with one member gets 0.
/// With `scale = false` (Dr.GRPO) the result is only centred. Two passes (the mean, then the
/// squared deviations from it): the one-pass `E[x²] − E[x]²` loses every digit of the spread
/// when the values share a large offset.
pub fn group_normalize<G: Hash + Eq + Clone>(x: &[f64], groups: &[G], scale: bool) -> Vec<f64> {
    let mut sum: HashMap<G, (f64, usize)> = HashMap::new();
    for (v, g) in x.iter().zip(groups) {
        let e = sum.entry(g.clone()).or_insert((0.0, 0));
        e.0 += v;
        e.1 += 1;
    }
    let mean = |g: &G| {
        let (s, n) = sum[g];
        s / n as f64
    };
    let mut sq: HashMap<G, f64> = HashMap::new();
    for (v, g) in x.iter().zip(groups) {
        *sq.entry(g.clone()).or_insert(0.0) += (v - mean(g)).powi(2);
    }
    x.iter()
        .zip(groups)
        .map(|(v, g)| {
            let n = sum[g].1;
            if n < 2 {
                return 0.0;
            }
            let m = mean(g);
            if scale {
                let var = sq[g] / n as f64;
                (v - m) / ((var + 1e-8).sqrt() + 1e-6)
            } else {
                v - m
            }
        })
        .collect()
}

/// DAPO dynamic sampling: false for members of groups whose rewards are all equal.
pub fn informative_groups<G: Hash + Eq + Clone>(rewards: &[f64], groups: &[G]) -> Vec<bool> {
    let mut range: HashMap<G, (f64, f64)> = HashMap::new();
    for (r, g) in rewards.iter().zip(groups) {
        let e = range
            .entry(g.clone())
            .or_insert((f64::INFINITY, f64::NEG_INFINITY));
        e.0 = e.0.min(*r);
        e.1 = e.1.max(*r);
    }
    groups.iter().map(|g| range[g].1 > range[g].0).collect()
}

/// A²TGPO turn-level advantages (§3). `signal[i][t]` is the per-turn process signal of session
/// `i` (information gain or success contribution) for its assistant turns `t = 0..T_i`;
/// `r_hat[i]` the normalised outcome. Returns `(Â, îg)` per session and turn:
/// `îg` is `z(signal)` (only centred with `scale = false`, the switch that governs the outcome's
/// std division too) within the turn group `(g_i, t)` of **process turns only**: a session's
/// final turn joins no turn group (its signal carries the outcome, on another scale, and would
/// credit a longer group-mate's process turn with this session's ending) and gets `îg = 0`;
/// process turns get
/// `α · Σ_{k=t}^{T−2} γ^{k−t} îg_k / √(T − 1 − t) + R̂`, the final turn gets `R̂`.
pub fn a2tgpo<G: Hash + Eq + Clone>(
    signal: &[Vec<f64>],
    groups: &[G],
    r_hat: &[f64],
    gamma: f64,
    alpha: f64,
    scale: bool,
) -> (Vec<Vec<f64>>, Vec<Vec<f64>>) {
    // turn-group normalisation over (group, turn index) of the process turns only
    let mut flat = Vec::new();
    let mut keys = Vec::new();
    for (i, s) in signal.iter().enumerate() {
        for (t, v) in s.iter().enumerate().take(s.len().saturating_sub(1)) {
            flat.push(*v);
            keys.push((groups[i].clone(), t));
        }
    }
    let z = group_normalize(&flat, &keys, scale);
    let mut ig_hat = Vec::with_capacity(signal.len());
    let mut k = 0;
    for s in signal {
        let n = s.len().saturating_sub(1);
        let mut row = z[k..k + n].to_vec();
        if !s.is_empty() {
            row.push(0.0); // the final turn: R̂ and c = 1, no turn group
        }
        ig_hat.push(row);
        k += n;
    }
    let adv = ig_hat
        .iter()
        .zip(r_hat)
        .map(|(ig, &r)| {
            let n = ig.len();
            (0..n)
                .map(|t| {
                    if t + 1 == n {
                        return r;
                    }
                    // process turns: discounted sum over the process turns t..n-2
                    let d: f64 = (t..n - 1).map(|k| gamma.powi((k - t) as i32) * ig[k]).sum();
                    alpha * d / ((n - 1 - t) as f64).sqrt() + r
                })
                .collect()
        })
        .collect();
    (adv, ig_hat)
}

/// How the outcome and the process signal share a batch's turn advantages (A²TGPO-style
/// estimators: `Â_{i,t} = R̂_i + process_{i,t}`). `kind(i, t)` names the kind of session `i`'s
/// process turn `t` (its signal and position) for the per-kind rows.
///
/// - `outcome_share` = `Σ|R̂_i| / Σ(|R̂_i| + |Â_{i,t} − R̂_i|)` over every turn;
/// - a process turn (any turn but its session's last) *contradicts* its outcome when
///   `R̂_i ≠ 0` and `Â_{i,t}` has the other sign (or is 0): the update then pushes the turn
///   against what its session's ending says. Turns of sessions with `R̂ = 0` are not counted.
pub fn advantage_balance(
    adv: &[Vec<f64>],
    r_hat: &[f64],
    kind: impl Fn(usize, usize) -> String,
) -> AdvantageBalance {
    let (mut outcome, mut process) = (0.0, 0.0);
    let mut kinds: std::collections::BTreeMap<String, (usize, usize)> = Default::default();
    let (mut turns, mut against) = (0, 0);
    for (i, (a, &r)) in adv.iter().zip(r_hat).enumerate() {
        for (t, &x) in a.iter().enumerate() {
            outcome += r.abs();
            process += (x - r).abs();
            if t + 1 == a.len() || r == 0.0 {
                continue;
            }
            let contradicts = x * r <= 0.0;
            let e = kinds.entry(kind(i, t)).or_default();
            e.0 += 1;
            turns += 1;
            if contradicts {
                e.1 += 1;
                against += 1;
            }
        }
    }
    let total = outcome + process;
    AdvantageBalance {
        outcome_share: if total > 0.0 { outcome / total } else { 0.0 },
        process_turns: turns,
        contradicting: against,
        by_kind: kinds
            .into_iter()
            .map(|(kind, (turns, contradicting))| KindBalance {
                kind,
                turns,
                contradicting,
            })
            .collect(),
    }
}

/// GiGPO / SLEA-RL step advantages (§3): `A = R̂ + ω · A_step`, where `A_step` is the z-score of
/// the discounted return-to-go `Σ_{k≥t} γ^{k−t} r_k` among the steps that share a step key
/// (same group, same observation) — steps with a unique observation get `A_step = 0`.
pub fn gigpo<G: Hash + Eq + Clone, K: Hash + Eq + Clone>(
    rewards: &[Vec<f64>],
    step_keys: &[Vec<K>],
    groups: &[G],
    r_hat: &[f64],
    gamma: f64,
    omega: f64,
) -> Vec<Vec<f64>> {
    let mut flat = Vec::new();
    let mut keys = Vec::new();
    for (i, r) in rewards.iter().enumerate() {
        let mut ret = vec![0.0; r.len()];
        let mut acc = 0.0;
        for t in (0..r.len()).rev() {
            acc = r[t] + gamma * acc;
            ret[t] = acc;
        }
        for (t, v) in ret.into_iter().enumerate() {
            flat.push(v);
            keys.push((groups[i].clone(), step_keys[i][t].clone()));
        }
    }
    let z = group_normalize(&flat, &keys, true);
    let mut out = Vec::with_capacity(rewards.len());
    let mut k = 0;
    for (i, r) in rewards.iter().enumerate() {
        out.push((0..r.len()).map(|t| r_hat[i] + omega * z[k + t]).collect());
        k += r.len();
    }
    out
}

/// GiGPO's step groups (§3): per session and assistant turn, the index of the step group its
/// observation belongs to — the observation being what the environment said just before the
/// turn (the user or tool messages since the previous assistant turn), as token ids. Inside one
/// group key, an observation joins the first step group whose leader it matches: identical
/// tokens at `threshold >= 1`, else a token-multiset Jaccard similarity of at least
/// `threshold`. The turn index plays no part: the same tool answer at turn 1 of one session
/// and turn 3 of another is one anchor state.
pub fn observation_groups<G: Hash + Eq + Clone>(
    observations: &[Vec<Vec<i32>>],
    groups: &[G],
    threshold: f64,
) -> Vec<Vec<usize>> {
    let mut leaders: Vec<(G, &[i32])> = Vec::new();
    observations
        .iter()
        .zip(groups)
        .map(|(obs, g)| {
            obs.iter()
                .map(|o| {
                    let found = leaders.iter().position(|(lg, lo)| {
                        lg == g
                            && if threshold >= 1.0 {
                                *lo == o.as_slice()
                            } else {
                                jaccard(lo, o) >= threshold
                            }
                    });
                    found.unwrap_or_else(|| {
                        leaders.push((g.clone(), o.as_slice()));
                        leaders.len() - 1
                    })
                })
                .collect()
        })
        .collect()
}

/// Jaccard similarity of two token multisets (1 for two empty ones).
pub fn jaccard(a: &[i32], b: &[i32]) -> f64 {
    let mut count: HashMap<i32, (usize, usize)> = HashMap::new();
    for &x in a {
        count.entry(x).or_default().0 += 1;
    }
    for &x in b {
        count.entry(x).or_default().1 += 1;
    }
    let (inter, union) = count
        .values()
        .fold((0, 0), |(i, u), &(x, y)| (i + x.min(y), u + x.max(y)));
    if union == 0 {
        1.0
    } else {
        inter as f64 / union as f64
    }
}

/// The live-traffic fallback of §7: members of groups with fewer than `min_size` sessions are
/// moved into one batch-wide group named `fallback`. Returns the new keys and, per session,
/// whether it was moved (those sessions take the value head as their outcome baseline).
pub fn merge_small_groups(
    groups: &[String],
    min_size: usize,
    fallback: &str,
) -> (Vec<String>, Vec<bool>) {
    let mut count: HashMap<&str, usize> = HashMap::new();
    for g in groups {
        *count.entry(g.as_str()).or_default() += 1;
    }
    groups
        .iter()
        .map(|g| {
            if count[g.as_str()] < min_size {
                (fallback.to_string(), true)
            } else {
                (g.clone(), false)
            }
        })
        .unzip()
}

/// The outcome advantage of sessions in the fallback group (§7): they were not rollouts of one
/// prompt, so their outcomes are compared against the value head's estimate of their opening
/// state, `R − V(s_0)` (both on the `[0, 1]` success scale), then normalised across the
/// fallback group like any group (`scale = false`: only centred). A lone member keeps `R − V`.
pub fn baseline_advantage(success: &[f64], opening_value: &[f64], scale: bool) -> Vec<f64> {
    let resid: Vec<f64> = success
        .iter()
        .zip(opening_value)
        .map(|(r, v)| r - v)
        .collect();
    if resid.len() < 2 {
        return resid;
    }
    group_normalize(&resid, &vec![0u8; resid.len()], scale)
}

/// The seed article's windowed turn-group GAE (§3): the session is cut into windows of
/// `window` turns; inside a window, `δ_t = r_t + γ·V_{t+1} − V_t` with `V` at the window's end
/// bootstrapped from the value head (`values[end]`, 0 at the session's end), and
/// `A_t = Σ_l (γλ)^l δ_{t+l}` without crossing the window boundary.
pub fn windowed_gae(
    rewards: &[f64],
    values: &[f64],
    window: usize,
    gamma: f64,
    lambda: f64,
) -> Vec<f64> {
    let n = rewards.len();
    let window = window.max(1);
    let mut adv = vec![0.0; n];
    let mut start = 0;
    while start < n {
        let end = (start + window).min(n);
        let mut acc = 0.0;
        for t in (start..end).rev() {
            let next = if t + 1 < n { values[t + 1] } else { 0.0 };
            let delta = rewards[t] + gamma * next - values[t];
            acc = if t + 1 == end {
                delta
            } else {
                delta + gamma * lambda * acc
            };
            adv[t] = acc;
        }
        start = end;
    }
    adv
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpo_and_dr_grpo_by_hand() {
        // group a: 1, 0 -> mean .5, std .5 -> ±(0.5 / (0.5 + 1e-6 + ~1e-8))
        let z = group_normalize(&[1.0, 0.0, 3.0], &["a", "a", "b"], true);
        assert!((z[0] - 0.999_998).abs() < 1e-5 && (z[1] + 0.999_998).abs() < 1e-5);
        assert_eq!(z[2], 0.0, "a singleton group gets 0");
        let c = group_normalize(&[1.0, 0.0, 2.0], &["a", "a", "a"], false);
        assert_eq!(c, vec![0.0, -1.0, 1.0]);
        assert_eq!(
            informative_groups(&[1.0, 1.0, 0.0, 1.0], &[1, 1, 2, 2]),
            vec![false, false, true, true]
        );
    }

    /// The demo's reason for Dr.GRPO: a group where every rollout failed and only the format
    /// term differs (0, −0.1, −0.1, −0.2) gets advantages as large as a group with one success
    /// when divided by its std, and ten times smaller when only centred.
    #[test]
    fn format_only_groups_weigh_little_without_std_division() {
        let r = [0.0, -0.1, -0.1, -0.2, 1.0, 0.0, 0.0, 0.0];
        let g = [0, 0, 0, 0, 1, 1, 1, 1];
        let z = group_normalize(&r, &g, true);
        // both groups: the best member is +√2 (fail group) and +√3 (success group) std above
        assert!((z[0] - 2f64.sqrt()).abs() < 1e-4 && (z[4] - 3f64.sqrt()).abs() < 1e-4);
        let c = group_normalize(&r, &g, false);
        // centred: +0.1 for the tidiest failure, +0.75 for the success
        assert!((c[0] - 0.1).abs() < 1e-12 && (c[4] - 0.75).abs() < 1e-12);
        assert!((c[3] + 0.1).abs() < 1e-12 && (c[5] + 0.25).abs() < 1e-12);
    }

    #[test]
    fn gigpo_by_hand() {
        // two sessions in one group; both start from the same observation "o0", then diverge
        let rewards = vec![vec![0.0, 1.0], vec![0.0, 0.0]];
        let keys = vec![vec!["o0", "a"], vec!["o0", "b"]];
        let a = gigpo(&rewards, &keys, &["g", "g"], &[0.5, -0.5], 0.5, 1.0);
        // returns at o0: 0 + 0.5·1 = 0.5 and 0 -> z = ±1 (to 1e-5); unique later steps get 0
        assert!((a[0][0] - 1.5).abs() < 1e-5 && (a[1][0] + 1.5).abs() < 1e-5);
        assert_eq!(a[0][1], 0.5);
        assert_eq!(a[1][1], -0.5);
    }

    #[test]
    fn windowed_gae_by_hand() {
        // 3 turns, window 2, γ = 1, λ = 0.5; reward only at the end
        let r = [0.0, 0.0, 1.0];
        let v = [0.2, 0.4, 0.6];
        let a = windowed_gae(&r, &v, 2, 1.0, 0.5);
        // window [0, 2): δ1 = 0 + V2 − V1 = 0.2 (bootstrap V2), δ0 = 0 + 0.4 − 0.2 = 0.2
        // A1 = 0.2, A0 = 0.2 + 0.5·0.2 = 0.3; window [2, 3): A2 = 1 + 0 − 0.6 = 0.4
        assert!(
            (a[0] - 0.3).abs() < 1e-12 && (a[1] - 0.2).abs() < 1e-12 && (a[2] - 0.4).abs() < 1e-12
        );
        // window 1: every turn is its own window
        let b = windowed_gae(&r, &v, 1, 1.0, 0.5);
        assert!((b[0] - 0.2).abs() < 1e-12 && (b[1] - 0.2).abs() < 1e-12);
    }

    /// The case: two successful sessions of one group with signals [0.2, 3.0] and
    /// [0.2, 0.5, 2.0]. Only process turns form turn groups: turn 0 holds (0.2, 0.2) → 0, turn
    /// 1 holds only the longer session's 0.5 (the shorter one's final 3.0 stays out) → 0. With
    /// equal outcomes (R̂ = 0) every advantage is 0 and every final-turn îg is 0.
    #[test]
    fn unequal_lengths_keep_final_turns_out_of_turn_groups() {
        let sig = vec![vec![0.2, 3.0], vec![0.2, 0.5, 2.0]];
        let (adv, ig) = a2tgpo(&sig, &["g", "g"], &[0.0, 0.0], 1.0, 1.0, true);
        for a in adv.iter().flatten() {
            assert!(a.abs() < 1e-12, "{adv:?}");
        }
        assert_eq!(ig, vec![vec![0.0, 0.0], vec![0.0, 0.0, 0.0]]);
        // before the fix, (g, 1) held 3.0 and 0.5: the longer session's turn 1 got îg = −1 and
        // its turn 0 an advantage of −1/√2
        let sig = vec![vec![1.0, 9.0], vec![0.0, 2.0, 7.0], vec![0.0, 4.0, 1.0]];
        let (adv, ig) = a2tgpo(&sig, &["g", "g", "g"], &[0.0; 3], 1.0, 1.0, true);
        // (g, 0): (1, 0, 0) → z = (√2, −1/√2, −1/√2); (g, 1): (2, 4) → ∓1
        let s2 = 2f64.sqrt();
        assert!((ig[0][0] - s2).abs() < 1e-5 && (ig[1][0] + 1.0 / s2).abs() < 1e-5);
        assert!((ig[1][1] + 1.0).abs() < 1e-5 && (ig[2][1] - 1.0).abs() < 1e-5);
        assert_eq!(ig[0][1], 0.0);
        // session 1: t=0 → (−1/√2 − 1)/√2, t=1 → −1; session 0's only process turn → √2
        assert!((adv[1][0] - (-1.0 / s2 - 1.0) / s2).abs() < 1e-5);
        assert!((adv[1][1] + 1.0).abs() < 1e-5 && (adv[0][0] - s2).abs() < 1e-5);
        assert_eq!(adv[0][1], 0.0);
    }

    /// GiGPO steps are grouped by what they observed, not by turn index: session a sees the
    /// tool answer [7, 8] at turn 1, session b at turn 2; they share a step group, and their
    /// returns-to-go (1 and 0) get ±1 there.
    #[test]
    fn gigpo_groups_equal_observations_at_different_turns() {
        let obs = vec![
            vec![vec![1, 2], vec![7, 8]],
            vec![vec![1, 2], vec![5], vec![7, 8]],
            vec![vec![1, 2], vec![7, 8]],
        ];
        let g = ["g", "g", "h"];
        let keys = observation_groups(&obs, &g, 1.0);
        assert_eq!(keys[0][1], keys[1][2], "same observation, other turn index");
        assert_eq!(keys[0][0], keys[1][0]);
        assert_ne!(keys[1][1], keys[0][1]);
        assert_ne!(
            keys[2][1], keys[0][1],
            "another group key is another step group"
        );
        let rewards = vec![vec![0.0, 1.0], vec![0.0, 0.0, 0.0], vec![0.0, 1.0]];
        let a = gigpo(&rewards, &keys, &g, &[0.0, 0.0, 0.0], 1.0, 1.0);
        assert!((a[0][1] - 1.0).abs() < 1e-5 && (a[1][2] + 1.0).abs() < 1e-5);
        // turn 0 (same opening): returns 1 and 0 → ±1 as well
        assert!((a[0][0] - 1.0).abs() < 1e-5 && (a[1][0] + 1.0).abs() < 1e-5);
        assert_eq!(a[1][1], 0.0, "a unique observation gets no step term");
        // similarity: {1,2,3} vs {1,2,4}: 2 shared of 4 → 0.5
        assert!((jaccard(&[1, 2, 3], &[1, 2, 4]) - 0.5).abs() < 1e-12);
        let near = observation_groups(&[vec![vec![1, 2, 3]], vec![vec![1, 2, 4]]], &g[..2], 0.5);
        assert_eq!(near[0][0], near[1][0]);
        let far = observation_groups(&[vec![vec![1, 2, 3]], vec![vec![1, 2, 4]]], &g[..2], 0.6);
        assert_ne!(far[0][0], far[1][0]);
    }

    /// A session alone in its cluster moves to the batch-wide fallback group and is judged
    /// against the value head: clusters a (2 members) stay, b and c (1 each) merge.
    #[test]
    fn singleton_clusters_fall_back_to_the_batch_group_with_the_value_baseline() {
        let keys: Vec<String> = ["a", "a", "b", "c"].iter().map(|s| s.to_string()).collect();
        let (merged, moved) = merge_small_groups(&keys, 2, "batch");
        assert_eq!(merged, vec!["a", "a", "batch", "batch"]);
        assert_eq!(moved, vec![false, false, true, true]);
        // b succeeded where V said 0.25, c failed where V said 0.5: residuals 0.75, −0.5,
        // centred ±0.625, scaled ±1
        let c = baseline_advantage(&[1.0, 0.0], &[0.25, 0.5], false);
        assert!((c[0] - 0.625).abs() < 1e-12 && (c[1] + 0.625).abs() < 1e-12);
        let z = baseline_advantage(&[1.0, 0.0], &[0.25, 0.5], true);
        assert!((z[0] - 1.0).abs() < 1e-5 && (z[1] + 1.0).abs() < 1e-5);
        // alone: R − V
        assert_eq!(baseline_advantage(&[1.0], &[0.25], true), vec![0.75]);
        // without the fallback the singletons' outcome advantage is 0
        let r = group_normalize(&[1.0, 0.0, 1.0, 0.0], &keys, true);
        assert_eq!((r[2], r[3]), (0.0, 0.0));
    }

    #[test]
    fn a2tgpo_by_hand() {
        // two sessions of one group, three turns each; signals per turn index
        let sig = vec![vec![1.0, 2.0, 9.0], vec![0.0, 0.0, 5.0]];
        let (adv, ig) = a2tgpo(&sig, &["g", "g"], &[0.5, -0.5], 1.0, 1.0, true);
        // turn 0: (1, 0) -> ±1; turn 1: (2, 0) -> ±1
        let one = 1.0 / (1.0 + 1e-6 + 1e-8 / 2.0);
        assert!((ig[0][0] - 1.0).abs() < 1e-5 && (ig[1][1] + 1.0).abs() < 1e-5);
        // session 0, t=0: (1 + 1)/sqrt(2) + 0.5; t=1: 1/1 + 0.5; final: 0.5
        assert!((adv[0][0] - (2.0 * one / 2f64.sqrt() + 0.5)).abs() < 1e-5);
        assert!((adv[0][1] - (one + 0.5)).abs() < 1e-5);
        assert_eq!(adv[0][2], 0.5);
        assert!((adv[1][0] - (-2.0 * one / 2f64.sqrt() - 0.5)).abs() < 1e-5);
        // gamma discounts later turns
        let (adv, _) = a2tgpo(&sig, &["g", "g"], &[0.0, 0.0], 0.5, 0.3, true);
        assert!((adv[0][0] - 0.3 * (one + 0.5 * one) / 2f64.sqrt()).abs() < 1e-5);
    }

    /// Two sessions of one group, R̂ = ±0.5, three turns each: each has one process turn
    /// pushed against its outcome (−0.2 in the success, +0.1 in the failure).
    #[test]
    fn advantage_balance_by_hand() {
        let adv = vec![vec![0.8, -0.2, 0.5], vec![-0.3, 0.1, -0.5], vec![0.4, 0.0]];
        let r = [0.5, -0.5, 0.0];
        let b = advantage_balance(&adv, &r, |_, t| format!("turn {}", t + 1));
        // Σ|R̂| = 6 × 0.5 = 3; process parts 0.3 + 0.7 + 0.2 + 0.6 + 0.4 = 2.2
        assert!((b.outcome_share - 3.0 / 5.2).abs() < 1e-12, "{b:?}");
        assert_eq!((b.process_turns, b.contradicting), (4, 2));
        assert_eq!(b.by_kind.len(), 2);
        assert_eq!(
            (b.by_kind[1].kind.as_str(), b.by_kind[1].turns),
            ("turn 2", 2)
        );
        assert_eq!(b.by_kind[1].contradicting, 2);
        assert_eq!(b.by_kind[0].contradicting, 0);
        assert!((b.contradiction_rate() - 0.5).abs() < 1e-12);
    }

    /// The numbers: rewards 1e5 + {0, .001, .002, 0} have mean 1e5 + 7.5e-4 and
    /// std ≈ 8.29e-4; the one-pass variance lost 40 % of z.
    #[test]
    fn z_scores_keep_their_digits_under_a_large_offset() {
        let x = [1e5, 1e5 + 0.001, 1e5 + 0.002, 1e5];
        let z = group_normalize(&x, &[0; 4], true);
        let m: f64 = 7.5e-4;
        let sd = ((m * m + (0.001 - m).powi(2) + (0.002 - m).powi(2) + m * m) / 4.0f64).sqrt();
        let want = (0.002 - m) / ((sd * sd + 1e-8).sqrt() + 1e-6);
        assert!(
            (z[2] - want).abs() < 1e-6 * want.abs(),
            "{} vs {want}",
            z[2]
        );
    }

    /// One switch scales both terms: centred only, a turn group (0.01, 0.02) gets ∓0.005,
    /// not ∓1.
    #[test]
    fn centred_process_signal_keeps_its_magnitude() {
        let sig = vec![vec![0.01, 1.0], vec![0.02, 0.0]];
        let (adv, ig) = a2tgpo(&sig, &["g", "g"], &[0.25, -0.25], 1.0, 0.3, false);
        assert!((ig[0][0] + 0.005).abs() < 1e-12 && (ig[1][0] - 0.005).abs() < 1e-12);
        assert!((adv[0][0] - (0.25 - 0.3 * 0.005)).abs() < 1e-12);
        let (_, z) = a2tgpo(&sig, &["g", "g"], &[0.25, -0.25], 1.0, 0.3, true);
        assert!((z[0][0] + 1.0).abs() < 1e-3);
    }
}
