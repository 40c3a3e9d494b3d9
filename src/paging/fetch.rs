//! Reading `/metrics`: the apiserver's through the upstream client with the proxy's own
//! identity, etcd's over plain HTTP; each bounded in size and time, parsed into its scrape.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use http_body_util::BodyExt as _;

use super::scrape::{ApiserverScrape, EtcdScrape};
use crate::http::body::{self, Body};
use crate::upstream::{As, Upstream};

/// Largest `/metrics` body read. A big apiserver exports a few MiB.
const MAX_METRICS_BYTES: usize = 64 << 20;

async fn read_metrics(resp: Response<hyper::body::Incoming>) -> Result<String, String> {
    let status = resp.status();
    if !status.is_success() {
        return Err(format!("GET /metrics returned {status}"));
    }
    let b: Bytes = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(|e| format!("reading /metrics: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&b).into_owned())
}

fn metrics_request(uri: http::Uri) -> Request<Body> {
    let mut req = Request::new(body::empty());
    *req.uri_mut() = uri;
    req.headers_mut()
        .insert(header::ACCEPT, HeaderValue::from_static("text/plain"));
    req
}

/// Scrapes the apiserver's `/metrics` with the proxy's identity. Not counted in the upstream
/// latency: a multi-MiB exposition says little about request latency.
pub(super) async fn scrape_apiserver(
    upstream: &Upstream,
    timeout: Duration,
) -> Result<ApiserverScrape, String> {
    let req = metrics_request(upstream.uri("/metrics"));
    let fetch = async {
        let resp = upstream
            .send_untimed(req, As::Proxy, false)
            .await
            .map_err(|e| format!("GET /metrics: {e}"))?;
        read_metrics(resp).await
    };
    let text = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("GET /metrics timed out after {timeout:?}"))??;
    Ok(ApiserverScrape::parse(&text))
}

pub(super) async fn scrape_etcd(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Body,
    >,
    url: &str,
    timeout: Duration,
) -> Result<EtcdScrape, String> {
    let uri: http::Uri = url.parse().map_err(|e| format!("{url}: {e}"))?;
    let fetch = async {
        let resp = client
            .request(metrics_request(uri))
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        read_metrics(resp).await
    };
    let text = tokio::time::timeout(timeout, fetch)
        .await
        .map_err(|_| format!("GET {url} timed out after {timeout:?}"))??;
    Ok(EtcdScrape::parse(&text))
}
