//! The real server binary on 127.0.0.1 with a real HTTP/1.1 client: completions (plain and
//! streamed), token-exact sessions, feedback, metrics, bad requests, and kill -9 faults.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;
use turnwise::AdapterStatus;

use serde_json::{json, Value};
use turnwise::store::Store;

use crate::common::{tempdir, turnwise};

struct Server {
    child: Child,
    addr: String,
}

impl Server {
    fn start(db: &Path, extra: &[&str]) -> Server {
        let mut child = turnwise(db)
            .args(["serve", "--port", "0"])
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let addr = line.trim().rsplit("http://").next().unwrap().to_string();
        assert!(addr.starts_with("127.0.0.1:"), "server said {line:?}");
        Server { child, addr }
    }
    fn kill(mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One request; returns (status, body).
fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("Content-Type: application/json\r\n\r\n");
    s.write_all(req.as_bytes()).unwrap();
    let _ = s.write_all(body);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (status, dechunk(&body))
}

/// Writes a fresh adapter (seed `seed`) into `db`'s adapter folder and registers it as a
/// `candidate` with `metrics` (None: none recorded).
fn write_candidate(store: &Store, db: &Path, seed: u64, metrics: Option<&Value>) -> i64 {
    use turnwise::adapter::{adapter_dir, Adapter};
    let h = crate::common::head();
    let id = store
        .register_adapter(None, |id| {
            adapter_dir(db, id).to_string_lossy().into_owned()
        })
        .unwrap();
    Adapter::fresh(h.n_embd(), h.n_vocab(), 4, 8.0, seed, "t")
        .save(&adapter_dir(db, id))
        .unwrap();
    store
        .set_adapter_status(id, AdapterStatus::Candidate, metrics)
        .unwrap();
    id
}

/// Removes HTTP/1.1 chunked framing when present.
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    loop {
        let Some((size, tail)) = rest.split_once("\r\n") else {
            return if out.is_empty() {
                body.to_string()
            } else {
                out
            };
        };
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            return body.to_string();
        };
        if n == 0 || tail.len() < n {
            return out;
        }
        out.push_str(&tail[..n]);
        rest = tail[n..].trim_start_matches("\r\n");
    }
}

fn chat(addr: &str, body: Value) -> (u16, Value) {
    let (s, b) = http(
        addr,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    (s, serde_json::from_str(&b).unwrap_or(Value::String(b)))
}

#[test]
fn completions_sessions_feedback_and_metrics() {
    let dir = tempdir();
    let db = dir.path().join("serve.db");
    let srv = Server::start(&db, &["--no-learn"]);
    let a = &srv.addr;
    // a three-turn session, each request carrying the whole history
    let mut history = vec![json!({"role": "system", "content": "You are a support agent."})];
    for (i, u) in [
        "Hi, my order 48213 is late.",
        "It was a jacket.",
        "Thanks, bye.",
    ]
    .iter()
    .enumerate()
    {
        history.push(json!({"role": "user", "content": u}));
        let (s, r) = chat(
            a,
            json!({"messages": history, "max_tokens": 16, "seed": i, "session_id": "sess-1"}),
        );
        assert_eq!(s, 200, "{r}");
        assert_eq!(r["object"], "chat.completion");
        assert_eq!(r["session_id"], "sess-1");
        assert!(r["usage"]["completion_tokens"].as_u64().unwrap() > 0);
        history
            .push(json!({"role": "assistant", "content": r["choices"][0]["message"]["content"]}));
    }
    {
        let store = Store::open(&db).unwrap();
        let sessions = store.sessions(None, 10).unwrap();
        assert_eq!(
            sessions.len(),
            1,
            "the history extended one session each time"
        );
        let turns = store.turns(sessions[0].id).unwrap();
        assert_eq!(turns.len(), 7);
        let mut ctx = 0;
        for t in &turns {
            assert_eq!(t.context_len, ctx, "turn {} continues token-exact", t.idx);
            assert!(!t.retokenized);
            ctx += t.token_ids.len();
        }
    }
    // streaming: role chunk, content chunks, a final chunk, then [DONE]
    let body = json!({"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 12, "stream": true, "user": "sess-2"});
    let (s, text) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &[],
        body.to_string().as_bytes(),
    );
    assert_eq!(s, 200);
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]", "{text}");
    let mut streamed = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        streamed.push_str(v["choices"][0]["delta"]["content"].as_str().unwrap_or(""));
    }
    // feedback, end
    let (s, _) = http(
        a,
        "POST",
        "/v1/sessions/sess-1/feedback",
        &[],
        br#"{"thumb": "up", "outcome": "resolved", "note": "great"}"#,
    );
    assert_eq!(s, 200);
    let (s, _) = http(a, "POST", "/v1/sessions/sess-1/end", &[], b"");
    assert_eq!(s, 200);
    let (s, m) = http(a, "GET", "/metrics", &[], b"");
    assert_eq!(s, 200);
    for line in m.lines().filter(|l| !l.starts_with('#') && !l.is_empty()) {
        let (name, value) = line.split_once(' ').unwrap();
        assert!(name.starts_with("turnwise_"), "{line}");
        value
            .parse::<f64>()
            .unwrap_or_else(|_| panic!("metric value {line}"));
    }
    assert!(m.contains("turnwise_completion_tokens_total"));
    let (s, models) = http(a, "GET", "/v1/models", &[], b"");
    assert_eq!(s, 200, "{models}");
    let store = Store::open(&db).unwrap();
    let s1 = store
        .sessions(None, 10)
        .unwrap()
        .into_iter()
        .find(|s| s.metadata["client_session_id"] == "sess-1")
        .unwrap();
    assert_eq!(s1.outcome_reward, Some(1.0));
    assert!(s1.ended_at.is_some());
    assert_eq!(store.feedback(s1.id).unwrap().len(), 2);
    let s2 = store
        .sessions(None, 10)
        .unwrap()
        .into_iter()
        .find(|s| s.metadata["client_session_id"] == "sess-2")
        .unwrap();
    let reply = store.turns(s2.id).unwrap().pop().unwrap();
    assert_eq!(reply.text, streamed, "what was streamed is what was logged");
}

