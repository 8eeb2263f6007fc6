//! The statistics of the demo's reports and of `turnwise compare`: paired, stratified and
//! hierarchical bootstrap intervals and Wilson intervals.

use super::*;

pub(super) fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Paired bootstrap of `mean(b) − mean(a)`: (point estimate, 2.5 % and 97.5 % quantiles).
pub fn paired_bootstrap(a: &[bool], b: &[bool], reps: usize, seed: u64) -> (f64, f64, f64) {
    let n = a.len().min(b.len());
    if n == 0 {
        return (0.0, 0.0, 0.0);
    }
    let d: Vec<f64> = (0..n)
        .map(|i| f64::from(u8::from(b[i])) - f64::from(u8::from(a[i])))
        .collect();
    let point = mean(&d);
    let mut rng = Rng::new(seed);
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            (0..n)
                .map(|_| d[(rng.next_u64() % n as u64) as usize])
                .sum::<f64>()
                / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Stratified paired bootstrap of a pooled mean: `strata[k]` holds the paired differences of
/// stratum k (a seed's held-out scenarios); each replicate resamples within every stratum, so
/// the interval reflects scenario noise, not how the seeds happened to be mixed. Returns
/// (pooled mean over all items, 2.5 %, 97.5 %).
pub fn stratified_bootstrap(strata: &[Vec<f64>], reps: usize, seed: u64) -> (f64, f64, f64) {
    let n: usize = strata.iter().map(Vec::len).sum();
    if n == 0 || reps == 0 {
        return (0.0, 0.0, 0.0);
    }
    let point = strata.iter().flatten().sum::<f64>() / n as f64;
    let mut rng = Rng::new(seed);
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            let mut total = 0.0;
            for s in strata.iter().filter(|s| !s.is_empty()) {
                for _ in 0..s.len() {
                    total += s[(rng.next_u64() % s.len() as u64) as usize];
                }
            }
            total / n as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Hierarchical paired bootstrap of a pooled mean: each replicate draws as many strata (seeds)
/// as there are, with replacement, then resamples the items (held-out scenarios) within each
/// drawn stratum. Runs of one seed differ by more than its scenarios say (the rollouts, the
/// updates), so an interval that resamples only scenarios inside fixed seeds is too narrow for
/// a claim about a method; this one counts seeds. With one stratum it is the stratified
/// bootstrap. Returns (pooled mean over all items, 2.5 %, 97.5 %).
pub fn hierarchical_bootstrap(strata: &[Vec<f64>], reps: usize, seed: u64) -> (f64, f64, f64) {
    let strata: Vec<&Vec<f64>> = strata.iter().filter(|s| !s.is_empty()).collect();
    let n: usize = strata.iter().map(|s| s.len()).sum();
    if n == 0 || reps == 0 {
        return (0.0, 0.0, 0.0);
    }
    let point = strata.iter().copied().flatten().sum::<f64>() / n as f64;
    let mut rng = Rng::new(seed);
    let k = strata.len() as u64;
    let mut means: Vec<f64> = (0..reps)
        .map(|_| {
            let (mut total, mut count) = (0.0, 0usize);
            for _ in 0..k {
                let s = strata[(rng.next_u64() % k) as usize];
                for _ in 0..s.len() {
                    total += s[(rng.next_u64() % s.len() as u64) as usize];
                }
                count += s.len();
            }
            total / count as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    let q = |p: f64| means[((p * (reps - 1) as f64).round() as usize).min(reps - 1)];
    (point, q(0.025), q(0.975))
}

/// Wilson 95 % interval of a success rate.
pub fn wilson(successes: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let (z, nf) = (1.96f64, n as f64);
    let p = successes as f64 / nf;
    let den = 1.0 + z * z / nf;
    let c = (p + z * z / (2.0 * nf)) / den;
    let h = z * ((p * (1.0 - p) / nf + z * z / (4.0 * nf * nf)).sqrt()) / den;
    ((c - h).max(0.0), (c + h).min(1.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_and_wilson_intervals() {
        // identical outcomes: no difference, zero-width interval
        let a = vec![true, false, true, false];
        assert_eq!(paired_bootstrap(&a, &a, 200, 1), (0.0, 0.0, 0.0));
        // every pair improves: difference 1 with certainty
        let b = vec![false; 6];
        let c = vec![true; 6];
        assert_eq!(paired_bootstrap(&b, &c, 200, 1), (1.0, 1.0, 1.0));
        // half the pairs improve: point 0.5, interval inside [0, 1] and around 0.5
        let d: Vec<bool> = (0..40).map(|i| i % 2 == 0).collect();
        let (p, lo, hi) = paired_bootstrap(&[false; 40], &d, 2000, 3);
        assert_eq!(p, 0.5);
        assert!(lo > 0.3 && lo < 0.5 && hi > 0.5 && hi < 0.7, "{lo} {hi}");
        // Wilson: 0 of 10 → [0, 0.2775]; 5 of 10 → [0.2366, 0.7634]
        let (l, h) = wilson(0, 10);
        assert!(l.abs() < 1e-12 && (h - 0.2775).abs() < 1e-3, "{h}");
        let (l, h) = wilson(5, 10);
        assert!((l - 0.2366).abs() < 1e-3 && (h - 0.7634).abs() < 1e-3);
    }

    #[test]
    fn stratified_bootstrap_resamples_within_each_stratum() {
        // constant strata keep their means in every replicate: a zero-width interval at the
        // pooled mean (1 + 1 + 0 + 0) / 4
        let (p, lo, hi) = stratified_bootstrap(&[vec![1.0, 1.0], vec![0.0, 0.0]], 500, 1);
        assert_eq!((p, lo, hi), (0.5, 0.5, 0.5));
        // strata of different sizes weigh by their items: (3·1 + 1·0) / 4
        let (p, ..) = stratified_bootstrap(&[vec![1.0; 3], vec![0.0]], 100, 2);
        assert_eq!(p, 0.75);
        // a mixed stratum widens the interval around the point
        let (p, lo, hi) =
            stratified_bootstrap(&[vec![1.0, -1.0, 1.0, -1.0], vec![0.0; 4]], 2000, 3);
        assert_eq!(p, 0.0);
        assert!(lo < 0.0 && hi > 0.0 && lo >= -0.5 && hi <= 0.5, "{lo} {hi}");
        assert_eq!(stratified_bootstrap(&[], 100, 1), (0.0, 0.0, 0.0));
    }

    /// Seeds that disagree: +1 on every scenario of one seed, −1 on every scenario of the
    /// other. Resampling scenarios inside the seeds sees no noise at all; resampling the seeds
    /// draws (+1, +1), (−1, −1) or a mix, so the interval spans [−1, +1].
    #[test]
    fn hierarchical_bootstrap_counts_the_spread_between_seeds() {
        let strata = [vec![1.0; 10], vec![-1.0; 10]];
        assert_eq!(stratified_bootstrap(&strata, 2000, 1), (0.0, 0.0, 0.0));
        let (p, lo, hi) = hierarchical_bootstrap(&strata, 2000, 1);
        assert_eq!((p, lo, hi), (0.0, -1.0, 1.0));
        // one seed: the stratified bootstrap's behaviour
        let (p, lo, hi) = hierarchical_bootstrap(&[vec![1.0, 1.0]], 500, 1);
        assert_eq!((p, lo, hi), (1.0, 1.0, 1.0));
        // seeds that agree keep a narrow interval
        let (_, lo, hi) = hierarchical_bootstrap(&[vec![1.0, 0.0], vec![0.0, 1.0]], 2000, 4);
        assert!(lo >= 0.0 && hi <= 1.0 && lo < 0.5 && hi > 0.5, "{lo} {hi}");
        assert_eq!(hierarchical_bootstrap(&[vec![]], 100, 1), (0.0, 0.0, 0.0));
    }
}
