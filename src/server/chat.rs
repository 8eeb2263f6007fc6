//! `/v1/chat/completions` (plain and streamed), feedback and session end: routing a request to
//! its live session (or restoring it from the log), the sampler settings, and committing every
//! turn before its reply is acknowledged.

use super::*;

pub(super) fn content_text(v: &Option<Value>) -> ApiResult<String> {
    crate::replay::content_text(v.as_ref()).map_err(ApiError::bad)
}

pub(super) fn sampler(req: &ChatRequest, limit: usize) -> ApiResult<SamplerParams> {
    let max = req.max_completion_tokens.or(req.max_tokens).unwrap_or(128);
    if max == 0 || max > limit {
        return Err(ApiError::bad(format!(
            "max_tokens must be between 1 and {limit}"
        )));
    }
    let stop = match &req.stop {
        None | Some(Value::Null) => vec![],
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<String>>>()
            .ok_or_else(|| ApiError::bad("stop must be a string or an array of strings"))?,
        Some(_) => {
            return Err(ApiError::bad(
                "stop must be a string or an array of strings",
            ))
        }
    };
    let (most, longest) = MAX_STOP;
    if stop.len() > most || stop.iter().any(|s| s.is_empty() || s.len() > longest) {
        return Err(ApiError::bad(format!(
            "stop takes at most {most} strings of 1 to {longest} bytes"
        )));
    }
    let d = SamplerParams::default();
    let p = SamplerParams {
        temperature: req.temperature.unwrap_or(d.temperature),
        top_p: req.top_p.unwrap_or(d.top_p),
        top_k: req.top_k.unwrap_or(d.top_k),
        max_tokens: max,
        seed: req.seed.unwrap_or_else(rand_seed),
        stop,
        ignore_eog: req.ignore_eos,
        greedy_digits: req.greedy_digits,
        id_slot: req.id_slot.clone(),
    };
    if let Some(ids) = &p.id_slot {
        let ok =
            |id: &String| (1..=20).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_digit());
        if ids.len() > 64 || !ids.iter().all(ok) {
            return Err(ApiError::bad(
                "id_slot takes at most 64 ids of 1 to 20 ASCII digits",
            ));
        }
    }
    if !(0.0..=2.0).contains(&p.temperature) || !(0.0..=1.0).contains(&p.top_p) || p.top_p == 0.0 {
        return Err(ApiError::bad(
            "temperature must be in [0, 2] and top_p in (0, 1]",
        ));
    }
    Ok(p)
}

pub(super) fn rand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// Resolves the session a request continues and the messages it adds.
pub(super) fn route_session(
    st: &AppState,
    id: String,
    msgs: Vec<Message>,
    held_out: bool,
) -> ApiResult<(String, LiveSession, Vec<Message>)> {
    let known = st.live().get(&id).cloned();
    let known = match known {
        Some(k) => Some(k),
        None => restore(st, &id)?,
    };
    if let Some(live) = known {
        let n = live.messages.len();
        let extends = msgs.len() > n
            && msgs[..n] == live.messages[..]
            && msgs[n..].iter().all(|m| m.role != Role::Assistant);
        if extends {
            if held_out {
                st.store().set_held_out(live.store_id)?;
            }
            return Ok((id, live.clone(), msgs[n..].to_vec()));
        }
    }
    // a new session, or a new branch of one whose history the request does not extend
    let mut s = NewSession::new(Source::Live);
    s.metadata = if held_out {
        json!({"client_session_id": id, "held_out": true})
    } else {
        json!({"client_session_id": id})
    };
    let store_id = Recorder::open(&st.store(), &s)?.id();
    Ok((
        id,
        LiveSession {
            store_id,
            messages: Vec::new(),
            last_used: Instant::now(),
        },
        msgs,
    ))
}

/// After a restart: the newest open session with this client id, restored token-exact.
pub(super) fn restore(st: &AppState, client_id: &str) -> ApiResult<Option<LiveSession>> {
    let store = st.store();
    let found = store.session_of_client(client_id, true)?;
    let Some(sid) = found else { return Ok(None) };
    let turns = store.turns(sid)?;
    drop(store);
    let tokens: Vec<i32> = turns
        .iter()
        .flat_map(|t| t.token_ids.iter().copied())
        .collect();
    let messages: Vec<Message> = turns
        .iter()
        .map(|t| Message::new(t.role, t.text.clone()))
        .collect();
    // the engine call blocks: keep it off the async worker's back
    tokio::task::block_in_place(|| st.engine.restore(sid as u64, tokens, messages.clone()))?;
    Ok(Some(LiveSession {
        store_id: sid,
        messages,
        last_used: Instant::now(),
    }))
}

