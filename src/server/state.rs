//! The handlers' shared state: the runtime, the live-session table and its bound, the
//! one-generation-per-session guard, and yielding the cores to serving.

use super::*;

/// The server's async runtime: two workers (generation runs on the engine thread and the
/// learner on its own, so the workers only move bytes).
///
/// # Errors
/// The runtime cannot start (no threads).
pub fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

/// The longest the learner waits between two steps for the server to fall idle.
pub const YIELD_MAX: Duration = Duration::from_secs(10);

impl AppState {
    /// Generations admitted and not finished.
    pub fn generating(&self) -> usize {
        self.cfg
            .queue
            .saturating_sub(self.queue.available_permits())
    }

    /// Blocks the calling (learner) thread while replies are being generated, for at most
    /// [`YIELD_MAX`].
    pub fn yield_to_serving(&self) {
        let t = Instant::now();
        while self.generating() > 0 && t.elapsed() < YIELD_MAX {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Opens the store, loads the active adapter into the engine.
    ///
    /// # Errors
    /// Store errors, or an active adapter that cannot be loaded.
    pub fn new(engine: Engine, cfg: ServerConfig) -> crate::Result<Arc<Self>> {
        let mut store = Store::open(&cfg.db)?;
        // what a crash left half-written: `writing` rows and temporary adapter folders
        let unfinished = store.reject_unfinished_adapters()?;
        let stale = crate::adapter::remove_stale_temp_dirs(&cfg.db);
        if !unfinished.is_empty() || stale > 0 {
            tracing::warn!(
                "a crash left adapters half-written: versions {unfinished:?} marked rejected, {stale} temporary folders removed"
            );
        }
        // candidates without a gate verdict (a crash between writing and judging, or an
        // offline `train` without --activate) are judged now: none becomes active unjudged
        for (id, passed) in gate::regate_unjudged(&store, cfg.gate_kl, Some(Source::Live))? {
            tracing::warn!(
                "adapter {id} had no gate verdict: re-gated at start-up, {}",
                if passed { "passed" } else { "rejected" }
            );
        }
        // the active adapter, or, when it does not load or fit the model, the previous good one
        let active = loop {
            let Some(rec) = store.active_adapter()? else {
                break None;
            };
            let loaded = Adapter::load(std::path::Path::new(&rec.path))
                .and_then(|a| engine.set_adapter(Some((rec.id, Arc::new(a)))));
            match loaded {
                Ok(()) => break Some(rec.id),
                Err(e) => {
                    tracing::warn!(
                        "active adapter {} cannot be served ({e}); falling back to the previous one",
                        rec.id
                    );
                    store.rollback_adapter()?;
                    let why = json!({"error": format!("cannot be served: {e}")});
                    store.set_adapter_status(rec.id, AdapterStatus::Rejected, Some(&why))?;
                }
            }
        };
        Ok(Arc::new(AppState {
            engine,
            store: Mutex::new(store),
            queue: Arc::new(Semaphore::new(cfg.queue.max(1))),
            cfg,
            sessions: Mutex::new(HashMap::new()),
            busy: Mutex::new(std::collections::HashSet::new()),
            metrics: Metrics::default(),
            active: Mutex::new(active),
            last_update: Mutex::new(None),
            next_id: AtomicU64::new(0),
        }))
    }

    pub(super) fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn live(&self) -> std::sync::MutexGuard<'_, HashMap<String, LiveSession>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `live` in memory under `id`, then drops what is idle for too long and, over the
    /// cap, the least recently used: their engine contexts are closed, their logs stay, and a
    /// later request with their id restores them from the store.
    pub(super) fn keep_live(&self, id: String, live: LiveSession) {
        let mut map = self.live();
        map.insert(id, live);
        let now = Instant::now();
        let busy = self.busy.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut dropped: Vec<(String, i64)> = map
            .iter()
            .filter(|(k, l)| {
                now.duration_since(l.last_used) > self.cfg.session_idle && !busy.contains(*k)
            })
            .map(|(k, l)| (k.clone(), l.store_id))
            .collect();
        for (k, _) in &dropped {
            map.remove(k);
        }
        while map.len() > self.cfg.max_live_sessions {
            let Some((k, sid)) = map
                .iter()
                .filter(|(k, _)| !busy.contains(*k))
                .min_by_key(|(_, l)| l.last_used)
                .map(|(k, l)| (k.clone(), l.store_id))
            else {
                break;
            };
            map.remove(&k);
            dropped.push((k, sid));
        }
        drop(map);
        for (_, sid) in dropped {
            self.engine.close(sid as u64);
        }
    }
}

/// Marks a client session as generating; cleared when dropped (the job's end, whatever it is).
pub(super) struct BusyGuard {
    st: Arc<AppState>,
    id: String,
}

impl BusyGuard {
    /// `None` when the session already has a generation in flight.
    pub(super) fn take(st: &Arc<AppState>, id: &str) -> Option<BusyGuard> {
        let mut busy = st.busy.lock().unwrap_or_else(|p| p.into_inner());
        busy.insert(id.to_string()).then(|| BusyGuard {
            st: st.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.st
            .busy
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.id);
    }
}

pub(super) fn conflict(id: &str) -> ApiError {
    ApiError::new(
        StatusCode::CONFLICT,
        "conflict_error",
        format!("session {id} has a reply in progress; send the next request after it"),
    )
}
