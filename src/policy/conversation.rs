//! Conversations as token sequences that only grow (token-in-token-out).
//!
//! A session's context is the concatenation of the tokens of its turns. A new message is appended
//! as the tokens of the text the chat template adds for it: we render the whole conversation,
//! check that it still starts with the text our stored tokens stand for, and tokenise only the
//! new suffix. Earlier text is never tokenised again. If a template is not append-only (the new
//! rendering does not extend the old one), the conversation is re-tokenised from the full
//! rendering and the turn is flagged `retokenized`.

use serde::{Deserialize, Serialize};

use super::llama::{Model, Token};
use crate::error::{Error, Result};

/// Who wrote a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// instructions for the assistant
    System,
    /// the customer / user
    User,
    /// the policy
    Assistant,
    /// a tool's result
    Tool,
}

impl Role {
    /// The role's name in chat templates and in the store.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
    /// Parses a role name.
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown role.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "system" | "developer" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            "tool" | "function" => Ok(Role::Tool),
            other => Err(Error::Invalid(format!("unknown role {other:?}"))),
        }
    }
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// author
    pub role: Role,
    /// text
    pub content: String,
}

impl Message {
    /// A message from parts.
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Message {
            role,
            content: content.into(),
        }
    }
}

/// The tokens one appended message added to the context.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptTurn {
    /// the message
    pub message: Message,
    /// tokens appended for it (template markers included)
    pub tokens: Vec<Token>,
    /// the template was not append-only here and the context was re-tokenised
    pub retokenized: bool,
}

/// A conversation's messages, its context tokens and the text those tokens stand for.
#[derive(Debug, Clone, Default)]
pub struct Conversation {
    /// messages so far (assistant messages hold the full generated text)
    pub messages: Vec<Message>,
    /// the context
    pub tokens: Vec<Token>,
    /// the rendered text the tokens stand for
    pub rendered: String,
}

/// Renders messages with a template.
///
/// # Errors
/// [`Error::Template`] when the template cannot render them.
pub fn render(template: &str, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
    let pairs: Vec<(&str, &str)> = messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    Model::apply_template(template, &pairs, add_generation_prompt)
}

/// A rendering cut into template text and message contents, in order: `(text, is_content)`.
/// The template is rendered with a unique marker in place of each message's content, so a
/// content is found by position, never by searching for its text (a user message equal to the
/// template's own closing text, `<|im_end|>\n<|im_start|>assistant\n`, would otherwise be
/// found where the template wrote it, and the user's copy parsed as control tokens).
///
/// # Errors
/// [`Error::Template`] when the template cannot render the messages, or does not show each
/// content exactly once as given (then it cannot be tokenised safely).
fn segments(
    template: &str,
    messages: &[Message],
    add_generation_prompt: bool,
) -> Result<Vec<(String, bool)>> {
    let marks: Vec<String> = (0..messages.len())
        .map(|i| format!("\u{E000}turnwise-content-{i}\u{E001}"))
        .collect();
    let pairs: Vec<(&str, &str)> = messages
        .iter()
        .zip(&marks)
        .map(|(m, k)| (m.role.as_str(), k.as_str()))
        .collect();
    let rendered = Model::apply_template(template, &pairs, add_generation_prompt)?;
    let mut out = Vec::with_capacity(2 * messages.len() + 1);
    let mut rest = rendered.as_str();
    for (m, k) in messages.iter().zip(&marks) {
        let at = match (rest.find(k.as_str()), rendered.matches(k.as_str()).count()) {
            (Some(at), 1) => at,
            _ => {
                return Err(Error::Template(
                    "the chat template does not show each message's text once as given; it \
                     cannot be tokenised without parsing user text as control tokens"
                        .into(),
                ))
            }
        };
        out.push((rest[..at].to_string(), false));
        out.push((m.content.clone(), true));
        rest = &rest[at + k.len()..];
    }
    out.push((rest.to_string(), false));
    Ok(out)
}

/// Tokenises the segments' text from byte `from` of their concatenation: template text with
/// its markers parsed as control tokens, message contents as plain text.
fn tokenize_segments(
    model: &Model,
    segments: &[(String, bool)],
    from: usize,
    add_bos: bool,
) -> Result<Vec<Token>> {
    let mut tokens = Vec::new();
    let (mut off, mut bos) = (0usize, add_bos);
    for (text, is_content) in segments {
        let end = off + text.len();
        if end > from || (bos && end == from) {
            let piece = text.get(from.saturating_sub(off)..).ok_or_else(|| {
                Error::Template("the rendered history does not end between characters".into())
            })?;
            if !piece.is_empty() || bos {
                tokens.extend(model.tokenize(piece, bos, !is_content)?);
                bos = false;
            }
        }
        off = end;
    }
    Ok(tokens)
}

