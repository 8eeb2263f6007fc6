//! Offline replay: import JSON Lines chat logs into the turn log, and export them back.
//!
//! One conversation per line: `{"messages": [{"role", "content"}, …], "outcome"?, "reference"?,
//! "group"?, "metadata"?}` in OpenAI's chat format (assistant `tool_calls` are kept, rendered into
//! the assistant's text as `<tool_call>{json}</tool_call>`). Each conversation is tokenised once
//! with the template and its assistant turns are scored by the frozen policy in one prefill, so
//! they carry log-probs and features (marked `rescored`) like generated turns.

use std::io::{BufRead, Write};

use serde::Deserialize;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
use crate::policy::{Engine, Message, Role};
use crate::session::Recorder;
use crate::store::{Behavior, Features, NewSession, NewTurn, Source, Store, TokenLogprobs};

/// One parsed conversation.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    /// messages in order
    pub messages: Vec<Message>,
    /// outcome reward (resolved = 1, unresolved = 0)
    pub outcome: Option<f64>,
    /// ground-truth final answer
    pub reference: Option<String>,
    /// group key
    pub group: Option<String>,
    /// free-form metadata
    pub metadata: Value,
}

#[derive(Deserialize)]
struct RawLine {
    messages: Option<Vec<RawMessage>>,
    #[serde(default)]
    outcome: Option<Value>,
    #[serde(default)]
    reference: Option<String>,
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    metadata: Option<Value>,
}

#[derive(Deserialize)]
struct RawMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
}

/// The text of an OpenAI message `content`: a string, an array of text parts, or null.
///
/// # Errors
/// A reason for any other shape.
pub fn content_text(v: Option<&Value>) -> std::result::Result<String, String> {
    match v {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(|p| {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => Ok(t.to_string()),
                    _ => Err("only text content parts are supported".to_string()),
                }
            })
            .collect::<std::result::Result<Vec<_>, _>>()
            .map(|v| v.join("")),
        Some(_) => Err("content must be a string, an array of text parts, or null".into()),
    }
}

/// Parses and validates one line. The error is the reason to report.
///
/// # Errors
/// A human-readable reason when the line is not an acceptable conversation.
pub fn parse_line(bytes: &[u8]) -> std::result::Result<Conversation, String> {
    let text = std::str::from_utf8(bytes)
        .map_err(|e| format!("invalid UTF-8 at byte {}", e.valid_up_to()))?;
    if text.trim().is_empty() {
        return Err("empty line".into());
    }
    let raw: RawLine =
        serde_json::from_str(text).map_err(|e| format!("not a JSON conversation: {e}"))?;
    let raw_msgs = raw.messages.ok_or("missing \"messages\"")?;
    if raw_msgs.is_empty() {
        return Err("\"messages\" is empty".into());
    }
    let mut messages = Vec::with_capacity(raw_msgs.len());
    for (i, m) in raw_msgs.iter().enumerate() {
        let role =
            Role::parse(&m.role).map_err(|_| format!("message {i}: unknown role {:?}", m.role))?;
        let mut content =
            content_text(m.content.as_ref()).map_err(|e| format!("message {i}: {e}"))?;
        if let Some(calls) = &m.tool_calls {
            if role != Role::Assistant {
                return Err(format!(
                    "message {i}: only assistant messages may have tool_calls"
                ));
            }
            for c in calls {
                let f = c.get("function").unwrap_or(c);
                let call = json!({"name": f.get("name"), "arguments": f.get("arguments")});
                if !content.is_empty() {
                    content.push('\n');
                }
                content.push_str(&format!("<tool_call>{call}</tool_call>"));
            }
        }
        if content.contains('\0') {
            return Err(format!("message {i}: contains a NUL character"));
        }
        // an empty reply is something a policy does (it ended its turn at once) and what
        // Turnwise's own export writes for it; an empty system or user message is not a chat
        if content.trim().is_empty() && !matches!(role, Role::Tool | Role::Assistant) {
            return Err(format!("message {i}: empty {} message", role.as_str()));
        }
        if role == Role::System && i != 0 {
            return Err(format!("message {i}: a system message must come first"));
        }
        messages.push(Message::new(role, content));
    }
    if messages
        .iter()
        .find(|m| m.role != Role::System)
        .map(|m| m.role)
        == Some(Role::Assistant)
    {
        return Err(
            "the conversation opens with an assistant message (nothing prompted it)".into(),
        );
    }
    if !messages.iter().any(|m| m.role == Role::Assistant) {
        return Err("no assistant message: nothing to learn from".into());
    }
    let outcome = match raw.outcome {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => Some(
            n.as_f64()
                .filter(|v| v.is_finite())
                .ok_or("outcome is not finite")?,
        ),
        Some(Value::String(s)) if s == "resolved" => Some(1.0),
        Some(Value::String(s)) if s == "unresolved" => Some(0.0),
        Some(other) => {
            return Err(format!(
                "outcome must be a number, \"resolved\" or \"unresolved\", not {other}"
            ))
        }
    };
    Ok(Conversation {
        messages,
        outcome,
        reference: raw.reference,
        group: raw.group,
        metadata: raw.metadata.unwrap_or_else(|| json!({})),
    })
}

