//! Accepting connections and requests: the per-peer and total connection limits, the
//! browser-origin check, the bearer token and bounded request bodies.

use super::*;

/// Whether a `Host` header value names this machine's loopback interface.
pub(super) fn loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // [::1]:port
        match rest.split_once(']') {
            Some((ip, after)) if after.is_empty() || after.starts_with(':') => ip,
            _ => return false,
        }
    } else {
        host.rsplit_once(':')
            .filter(|(_, port)| port.chars().all(|c| c.is_ascii_digit()))
            .map_or(host, |(h, _)| h)
    };
    let name = name.to_ascii_lowercase();
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// Browser protection (as local model servers do): a web page the user opens can send
/// requests to 127.0.0.1, so requests whose `Host` is not a loopback name (DNS rebinding),
/// whose `Origin` is not allowed, or that POST anything but `application/json` (the "simple"
/// cross-origin requests a page may send without asking) are refused.
pub(super) fn browser_check(cfg: &ServerConfig, req: &Request) -> Result<(), ApiError> {
    let h = req.headers();
    let forbidden = |m: String| ApiError::new(StatusCode::FORBIDDEN, "permission_error", m);
    if cfg.loopback_only {
        if let Some(host) = h.get(axum::http::header::HOST) {
            let host = host.to_str().unwrap_or("");
            if !loopback_host(host) {
                return Err(forbidden(format!(
                    "Host {host:?} is not a loopback name: this server answers requests to localhost only (bind another address with --host to serve a network)"
                )));
            }
        }
    }
    if let Some(origin) = h.get(axum::http::header::ORIGIN) {
        let origin = origin.to_str().unwrap_or("");
        if !cfg.allow_origins.iter().any(|o| o == origin) {
            return Err(forbidden(format!(
                "requests from web pages of origin {origin:?} are not allowed (allow one with --allow-origin)"
            )));
        }
    }
    if req.method() == axum::http::Method::POST {
        let json = h
            .get(axum::http::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next())
            .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"));
        if !json {
            return Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "invalid_request_error",
                "POST bodies must be sent as Content-Type: application/json",
            ));
        }
    }
    Ok(())
}

/// The largest request head (request line and headers) the server reads: beyond it, 431.
pub const MAX_HEAD: usize = 128 * 1024;

/// How many connections [`serve`] holds open, and for how long it waits for a request head.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// connections open at once; one more is closed as soon as it is accepted
    pub max: usize,
    /// connections one peer address may hold at once (one client cannot take the whole
    /// budget; on a loopback bind every local process is the same peer)
    pub per_peer: usize,
    /// time a client has to send a request's headers
    pub head_timeout: Duration,
}

impl ConnectionLimits {
    /// `max` connections, half of them (at least one) per peer, 10 s for a request head.
    pub fn new(max: usize) -> Self {
        ConnectionLimits {
            max: max.max(1),
            per_peer: (max / 2).max(1),
            head_timeout: Duration::from_secs(10),
        }
    }
}

/// A held connection slot of one peer: gives its count back when the connection ends.
pub(super) struct PeerSlot {
    peers: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>>,
    ip: std::net::IpAddr,
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.peers.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// Serves `app` on `listener` until the process ends: at most `limits.max` connections at
/// once and `limits.per_peer` from one peer address (one more is closed as soon as it is
/// accepted), and each request head must arrive within `limits.head_timeout` (a client that
/// opens a connection and sends nothing, or sends its headers a byte at a time, is
/// disconnected instead of holding a slot).
///
/// # Errors
/// None in practice: a failed accept is logged and serving goes on.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    limits: ConnectionLimits,
) -> std::io::Result<()> {
    let slots = Arc::new(Semaphore::new(limits.max.max(1)));
    let peers: Arc<std::sync::Mutex<HashMap<std::net::IpAddr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(e) => {
                // e.g. out of file descriptors: wait a little instead of spinning
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let peer_slot = {
            let mut m = peers.lock().unwrap_or_else(|e| e.into_inner());
            let n = m.entry(peer.ip()).or_insert(0);
            if *n >= limits.per_peer.max(1) {
                drop(stream);
                continue;
            }
            *n += 1;
            PeerSlot {
                peers: peers.clone(),
                ip: peer.ip(),
            }
        };
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            drop(stream);
            continue;
        };
        let service = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let (_slot, _peer) = (slot, peer_slot);
            let mut http = hyper::server::conn::http1::Builder::new();
            // a request head over MAX_HEAD is 431 whether it arrives in one read or many
            // (hyper's buffer limit alone depends on how the bytes arrive)
            http.timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(limits.head_timeout)
                .max_header_size(MAX_HEAD);
            let io = hyper_util::rt::TokioIo::new(wire::JsonErrors::new(stream));
            if let Err(e) = http.serve_connection(io, service).await {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
}

pub(super) async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    st.metrics.requests.fetch_add(1, Ordering::Relaxed);
    if let Err(e) = browser_check(&st.cfg, &req) {
        st.metrics.errors.fetch_add(1, Ordering::Relaxed);
        return e.into_response();
    }
    if let Some(key) = &st.cfg.api_key {
        let ok = req
            .headers()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .is_some_and(|k| k == key);
        if !ok {
            st.metrics.errors.fetch_add(1, Ordering::Relaxed);
            return ApiError::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                "missing or wrong bearer token",
            )
            .into_response();
        }
    }
    next.run(req).await
}

pub(super) async fn read_json<T: serde::de::DeserializeOwned>(
    st: &AppState,
    body: Body,
) -> ApiResult<T> {
    let bytes = read_body(st, body).await?;
    serde_json::from_slice(&bytes).map_err(|e| ApiError::bad(format!("malformed JSON body: {e}")))
}

/// The request body, bounded in size (413) and in time (408).
pub(super) async fn read_body(st: &AppState, body: Body) -> ApiResult<Vec<u8>> {
    use tokio_stream::StreamExt as _;
    let max = st.cfg.max_body;
    let read = async {
        let mut stream = body.into_data_stream();
        let mut bytes: Vec<u8> = Vec::new();
        while let Some(chunk) = stream.next().await {
            let chunk: Bytes = chunk
                .map_err(|e| ApiError::bad(format!("the request body could not be read: {e}")))?;
            if bytes.len() + chunk.len() > max {
                return Err(ApiError::new(
                    StatusCode::PAYLOAD_TOO_LARGE,
                    "invalid_request_error",
                    format!("request body over {max} bytes"),
                ));
            }
            bytes.extend_from_slice(&chunk);
        }
        Ok(bytes)
    };
    let bytes = tokio::time::timeout(st.cfg.body_timeout, read)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::REQUEST_TIMEOUT,
                "invalid_request_error",
                format!(
                    "the request body did not arrive within {} s",
                    st.cfg.body_timeout.as_secs()
                ),
            )
        })??;
    Ok(bytes)
}