#[test]
fn bad_requests_get_openai_errors_and_change_nothing() {
    let dir = tempdir();
    let db = dir.path().join("bad.db");
    let srv = Server::start(
        &db,
        &["--no-learn", "--api-key", "sekrit", "--max-body", "4096"],
    );
    let a = &srv.addr;
    let auth = [("Authorization", "Bearer sekrit")];
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let (s, b) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &[],
        ok.to_string().as_bytes(),
    );
    assert_eq!(s, 401, "{b}");
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (b"{not json".to_vec(), 400, "malformed JSON"),
        (json!({"messages": []}).to_string().into_bytes(), 400, "empty"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string().into_bytes(), 400, "unknown role"),
        (json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}).to_string().into_bytes(), 400, "last message"),
        (json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}).to_string().into_bytes(), 400, "max_tokens"),
        (json!({"messages": [{"role": "user", "content": "x".repeat(10000)}]}).to_string().into_bytes(), 413, "over"),
    ];
    for (body, status, why) in cases {
        let (s, b) = http(a, "POST", "/v1/chat/completions", &auth, &body);
        assert_eq!(s, status, "{why}: {b}");
        let v: Value = serde_json::from_str(&b).unwrap_or_else(|_| panic!("{why}: not JSON: {b}"));
        assert!(
            v["error"]["message"].as_str().unwrap().contains(why),
            "{why}: {b}"
        );
    }
    // stop lists: bounded, no empty string, strings only
    let many: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    let stops = [
        json!(""),
        json!(many),
        json!(["ok", 7]),
        json!(["x".repeat(300)]),
    ];
    for stop in stops {
        let body = json!({"messages": [{"role": "user", "content": "x"}], "stop": stop});
        let (s, b) = http(
            a,
            "POST",
            "/v1/chat/completions",
            &auth,
            body.to_string().as_bytes(),
        );
        assert_eq!(s, 400, "{b}");
        assert!(b.contains("stop"), "{b}");
    }
    // a body that ends before its Content-Length is a read error (400), not "too large"
    let mut sock = TcpStream::connect(a).unwrap();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sekrit\r\nContent-Length: 200\r\nContent-Type: application/json\r\n\r\n{{\"messages\"").unwrap();
    sock.shutdown(std::net::Shutdown::Write).unwrap();
    let mut raw = String::new();
    let _ = sock.read_to_string(&mut raw);
    assert!(raw.starts_with("HTTP/1.1 400"), "{raw}");
    assert!(raw.contains("could not be read"), "{raw}");
    let (s, b) = http(
        a,
        "POST",
        "/v1/sessions/nope/feedback",
        &auth,
        br#"{"thumb":"up"}"#,
    );
    assert_eq!(s, 404, "{b}");
    let (s, b) = http(
        a,
        "POST",
        "/v1/chat/completions",
        &auth,
        ok.to_string().as_bytes(),
    );
    assert_eq!(s, 200);
    let sid = serde_json::from_str::<Value>(&b).unwrap()["session_id"]
        .as_str()
        .unwrap()
        .to_string();
    // feedback names a turn of the session that the assistant wrote, or none
    for turn in [0, 7, -1] {
        let body = json!({"thumb": "up", "turn": turn}).to_string();
        let path = format!("/v1/sessions/{sid}/feedback");
        let (s, b) = http(a, "POST", &path, &auth, body.as_bytes());
        assert_eq!(s, 400, "turn {turn}: {b}");
    }
    // health, the adapters list without file paths, the conversations held in memory
    let (s, b) = http(a, "GET", "/healthz", &auth, b"");
    assert_eq!((s, b.contains("ok")), (200, true), "{b}");
    let (_, b) = http(a, "GET", "/v1/adapters", &auth, b"");
    assert!(!b.contains("path") && !b.contains(".adapters"), "{b}");
    let (_, b) = http(a, "GET", "/metrics", &auth, b"");
    assert!(b.contains("turnwise_live_sessions 1"), "{b}");
    let store = Store::open(&db).unwrap();
    let st = store.storage_stats().unwrap();
    assert_eq!(
        (st.sessions, st.turns),
        (1, 2),
        "only the good request left rows"
    );
    let ok: String = store
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
}

#[test]
fn kill_during_stream_and_training_loses_no_acknowledged_turn() {
    let dir = tempdir();
    let db = dir.path().join("fault.db");
    let srv = Server::start(&db, &["--learn-every", "1", "--gate-kl", "10"]);
    let a = srv.addr.clone();
    let first = json!({"messages": [{"role": "user", "content": "Where is order 555?"}], "max_tokens": 10, "session_id": "f1", "seed": 3});
    let (s, r) = chat(&a, first.clone());
    assert_eq!(s, 200);
    let acknowledged = r["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    // start a long stream and kill the server in the middle of it
    let mut sock = TcpStream::connect(&a).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 300, "stream": true, "session_id": "f2"}).to_string();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 512];
    let _ = sock.read(&mut buf).unwrap();
    srv.kill();
    let store = Store::open(&db).unwrap();
    let f1 = store
        .sessions(None, 10)
        .unwrap()
        .into_iter()
        .find(|s| s.metadata["client_session_id"] == "f1")
        .unwrap();
    assert_eq!(
        store.turns(f1.id).unwrap().last().unwrap().text.trim_end(),
        acknowledged.trim_end()
    );
    drop(store);

    // restart: the acknowledged session continues token-exact in the same stored session
    let srv = Server::start(&db, &["--learn-every", "1", "--gate-kl", "10"]);
    let a = srv.addr.clone();
    let mut msgs = first["messages"].as_array().unwrap().clone();
    msgs.push(json!({"role": "assistant", "content": acknowledged}));
    msgs.push(json!({"role": "user", "content": "Thanks."}));
    let (s, r) = chat(
        &a,
        json!({"messages": msgs, "max_tokens": 8, "session_id": "f1"}),
    );
    assert_eq!(s, 200, "{r}");
    {
        let store = Store::open(&db).unwrap();
        let turns = store.turns(f1.id).unwrap();
        assert_eq!(
            turns.len(),
            4,
            "continued in the same session after the restart"
        );
        assert_eq!(
            turns[2].context_len,
            turns[0].token_ids.len() + turns[1].token_ids.len()
        );
        assert!(!turns[2].retokenized);
    }
    // feedback + end triggers a background update; kill while it may be running
    http(
        &a,
        "POST",
        "/v1/sessions/f1/feedback",
        &[],
        br#"{"outcome": 1}"#,
    );
    http(&a, "POST", "/v1/sessions/f1/end", &[], b"");
    std::thread::sleep(Duration::from_millis(1500));
    srv.kill();
    let store = Store::open(&db).unwrap();
    for ad in store.adapters().unwrap() {
        if ad.status == AdapterStatus::Active {
            turnwise::adapter::Adapter::load(Path::new(&ad.path))
                .expect("the active adapter is complete");
        }
    }
    let ok: String = store
        .connection()
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok");
    drop(store);
    // and the server starts again on whatever is active
    let srv = Server::start(&db, &["--no-learn"]);
    let (s, _) = http(&srv.addr, "GET", "/healthz", &[], b"");
    assert_eq!(s, 200);
}

