//! Requests the apiserver refused unprocessed are sent again; others are not. The first
//! connection to a TLS HTTP/2 server here speaks raw frames: it answers the first request's
//! HEADERS with a GOAWAY (`NO_ERROR`, last stream 0: nothing processed, as kube-apiserver's
//! idle timeout does) or a `REFUSED_STREAM` reset, and any later request `200 ok`, as do
//! later connections.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use http::{Method, Request};
use http_body_util::BodyExt;
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;

#[derive(Clone, Copy)]
enum First {
    GoAway,
    RefusedStream,
}

struct Server {
    port: u16,
    /// Connections accepted.
    conns: Arc<AtomicUsize>,
    ca_der: Vec<u8>,
}

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// Speaks raw HTTP/2 on `io`: acknowledges SETTINGS and PINGs, refuses the first request
/// as `first` says and answers any later one `200 ok`.
async fn raw<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    io: &mut S,
    first: First,
) -> Option<()> {
    let mut preface = [0u8; 24];
    io.read_exact(&mut preface).await.ok()?;
    io.write_all(&frame(4, 0, 0, &[])).await.ok()?;
    let mut refused = false;
    loop {
        let mut h = [0u8; 9];
        io.read_exact(&mut h).await.ok()?;
        let len = (h[0] as usize) << 16 | (h[1] as usize) << 8 | h[2] as usize;
        let mut payload = vec![0u8; len];
        io.read_exact(&mut payload).await.ok()?;
        let stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        let reply = match (h[3], h[4] & 1) {
            (4, 0) => frame(4, 1, 0, &[]),
            (6, 0) => frame(6, 1, 0, &payload),
            (1, _) if !refused => {
                refused = true;
                match first {
                    // Last stream ID 0, NO_ERROR: nothing was processed.
                    First::GoAway => {
                        io.write_all(&frame(7, 0, 0, &[0; 8])).await.ok()?;
                        io.flush().await.ok()?;
                        let _ = io.shutdown().await;
                        return None;
                    }
                    First::RefusedStream => frame(3, 0, stream, &7u32.to_be_bytes()),
                }
            }
            // `:status: 200` (HPACK static index 8), then DATA "ok" ending the stream.
            (1, _) => [frame(1, 4, stream, &[0x88]), frame(0, 1, stream, b"ok")].concat(),
            _ => continue,
        };
        io.write_all(&reply).await.ok()?;
        io.flush().await.ok()?;
    }
}

async fn serve(first: First) -> Server {
    crate::http::tls::install_crypto_provider();
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = crate::http::tls::generate_serving_pair(&["localhost"]).unwrap();
    std::fs::write(dir.path().join("tls.crt"), cert).unwrap();
    std::fs::write(dir.path().join("tls.key"), key).unwrap();
    let pair = crate::http::tls::ReloadingCert::load(
        &dir.path().join("tls.crt"),
        &dir.path().join("tls.key"),
    )
    .unwrap();
    let tls = crate::http::tls::server_config(pair, None).unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(tls));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let conns = Arc::new(AtomicUsize::new(0));
    let counted = conns.clone();
    tokio::spawn(async move {
        let _dir = dir;
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            let n = counted.fetch_add(1, Ordering::SeqCst);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut io) = acceptor.accept(tcp).await else {
                    return;
                };
                if n == 0 {
                    raw(&mut io, first).await;
                    return;
                }
                let svc = hyper::service::service_fn(|_req| async {
                    Ok::<_, std::convert::Infallible>(http::Response::new(
                        http_body_util::Full::new(bytes::Bytes::from_static(b"ok")),
                    ))
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(io), svc)
                    .await;
            });
        }
    });
    Server {
        port,
        conns,
        ca_der: rustls_pki_types::CertificateDer::from_pem_slice(ca.as_bytes())
            .unwrap()
            .to_vec(),
    }
}

fn upstream(s: &Server) -> Upstream {
    let mut kc = kube::Config::new(format!("https://127.0.0.1:{}", s.port).parse().unwrap());
    kc.root_cert = Some(vec![s.ca_der.clone()]);
    kc.tls_server_name = Some("localhost".into());
    Upstream::new(&kc, &UpstreamConfig::default()).unwrap()
}

async fn send(up: &Upstream, method: Method, body: &'static [u8]) -> Result<String, BoxError> {
    let mut req = Request::new(if body.is_empty() {
        crate::http::body::empty()
    } else {
        crate::http::body::full(bytes::Bytes::from_static(body))
    });
    *req.method_mut() = method;
    *req.uri_mut() = up.uri("/api/v1/namespaces/default/configmaps/a");
    let resp = up.send(req, As::Caller, false).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

#[tokio::test]
async fn a_read_refused_by_a_goaway_is_sent_again_on_a_new_connection() {
    let s = serve(First::GoAway).await;
    let up = upstream(&s);
    assert_eq!(send(&up, Method::GET, b"").await.unwrap(), "ok");
    assert_eq!(s.conns.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn a_write_ended_by_a_goaway_is_not_sent_again() {
    // h2 cannot say whether the apiserver processed it: the caller gets the error.
    let s = serve(First::GoAway).await;
    let up = upstream(&s);
    let e = send(&up, Method::DELETE, b"").await.unwrap_err();
    assert!(e.to_string().contains("127.0.0.1"), "{e}");
    assert_eq!(s.conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_write_refused_by_refused_stream_is_sent_again() {
    let s = serve(First::RefusedStream).await;
    let up = upstream(&s);
    assert_eq!(send(&up, Method::DELETE, b"").await.unwrap(), "ok");
    // On the same connection: a refused stream leaves it usable.
    assert_eq!(s.conns.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_request_with_a_body_is_never_sent_again() {
    // Its body was streamed upstream and is gone.
    let s = serve(First::RefusedStream).await;
    let up = upstream(&s);
    assert!(send(&up, Method::POST, b"{}").await.is_err());
    assert_eq!(s.conns.load(Ordering::SeqCst), 1);
}
