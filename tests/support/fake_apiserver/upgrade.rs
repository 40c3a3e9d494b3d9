//! Upgrades (exec / attach / portforward).

use super::*;

pub(super) fn upgrade(
    shared: &Shared,
    req: &ReadRequest,
    ns: Option<&str>,
    name: &str,
    on_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response<Body>, Status> {
    if req.method != Method::GET && req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    if !shared
        .store()
        .objects(Kind::Pod)
        .contains_key(&object_key(Kind::Pod, ns, name))
    {
        return Err(Status::not_found(Kind::Pod, name));
    }
    let Some(on_upgrade) = on_upgrade else {
        return Err(Status::bad_request("Upgrade request required".into()));
    };
    let mut resp = Response::new(empty_body());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(
        http::header::CONNECTION,
        HeaderValue::from_static("Upgrade"),
    );
    if let Some(proto) = req.headers.get(UPGRADE) {
        h.insert(UPGRADE, proto.clone());
    }
    // SPDY: the client offers protocol versions, the server picks one (the first).
    if let Some(v) = req.headers.get("x-stream-protocol-version") {
        h.insert("x-stream-protocol-version", first_token(v));
    }
    // WebSocket: the handshake answer (RFC 6455 section 4.2.2) and the chosen subprotocol.
    if let Some(key) = req.headers.get("sec-websocket-key") {
        let mut input = key.as_bytes().to_vec();
        input.extend_from_slice(b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11");
        let accept = base64::engine::general_purpose::STANDARD.encode(sha1(&input));
        if let Ok(v) = HeaderValue::from_str(&accept) {
            h.insert("sec-websocket-accept", v);
        }
    }
    if let Some(v) = req.headers.get("sec-websocket-protocol") {
        h.insert("sec-websocket-protocol", first_token(v));
    }
    tokio::spawn(async move {
        let Ok(upgraded) = on_upgrade.await else {
            return;
        };
        let io = TokioIo::new(upgraded);
        let (mut r, mut w) = tokio::io::split(io);
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = tokio::io::AsyncWriteExt::shutdown(&mut w).await;
    });
    Ok(resp)
}

pub(super) fn first_token(v: &HeaderValue) -> HeaderValue {
    v.to_str()
        .ok()
        .and_then(|s| s.split(',').next())
        .and_then(|s| HeaderValue::from_str(s.trim()).ok())
        .unwrap_or_else(|| v.clone())
}