fn common_prefix(a: &[Token], b: &[Token]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl Conversation {
    /// Appends a message as template tokens. `add_generation_prompt` also appends the tokens
    /// that open the assistant's reply (set it on the last message before generating).
    ///
    /// # Errors
    /// Template or tokenizer errors; the conversation is unchanged on error.
    pub fn append(
        &mut self,
        model: &Model,
        template: &str,
        message: Message,
        add_generation_prompt: bool,
    ) -> Result<PromptTurn> {
        let mut msgs = self.messages.clone();
        msgs.push(message.clone());
        let segs = segments(template, &msgs, add_generation_prompt)?;
        let full: String = segs.iter().map(|s| s.0.as_str()).collect();
        let (tokens, retokenized) = if self.tokens.is_empty() {
            (tokenize_segments(model, &segs, 0, model.add_bos())?, false)
        } else if full.starts_with(self.rendered.as_str()) {
            (
                tokenize_segments(model, &segs, self.rendered.len(), false)?,
                false,
            )
        } else {
            let all = tokenize_segments(model, &segs, 0, model.add_bos())?;
            let keep = common_prefix(&self.tokens, &all);
            self.tokens.truncate(keep);
            (all[keep..].to_vec(), true)
        };
        self.tokens.extend_from_slice(&tokens);
        self.rendered = full;
        self.messages.push(message.clone());
        Ok(PromptTurn {
            message,
            tokens,
            retokenized,
        })
    }

    /// Records an assistant reply that was generated token by token: `text` is its decoded text
    /// (without the end-of-turn marker), `rendered` the exact text of `tokens` with control
    /// tokens spelled out.
    pub fn push_reply(&mut self, text: String, tokens: &[Token], rendered: &str) {
        self.tokens.extend_from_slice(tokens);
        self.rendered.push_str(rendered);
        self.messages.push(Message::new(Role::Assistant, text));
    }

    /// Appends an assistant message that was not generated here (imports): its content
    /// tokenised as plain text followed by `turn_end`, the end-of-turn token the template closes
    /// assistant messages with — exactly what the model would have had to sample.
    ///
    /// # Errors
    /// Tokenizer errors.
    pub fn push_forced_reply(
        &mut self,
        model: &Model,
        content: &str,
        turn_end: Token,
    ) -> Result<PromptTurn> {
        let mut tokens = model.tokenize(content, false, false)?;
        tokens.push(turn_end);
        let piece = String::from_utf8_lossy(&model.piece(turn_end, true)).into_owned();
        self.push_reply(content.to_string(), &tokens, &format!("{content}{piece}"));
        Ok(PromptTurn {
            message: Message::new(Role::Assistant, content),
            tokens,
            retokenized: false,
        })
    }
}

/// The end-of-generation token a template closes assistant messages with (`<|im_end|>` for
/// chatml), found by rendering a probe message; falls back to the model's EOT/EOS token.
///
/// # Errors
/// Template errors, or a model without any end-of-turn token.
pub fn turn_end_token(model: &Model, template: &str) -> Result<Token> {
    const PROBE: &str = "TURNWISEPROBE";
    let msgs = [
        Message::new(Role::User, "x"),
        Message::new(Role::Assistant, PROBE),
    ];
    let text = render(template, &msgs, false)?;
    let from_template = text
        .rfind(PROBE)
        .map(|at| &text[at + PROBE.len()..])
        .map(|after| model.tokenize(after, false, true))
        .transpose()?
        .and_then(|t| t.first().copied())
        .filter(|&t| model.is_eog(t));
    from_template
        .or_else(|| model.eot())
        .ok_or_else(|| Error::Template("the model has no end-of-turn token".into()))
}

/// The template text that opens an assistant message right after a closed assistant message
/// (chatml: `"\n<|im_start|>assistant\n"`), found by rendering two probe replies.
///
/// # Errors
/// [`Error::Template`] when the rendering does not show the probes in order.
pub fn assistant_opening(model: &Model, template: &str, turn_end: Token) -> Result<String> {
    let (p1, p2) = ("TURNWISEPROBEA", "TURNWISEPROBEB");
    let msgs = [
        Message::new(Role::User, "x"),
        Message::new(Role::Assistant, p1),
        Message::new(Role::Assistant, p2),
    ];
    let text = render(template, &msgs, false)?;
    let end = String::from_utf8_lossy(&model.piece(turn_end, true)).into_owned();
    let bad = || Error::Template("cannot find how the template opens an assistant message".into());
    let after = text
        .find(p1)
        .map(|i| &text[i + p1.len()..])
        .ok_or_else(bad)?;
    let after = after.strip_prefix(end.as_str()).unwrap_or(after);
    let stop = after.find(p2).ok_or_else(bad)?;
    Ok(after[..stop].to_string())
}

/// Turns a stream of token bytes into text without splitting a UTF-8 character across pieces.
#[derive(Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes and returns the text that is complete so far.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let valid = match std::str::from_utf8(&self.pending) {
            Ok(_) => self.pending.len(),
            Err(e) if e.error_len().is_some() => {
                // invalid bytes, not a split character: replace them and move on
                let s = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                return s;
            }
            Err(e) => e.valid_up_to(),
        };
        let rest = self.pending.split_off(valid);

        String::from_utf8(std::mem::replace(&mut self.pending, rest)).unwrap_or_default()
    }

    /// Whatever is left (an incomplete character is replaced by U+FFFD).
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_stream_keeps_split_characters() {
        let mut s = Utf8Stream::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(s.push(b"a"), "a");
        assert_eq!(s.push(&euro[..1]), "");
        assert_eq!(s.push(&euro[1..2]), "");
        assert_eq!(s.push(&euro[2..]), "€");
        assert_eq!(s.push(&[0xff, b'b']), "\u{fffd}b");
        assert_eq!(s.push(&euro[..2]), "");
        assert_eq!(s.finish(), "\u{fffd}");
    }

    #[test]
    fn roles_parse() {
        assert_eq!(Role::parse("tool").unwrap(), Role::Tool);
        assert!(Role::parse("robot").is_err());
    }
}
