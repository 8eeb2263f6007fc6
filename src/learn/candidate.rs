//! Writing a new adapter version: the one way an update, a warm start or a value fit puts an
//! adapter on disk. It is registered (status `writing`, its directory named after its id),
//! written atomically, and on a failed write marked `rejected` with the error — never left
//! `writing`. The caller then makes it a candidate, with its metrics or in the same transaction
//! as the update's other rows (`Store::commit_candidate`).

use std::path::Path;

use serde_json::json;

use crate::adapter::{adapter_dir, Adapter};
use crate::error::Result;
use crate::store::{AdapterStatus, Store};

/// Registers a version with `parent`, writes `adapter` (and `extra` files beside it) into its
/// directory next to the database `db`, and returns its id; on a failed write the version is
/// marked rejected with the error, and the error returned.
///
/// # Errors
/// Store errors; the write's error.
pub fn write(
    store: &mut Store,
    db: &Path,
    parent: Option<i64>,
    adapter: &Adapter,
    extra: &[(&str, Vec<u8>)],
) -> Result<i64> {
    let id = store.register_adapter(parent, |id| {
        adapter_dir(db, id).to_string_lossy().into_owned()
    })?;
    if let Err(e) = adapter.save_with(&adapter_dir(db, id), extra) {
        store.set_adapter_status(
            id,
            AdapterStatus::Rejected,
            Some(&json!({"error": e.to_string()})),
        )?;
        return Err(e);
    }
    Ok(id)
}

/// [`write`], then the version becomes a candidate with `metrics`.
///
/// # Errors
/// As [`write`].
pub fn write_candidate(
    store: &mut Store,
    db: &Path,
    parent: Option<i64>,
    adapter: &Adapter,
    metrics: &serde_json::Value,
) -> Result<i64> {
    let id = write(store, db, parent, adapter, &[])?;
    store.set_adapter_status(id, AdapterStatus::Candidate, Some(metrics))?;
    Ok(id)
}
