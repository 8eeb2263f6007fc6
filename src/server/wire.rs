//! The connection as bytes: hyper answers a request it cannot parse (a bad request line, a head
//! over its buffer, a path too long) itself, before any route runs, with an empty body. A client
//! of this server reads errors as OpenAI's JSON shape, so [`JsonErrors`] wraps the socket and
//! gives exactly those responses a JSON body: a head that hyper wrote for a 4xx with
//! `content-length: 0` and no `content-type` is replaced, as it is written, by the same status
//! with `{"error": {...}}`. Every response of the router carries a `content-type`, so none of them
//! is touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// A socket whose parser-level error responses get a JSON body.
pub struct JsonErrors<S> {
    inner: S,
    /// a replacement being written, and the length of the original write it stands for
    pending: Option<(Vec<u8>, usize, usize)>,
}

impl<S> JsonErrors<S> {
    /// Wraps `inner`.
    pub fn new(inner: S) -> Self {
        JsonErrors {
            inner,
            pending: None,
        }
    }
}

/// The replacement of one of hyper's own error responses, or None for any other write.
pub fn replacement(buf: &[u8]) -> Option<Vec<u8>> {
    let text = std::str::from_utf8(buf).ok()?;
    let head = text.strip_suffix("\r\n\r\n")?;
    let status_line = head.lines().next()?;
    let rest = status_line.strip_prefix("HTTP/1.1 4")?;
    let lower = head.to_ascii_lowercase();
    let mut fields = lower.split("\r\n").skip(1);
    if lower.contains("\r\ncontent-type:") || !fields.any(|l| l == "content-length: 0") {
        return None;
    }
    let code: u16 = format!("4{}", rest.get(..2)?).parse().ok()?;
    let reason = rest.get(3..).unwrap_or("").trim();
    let message = match code {
        431 => "the request's headers are too large",
        414 => "the request's path is too long",
        _ => "the request could not be parsed as HTTP/1.1",
    };
    let body = super::openai::error_body(message, "invalid_request_error", None).to_string();
    Some(
        format!(
            "HTTP/1.1 {code} {reason}\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .into_bytes(),
    )
}

impl<S: AsyncRead + Unpin> AsyncRead for JsonErrors<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> JsonErrors<S> {
    /// Writes what is left of a replacement; Ready with the original write's length when done.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        while let Some((bytes, written, original)) = self.pending.as_mut() {
            if *written == bytes.len() {
                let n = *original;
                self.pending = None;
                return Poll::Ready(Ok(n));
            }
            match Pin::new(&mut self.inner).poll_write(cx, &bytes[*written..]) {
                Poll::Ready(Ok(0)) => {
                    self.pending = None;
                    return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
                }
                Poll::Ready(Ok(k)) => *written += k,
                Poll::Ready(Err(e)) => {
                    self.pending = None;
                    return Poll::Ready(Err(e));
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        Poll::Ready(Ok(0))
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for JsonErrors<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        // a replacement under way stands for the same write, which hyper repeats until it is
        // acknowledged
        if self.pending.is_none() {
            if let Some(r) = replacement(buf) {
                self.pending = Some((r, 0, buf.len()));
            }
        }
        if self.pending.is_some() {
            return self.drain(cx);
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_hypers_empty_error_heads_are_replaced() {
        let hyper_431 = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Thu, 03 Dec 2026 16:56:30 GMT\r\n\r\n";
        let r = String::from_utf8(replacement(hyper_431).unwrap()).unwrap();
        assert!(
            r.starts_with("HTTP/1.1 431 Request Header Fields Too Large\r\n"),
            "{r}"
        );
        let (_, body) = r.split_once("\r\n\r\n").unwrap();
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(r.contains(&format!("content-length: {}\r\n", body.len())));
        // the router's own answers carry a content type, and 2xx/5xx are never touched
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n").is_none());
        assert!(replacement(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 12\r\n\r\n").is_none());
        assert!(replacement(b"{\"partial\": \"body\"}").is_none());
    }
}
