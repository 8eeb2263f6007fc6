//! Group keys for live traffic (docs/algorithms.md §7): live sessions are not repeated rollouts of
//! one prompt, so comparable sessions are found by clustering their opening states — the
//! policy's own hidden state after the first user message — with leader clustering on cosine
//! similarity. Clusters persist in the store, so a key means the same thing across updates.
//!
//! The states are compared **centred**: minus the mean opening state of every session clustered
//! so far. Raw final hidden states share one dominant direction (on the default model any two
//! openings of the live desk have cosine ≥ 0.95, so a 0.9 threshold put every session in one
//! cluster); what tells a refund from an address change is the part that remains.

use crate::error::Result;
use crate::store::Store;

/// Cosine similarity.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        ab += (*x as f64) * (*y as f64);
        aa += (*x as f64).powi(2);
        bb += (*y as f64).powi(2);
    }
    if aa == 0.0 || bb == 0.0 {
        return 0.0;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// The mean opening state of everything clustered so far and of `points`: the prototypes
/// weighted by their members (a prototype is its members' mean) together with the new points.
/// Prototypes of another width (a different model) are left out.
pub fn centre(clusters: &[(Vec<f32>, i64)], points: &[Vec<f32>]) -> Vec<f32> {
    let Some(width) = points.first().map(Vec::len) else {
        return Vec::new();
    };
    let mut sum = vec![0f64; width];
    let mut n = 0f64;
    let weighted = clusters
        .iter()
        .filter(|(p, m)| p.len() == width && *m > 0)
        .map(|(p, m)| (p, *m as f64))
        .chain(points.iter().filter(|p| p.len() == width).map(|p| (p, 1.0)));
    for (p, w) in weighted {
        for (s, &x) in sum.iter_mut().zip(p) {
            *s += w * f64::from(x);
        }
        n += w;
    }
    sum.iter().map(|s| (s / n.max(1.0)) as f32).collect()
}

/// Cosine similarity of `a − c` and `b − c`; 0 when the widths differ.
fn centred_cosine(a: &[f32], b: &[f32], c: &[f32]) -> f64 {
    if a.len() != c.len() || b.len() != c.len() {
        return 0.0;
    }
    let sub = |v: &[f32]| -> Vec<f32> { v.iter().zip(c).map(|(x, m)| x - m).collect() };
    cosine(&sub(a), &sub(b))
}

/// Leader clustering: each point joins the most similar prototype whose cosine similarity,
/// both taken relative to [`centre`] (of the stored clusters and all of `points`), is at least
/// `threshold` (its prototype becomes the running mean), or starts a new cluster. `clusters`
/// holds `(prototype, members)` and is extended in place; returns each point's index.
pub fn leader_assign(
    clusters: &mut Vec<(Vec<f32>, i64)>,
    points: &[Vec<f32>],
    threshold: f64,
) -> Vec<usize> {
    let c = centre(clusters, points);
    points
        .iter()
        .map(|p| {
            let best = clusters
                .iter()
                .enumerate()
                .map(|(i, (proto, _))| (i, centred_cosine(proto, p, &c)))
                .filter(|&(_, s)| s >= threshold)
                .max_by(|a, b| a.1.total_cmp(&b.1));
            match best {
                Some((i, _)) => {
                    let (proto, n) = &mut clusters[i];
                    *n += 1;
                    let w = 1.0 / *n as f32;
                    for (q, x) in proto.iter_mut().zip(p) {
                        *q += w * (x - *q);
                    }
                    i
                }
                None => {
                    clusters.push((p.clone(), 1));
                    clusters.len() - 1
                }
            }
        })
        .collect()
}

/// Gives every session without a group key the key of its opening-state cluster
/// (`cluster:<id>`). `openings`: `(session id, opening state)`. Returns how many were assigned.
///
/// # Errors
/// Store errors.
pub fn assign_group_keys(
    store: &mut Store,
    openings: &[(i64, Vec<f32>)],
    threshold: f64,
) -> Result<usize> {
    if openings.is_empty() {
        return Ok(0);
    }
    let stored = store.opening_clusters()?;
    let known = stored.len();
    let mut clusters: Vec<(Vec<f32>, i64)> =
        stored.iter().map(|(_, p, n)| (p.clone(), *n)).collect();
    let points: Vec<Vec<f32>> = openings.iter().map(|(_, h)| h.clone()).collect();
    let idx = leader_assign(&mut clusters, &points, threshold);
    let rows: Vec<(Option<i64>, Vec<f32>, i64)> = clusters
        .into_iter()
        .enumerate()
        .map(|(i, (p, n))| (stored.get(i).filter(|_| i < known).map(|s| s.0), p, n))
        .collect();
    let assign: Vec<(i64, usize)> = openings
        .iter()
        .zip(&idx)
        .map(|((sid, _), &k)| (*sid, k))
        .collect();
    store.save_opening_clusters(&rows, &assign)?;
    Ok(assign.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leader_clustering_by_hand() {
        let mut c = Vec::new();
        let pts = vec![
            vec![1.0, 0.0],
            vec![0.9, 0.1],
            vec![0.0, 1.0],
            vec![1.0, 0.05],
        ];
        let idx = leader_assign(&mut c, &pts, 0.95);
        assert_eq!(idx, vec![0, 0, 1, 0]);
        assert_eq!(c.len(), 2);
        // prototype 0 is the running mean of its three members
        assert!((c[0].0[0] - (1.0 + 0.9 + 1.0) / 3.0).abs() < 1e-6);
        assert_eq!(c[0].1, 3);
        assert!((cosine(&[1.0, 0.0], &[0.0, 1.0])).abs() < 1e-12);
        assert!((cosine(&[1.0, 1.0], &[2.0, 2.0]) - 1.0).abs() < 1e-12);
    }

    #[test]
    fn keys_persist_across_calls() {
        let mut s = Store::in_memory().unwrap();
        let mk = |s: &mut Store| {
            s.create_session(&crate::store::NewSession::new(crate::store::Source::Live))
                .unwrap()
        };
        let (a, b, c) = (mk(&mut s), mk(&mut s), mk(&mut s));
        assert_eq!(
            assign_group_keys(&mut s, &[(a, vec![1.0, 0.0]), (b, vec![0.0, 1.0])], 0.9).unwrap(),
            2
        );
        assign_group_keys(&mut s, &[(c, vec![0.98, 0.05])], 0.9).unwrap();
        let key = |id| s.session(id).unwrap().group_key.unwrap();
        assert_eq!(key(a), key(c), "a later session joins the stored cluster");
        assert_ne!(key(a), key(b));
        assert_eq!(s.opening_clusters().unwrap().len(), 2);
    }

    /// States that share a large common direction (as final hidden states do) are one cluster
    /// by raw cosine; relative to their mean the two kinds point opposite ways.
    #[test]
    fn a_shared_direction_does_not_merge_different_openings() {
        let pts = vec![
            vec![10.0, 1.0, 0.0],
            vec![10.0, 0.0, 1.0],
            vec![10.0, 1.1, 0.0],
            vec![10.0, 0.0, 0.9],
        ];
        // raw cosine of the two kinds: 100 / 101 ≈ 0.990, above any useful threshold
        assert!((cosine(&pts[0], &pts[1]) - 100.0 / 101.0).abs() < 1e-9);
        // the centre by hand: (10, 2.1 / 4, 1.9 / 4)
        let c = centre(&[], &pts);
        for (x, want) in c.iter().zip([10.0, 0.525, 0.475]) {
            assert!((x - want).abs() < 1e-6, "{c:?}");
        }
        // centred, the first two are (0, .475, −.475) and (0, −.525, .525): cosine −1
        assert!((centred_cosine(&pts[0], &pts[1], &c) + 1.0).abs() < 1e-6);
        let mut clusters = Vec::new();
        assert_eq!(leader_assign(&mut clusters, &pts, 0.5), vec![0, 1, 0, 1]);
        // stored prototypes weigh by their members in the next call's centre: (10, .525, .475)
        let c2 = centre(&clusters, &[]);
        assert!(c2.is_empty(), "no new points, nothing to centre");
        let c3 = centre(&clusters, &[vec![10.0, 0.0, 0.0]]);
        for (x, want) in c3.iter().zip([10.0, 2.1 / 5.0, 1.9 / 5.0]) {
            assert!((x - want).abs() < 1e-6, "{c3:?}");
        }
        // a prototype of another width never matches and does not enter the centre
        let mut mixed = vec![(vec![1.0, 2.0], 3)];
        assert_eq!(leader_assign(&mut mixed, &pts[..2], 0.5), vec![1, 2]);
    }
}
