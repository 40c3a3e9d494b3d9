//! An in-process OTLP receiver: a tiny HTTP/1.1 server that decodes the
//! `ExportTraceServiceRequest`s posted to `/v1/traces` and keeps their spans, for tests of the
//! proxy's tracing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value;
use prost::Message as _;

/// One received span, flattened: ids in lowercase hex, attributes as strings.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// OTLP's `SpanKind`: 1 internal, 2 server, 3 client.
    pub kind: i32,
    pub attributes: HashMap<String, String>,
}

impl ReceivedSpan {
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

pub struct OtlpReceiver {
    pub addr: SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    /// Export requests received (a proxy with tracing off must send none).
    posts: Arc<Mutex<usize>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let spans: Arc<Mutex<Vec<ReceivedSpan>>> = Default::default();
        let posts: Arc<Mutex<usize>> = Default::default();
        let (s, p) = (spans.clone(), posts.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    return;
                };
                let (s, p) = (s.clone(), p.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: Request<Incoming>| {
                        let (s, p) = (s.clone(), p.clone());
                        async move { Ok::<_, hyper::Error>(receive(req, &s, &p).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(tcp), svc)
                        .await;
                });
            }
        });
        OtlpReceiver {
            addr,
            spans,
            posts,
            task,
        }
    }

    /// The base URL to configure as `tracing.otlp.endpoint`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    pub fn posts(&self) -> usize {
        *self.posts.lock().unwrap()
    }
}

async fn receive(
    req: Request<Incoming>,
    spans: &Mutex<Vec<ReceivedSpan>>,
    posts: &Mutex<usize>,
) -> Response<Full<Bytes>> {
    *posts.lock().unwrap() += 1;
    let reply = |code: StatusCode, body: Bytes| {
        Response::builder()
            .status(code)
            .header("content-type", "application/x-protobuf")
            .body(Full::new(body))
            .unwrap()
    };
    if req.uri().path() != "/v1/traces" {
        return reply(StatusCode::NOT_FOUND, Bytes::new());
    }
    let body = req.into_body().collect().await.unwrap().to_bytes();
    let Ok(export) = ExportTraceServiceRequest::decode(body) else {
        return reply(StatusCode::BAD_REQUEST, Bytes::new());
    };
    let mut out = spans.lock().unwrap();
    for rs in export.resource_spans {
        let service = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "service.name")
            .and_then(|kv| kv.value.as_ref())
            .map(|v| value_string(v.value.as_ref()))
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                out.push(ReceivedSpan {
                    service: service.clone(),
                    name: s.name,
                    trace_id: hex::encode(&s.trace_id),
                    span_id: hex::encode(&s.span_id),
                    parent_span_id: hex::encode(&s.parent_span_id),
                    kind: s.kind,
                    attributes: s
                        .attributes
                        .into_iter()
                        .map(|kv| {
                            let v = value_string(kv.value.as_ref().and_then(|v| v.value.as_ref()));
                            (kv.key, v)
                        })
                        .collect(),
                });
            }
        }
    }
    reply(
        StatusCode::OK,
        ExportTraceServiceResponse::default().encode_to_vec().into(),
    )
}

fn value_string(v: Option<&any_value::Value>) -> String {
    match v {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}