/// Two one-turn sessions `{prefix}0` (resolved) and `{prefix}1` (unresolved), each ended after
/// its feedback: enough for a background update with `--learn-every 2`.
fn two_sessions_with_outcomes(a: &str, prefix: &str) {
    two_sessions(a, prefix, true);
}

/// Two one-turn sessions `{prefix}0` (resolved) and `{prefix}1` (unresolved), ended; with
/// `learn` false they are held out of learning.
fn two_sessions(a: &str, prefix: &str, learn: bool) {
    for (i, outcome) in [(0, "resolved"), (1, "unresolved")] {
        let id = format!("{prefix}{i}");
        let (s, r) = chat(
            a,
            json!({"messages": [{"role": "user", "content": "Hello, I need help."}], "max_tokens": 8, "seed": i, "session_id": id, "learn": learn}),
        );
        assert_eq!(s, 200, "{r}");
        let fb = json!({"outcome": outcome}).to_string();
        let path = format!("/v1/sessions/{id}/feedback");
        assert_eq!(http(a, "POST", &path, &[], fb.as_bytes()).0, 200);
        let path = format!("/v1/sessions/{id}/end");
        assert_eq!(http(a, "POST", &path, &[], b"").0, 200);
    }
}

#[test]
fn background_learning_gates_and_hot_swaps_the_adapter() {
    let dir = tempdir();
    let db = dir.path().join("learn.db");
    let srv = Server::start(
        &db,
        &["--learn-every", "2", "--gate-kl", "10", "--algo", "grpo"],
    );
    let a = &srv.addr;
    two_sessions_with_outcomes(a, "l");
    let mut active = Value::Null;
    for _ in 0..240 {
        let (_, b) = http(a, "GET", "/v1/adapters", &[], b"");
        active = serde_json::from_str::<Value>(&b).unwrap()["active"].clone();
        if !active.is_null() {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(
        !active.is_null(),
        "the background update passed the gate and was activated"
    );
    let (_, r) = chat(
        a,
        json!({"messages": [{"role": "user", "content": "Hi again."}], "max_tokens": 4}),
    );
    assert_eq!(
        r["adapter_id"], active,
        "new requests sample with the new adapter"
    );
    let (_, m) = http(a, "GET", "/metrics", &[], b"");
    assert!(m.contains("turnwise_updates_total 1"), "{m}");
    // admin: roll back to the base model, unknown adapters are 404
    let (s, b) = http(a, "POST", "/v1/adapters/rollback", &[], b"");
    assert_eq!(s, 200, "{b}");
    assert_eq!(
        http(a, "POST", "/v1/adapters/999/activate", &[], b"").0,
        404
    );
    let (_, r) = chat(
        a,
        json!({"messages": [{"role": "user", "content": "Hi again."}], "max_tokens": 4}),
    );
    assert!(r["adapter_id"].is_null(), "{r}");
}

/// The gate can refuse: with a KL bound no real update meets, the background update writes its
/// candidate, the gate records the refusal, the candidate becomes `rejected` and replies keep
/// coming from the base model (no adapter becomes active).
#[test]
fn a_candidate_the_gate_refuses_stays_inactive() {
    let dir = tempdir();
    let db = dir.path().join("refused.db");
    let srv = Server::start(
        &db,
        &["--learn-every", "2", "--gate-kl", "1e-12", "--algo", "grpo"],
    );
    let a = &srv.addr;
    two_sessions_with_outcomes(a, "r");
    let mut rejected = None;
    for _ in 0..480 {
        let store = Store::open(&db).unwrap();
        rejected = store
            .adapters()
            .unwrap()
            .into_iter()
            .find(|ad| ad.status == AdapterStatus::Rejected);
        if rejected.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let rejected = rejected.expect("the update's candidate was judged and refused");
    let gate = &rejected.metrics["gate"];
    assert_eq!(gate["passed"], false, "{gate}");
    assert!(
        gate["reason"].as_str().is_some_and(|r| r.contains("KL")),
        "{gate}"
    );
    let (_, b) = http(a, "GET", "/v1/adapters", &[], b"");
    assert!(
        serde_json::from_str::<Value>(&b).unwrap()["active"].is_null(),
        "{b}"
    );
    let (_, r) = chat(
        a,
        json!({"messages": [{"role": "user", "content": "Hi again."}], "max_tokens": 4}),
    );
    assert!(
        r["adapter_id"].is_null(),
        "replies still come from the base model: {r}"
    );
}

#[test]
fn a_full_queue_is_429_and_a_client_that_leaves_cancels_but_is_logged() {
    let dir = tempdir();
    let db = dir.path().join("queue.db");
    let srv = Server::start(&db, &["--no-learn", "--queue", "1"]);
    let a = srv.addr.clone();
    // a long stream holds the only slot
    let mut sock = TcpStream::connect(&a).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 400,
                      "stream": true, "session_id": "long", "seed": 1})
    .to_string();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}", body.len()).unwrap();
    let mut buf = [0u8; 256];
    let _ = sock.read(&mut buf).unwrap(); // headers / first chunk: the slot is taken
    let mut s = TcpStream::connect(&a).unwrap();
    let b2 = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).to_string();
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{b2}", b2.len()).unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    assert!(raw.starts_with("HTTP/1.1 429"), "{raw}");
    assert!(raw.to_lowercase().contains("retry-after: 1"), "{raw}");
    assert!(raw.contains("rate_limit_error"), "{raw}");
    // the streaming client leaves: generation stops early and what was produced is logged
    drop(sock);
    let mut logged = None;
    for _ in 0..100 {
        std::thread::sleep(Duration::from_millis(100));
        let store = Store::open(&db).unwrap();
        if let Some(s) = store
            .sessions(None, 10)
            .unwrap()
            .into_iter()
            .find(|s| s.metadata["client_session_id"] == "long")
        {
            if let Some(t) = store
                .turns(s.id)
                .unwrap()
                .into_iter()
                .find(|t| t.role == turnwise::Role::Assistant)
            {
                logged = Some(t);
                break;
            }
        }
    }
    let t = logged.expect("the cancelled reply is in the log");
    assert_eq!(t.stop_reason.as_deref(), Some("cancelled"));
    assert!(t.token_ids.len() < 400);
    // the slot is free again
    let (s, _) = chat(
        &a,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(s, 200);
}

