//! The background learner: triggers, one update over the logged sessions, the gate and the
//! hot-swap, at a lower thread priority than serving.

use super::*;

/// The background learner: wakes every `learn_every_sessions` ended sessions with feedback or
/// every `learn_every_minutes`, runs an update over the live sessions, gates the candidate and
/// hot-swaps it in when it passes.
pub async fn learner(st: Arc<AppState>, head: Arc<OutputHead>) {
    let Some(every) = st.cfg.learn_every_sessions else {
        return;
    };
    let mut last_run = Instant::now();
    let mut seen = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let ended = st.metrics.ended_with_feedback.load(Ordering::Relaxed);
        let due_sessions = ended.saturating_sub(seen) as usize >= every.max(1);
        let due_time =
            last_run.elapsed().as_secs_f64() >= st.cfg.learn_every_minutes * 60.0 && ended > seen;
        if !(due_sessions || due_time) {
            continue;
        }
        seen = ended;
        last_run = Instant::now();
        match update_in_background(st.clone(), head.clone()).await {
            Ok(msg) => tracing::info!("{msg}"),
            Err(e) => tracing::warn!("background update: {e}"),
        }
    }
}

/// Runs [`learn_once`] on a thread of its own at the learner's priority
/// ([`ServerConfig::learn_nice`]): the async runtime's workers and the engine thread keep
/// serving, and when both want the CPU the scheduler gives it to serving. No lock of the
/// handlers is held meanwhile (the learner writes through its own store connection).
///
/// # Errors
/// The update's errors; a panic of the update thread.
pub async fn update_in_background(
    st: Arc<AppState>,
    head: Arc<OutputHead>,
) -> crate::Result<String> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    let nice = st.cfg.learn_nice;
    std::thread::Builder::new()
        .name("turnwise-learner".into())
        .spawn(move || {
            lower_thread_priority(nice);
            st.metrics.updating.store(1, Ordering::Relaxed);
            let r = learn_once(&st, &head);
            st.metrics.updating.store(0, Ordering::Relaxed);
            let _ = tx.send(r);
        })
        .map_err(|e| crate::Error::Invalid(format!("cannot start the learner thread: {e}")))?;
    rx.await
        .map_err(|_| crate::Error::Invalid("the update thread panicked".into()))?
}

/// Sets the calling thread's nice value (threads it starts later inherit it). Best effort: a
/// refusal is logged, and other systems than Linux keep the default priority. (Measured with
/// `turnwise bench --serve` on 2 cores: Linux's idle scheduling class on top of nice 19 made
/// completions slower, not faster — p50 1.93× idle against 1.09× — so it is not used.)
pub fn lower_thread_priority(nice: i32) {
    #[cfg(target_os = "linux")]
    {
        let nice = nice.clamp(0, 19);
        // SAFETY: gettid and setpriority only read their arguments; on Linux PRIO_PROCESS
        // with a thread id addresses that thread alone
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, nice)
        };
        if rc != 0 {
            tracing::debug!(
                "could not lower the learner's priority: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = nice;
}

/// One background update with the promotion gate. Returns a line for the log.
///
/// # Errors
/// Update or store errors (the active adapter is unchanged then).
pub fn learn_once(st: &AppState, head: &OutputHead) -> crate::Result<String> {
    // the learner's own connection: handlers keep reading and writing the log meanwhile (WAL)
    let mut store = Store::open(&st.cfg.db)?;
    store.set_policy_model(&crate::assets::model_stamp_json(&st.engine.info().path));
    let parent = {
        match store.active_adapter()? {
            Some(rec) => Some((
                rec.id,
                Arc::new(Adapter::load(std::path::Path::new(&rec.path))?),
            )),
            None => None,
        }
    };
    let mut cfg = TrainConfig::preset(st.cfg.learn_algo);
    cfg.threads = st.cfg.train_threads;
    cfg.epochs = 1;
    let sel = Selection {
        source: Some(Source::Live),
        since: None,
        until: None,
        limit: st.cfg.learn_sessions.max(1),
    };
    // between steps the learner waits while replies are being generated (at most
    // YIELD_MAX per step, so that a server that is never idle still learns)
    let report = run_update(
        &mut store,
        &st.cfg.db,
        head,
        parent.clone(),
        &cfg,
        &sel,
        |_, _, _| st.yield_to_serving(),
    )?;
    st.metrics.updates.fetch_add(1, Ordering::Relaxed);
    *st.last_update.lock().unwrap_or_else(|p| p.into_inner()) = Some(report.diagnostics.clone());
    let Some(id) = report.adapter_id else {
        return Ok("update wrote no adapter".into());
    };
    // gate: the KL to the parent on the batch (the guard set of logged sessions) is bounded,
    // and the value head is no worse calibrated than its parent's on recent live sessions
    let kl = report.diagnostics.approx_kl;
    let verdict = gate::decide(
        kl,
        st.cfg.gate_kl,
        || {
            let cand = Adapter::load(&crate::adapter::adapter_dir(&st.cfg.db, id))?;
            gate::value_check(
                &store,
                &cand,
                parent.as_ref().map(|p| p.1.as_ref()),
                Some(Source::Live),
                gate::VALUE_SESSIONS,
            )
            .map(Some)
        },
        || Ok(None),
    )?;
    gate::record(&store, id, &verdict)?;
    let line = serde_json::to_string(&verdict)?;
    if !verdict.passed {
        return Ok(format!("adapter {id} failed the gate ({line})"));
    }
    let previous = parent.as_ref().map(|p| p.0);
    gate::activate(
        &mut store,
        id,
        |a| st.engine.set_adapter(Some((id, a))),
        || switch_to(st, previous),
    )?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    Ok(format!(
        "adapter {id} passed the gate and is active ({line})"
    ))
}
