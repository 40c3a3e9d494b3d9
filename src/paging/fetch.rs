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

/// Why a `/metrics` scrape gave no scrape; the load signal it carries is then unknown.
#[derive(Debug, thiserror::Error)]
pub enum ScrapeError {
    /// The etcd metrics URL in the configuration is not a URI.
    #[error("{url}: {source}")]
    BadUrl {
        url: String,
        #[source]
        source: http::uri::InvalidUri,
    },
    /// No response: `target` is `/metrics` for the apiserver, the URL for etcd.
    #[error("GET {target}: {source}")]
    Send {
        target: String,
        #[source]
        source: tower::BoxError,
    },
    #[error("GET /metrics returned {0}")]
    Status(http::StatusCode),
    /// The body broke off or is larger than 64 MiB.
    #[error("reading /metrics: {0}")]
    Read(#[source] tower::BoxError),
    #[error("GET {target} timed out after {after:?}")]
    TimedOut { target: String, after: Duration },
}

async fn read_metrics(resp: Response<hyper::body::Incoming>) -> Result<String, ScrapeError> {
    let status = resp.status();
    if !status.is_success() {
        return Err(ScrapeError::Status(status));
    }
    let b: Bytes = http_body_util::Limited::new(resp.into_body(), MAX_METRICS_BYTES)
        .collect()
        .await
        .map_err(ScrapeError::Read)?
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
) -> Result<ApiserverScrape, ScrapeError> {
    let req = metrics_request(upstream.uri("/metrics"));
    let fetch = async {
        let resp = upstream
            .send_untimed(req, As::Proxy, false)
            .await
            .map_err(|source| ScrapeError::Send {
                target: "/metrics".into(),
                source,
            })?;
        read_metrics(resp).await
    };
    let text =
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| ScrapeError::TimedOut {
                target: "/metrics".into(),
                after: timeout,
            })??;
    Ok(ApiserverScrape::parse(&text))
}

pub(super) async fn scrape_etcd(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        Body,
    >,
    url: &str,
    timeout: Duration,
) -> Result<EtcdScrape, ScrapeError> {
    let uri: http::Uri = url.parse().map_err(|source| ScrapeError::BadUrl {
        url: url.to_string(),
        source,
    })?;
    let fetch = async {
        let resp = client
            .request(metrics_request(uri))
            .await
            .map_err(|e| ScrapeError::Send {
                target: url.to_string(),
                source: e.into(),
            })?;
        read_metrics(resp).await
    };
    let text =
        tokio::time::timeout(timeout, fetch)
            .await
            .map_err(|_| ScrapeError::TimedOut {
                target: url.to_string(),
                after: timeout,
            })??;
    Ok(EtcdScrape::parse(&text))
}