/// One reply at a time per session: a second request on a session whose reply is being
/// streamed, and `/end` during it, are 409 (they would interleave into one context, or let the
/// finishing job re-open an ended session). Conversations held in memory are bounded: beyond
/// `--max-live-sessions` the least recently used is dropped and restored from the log when its
/// client comes back.
#[test]
fn one_reply_at_a_time_per_session_and_bounded_conversations() {
    let dir = tempdir();
    let db = dir.path().join("busy.db");
    let srv = Server::start(&db, &["--no-learn", "--max-live-sessions", "2"]);
    let a = srv.addr.clone();
    let mut sock = TcpStream::connect(&a).unwrap();
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                      "max_tokens": 300, "stream": true, "session_id": "c1", "seed": 1})
    .to_string();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(sock);
    let mut line = String::new();
    while !line.contains("data:") {
        line.clear();
        reader.read_line(&mut line).unwrap(); // the stream has started
    }
    let again = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "session_id": "c1"});
    let (s, b) = chat(&a, again);
    assert_eq!(s, 409, "{b}");
    let (s, b) = http(&a, "POST", "/v1/sessions/c1/end", &[], b"");
    assert_eq!(s, 409, "{b}");
    let mut rest = String::new();
    reader.read_to_string(&mut rest).unwrap_or(0);
    assert!(rest.contains("[DONE]"), "{rest}");
    // after the reply the session can be ended
    let (s, b) = http(&a, "POST", "/v1/sessions/c1/end", &[], b"");
    assert_eq!(s, 200, "{b}");

    // three conversations, at most two in memory
    let mut first = Value::Null;
    for id in ["k1", "k2", "k3"] {
        let (s, r) = chat(
            &a,
            json!({"messages": [{"role": "user", "content": format!("Hello from {id}")}],
                   "max_tokens": 6, "session_id": id, "seed": 2}),
        );
        assert_eq!(s, 200, "{r}");
        if id == "k1" {
            first = r;
        }
    }
    let (_, m) = http(&a, "GET", "/metrics", &[], b"");
    assert!(m.contains("turnwise_live_sessions 2"), "{m}");
    // k1 was dropped from memory; its client continues it and the log has one session for it
    let reply = first["choices"][0]["message"]["content"].clone();
    let (s, r) = chat(
        &a,
        json!({"messages": [{"role": "user", "content": "Hello from k1"},
                            {"role": "assistant", "content": reply},
                            {"role": "user", "content": "And again"}],
               "max_tokens": 6, "session_id": "k1", "seed": 2}),
    );
    assert_eq!(s, 200, "{r}");
    let store = Store::open(&db).unwrap();
    let k1: Vec<i64> = store
        .sessions(None, 20)
        .unwrap()
        .into_iter()
        .filter(|s| s.metadata["client_session_id"] == "k1")
        .map(|s| s.id)
        .collect();
    assert_eq!(k1.len(), 1, "restored, not a new session: {k1:?}");
    assert_eq!(
        store.turns(k1[0]).unwrap().len(),
        4,
        "two user turns, two replies"
    );

    // a body that cannot fit the context window is refused before anything is rendered:
    // thousands of short messages (each re-rendering the whole conversation before the fix),
    // and one message longer than the window can hold whatever its tokens
    let many: Vec<Value> = (0..5000)
        .map(|_| json!({"role": "user", "content": "hi"}))
        .collect();
    let huge = vec![json!({"role": "user", "content": "a".repeat(900_000)})];
    for messages in [many, huge] {
        let (s, b) = chat(&a, json!({"messages": messages, "max_tokens": 4}));
        assert_eq!(s, 400, "{b}");
        assert!(b.to_string().contains("context window"), "{b}");
    }
}

/// Start-up after a crash: an active adapter that cannot be served (a damaged file) gives way to
/// the previous one with a warning instead of stopping the server, a version left `writing` is
/// marked rejected and a dead process's temporary adapter folder is removed.
#[test]
fn the_server_starts_on_the_previous_adapter_when_the_active_one_is_damaged() {
    use turnwise::adapter::{adapter_dir, adapters_root};
    let dir = tempdir();
    let db = dir.path().join("start.db");
    let mut store = Store::open(&db).unwrap();
    let mut ids = Vec::new();
    for seed in [1, 2] {
        let id = write_candidate(&store, &db, seed, None);
        store.activate_adapter(id).unwrap();
        ids.push(id);
    }
    let writing = store
        .register_adapter(None, |id| {
            adapter_dir(&db, id).to_string_lossy().into_owned()
        })
        .unwrap();
    let tmp = adapters_root(&db).join(".000099.tmp-4000000");
    std::fs::create_dir_all(&tmp).unwrap();
    drop(store);
    // damage the active adapter's tensors
    for f in std::fs::read_dir(adapter_dir(&db, ids[1])).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "safetensors") {
            std::fs::write(&p, b"not a safetensors file").unwrap();
        }
    }
    let srv = Server::start(&db, &["--no-learn"]);
    let (s, b) = http(&srv.addr, "GET", "/v1/adapters", &[], b"");
    assert_eq!(s, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(v["active"], json!(ids[0]), "{b}");
    let (s, _) = chat(
        &srv.addr,
        json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    );
    assert_eq!(s, 200);
    let store = Store::open(&db).unwrap();
    assert_eq!(
        store.adapter(ids[1]).unwrap().status,
        AdapterStatus::Rejected
    );
    assert_eq!(
        store.adapter(writing).unwrap().status,
        AdapterStatus::Rejected
    );
    assert!(!tmp.exists(), "the dead process's temporary folder is gone");
}

/// Connections are bounded and must send their headers in time: with room for two, a third is
/// closed at once; two that send nothing are disconnected after the header deadline, and the
/// server then answers again.
#[test]
fn idle_connections_are_capped_and_timed_out() {
    let dir = tempdir();
    let db = dir.path().join("conns.db");
    let srv = Server::start(
        &db,
        &[
            "--no-learn",
            "--max-connections",
            "2",
            "--max-connections-per-peer",
            "2",
            "--header-timeout-s",
            "1",
        ],
    );
    let a = srv.addr.clone();
    let idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&a).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(&a).unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        matches!(third.read(&mut buf), Ok(0)),
        "a connection over the cap is closed at once"
    );
    // the idle two are closed by the header deadline
    for mut s in idle {
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut raw = Vec::new();
        let _ = s.read_to_end(&mut raw);
        assert!(
            !String::from_utf8_lossy(&raw).contains("200 OK"),
            "an idle connection gets no answer"
        );
    }
    let (s, b) = http(&a, "GET", "/healthz", &[], b"");
    assert_eq!(s, 200, "{b}");
}