pub(super) async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<Response> {
    let req: ChatRequest = read_json(&st, body).await?;
    if req.messages.is_empty() {
        return Err(ApiError::bad("messages must not be empty"));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let role = Role::parse(&m.role)
            .map_err(|_| ApiError::bad(format!("messages[{i}]: unknown role {:?}", m.role)))?;
        msgs.push(Message::new(role, content_text(&m.content)?));
    }
    // the context budget, before anything is rendered or tokenised: every message takes its
    // template's markers (at least two tokens) and its text at least bytes / longest piece
    let info = st.engine.info();
    let least: usize = msgs
        .iter()
        .map(|m| 2 + m.content.len() / info.max_piece_bytes.max(1))
        .sum();
    if least > info.n_ctx {
        return Err(ApiError::bad(format!(
            "the messages need at least {least} tokens; the context window holds {}",
            info.n_ctx
        )));
    }
    if !matches!(msgs.last().map(|m| m.role), Some(Role::User | Role::Tool)) {
        return Err(ApiError::bad(
            "the last message must be from the user or a tool",
        ));
    }
    let params = sampler(&req, st.cfg.max_tokens_limit)?;
    let client_id = req
        .session_id
        .clone()
        .or_else(|| {
            headers
                .get("x-session-id")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        })
        .or_else(|| req.user.clone());
    let permit = st.queue.clone().try_acquire_owned().map_err(|_| ApiError {
        retry_after: Some(1),
        ..ApiError::new(
            StatusCode::TOO_MANY_REQUESTS,
            "rate_limit_error",
            "the generation queue is full; retry shortly",
        )
    })?;
    // one generation at a time per session: a second request on it, or on a new session id
    // being created, is answered 409 instead of interleaving into one context
    let client_id = client_id.unwrap_or_else(|| {
        format!(
            "s{}-{}",
            rand_seed() % 1_000_000_007,
            st.next_id.fetch_add(1, Ordering::Relaxed)
        )
    });
    let busy = BusyGuard::take(&st, &client_id).ok_or_else(|| conflict(&client_id))?;
    let (client_id, live, new_msgs) =
        route_session(&st, client_id, msgs, req.learn == Some(false))?;
    let model = st.engine.info().name.clone();
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let cid = format!("chatcmpl-{}-{}", live.store_id, live.messages.len());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    let st2 = st.clone();
    let (p2, live2, client2) = (params.clone(), live.clone(), client_id.clone());
    // generation + commit run to completion even if the client goes away
    let job = tokio::spawn(async move {
        let _permit = permit;
        let _busy = busy;
        let g = st2
            .engine
            .generate_async(
                live2.store_id as u64,
                new_msgs.clone(),
                p2.clone(),
                Some(tx),
            )
            .await?;
        let info = st2.engine.info();
        let committed =
            Recorder::resume(live2.store_id).generation(&mut st2.store(), &g, &p2, info);
        if let Err(e) = committed {
            // the engine's context is ahead of the log: drop it, so that the next request on
            // this session starts again from what the log holds
            st2.live().remove(&client2);
            st2.engine.close(live2.store_id as u64);
            return Err(e);
        }
        let mut live3 = live2.clone();
        live3.messages.extend(new_msgs);
        live3
            .messages
            .push(Message::new(Role::Assistant, g.reply.visible.clone()));
        live3.last_used = Instant::now();
        st2.keep_live(client2, live3);
        let n = g.reply.tokens.len() as u64;
        st2.metrics
            .completion_tokens
            .fetch_add(n, Ordering::Relaxed);
        if g.reply.decode_ms > 0.0 {
            st2.metrics.decode_tps_milli.store(
                (n as f64 / (g.reply.decode_ms / 1e3) * 1e3) as u64,
                Ordering::Relaxed,
            );
        }
        Ok::<_, Error>(g)
    });
    let usage = |g: &crate::policy::Generation| Usage {
        prompt_tokens: g.prompt.iter().map(|t| t.tokens.len()).sum(),
        completion_tokens: g.reply.tokens.len(),
        total_tokens: g.prompt.iter().map(|t| t.tokens.len()).sum::<usize>() + g.reply.tokens.len(),
    };
    let finish = |s: StopReason| {
        if s == StopReason::MaxTokens {
            "length"
        } else {
            "stop"
        }
    };
    if !req.stream {
        while rx.recv().await.is_some() {}
        let g = job.await.map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
        })??;
        return Ok(Json(json!({
            "id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": g.reply.visible},
                         "finish_reason": finish(g.reply.stop)}],
            "usage": usage(&g), "session_id": client_id, "adapter_id": g.reply.adapter_id,
        }))
        .into_response());
    }
    let (etx, erx) = tokio::sync::mpsc::channel::<Result<Event, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let chunk = |delta: Value, fin: Option<&str>| {
            json!({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": fin}], "session_id": client_id})
        };
        let _ = etx
            .send(Ok(
                Event::default().data(chunk(json!({"role": "assistant"}), None).to_string())
            ))
            .await;
        while let Some(piece) = rx.recv().await {
            if etx
                .send(Ok(
                    Event::default().data(chunk(json!({"content": piece}), None).to_string())
                ))
                .await
                .is_err()
            {
                // the client left: dropping the receiver cancels the generation; what was
                // produced is still committed by the job
                drop(rx);
                let _ = job.await;
                return;
            }
        }
        match job.await {
            Ok(Ok(g)) => {
                let mut last = chunk(json!({}), Some(finish(g.reply.stop)));
                last["usage"] = serde_json::to_value(usage(&g)).unwrap_or(Value::Null);
                last["adapter_id"] = json!(g.reply.adapter_id);
                let _ = etx.send(Ok(Event::default().data(last.to_string()))).await;
                let _ = etx.send(Ok(Event::default().data("[DONE]"))).await;
            }
            Ok(Err(e)) => {
                let _ = etx
                    .send(Ok(Event::default().data(
                        error_body(&e.to_string(), "server_error", None).to_string(),
                    )))
                    .await;
            }
            Err(e) => {
                let _ = etx
                    .send(Ok(Event::default().data(
                        error_body(&e.to_string(), "server_error", None).to_string(),
                    )))
                    .await;
            }
        }
    });
    Ok(Sse::new(tokio_stream::wrappers::ReceiverStream::new(erx)).into_response())
}

