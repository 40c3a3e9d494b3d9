//! One HTTP/1.1 request written as raw bytes, for a request target no `http::Uri` can hold:
//! the `http` crate drops a `#` and what follows (hyper's client would send the target
//! without it), while kube-apiserver reads `#` as a character of the path or query.

use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};

/// A response read to the connection's end.
pub struct RawReply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// Sends `method target` to `base` (`https://host:port` with `tls`, or `http://host:port`)
/// with `Connection: close` and, if given, the bearer token; reads the whole response.
///
/// # Errors
/// Connection errors and unparsable responses, as text.
pub async fn send(
    base: &str,
    tls: Option<Arc<rustls::ClientConfig>>,
    method: &str,
    target: &str,
    token: Option<&str>,
) -> Result<RawReply, String> {
    let (scheme, authority) = base.split_once("://").ok_or("no scheme in base")?;
    let mut head = format!("{method} {target} HTTP/1.1\r\nHost: {authority}\r\n");
    if let Some(t) = token {
        head.push_str(&format!("Authorization: Bearer {t}\r\n"));
    }
    head.push_str("Connection: close\r\n\r\n");
    let tcp = tokio::net::TcpStream::connect(authority)
        .await
        .map_err(|e| e.to_string())?;
    let raw = match (scheme, tls) {
        ("https", Some(tls)) => {
            let mut cfg = (*tls).clone();
            cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
            let host = authority.rsplit_once(':').map_or(authority, |(h, _)| h);
            let name = rustls_pki_types::ServerName::try_from(host.to_string())
                .map_err(|e| e.to_string())?;
            let tls = tokio_rustls::TlsConnector::from(Arc::new(cfg))
                .connect(name, tcp)
                .await
                .map_err(|e| e.to_string())?;
            exchange(tls, head.as_bytes()).await?
        }
        ("http", _) => exchange(tcp, head.as_bytes()).await?,
        _ => return Err(format!("cannot send to {base}")),
    };
    parse(&raw)
}

async fn exchange<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    head: &[u8],
) -> Result<Vec<u8>, String> {
    s.write_all(head).await.map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    // A server may close without TLS close_notify: what was read is the answer.
    if let Err(e) = s.read_to_end(&mut raw).await
        && raw.is_empty()
    {
        return Err(e.to_string());
    }
    Ok(raw)
}

fn parse(raw: &[u8]) -> Result<RawReply, String> {
    let split = memchr::memmem::find(raw, b"\r\n\r\n").ok_or("no end of the response head")?;
    let head = std::str::from_utf8(&raw[..split]).map_err(|e| e.to_string())?;
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| format!("bad status line in {head:?}"))?;
    let mut headers = HeaderMap::new();
    for l in lines {
        let (n, v) = l
            .split_once(':')
            .ok_or_else(|| format!("bad header {l:?}"))?;
        let n = HeaderName::from_bytes(n.trim().as_bytes()).map_err(|e| e.to_string())?;
        let v = HeaderValue::from_str(v.trim()).map_err(|e| e.to_string())?;
        headers.append(n, v);
    }
    let mut body = &raw[split + 4..];
    let chunked = headers
        .get("transfer-encoding")
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"chunked"));
    if !chunked {
        return Ok(RawReply {
            status,
            headers,
            body: Bytes::copy_from_slice(body),
        });
    }
    let mut out = Vec::new();
    loop {
        let nl = memchr::memmem::find(body, b"\r\n").ok_or("a chunk without its size line")?;
        let size = std::str::from_utf8(&body[..nl]).map_err(|e| e.to_string())?;
        let size = size.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size, 16).map_err(|e| format!("chunk size: {e}"))?;
        if size == 0 {
            break;
        }
        let data = body.get(nl + 2..nl + 2 + size).ok_or("a chunk cut short")?;
        out.extend_from_slice(data);
        body = body.get(nl + 4 + size..).ok_or("a chunk without its end")?;
    }
    Ok(RawReply {
        status,
        headers,
        body: Bytes::from(out),
    })
}
