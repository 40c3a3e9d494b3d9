//! Streaming passthrough to kube-apiserver for every request not served by the proxy itself.
//!
//! Bodies stream both ways frame by frame; long-running responses (watches, logs with
//! `follow`) are handed to the client as soon as the upstream's headers arrive and end cleanly
//! at shutdown; protocol upgrades (exec/attach/port-forward over SPDY or WebSocket) are
//! relayed byte for byte after a `101` from the apiserver. Redirects are relayed, never
//! followed.

use http::{HeaderValue, Request, Response, StatusCode, Version, header};
use http_body_util::Limited;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use crate::auth::identity::{self, Caller};
use crate::http::body::{self, Body};
use crate::http::drain::DrainBody;
use crate::k8s::request_info::RequestInfo;
use crate::k8s::status::{Reason, Status};
use crate::metrics::{UpstreamDurationLabels, UpstreamLabels};
use crate::serve::state::{ConnInfo, State};

/// Forwards one request upstream and returns the response to stream back.
pub async fn forward(
    state: &State,
    conn: &ConnInfo,
    mut req: Request<Incoming>,
    info: &RequestInfo,
    long_running: bool,
) -> Response<Body> {
    let upgrade = if req.version() <= Version::HTTP_11 {
        identity::upgrade_protocol(req.headers()).cloned()
    } else {
        None
    };
    let caller = Caller::identify(conn.cert.as_deref(), req.headers());
    let headers = identity::upstream_headers(
        req.headers(),
        &caller,
        upgrade.as_ref(),
        conn.peer.map(|p| p.ip()),
    );
    let pq = req
        .uri()
        .path_and_query()
        .map(|p| p.as_str())
        .unwrap_or("/")
        .to_string();

    let limit = state.config.server.max_request_body_bytes;
    if upgrade.is_none()
        && let Some(len) = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
        && len > limit
    {
        state.metrics.reject("body_too_large");
        return too_large(limit);
    }

    let server_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
    let method = req.method().clone();
    let body: Body = if upgrade.is_some() {
        body::empty()
    } else {
        body::boxed(Limited::new(req.into_body(), limit as usize))
    };
    let mut up = Request::new(body);
    *up.method_mut() = method.clone();
    *up.uri_mut() = state.upstream.uri(&pq);
    *up.headers_mut() = headers;

    // Untimed: callers' requests (even those sent with the proxy's identity for client
    // certificates) are not the proxy's own upstream latency that adaptive paging reads.
    // The upstream request's span (`telemetry`): its `traceparent` replaces the caller's
    // (with tracing off the caller's passes through with the other headers).
    let send = async {
        let r = state
            .upstream
            .send_untimed(up, caller.upstream_as(), upgrade.is_some() || long_running)
            .await;
        if let Ok(resp) = &r {
            crate::telemetry::set_status_code(resp.status().as_u16());
        }
        r
    };
    let sending = std::time::Instant::now();
    let sent =
        crate::telemetry::in_span_of("passthrough", crate::telemetry::SpanKind::Client, send).await;
    let upstream_time = sending.elapsed();
    let verb = info.metrics_verb(&method, None, upgrade.is_some());
    // The resource label only once an answer shows the resource exists (`KnownResources`).
    let resource = state
        .metrics
        .resources
        .labels(
            &info.api_group,
            &info.api_version,
            &info.resource,
            &info.subresource,
            sent.as_ref()
                .is_ok_and(|r| crate::metrics::KnownResources::shows_served(r.status())),
        )
        .resource;
    state
        .metrics
        .upstream_request_duration
        .get_or_create(&UpstreamDurationLabels {
            verb: verb.clone(),
            resource: resource.clone(),
        })
        .observe(upstream_time.as_secs_f64());
    let count = |code: &str| {
        state
            .metrics
            .upstream_requests
            .get_or_create(&UpstreamLabels {
                verb: verb.clone(),
                resource: resource.clone(),
                code: code.into(),
            })
            .inc();
    };
    let mut resp = match sent {
        Ok(r) => r,
        Err(e) => {
            count("error");
            if is_body_limit(&*e) {
                state.metrics.reject("body_too_large");
                return too_large(limit);
            }
            tracing::warn!(error = %e, path = %req_path(&pq), caller = %caller.describe(), "upstream request failed");
            let message = format!("the upstream apiserver could not be reached: {e}");
            // A watch: 429, on which client-go watches again instead of relisting, as after
            // the "connection refused" a direct client would get (`read::watch_unreachable`).
            return if info.verb == "watch" {
                crate::read::watch_unreachable(message)
            } else {
                Status::service_unavailable(message, 1)
            }
            .into_response();
        }
    };
    count(resp.status().as_str());

    if let Some(server_upgrade) = server_upgrade {
        return finish_upgrade(resp, server_upgrade);
    }

    let line_framed = long_running
        && resp
            .headers()
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|ct| ct.starts_with("application/json"));
    identity::strip_hop_by_hop(resp.headers_mut());
    let (parts, incoming) = resp.into_parts();
    let body = if long_running {
        let b = DrainBody::new(incoming, &state.drain, line_framed);
        if info.verb == "watch" {
            body::boxed(b.ending_cleanly_on_error())
        } else {
            body::boxed(b)
        }
    } else {
        body::boxed(incoming)
    };
    Response::from_parts(parts, body)
}

/// Completes an upgrade: on `101` both sides are joined and bytes copied until either side
/// closes; otherwise the apiserver's answer (a Status, usually) is relayed and the client
/// connection closed, since it expected to switch protocols.
fn finish_upgrade(
    mut resp: Response<Incoming>,
    server_upgrade: hyper::upgrade::OnUpgrade,
) -> Response<Body> {
    if resp.status() != StatusCode::SWITCHING_PROTOCOLS {
        identity::strip_hop_by_hop(resp.headers_mut());
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        let (parts, incoming) = resp.into_parts();
        return Response::from_parts(parts, body::boxed(incoming));
    }
    let upstream_upgrade = hyper::upgrade::on(&mut resp);
    tokio::spawn(async move {
        let (down, up) = match tokio::try_join!(server_upgrade, upstream_upgrade) {
            Ok(pair) => pair,
            Err(e) => {
                tracing::debug!(error = %e, "upgrade did not complete");
                return;
            }
        };
        let mut down = TokioIo::new(down);
        let mut up = TokioIo::new(up);
        match tokio::io::copy_bidirectional(&mut down, &mut up).await {
            Ok((to_up, to_down)) => {
                tracing::debug!(to_up, to_down, "upgraded stream closed")
            }
            Err(e) => tracing::debug!(error = %e, "upgraded stream ended with an error"),
        }
    });
    let (parts, _) = resp.into_parts();
    Response::from_parts(parts, body::empty())
}

fn too_large(limit: u64) -> Response<Body> {
    Status::failure(
        StatusCode::PAYLOAD_TOO_LARGE,
        Reason::RequestEntityTooLarge,
        format!("the request body is larger than the limit of {limit} bytes"),
    )
    .into_response()
}

fn is_body_limit(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if err.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        cur = err.source();
    }
    false
}

fn req_path(pq: &str) -> &str {
    pq.split('?').next().unwrap_or(pq)
}