pub(super) fn live_session(st: &AppState, id: &str) -> ApiResult<i64> {
    if let Some(l) = st.live().get(id) {
        return Ok(l.store_id);
    }
    st.store().session_of_client(id, false)?.ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "not_found_error",
            format!("unknown session {id}"),
        )
    })
}

pub(super) async fn feedback(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
    body: Body,
) -> ApiResult<Json<Value>> {
    let req: FeedbackRequest = read_json(&st, body).await?;
    let rec = Recorder::resume(live_session(&st, &id)?);
    let sid = rec.id();
    let mut store = st.store();
    let mut n = 0;
    if let Some(t) = &req.thumb {
        let up = match t.as_str() {
            "up" => true,
            "down" => false,
            _ => return Err(ApiError::bad("thumb must be \"up\" or \"down\"")),
        };
        let turn = match req.turn {
            Some(t) => Some(assistant_turn(&store, sid, &id, t)?),
            None => store
                .turns(sid)?
                .iter()
                .rev()
                .find(|t| t.role == Role::Assistant)
                .map(|t| t.idx),
        };
        let note = req.note.as_deref();
        rec.feedback(&mut store, &Feedback::Thumb { turn, up, note })?;
        n += 1;
    }
    if let Some(o) = &req.outcome {
        let v = match o {
            Value::String(s) if s == "resolved" => 1.0,
            Value::String(s) if s == "unresolved" => 0.0,
            Value::Number(x) => {
                let (lo, hi) = st.cfg.reward_range;
                x.as_f64()
                    .filter(|v| v.is_finite() && (lo..=hi).contains(v))
                    .ok_or_else(|| {
                        ApiError::bad(format!(
                            "outcome must be a number from {lo} to {hi} (the server's --reward-range)"
                        ))
                    })?
            }
            _ => {
                return Err(ApiError::bad(
                    "outcome must be \"resolved\", \"unresolved\" or a number",
                ))
            }
        };
        let note = req.note.as_deref();
        rec.feedback(&mut store, &Feedback::Outcome { value: v, note })?;
        n += 1;
    }
    if n == 0 {
        match &req.note {
            Some(text) => {
                let turn = match req.turn {
                    Some(t) => Some(assistant_turn(&store, sid, &id, t)?),
                    None => None,
                };
                rec.feedback(&mut store, &Feedback::Note { turn, text })?
            }
            None => return Err(ApiError::bad("give a thumb, an outcome or a note")),
        }
    }
    Ok(Json(json!({"session_id": id, "recorded": true})))
}

/// `t` when it is the index of an assistant turn of session `sid` (client id `id`), else 400.
pub(super) fn assistant_turn(store: &Store, sid: i64, id: &str, t: i64) -> ApiResult<i64> {
    let ok = store
        .turns(sid)?
        .iter()
        .any(|x| x.idx == t && x.role == Role::Assistant);
    if ok {
        Ok(t)
    } else {
        Err(ApiError::bad(format!(
            "turn {t} is not an assistant turn of session {id}"
        )))
    }
}

pub(super) async fn end_session(
    State(st): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> ApiResult<Json<Value>> {
    // ending while a reply is being written would let the finishing job re-open the session
    let _busy = BusyGuard::take(&st, &id).ok_or_else(|| conflict(&id))?;
    let rec = Recorder::resume(live_session(&st, &id)?);
    let sid = rec.id();
    // a held-out session does not count towards the learner's trigger either
    let has_feedback = {
        let store = st.store();
        rec.end(&store)?;
        !store.feedback(sid)?.is_empty() && !store.is_held_out(sid)?
    };
    st.live().remove(&id);
    st.engine.close(sid as u64);
    if has_feedback {
        st.metrics
            .ended_with_feedback
            .fetch_add(1, Ordering::Relaxed);
    }
    Ok(Json(json!({"session_id": id, "ended": true})))
}
