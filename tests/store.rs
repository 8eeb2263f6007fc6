//! The turn log on real SQLite files: migrations on an old database, generated turns logged
//! with features, the feature budget and retention.

use turnwise::session::turns_from_generation;
use turnwise::store::{NewSession, Source, Store, MIGRATIONS};
use turnwise::{Message, Role, SamplerParams};

use crate::common::{engine, session_key, tempdir};

#[test]
fn migrations_apply_on_an_old_database_and_keep_its_rows() {
    let dir = tempdir();
    let path = dir.path().join("old.db");
    {
        // a database written by the first release: only migration 1
        let c = rusqlite::Connection::open(&path).unwrap();
        c.execute_batch(MIGRATIONS[0].1).unwrap();
        c.pragma_update(None, "user_version", 1).unwrap();
        c.execute(
            "INSERT INTO sessions (source, group_key) VALUES ('chat', 'legacy')",
            [],
        )
        .unwrap();
    }
    let s = Store::open(&path).unwrap();
    assert_eq!(s.schema_version().unwrap(), MIGRATIONS.len() as i64);
    let old = s.sessions(None, 10).unwrap();
    assert_eq!(old.len(), 1);
    assert_eq!(old[0].group_key.as_deref(), Some("legacy"));
    let n: i64 = s
        .connection()
        .query_row("SELECT COUNT(*) FROM updates", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0, "the new table exists");
    drop(s);
    // reopening applies nothing twice
    assert_eq!(
        Store::open(&path).unwrap().schema_version().unwrap(),
        MIGRATIONS.len() as i64
    );
}

#[test]
fn generated_turns_are_logged_with_features_within_budget() {
    let e = engine();
    let dir = tempdir();
    let mut store = Store::open(&dir.path().join("t.db")).unwrap();
    let sid = store
        .create_session(&NewSession::new(Source::Chat))
        .unwrap();
    let k = session_key();
    let p = SamplerParams {
        max_tokens: 32,
        seed: 5,
        ..Default::default()
    };
    let g = e
        .generate(
            k,
            vec![Message::new(Role::User, "Where is my parcel 55120?")],
            p.clone(),
            None,
        )
        .unwrap();
    e.close(k);
    let info = e.info();
    let ids = store
        .append_turns(sid, &turns_from_generation(&g, &p, info))
        .unwrap();
    let turns = store.turns(sid).unwrap();
    assert_eq!(turns.len(), 2);
    assert_eq!(turns[1].token_ids, g.reply.tokens);
    assert_eq!(turns[1].sampler.as_ref(), Some(&p));
    assert_eq!(turns[1].context_len, turns[0].token_ids.len());
    let lp = store.token_logprobs(ids[1]).unwrap().unwrap();
    assert_eq!(lp.logp_behavior, g.reply.logp_behavior);
    let f = store.features(ids[1]).unwrap().unwrap();
    assert_eq!(f.n_embd, info.n_embd);
    assert_eq!(f.values, g.reply.hidden, "features are stored losslessly");
    let st = store.storage_stats().unwrap();
    let per_token = st.bytes_per_featured_token();
    eprintln!("bytes per sampled token (features + ids + log-probs): {per_token:.0}");
    // 18 Q8_0 blocks of 34 bytes + 4 bytes id + 2 x 4 bytes log-probs
    assert_eq!(info.feature_dtype, turnwise::policy::FeatureDtype::Q8_0);
    assert!(
        (per_token - (18.0 * 34.0 + 12.0)).abs() < 1.0,
        "{per_token}"
    );
}