/// Stable hash of a conversation's content (what makes a re-import a duplicate).
pub fn content_hash(c: &Conversation) -> String {
    let canon = json!({
        "messages": c.messages.iter().map(|m| json!([m.role.as_str(), m.content])).collect::<Vec<_>>(),
        "outcome": c.outcome, "reference": c.reference, "group": c.group,
    });
    hex::encode(Sha256::digest(canon.to_string().as_bytes()))
}

/// What an import did.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct ImportSummary {
    /// sessions created
    pub imported: usize,
    /// lines already imported before (same content hash)
    pub duplicates: usize,
    /// bad lines: (line number from 1, reason)
    pub skipped: Vec<(usize, String)>,
}

/// Tokenises and rescores one conversation and stores it as a session. Returns `None` for a
/// duplicate.
///
/// # Errors
/// Engine errors (context overflow among them) and store errors; nothing is stored then.
pub fn import_conversation(
    engine: &Engine,
    store: &mut Store,
    c: &Conversation,
) -> Result<Option<i64>> {
    if store.session_by_hash(&content_hash(c))?.is_some() {
        return Ok(None);
    }
    let scored = rescore_conversation(engine, c)?;
    store_rescored(store, &scored)
}

/// A conversation tokenised and rescored by an engine, ready to be stored
/// ([`store_rescored`]); the engine and the store are separate steps so that several engines
/// can rescore while the conversations are still stored in a fixed order.
#[derive(Debug, Clone, PartialEq)]
pub struct RescoredConversation {
    session: NewSession,
    rows: Vec<NewTurn>,
    outcome: Option<f64>,
}

/// Tokenises `c` with the engine's chat template and rescores its assistant turns in one
/// prefill (log-probs and hidden states of every assistant token).
///
/// # Errors
/// Engine errors (context overflow among them); a chat template that is not append-only.
pub fn rescore_conversation(engine: &Engine, c: &Conversation) -> Result<RescoredConversation> {
    let hash = content_hash(c);
    // a key no live session uses; the engine forgets it at the end
    let key = u64::MAX - (u64::from_str_radix(&hash[..12], 16).unwrap_or(0));
    let result = (|| {
        let turns = engine.append(key, c.messages.clone())?;
        let tokens = engine.session_tokens(key)?;
        let mut positions = Vec::new();
        let mut ctx = 0usize;
        let mut spans = Vec::with_capacity(turns.len());
        for t in &turns {
            if t.message.role == Role::Assistant {
                positions.extend(ctx..ctx + t.tokens.len());
            }
            spans.push(ctx);
            ctx += t.tokens.len();
        }
        if ctx != tokens.len() {
            return Err(Error::Template(
                "the chat template is not append-only for this conversation; it cannot be imported token-exact".into(),
            ));
        }
        let scored = engine.rescore(tokens, positions.clone())?;
        Ok::<_, Error>((turns, spans, scored))
    })();
    engine.close(key);
    let (turns, spans, scored) = result?;
    let n_embd = engine.info().n_embd;
    let template = engine.info().template.clone();
    let mut k = 0;
    let mut rows = Vec::with_capacity(turns.len());
    for (t, &ctx) in turns.iter().zip(&spans) {
        let mut nt = NewTurn::message(
            t.message.role,
            t.message.content.clone(),
            t.tokens.clone(),
            ctx,
        );
        nt.template = Some(template.clone());
        nt.retokenized = t.retokenized;
        if t.message.role == Role::Assistant {
            let n = t.tokens.len();
            let lp = scored.logp[k..k + n].to_vec();
            let h = scored.hidden[k * n_embd..(k + n) * n_embd].to_vec();
            k += n;
            nt.behavior = Some(Behavior::Rescored);
            nt.logprobs = Some(TokenLogprobs {
                logp_behavior: lp.clone(),
                logp_full: lp,
                support: Vec::new(),
            });
            nt.hidden = (!h.is_empty()).then_some(Features {
                n_embd,
                dtype: engine.info().feature_dtype,
                values: h,
            });
        }
        rows.push(nt);
    }
    let session = NewSession {
        source: Source::Import,
        group_key: c.group.clone(),
        reference: c.reference.clone(),
        content_hash: Some(hash),
        metadata: c.metadata.clone(),
    };
    Ok(RescoredConversation {
        session,
        rows,
        outcome: c.outcome,
    })
}

