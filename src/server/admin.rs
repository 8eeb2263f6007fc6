//! `/v1/models`, the adapters' admin routes (list, activate with the gate, roll back),
//! `/healthz` and `/metrics`.

use super::*;

pub(super) async fn models(State(st): State<Arc<AppState>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": st.engine.info().name, "object": "model", "owned_by": "turnwise"}]}),
    )
}

pub(super) async fn adapters(State(st): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let mut list =
        serde_json::to_value(st.store().adapters()?).map_err(|e| ApiError::from(Error::from(e)))?;
    // where adapters live on disk is the server's business, not the client's
    if let Some(rows) = list.as_array_mut() {
        for r in rows.iter_mut().filter_map(Value::as_object_mut) {
            r.remove("path");
        }
    }
    Ok(Json(
        json!({"object": "list", "data": list, "active": *st.active.lock().unwrap_or_else(|p| p.into_inner())}),
    ))
}

/// Puts the engine (and `active`) on adapter `id` as the store records it.
pub(super) fn switch_to(st: &AppState, id: Option<i64>) -> crate::Result<()> {
    let adapter = match id {
        Some(id) => {
            let rec = st.store().adapter(id)?;
            Some((
                id,
                Arc::new(Adapter::load(std::path::Path::new(&rec.path))?),
            ))
        }
        None => None,
    };
    st.engine.set_adapter(adapter)?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = id;
    Ok(())
}

/// Body of `POST /v1/adapters/{id}/activate` (optional).
#[derive(serde::Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct ActivateRequest {
    /// activate a candidate that has not passed the gate (recorded with the adapter)
    #[serde(default)]
    force: bool,
}

pub(super) async fn activate(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Json<Value>> {
    let id: i64 = id
        .parse()
        .map_err(|_| ApiError::bad(format!("adapter id {id:?} is not an integer")))?;
    // an empty body asks for no force
    let bytes = read_body(&st, body).await?;
    let req: ActivateRequest = if bytes.iter().all(u8::is_ascii_whitespace) {
        ActivateRequest::default()
    } else {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))?
    };
    {
        let store = st.store();
        let rec = store.adapter(id)?;
        if rec.status == AdapterStatus::Candidate && !gate::passed(&rec.metrics) {
            if !req.force {
                return Err(ApiError::new(
                    StatusCode::CONFLICT,
                    "invalid_request_error",
                    format!(
                        "adapter {id} has not passed the gate; send {{\"force\": true}} to activate it anyway (recorded with the adapter)"
                    ),
                ));
            }
            let mut metrics = rec.metrics.clone();
            if !metrics.is_object() {
                metrics = json!({});
            }
            metrics["forced"] = json!({"via": "POST /v1/adapters/{id}/activate", "gate": rec.metrics["gate"].clone()});
            store.set_adapter_status(id, AdapterStatus::Candidate, Some(&metrics))?;
        }
    }
    let previous = *st.active.lock().unwrap_or_else(|p| p.into_inner());
    // checked by the engine first, written active after (learn::gate::activate)
    tokio::task::block_in_place(|| {
        // its own connection: the handlers' shared one stays free for `restore`
        let mut store = Store::open(&st.cfg.db)?;
        gate::activate(
            &mut store,
            id,
            |a| st.engine.set_adapter(Some((id, a))),
            || switch_to(&st, previous),
        )
    })
    .map_err(|e| match e {
        crate::Error::NotFound(_) => ApiError::from(e),
        e => ApiError::bad(e.to_string()),
    })?;
    *st.active.lock().unwrap_or_else(|p| p.into_inner()) = Some(id);
    Ok(Json(json!({"active": id})))
}

pub(super) async fn healthz(State(st): State<Arc<AppState>>) -> Response {
    if st.engine.is_alive() {
        Json(json!({"status": "ok"})).into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "engine thread has stopped"})),
        )
            .into_response()
    }
}

pub(super) async fn rollback(State(st): State<Arc<AppState>>) -> ApiResult<Json<Value>> {
    let now = st.store().rollback_adapter()?;
    tokio::task::block_in_place(|| switch_to(&st, now))?;
    Ok(Json(json!({"active": now})))
}

pub(super) async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    let m = &st.metrics;
    let (sessions, turns) = {
        let s = st.store();
        s.storage_stats()
            .map(|x| (x.sessions, x.turns))
            .unwrap_or((0, 0))
    };
    let in_use = st.generating();
    let last = st
        .last_update
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let mut out = String::new();
    let mut line = |name: &str, kind: &str, help: &str, v: f64| {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    line(
        "turnwise_requests_total",
        "counter",
        "HTTP requests received",
        m.requests.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_errors_total",
        "counter",
        "requests refused for authentication",
        m.errors.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_completion_tokens_total",
        "counter",
        "tokens generated",
        m.completion_tokens.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_decode_tokens_per_second",
        "gauge",
        "decode speed of the last reply",
        m.decode_tps_milli.load(Ordering::Relaxed) as f64 / 1e3,
    );
    line(
        "turnwise_update_running",
        "gauge",
        "1 while a background update runs",
        m.updating.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_queue_depth",
        "gauge",
        "generations admitted and not finished",
        in_use as f64,
    );
    let c = st.engine.stats().counters();
    let (steps, rows, max_rows) = (c.steps, c.rows, c.max_rows);
    line(
        "turnwise_decode_steps_total",
        "counter",
        "batched decoding steps (one token of every reply in flight)",
        steps as f64,
    );
    line(
        "turnwise_decode_rows_total",
        "counter",
        "tokens those steps decoded (rows / steps = mean batch)",
        rows as f64,
    );
    line(
        "turnwise_decode_batch_max",
        "gauge",
        "largest batch of one decoding step",
        max_rows as f64,
    );
    line(
        "turnwise_caches_parked_total",
        "counter",
        "idle sessions' KV caches moved out of the context into host memory",
        c.parked as f64,
    );
    line(
        "turnwise_caches_restored_total",
        "counter",
        "parked caches restored when their session (or a shared prefix) came back",
        c.restored as f64,
    );
    line(
        "turnwise_sessions",
        "gauge",
        "sessions in the log",
        sessions as f64,
    );
    line("turnwise_turns", "gauge", "turns in the log", turns as f64);
    line(
        "turnwise_live_sessions",
        "gauge",
        "conversations held in memory",
        st.live().len() as f64,
    );
    line(
        "turnwise_sessions_learnable_total",
        "counter",
        "ended sessions with feedback that count towards the learner's trigger (held-out ones do not)",
        m.ended_with_feedback.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_updates_total",
        "counter",
        "background updates run",
        m.updates.load(Ordering::Relaxed) as f64,
    );
    line(
        "turnwise_active_adapter",
        "gauge",
        "id of the active adapter (0: none)",
        st.active.lock().map(|a| a.unwrap_or(0)).unwrap_or(0) as f64,
    );
    if let Some(d) = &last {
        for (key, v) in [
            ("loss", d.loss),
            ("approx_kl", d.approx_kl),
            ("clip_frac_low", d.clip_frac_low),
            ("clip_frac_high", d.clip_frac_high),
            ("grad_norm", d.grad_norm),
        ] {
            line(
                &format!("turnwise_last_update_{key}"),
                "gauge",
                "diagnostic of the last update",
                v,
            );
        }
    }
    ([("content-type", "text/plain; version=0.0.4")], out).into_response()
}
