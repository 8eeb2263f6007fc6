//! Group keys for live traffic (docs/algorithms.md §7): live sessions are not repeated rollouts of
//! one prompt, so comparable sessions are found by clustering their opening states — the
//! policy's own hidden state after the first user message — with leader clustering on cosine
//! similarity. Clusters persist in the store, so a key means the same thing across updates.

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

/// Leader clustering: each point joins the most similar prototype whose cosine similarity is
/// at least `threshold` (its prototype becomes the running mean), or starts a new cluster.
/// `clusters` holds `(prototype, members)` and is extended in place; returns each point's index.
pub fn leader_assign(
    clusters: &mut Vec<(Vec<f32>, i64)>,
    points: &[Vec<f32>],
    threshold: f64,
) -> Vec<usize> {
    points
        .iter()
        .map(|p| {
            let best = clusters
                .iter()
                .enumerate()
                .map(|(i, (proto, _))| (i, cosine(proto, p)))
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
}