/// Requests the HTTP parser rejects before any route runs (a garbage request line, headers
/// over 128 KiB, a path too long) are answered in OpenAI's error shape like every other
/// error, not with hyper's empty bodies.
#[test]
fn requests_the_parser_rejects_get_json_errors() {
    let dir = tempdir();
    let db = dir.path().join("parse.db");
    let srv = Server::start(&db, &["--no-learn"]);
    let raw = |req: Vec<u8>| -> String {
        let mut s = TcpStream::connect(&srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        s.write_all(&req).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    let host = format!("Host: {}\r\n", srv.addr);
    let cases = [
        (b"GARBAGE\r\n\r\n".to_vec(), 400),
        (
            [
                b"GET /healthz HTTP/1.1\r\n".to_vec(),
                host.clone().into_bytes(),
                b"X-Big: ".to_vec(),
                vec![b'a'; 500_000],
                b"\r\n\r\n".to_vec(),
            ]
            .concat(),
            431,
        ),
        (
            [
                b"GET /".to_vec(),
                vec![b'a'; 70_000],
                b" HTTP/1.1\r\n".to_vec(),
                host.clone().into_bytes(),
                b"\r\n".to_vec(),
            ]
            .concat(),
            414,
        ),
    ];
    for (req, code) in cases {
        let answer = raw(req);
        assert!(
            answer.starts_with(&format!("HTTP/1.1 {code} ")),
            "{}",
            &answer[..answer.len().min(300)]
        );
        let (head, body) = answer.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("content-type: application/json"), "{head}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error", "{body}");
    }
    let (s, b) = http(&srv.addr, "GET", "/healthz", &[], b"");
    assert_eq!(s, 200, "{b}");
}

/// One peer cannot hold the whole connection budget: with room for four and two per peer,
/// 127.0.0.1's third idle connection is closed at once, while another peer (127.0.0.2, also
/// loopback) still gets an answer.
#[test]
fn one_peer_cannot_hold_every_connection() {
    let dir = tempdir();
    let db = dir.path().join("peers.db");
    let srv = Server::start(
        &db,
        &[
            "--no-learn",
            "--max-connections",
            "4",
            "--max-connections-per-peer",
            "2",
            "--header-timeout-s",
            "5",
        ],
    );
    let a = srv.addr.clone();
    let _idle: Vec<TcpStream> = (0..2).map(|_| TcpStream::connect(&a).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(200));
    let mut third = TcpStream::connect(&a).unwrap();
    third
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 64];
    assert!(
        matches!(third.read(&mut buf), Ok(0)),
        "a peer's connection over its share is closed at once"
    );
    // another loopback address is another peer
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut other = rt.block_on(async {
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        sock.connect(a.parse().unwrap())
            .await
            .unwrap()
            .into_std()
            .unwrap()
    });
    other.set_nonblocking(false).unwrap();
    other
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        other,
        "GET /healthz HTTP/1.1\r\nHost: {a}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut raw = Vec::new();
    other.read_to_end(&mut raw).unwrap();
    assert!(
        String::from_utf8_lossy(&raw).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&raw)
    );
}