/// Stores a rescored conversation as an ended `import` session with its outcome, in one
/// transaction ([`Recorder::finished`]). Returns `None` for a duplicate (same content hash).
///
/// # Errors
/// Store errors.
pub fn store_rescored(store: &mut Store, r: &RescoredConversation) -> Result<Option<i64>> {
    if let Some(hash) = &r.session.content_hash {
        if store.session_by_hash(hash)?.is_some() {
            return Ok(None);
        }
    }
    let outcome = r.outcome.map(|o| (o, "import"));
    let (rec, _) = Recorder::finished(store, &r.session, &r.rows, outcome)?;
    Ok(Some(rec.id()))
}

/// Imports every line of `input`; bad lines are reported and skipped, good ones imported.
/// `progress` is called after each line with (lines done, bytes read).
///
/// # Errors
/// Only I/O errors reading the input; per-line problems go into the summary.
pub fn import_jsonl(
    engine: &Engine,
    store: &mut Store,
    mut input: impl BufRead,
    mut progress: impl FnMut(usize, u64),
) -> Result<ImportSummary> {
    let mut sum = ImportSummary::default();
    let mut buf = Vec::new();
    let (mut line_no, mut bytes) = (0usize, 0u64);
    loop {
        buf.clear();
        let n = input
            .read_until(b'\n', &mut buf)
            .map_err(|e| Error::io("<import input>", e))?;
        if n == 0 {
            break;
        }
        line_no += 1;
        bytes += n as u64;
        let line = buf.strip_suffix(b"\n").unwrap_or(&buf);
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        if line.iter().all(u8::is_ascii_whitespace) {
            progress(line_no, bytes);
            continue; // blank lines are allowed between records
        }
        match parse_line(line) {
            Err(reason) => sum.skipped.push((line_no, reason)),
            Ok(c) => match import_conversation(engine, store, &c) {
                Ok(Some(_)) => sum.imported += 1,
                Ok(None) => sum.duplicates += 1,
                Err(e) => sum.skipped.push((line_no, e.to_string())),
            },
        }
        progress(line_no, bytes);
    }
    Ok(sum)
}

/// Writes sessions as JSON Lines in the import format, with outcomes, feedback and annotations.
///
/// # Errors
/// Store and I/O errors.
pub fn export_jsonl(store: &Store, source: Option<Source>, mut out: impl Write) -> Result<usize> {
    let mut sessions = store.sessions(source, usize::MAX >> 1)?;
    sessions.reverse();
    for s in &sessions {
        let turns = store.turns(s.id)?;
        let messages: Vec<Value> = turns
            .iter()
            .map(|t| json!({"role": t.role.as_str(), "content": t.text}))
            .collect();
        let annotations = store.annotations_of_session(s.id)?;
        let mut metadata =
            json!({"source": s.source, "created_at": s.created_at, "original": s.metadata});
        // a held-out session stays held out where the log is imported
        if s.metadata.get("held_out") == Some(&json!(true)) {
            metadata["held_out"] = json!(true);
        }
        let line = json!({
            "session_id": s.id,
            "messages": messages,
            "outcome": s.outcome_reward,
            "reference": s.reference,
            "group": s.group_key,
            "metadata": metadata,
            "annotations": annotations,
        });
        writeln!(out, "{line}").map_err(|e| Error::io("<export output>", e))?;
    }
    Ok(sessions.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_good_lines_and_explains_bad_ones() {
        let c = parse_line(br#"{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":null,"tool_calls":[{"type":"function","function":{"name":"refund","arguments":"{\"id\":5}"}}]},{"role":"tool","content":"ok"},{"role":"assistant","content":[{"type":"text","text":"done"}]}],"outcome":"resolved","group":"g"}"#).unwrap();
        assert_eq!(c.messages.len(), 4);
        assert!(c.messages[1].content.starts_with("<tool_call>{"));
        assert_eq!(c.outcome, Some(1.0));
        assert_eq!(c.messages[3].content, "done");

        let bad = |l: &[u8]| parse_line(l).unwrap_err();
        assert!(bad(b"{not json").contains("not a JSON"));
        assert!(bad(b"{\"messages\": []}").contains("empty"));
        assert!(bad(br#"{"messages":[{"role":"robot","content":"x"}]}"#).contains("unknown role"));
        assert!(bad(br#"{"messages":[{"role":"user","content":"x"}]}"#).contains("no assistant"));
        assert!(
            bad(b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}").contains("UTF-8")
        );
        assert!(bad(br#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"outcome":"maybe"}"#).contains("outcome"));
        assert!(bad(
            br#"{"messages":[{"role":"user","content":"x"},{"role":"system","content":"y"}]}"#
        )
        .contains("first"));
    }

    #[test]
    fn content_hash_ignores_metadata_but_not_text() {
        let a = parse_line(br#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":"y"}],"metadata":{"k":1}}"#).unwrap();
        let mut b = a.clone();
        b.metadata = json!({"k": 2});
        assert_eq!(content_hash(&a), content_hash(&b));
        b.messages[1].content = "z".into();
        assert_ne!(content_hash(&a), content_hash(&b));
    }
}
