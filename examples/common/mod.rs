//! What the examples that drive `turnwise serve` from outside share: the binary next to them,
//! starting the server as a user would (a separate process on 127.0.0.1, port picked by the
//! OS), one HTTP request over a fresh connection, the Prometheus metrics, percentiles.

#![allow(dead_code)]

use std::io::{BufRead as _, BufReader, Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};
use serde_json::Value;

/// `target/release/turnwise`, beside `target/release/examples/<this example>`.
pub fn binary_beside_example() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    exe.parent()
        .and_then(Path::parent)
        .map(|d| d.join("turnwise"))
        .context("where is the turnwise binary?")
}

/// Checks that `bin` exists, with what to do when it does not.
pub fn require_binary(bin: &Path) -> anyhow::Result<()> {
    if !bin.exists() {
        bail!(
            "{} does not exist: run `cargo build --release` first or pass --bin",
            bin.display()
        );
    }
    Ok(())
}

/// Starts `bin --db db serve --port 0 ARGS` and returns it with the address it printed.
pub fn start_server(bin: &Path, db: &Path, args: &[String]) -> anyhow::Result<(Child, String)> {
    let mut child = Command::new(bin)
        .arg("--db")
        .arg(db)
        .args(["serve", "--port", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut line = String::new();
    let stdout = child.stdout.take().context("no stdout")?;
    BufReader::new(stdout).read_line(&mut line)?;
    let addr = line
        .trim()
        .rsplit("http://")
        .next()
        .unwrap_or_default()
        .to_string();
    if !addr.starts_with("127.0.0.1:") {
        let _ = child.kill();
        let _ = child.wait();
        bail!("the server did not start (it said {line:?})");
    }
    Ok((child, addr))
}

/// One request over a fresh connection: (status, JSON body).
pub fn request(addr: &str, method: &str, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    let mut s = TcpStream::connect(addr)?;
    s.set_read_timeout(Some(Duration::from_secs(300)))?;
    let b = body.to_string();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{b}",
        b.len()
    )?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text.split_once("\r\n\r\n").context("no response")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("no status")?;
    Ok((code, serde_json::from_str(body).unwrap_or(Value::Null)))
}

/// The server's `/metrics` text (None when it does not answer).
pub fn metrics(addr: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut raw = String::new();
    s.read_to_string(&mut raw).ok()?;
    Some(raw)
}

/// One value of a metrics text.
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// The `p`-th percentile (nearest rank) of `v`; NaN for none.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((p / 100.0) * (s.len() - 1) as f64).round() as usize]
}