/// Fault cycles on one database: each cycle starts the server, gets one reply acknowledged,
/// then kills the server with SIGKILL in one of three places — in the middle of a streamed
/// reply, while a background update may be writing its adapter, or right after an activation
/// request — and checks that every reply acknowledged so far is in the log, that SQLite's
/// integrity check passes and that the active adapter loads; at the end the server starts.
/// `TURNWISE_FAULT_CYCLES` sets the number of cycles (default 3: one of each).
#[test]
fn fault_cycles_lose_no_acknowledged_turn() {
    let cycles: usize = std::env::var("TURNWISE_FAULT_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let dir = tempdir();
    let db = dir.path().join("cycles.db");
    let args = ["--learn-every", "1", "--gate-kl", "10"];
    let mut acknowledged: Vec<(String, String)> = Vec::new();
    let (mut lost, mut unloadable, mut ungated) = (0usize, 0usize, 0usize);
    for cycle in 0..cycles {
        let srv = Server::start(&db, &args);
        let a = srv.addr.clone();
        let id = format!("c{cycle}");
        let (s, r) = chat(
            &a,
            json!({"messages": [{"role": "user", "content": format!("Where is order {}?", 10_000 + cycle)}],
                   "max_tokens": 8, "session_id": id, "seed": cycle}),
        );
        assert_eq!(s, 200, "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        acknowledged.push((id.clone(), text.to_string()));
        match cycle % 3 {
            0 => {
                let mut sock = TcpStream::connect(&a).unwrap();
                let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
                                  "max_tokens": 300, "stream": true, "session_id": format!("s{cycle}")})
                .to_string();
                write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {}\r\nContent-Type: application/json\r\n\r\n{body}", body.len()).unwrap();
                let mut buf = [0u8; 512];
                let _ = sock.read(&mut buf).unwrap();
            }
            1 => {
                let path = format!("/v1/sessions/{id}/feedback");
                http(&a, "POST", &path, &[], br#"{"outcome": 1}"#);
                http(&a, "POST", &format!("/v1/sessions/{id}/end"), &[], b"");
                // somewhere in the update: loading, stepping, writing, registering
                std::thread::sleep(Duration::from_millis(200 + 300 * (cycle as u64 % 7)));
            }
            _ => {
                let candidate = Store::open(&db)
                    .unwrap()
                    .adapters()
                    .unwrap()
                    .into_iter()
                    .find(|ad| {
                        ad.status == AdapterStatus::Candidate || ad.status == AdapterStatus::Retired
                    });
                if let Some(ad) = candidate {
                    let mut sock = TcpStream::connect(&a).unwrap();
                    let path = format!("/v1/adapters/{}/activate", ad.id);
                    write!(
                        sock,
                        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 0\r\n\r\n"
                    )
                    .unwrap();
                    let mut buf = [0u8; 16];
                    let _ = sock.read(&mut buf); // the first bytes of the answer, then kill
                }
            }
        }
        srv.kill();
        let store = Store::open(&db).unwrap();
        for (sid, text) in &acknowledged {
            let found = store
                .sessions(None, 10_000)
                .unwrap()
                .into_iter()
                .filter(|s| s.metadata["client_session_id"] == sid.as_str())
                .any(|s| {
                    store
                        .turns(s.id)
                        .unwrap()
                        .iter()
                        .any(|t| t.text.trim_end() == text.trim_end())
                });
            lost += usize::from(!found);
        }
        let ok: String = store
            .connection()
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .unwrap();
        assert_eq!(ok, "ok", "cycle {cycle}");
        if let Some(ad) = store.active_adapter().unwrap() {
            unloadable +=
                usize::from(turnwise::adapter::Adapter::load(Path::new(&ad.path)).is_err());
            ungated += usize::from(!turnwise::learn::gate::passed(&ad.metrics));
        }
    }
    let srv = Server::start(&db, &["--no-learn"]);
    let (s, _) = http(&srv.addr, "GET", "/healthz", &[], b"");
    assert_eq!(s, 200);
    let store = Store::open(&db).unwrap();
    let adapters = store.adapters().unwrap().len();
    eprintln!(
        "fault cycles: {cycles}, acknowledged replies {}, lost {lost}, unloadable active adapters \
         {unloadable}, ungated active adapters {ungated}, adapters written {adapters}",
        acknowledged.len()
    );
    assert_eq!((lost, unloadable, ungated), (0, 0, 0));
}

/// A session of two greedy replies of `max_tokens` each (`ignore_eos`: always the full length)
/// to `opening` and then `follow`, sent with `"learn": learn`; returns the replies.
fn greedy_two_turns(
    addr: &str,
    sid: &str,
    opening: &str,
    follow: &str,
    max_tokens: usize,
    learn: bool,
) -> Vec<String> {
    let mut messages = vec![json!({"role": "user", "content": opening})];
    let mut replies = Vec::new();
    for next in [Some(follow), None] {
        let (s, v) = chat(
            addr,
            json!({"messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                   "ignore_eos": true, "session_id": sid, "learn": learn}),
        );
        assert_eq!(s, 200, "{v}");
        assert_eq!(
            v["usage"]["completion_tokens"], max_tokens,
            "ignore_eos: the full length"
        );
        let text = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string();
        messages.push(json!({"role": "assistant", "content": text.clone()}));
        replies.push(text);
        if let Some(f) = next {
            messages.push(json!({"role": "user", "content": f}));
        }
    }
    replies
}

/// Continuous batching through the real server: four clients with two-turn sessions at once
/// are all answered in full, their decoding steps are shared (the engine's batch counters in
/// `/metrics`), every turn is logged token-exact, and a session answered while three others
/// share its steps says what it says alone.
#[test]
fn concurrent_sessions_share_decoding_steps_and_are_all_logged() {
    let dir = tempdir();
    let db = dir.path().join("batch.db");
    let srv = Server::start(&db, &["--no-learn", "--parallel", "4"]);
    let a = srv.addr.clone();
    let session = |sid: String, order: usize| -> Vec<String> {
        let opening = format!("Hi, my order {order} has not arrived. Where is it?");
        greedy_two_turns(
            &a,
            &sid,
            &opening,
            "Thanks. Can I get a refund if it is lost?",
            24,
            true,
        )
    };
    let solo = session("solo".into(), 48213);
    let metric = |name: &str| -> f64 {
        let (_, m) = http(&a, "GET", "/metrics", &[], b"");
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(-1.0)
    };
    let (steps0, rows0, parked0) = (
        metric("turnwise_decode_steps_total"),
        metric("turnwise_decode_rows_total"),
        metric("turnwise_caches_parked_total"),
    );
    assert!(parked0 >= 0.0, "/metrics counts parked caches");
    let together: Vec<Vec<String>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|i| {
                let session = &session;
                s.spawn(move || session(format!("c{i}"), if i == 0 { 48213 } else { 50000 + i }))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let steps = metric("turnwise_decode_steps_total") - steps0;
    let rows = metric("turnwise_decode_rows_total") - rows0;
    assert!(
        rows / steps > 1.5,
        "{rows} rows in {steps} steps: the sessions shared steps"
    );
    assert!(metric("turnwise_decode_batch_max") >= 3.0);
    // the solo session stays open: its idle cache leaves the context when the four are
    // admitted (docs/batching.md, idle caches are parked)
    assert!(
        metric("turnwise_caches_parked_total") - parked0 >= 1.0,
        "the idle solo session's cache was parked"
    );
    // with the default model's repacked kernels a batch of rows is multiplied by other
    // kernels than one row, so a greedy reply near a tie may differ from the one written alone
    // (docs/batching.md); it is reported, not asserted
    eprintln!(
        "alone and in a batch: {} of {} greedy replies the same",
        together[0]
            .iter()
            .zip(&solo)
            .filter(|(a, b)| a == b)
            .count(),
        solo.len()
    );
    drop(srv);
    let store = Store::open(&db).unwrap();
    let sessions = store.sessions(None, 100).unwrap();
    assert_eq!(sessions.len(), 5);
    for s in sessions {
        let turns = store.turns(s.id).unwrap();
        assert_eq!(
            turns.len(),
            4,
            "two user and two assistant turns of {}",
            s.metadata
        );
        let replies = turns.iter().filter(|t| t.role == turnwise::Role::Assistant);
        assert!(replies.into_iter().all(|t| t.token_ids.len() == 24));
    }
}

/// Sends `request` as it is (raw bytes, a client that sets its own headers); returns the status.
fn raw_status(addr: &str, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s.write_all(request.as_bytes()).unwrap();
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    let status = raw
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, raw)
}

/// Browser protection: a web page can send requests to 127.0.0.1 but cannot name it as its
/// host, cannot hide its origin, and can only send "simple" bodies without asking first; all of
/// those are refused and record nothing. Outcomes beyond `--reward-range` are refused too.
#[test]
fn a_web_page_cannot_drive_the_server_and_outcomes_are_bounded() {
    let dir = tempdir();
    let db = dir.path().join("guard.db");
    let srv = Server::start(
        &db,
        &["--no-learn", "--allow-origin", "http://app.example:3000"],
    );
    let a = &srv.addr;
    let (s, r) = chat(
        a,
        json!({"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "session_id": "g1"}),
    );
    assert_eq!(s, 200, "{r}");
    let fb = br#"{"outcome": 1}"#;
    let path = "/v1/sessions/g1/feedback";
    // a cross-origin page (the README's curl probe)
    let (s, b) = http(a, "POST", path, &[("Origin", "http://evil.example")], fb);
    assert_eq!(s, 403, "{b}");
    assert!(
        b.contains("permission_error") && b.contains("--allow-origin"),
        "{b}"
    );
    // DNS rebinding: the page's own host name resolving to 127.0.0.1
    let body = std::str::from_utf8(fb).unwrap();
    let (s, raw) = raw_status(
        a,
        &format!("POST {path} HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()),
    );
    assert_eq!(s, 403, "{raw}");
    // a "simple" cross-origin POST: text/plain, or a form
    for ct in [
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
    ] {
        let (s, raw) = raw_status(
            a,
            &format!("POST {path} HTTP/1.1\r\nHost: {a}\r\nContent-Type: {ct}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()),
        );
        assert_eq!(s, 415, "{ct}: {raw}");
    }
    // no Content-Type at all on an action without a body (rollback, end)
    let (s, raw) = raw_status(
        a,
        &format!("POST /v1/sessions/g1/end HTTP/1.1\r\nHost: {a}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
    );
    assert_eq!(s, 415, "{raw}");
    // reads from another origin are refused too (a rebinding page could read replies)
    let (s, _) = http(
        a,
        "GET",
        "/v1/adapters",
        &[("Origin", "http://evil.example")],
        b"",
    );
    assert_eq!(s, 403);
    // nothing of the above was recorded; the allowed origin and localhost names work
    let store = Store::open(&db).unwrap();
    let n: i64 = store
        .connection()
        .query_row("SELECT COUNT(*) FROM feedback", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 0, "refused requests recorded nothing");
    let (s, b) = http(
        a,
        "POST",
        path,
        &[("Origin", "http://app.example:3000")],
        fb,
    );
    assert_eq!(s, 200, "{b}");
    let port = a.rsplit(':').next().unwrap();
    let (s, raw) = raw_status(
        a,
        &format!("GET /healthz HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n"),
    );
    assert_eq!(s, 200, "{raw}");
    // every error is in OpenAI's shape: a wrong method, an adapter id that is not a number,
    // a note on a turn the session does not have
    let (s, b) = http(a, "GET", "/v1/chat/completions", &[], b"");
    assert_eq!(s, 405, "{b}");
    assert!(b.contains("\"error\""), "{b}");
    let (s, b) = http(a, "POST", "/v1/adapters/abc/activate", &[], b"");
    assert_eq!(s, 400, "{b}");
    assert!(
        b.contains("\"error\"") && b.contains("not an integer"),
        "{b}"
    );
    for turn in [99, -5] {
        let note = json!({"note": "hm", "turn": turn}).to_string();
        let (s, b) = http(a, "POST", path, &[], note.as_bytes());
        assert_eq!(s, 400, "turn {turn}: {b}");
    }
    // outcomes: the default range is [-1, 1]; 1.7e308 from one client is refused at the door
    for (v, want) in [
        (json!(1.7e308), 400),
        (json!(-1.5), 400),
        (json!(-1.0), 200),
        (json!(0.25), 200),
    ] {
        let (s, b) = http(
            a,
            "POST",
            path,
            &[],
            json!({"outcome": v}).to_string().as_bytes(),
        );
        assert_eq!(s, want, "outcome {v}: {b}");
        if want == 400 {
            assert!(b.contains("--reward-range"), "{b}");
        }
    }
}

/// No adapter becomes active without a gate verdict: candidates a crash left unjudged are
/// judged at start-up (one passes the KL bound, one does not and is rejected), and activating
/// through the API a candidate that has not passed the gate needs `{"force": true}`, which is
/// recorded with the adapter.
#[test]
fn unjudged_candidates_are_gated_at_start_up_and_forced_activation_is_explicit() {
    let dir = tempdir();
    let db = dir.path().join("gate.db");
    let candidate = |store: &Store, seed: u64, kl: f64| {
        write_candidate(store, &db, seed, Some(&json!({"approx_kl": kl})))
    };
    let store = Store::open(&db).unwrap();
    let (near, far) = (candidate(&store, 1, 0.01), candidate(&store, 2, 3.0));
    drop(store);
    let srv = Server::start(&db, &["--no-learn"]);
    let a = &srv.addr;
    let store = Store::open(&db).unwrap();
    let rec = store.adapter(near).unwrap();
    assert_eq!(rec.status, AdapterStatus::Candidate);
    assert_eq!(rec.metrics["gate"]["passed"], true, "{}", rec.metrics);
    let rec = store.adapter(far).unwrap();
    assert_eq!(rec.status, AdapterStatus::Rejected);
    assert_eq!(rec.metrics["gate"]["passed"], false, "{}", rec.metrics);
    // the judged candidate activates; a rejected one never does, forced or not
    let (s, b) = http(
        a,
        "POST",
        &format!("/v1/adapters/{near}/activate"),
        &[],
        b"",
    );
    assert_eq!(s, 200, "{b}");
    let (s, b) = http(
        a,
        "POST",
        &format!("/v1/adapters/{far}/activate"),
        &[],
        br#"{"force": true}"#,
    );
    assert_eq!(s, 400, "{b}");
    // a candidate written while the server runs (an offline `train`) has no verdict
    let fresh = candidate(&store, 3, 0.01);
    let (s, b) = http(
        a,
        "POST",
        &format!("/v1/adapters/{fresh}/activate"),
        &[],
        b"",
    );
    assert_eq!(s, 409, "{b}");
    assert!(b.contains("force"), "{b}");
    assert_eq!(store.active_adapter().unwrap().map(|r| r.id), Some(near));
    let (s, b) = http(
        a,
        "POST",
        &format!("/v1/adapters/{fresh}/activate"),
        &[],
        br#"{"force": true}"#,
    );
    assert_eq!(s, 200, "{b}");
    let rec = store.adapter(fresh).unwrap();
    assert_eq!(rec.status, AdapterStatus::Active);
    assert!(rec.metrics["forced"].is_object(), "{}", rec.metrics);
}

/// Held-out evaluation traffic (`"learn": false` on a request) is logged like any other session
/// but never trained on: it does not count towards the learner's trigger, the update that runs
/// after two ordinary sessions learns from those two only, `turnwise train`'s selection skips
/// it, and an export keeps it held out where it is imported.
#[test]
fn held_out_sessions_are_logged_but_never_learned_from() {
    let dir = tempdir();
    let db = dir.path().join("held.db");
    let srv = Server::start(
        &db,
        &["--learn-every", "2", "--gate-kl", "10", "--algo", "grpo"],
    );
    let a = &srv.addr;
    let metric = |name: &str| -> f64 {
        let (_, m) = http(a, "GET", "/metrics", &[], b"");
        m.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or(f64::NAN)
    };
    two_sessions(a, "h", false);
    // a session held out from its second request on: held out for good
    let first = json!({"messages": [{"role": "user", "content": "Hello, I need help."}], "max_tokens": 8, "seed": 3, "session_id": "late"});
    let (s, r) = chat(a, first);
    assert_eq!(s, 200, "{r}");
    let reply = r["choices"][0]["message"]["content"].as_str().unwrap();
    let second = json!({"messages": [
        {"role": "user", "content": "Hello, I need help."},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "It is order 12345."}
    ], "max_tokens": 8, "session_id": "late", "learn": false});
    let (s, r) = chat(a, second);
    assert_eq!(s, 200, "{r}");
    let fb = json!({"outcome": "resolved"}).to_string();
    assert_eq!(
        http(a, "POST", "/v1/sessions/late/feedback", &[], fb.as_bytes()).0,
        200
    );
    assert_eq!(http(a, "POST", "/v1/sessions/late/end", &[], b"").0, 200);
    assert_eq!(metric("turnwise_sessions_learnable_total"), 0.0);
    two_sessions_with_outcomes(a, "n");
    assert_eq!(metric("turnwise_sessions_learnable_total"), 2.0);
    let mut updates = 0.0;
    for _ in 0..480 {
        updates = metric("turnwise_updates_total");
        if updates >= 1.0 && metric("turnwise_update_running") == 0.0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(
        updates, 1.0,
        "the two ordinary sessions triggered one update"
    );
    let store = Store::open(&db).unwrap();
    let mut st = store
        .connection()
        .prepare(
            "SELECT client_session_id, held_out, learned_at IS NOT NULL FROM sessions
             ORDER BY client_session_id",
        )
        .unwrap();
    let rows: Vec<(String, i64, bool)> = st
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(
        rows,
        vec![
            ("h0".to_string(), 1, false),
            ("h1".to_string(), 1, false),
            ("late".to_string(), 1, false),
            ("n0".to_string(), 0, true),
            ("n1".to_string(), 0, true),
        ]
    );
    let selectable: Vec<i64> = store
        .training_sessions(None, None, false, 100)
        .unwrap()
        .iter()
        .map(|s| s.id)
        .collect();
    assert_eq!(selectable.len(), 2, "{selectable:?}");
    drop(st);
    // the export carries the mark, and an import of it keeps the sessions out of training
    let exported = dir.path().join("held.jsonl");
    let ex = turnwise(&db)
        .args(["export", "--out"])
        .arg(&exported)
        .output()
        .unwrap();
    assert!(ex.status.success(), "{ex:?}");
    let text = std::fs::read_to_string(&exported).unwrap();
    let held: usize = text
        .lines()
        .filter(|l| serde_json::from_str::<Value>(l).unwrap()["metadata"]["held_out"] == true)
        .count();
    assert_eq!(held, 3, "{text}");
    let db2 = dir.path().join("imported.db");
    let im = turnwise(&db2)
        .arg("import")
        .arg(&exported)
        .output()
        .unwrap();
    assert!(im.status.success(), "{im:?}");
    let imported = Store::open(&db2).unwrap();
    assert_eq!(imported.sessions(None, 100).unwrap().len(), 5);
    assert_eq!(
        imported
            .training_sessions(None, None, false, 100)
            .unwrap()
            .len(),
        2
    );
}

/// The sampler extensions an application with tools sends — digits taken greedily and the
/// order-id slot limited to the ids the conversation holds — reach the sampler (the logged turn
/// records them), and an id slot that is not a short list of digit strings is refused.
#[test]
fn id_slot_and_greedy_digits_reach_the_sampler_and_bad_slots_are_refused() {
    let dir = tempdir();
    let db = dir.path().join("slot.db");
    let srv = Server::start(&db, &["--no-learn"]);
    let a = &srv.addr;
    let (s, r) = chat(
        a,
        json!({"messages": [{"role": "user", "content": "Refund order 48213, please."}],
               "max_tokens": 8, "temperature": 0.7, "seed": 1, "session_id": "slot",
               "greedy_digits": true, "id_slot": ["48213"]}),
    );
    assert_eq!(s, 200, "{r}");
    let store = Store::open(&db).unwrap();
    let sampler: String = store
        .connection()
        .query_row(
            "SELECT t.sampler FROM turns t JOIN sessions s ON s.id = t.session_id
             WHERE s.client_session_id = 'slot' AND t.role = 'assistant'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    let sampler: Value = serde_json::from_str(&sampler).unwrap();
    assert_eq!(sampler["greedy_digits"], true, "{sampler}");
    assert_eq!(sampler["id_slot"], json!(["48213"]), "{sampler}");
    for bad in [
        json!(["12a"]),
        json!([""]),
        json!(["1".repeat(21)]),
        json!(vec!["1"; 65]),
    ] {
        let (s, r) = chat(
            a,
            json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                   "id_slot": bad}),
        );
        assert_eq!(s, 400, "{r}");
        assert!(
            r["error"]["message"].as_str().unwrap().contains("id_slot"),
            "{r}"
        );
    }
}

#[test]
fn a_session_played_alone_repeats_bit_for_bit_whatever_the_server_did_before() {
    let dir = tempdir();
    let db = dir.path().join("alone.db");
    let srv = Server::start(&db, &["--no-learn", "--parallel", "4"]);
    let a = srv.addr.clone();
    // two greedy turns of a held-out session
    let session = |sid: &str, opening: &str| {
        greedy_two_turns(
            &a,
            sid,
            opening,
            "It is order 48213. Can I get a refund?",
            16,
            false,
        )
    };
    let opening = "Hi, my parcel never came. What can you do?";
    let first = session("e1", opening);
    // as many sessions as the server has sequences, with the same opening, decode it in shared
    // batches and take every sequence over: the next session copies its prefix from them
    std::thread::scope(|s| {
        for i in 0..4 {
            let session = &session;
            s.spawn(move || session(&format!("x{i}"), opening));
        }
    });
    let again = session("e2", opening);
    drop(srv);
    let store = Store::open(&db).unwrap();
    let logprobs = |client: &str| -> Vec<Vec<u32>> {
        let sid = store.session_of_client(client, false).unwrap().unwrap();
        store
            .turns(sid)
            .unwrap()
            .iter()
            .filter(|t| t.role == turnwise::Role::Assistant)
            .map(|t| {
                let lp = store.token_logprobs(t.id).unwrap().unwrap();
                lp.logp_full.iter().map(|x| x.to_bits()).collect()
            })
            .collect()
    };
    // what the live desk's held-out evaluations rely on (customers pause meanwhile)
    assert_eq!(first, again, "the same replies");
    let (l1, l2) = (logprobs("e1"), logprobs("e2"));
    assert_eq!(l1.iter().map(Vec::len).sum::<usize>(), 32);
    assert_eq!(l1, l2, "bit-identical log-probs after other sessions ran");
}
