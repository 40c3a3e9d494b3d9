//! `/livez`, `/readyz`, `/healthz` in kube-apiserver's format.
//!
//! Format as in k8s.io/apiserver `pkg/server/healthz`: `ok` on success; with `?verbose` one
//! line per check (`[+]name ok`, `[-]name failed: reason withheld`) and a final
//! `<endpoint> check passed|failed`; failure is HTTP 500 with the verbose listing. The
//! per-resource checks (`cache:<resource>`) show their reason instead of withholding it
//! (`[-]cache:deployment.apps failed: not discovered yet: deployment.apps is not served by the
//! apiserver ...`): what keeps a replica unready is then visible where the operator looks,
//! and it names only configuration, no address or credential.
//! `/readyz/<name>` runs one check; `?exclude=name` skips one (repeatable).
//!
//! Who sees what ([`View`]) follows kube-apiserver's defaults (`system:public-info-viewer`
//! lets anyone `get` `/livez`, `/readyz` and `/healthz`, verbose included, and nothing below
//! them): a probe or an anonymous caller gets the [`View::Public`] answer, where the
//! per-resource checks are one `caches` check (cached resource names, custom ones included,
//! are not shown to callers the apiserver would not show its discovery to); the per-resource
//! listing and `/<endpoint>/<name>` need an authorized caller ([`crate::serve::admin`]).
//!
//! While the apiserver is unreachable, `upstream` passes for `cache.maxStaleness` with a note
//! (`[+]upstream ok: degraded: the apiserver has been unreachable for 12s`): the caches still
//! answer what they can, and every replica losing the same apiserver must not leave the
//! Service at once. After that it fails ([`Unready::TooStale`]).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http::{Response, StatusCode, header};
use slot::Slot;

use crate::http::body::{self, Body};

/// Why a check fails. The text is what `/readyz/<name>` shows, and for the per-resource
/// checks also `?verbose` (the built-in checks' reasons are withheld there).
#[derive(Debug, Clone, thiserror::Error)]
pub enum Unready {
    /// `upstream` before its first probe.
    #[error("not probed yet")]
    NotProbed,
    #[error("process is shutting down")]
    ShuttingDown,
    /// The last probe of the apiserver's `/readyz` failed.
    #[error(transparent)]
    Upstream(Arc<UpstreamNotReady>),
    /// The apiserver has been unreachable for longer than `cache.maxStaleness`; `cause` is
    /// the request that found the outage (address and error, for `/readyz/upstream`).
    #[error(
        "the apiserver has been unreachable for {}s, longer than cache.maxStaleness ({max:?}): {cause}",
        unreachable.as_secs()
    )]
    TooStale {
        unreachable: std::time::Duration,
        max: std::time::Duration,
        cause: String,
    },
    /// A cached resource before its first sync; the reason is the cache's.
    #[error("not synced yet: {0}")]
    NotSynced(String),
    #[error("stopped")]
    Stopped,
    /// A configured resource without a cache; the reason is discovery's.
    #[error("not discovered yet: {0}")]
    NotDiscovered(String),
}

/// Why the upstream apiserver's `/readyz` did not answer ok.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamNotReady {
    #[error("GET /readyz timed out after {0:?}")]
    TimedOut(std::time::Duration),
    /// No response (the upstream's error names the address and cause).
    #[error("GET /readyz: {0}")]
    Send(#[source] tower::BoxError),
    #[error("GET /readyz returned {0}")]
    Status(StatusCode),
}

impl From<UpstreamNotReady> for Unready {
    fn from(e: UpstreamNotReady) -> Unready {
        Unready::Upstream(Arc::new(e))
    }
}

/// One check's result: failing, or passing with an optional note for the verbose listing.
pub type CheckResult = Result<Option<String>, Unready>;

/// A named check's latest result, updated by whoever owns the condition.
#[derive(Debug, Clone)]
pub struct Check {
    name: &'static str,
    state: Arc<Slot>,
}

impl Check {
    pub fn new(name: &'static str, initial: Result<(), Unready>) -> Check {
        let c = Check {
            name,
            state: Arc::new(Slot::default()),
        };
        c.set(initial);
        c
    }

    pub fn set(&self, r: Result<(), Unready>) {
        self.state.set(r);
    }

    pub fn get(&self) -> Result<(), Unready> {
        self.state.get()
    }

    pub fn name(&self) -> &'static str {
        self.name
    }
}

/// Which endpoint a check belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Livez,
    Readyz,
    Healthz,
}

impl Endpoint {
    pub fn from_path(path: &str) -> Option<(Endpoint, Option<&str>)> {
        let (ep, rest) = if let Some(r) = path.strip_prefix("/livez") {
            (Endpoint::Livez, r)
        } else if let Some(r) = path.strip_prefix("/readyz") {
            (Endpoint::Readyz, r)
        } else if let Some(r) = path.strip_prefix("/healthz") {
            (Endpoint::Healthz, r)
        } else {
            return None;
        };
        // Anything below `/<endpoint>/` names one check, as on the apiserver, whose mux has
        // only `/<endpoint>` and `/<endpoint>/<check>`: `/readyz/` (an empty name) and
        // `/readyz/a/b` are no check, so 404 for a caller allowed the path, 403 for one who
        // is not (anonymous callers: `system:public-info-viewer` names exact paths only).
        match rest {
            "" => Some((ep, None)),
            r if r.starts_with('/') => Some((ep, Some(&r[1..]))),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Endpoint::Livez => "livez",
            Endpoint::Readyz => "readyz",
            Endpoint::Healthz => "healthz",
        }
    }
}

/// How much of the checks an answer shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// Every check by name, per-resource reasons included (an authorized caller).
    Full,
    /// The built-in checks and one `caches` check standing for all per-resource ones, its
    /// reason withheld (probes, anonymous callers): no cached resource is named.
    Public,
}

/// The check that stands for every per-resource check in [`View::Public`].
pub const CACHES_CHECK: &str = "caches";

/// The proxy's health checks.
#[derive(Debug, Clone)]
pub struct Health {
    pub ping: Check,
    /// Fails from the moment shutdown starts, so endpoints drain before listeners close.
    pub shutdown: Check,
    /// The upstream apiserver's `/readyz`, probed periodically.
    pub upstream: Check,
    shutting_down: Arc<AtomicBool>,
}

impl Default for Health {
    fn default() -> Self {
        Self::new()
    }
}

impl Health {
    pub fn new() -> Health {
        Health {
            ping: Check::new("ping", Ok(())),
            shutdown: Check::new("shutdown", Ok(())),
            upstream: Check::new("upstream", Err(Unready::NotProbed)),
            shutting_down: Arc::new(AtomicBool::new(false)),
        }
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.shutdown.set(Err(Unready::ShuttingDown));
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }

    fn checks(&self, ep: Endpoint) -> Vec<&Check> {
        match ep {
            // Liveness must not depend on the upstream: restarting the proxy does not fix an
            // apiserver outage, it only adds relists.
            Endpoint::Livez => vec![&self.ping],
            Endpoint::Readyz => vec![&self.ping, &self.shutdown, &self.upstream],
            Endpoint::Healthz => vec![&self.ping, &self.upstream],
        }
    }

    /// Answers a health request. `path` is e.g. `/readyz` or `/readyz/upstream`.
    pub fn respond(&self, path: &str, query: Option<&str>) -> Option<Response<Body>> {
        self.respond_with(path, query, None, Vec::new(), View::Full)
    }

    /// As [`Self::respond`], with the `upstream` check's result given (`Some`: it replaces
    /// the last probe's, e.g. degraded during an outage) and `extra` readiness checks (one
    /// per cached resource). An `Ok(Some(note))` check passes and shows its note in the
    /// verbose listing (a resource that does not gate readiness but is not synced; the
    /// upstream while degraded). `view` says whether `extra` is listed by name or as one
    /// `caches` check.
    pub fn respond_with(
        &self,
        path: &str,
        query: Option<&str>,
        upstream: Option<CheckResult>,
        extra: Vec<(String, CheckResult)>,
        view: View,
    ) -> Option<Response<Body>> {
        let (ep, single) = Endpoint::from_path(path)?;
        let mut checks: Vec<(String, CheckResult)> = self
            .checks(ep)
            .into_iter()
            .map(|c| {
                let r = match &upstream {
                    Some(r) if c.name() == self.upstream.name() => r.clone(),
                    _ => c.get().map(|()| None),
                };
                (c.name().to_string(), r)
            })
            .collect();
        if ep == Endpoint::Readyz && view == View::Public && !extra.is_empty() {
            // Failing when any resource fails; passing notes are not shown either.
            let failing = extra.iter().find_map(|(_, r)| r.as_ref().err()).cloned();
            checks.push((CACHES_CHECK.to_string(), failing.map_or(Ok(None), Err)));
        }
        // The first `own` are the proxy's built-in checks (reasons withheld).
        let own = checks.len();
        if ep == Endpoint::Readyz && view == View::Full {
            checks.extend(extra);
        }
        if let Some(name) = single {
            let Some((_, result)) = checks.iter().find(|(n, _)| n == name) else {
                return Some(text(StatusCode::NOT_FOUND, "404 page not found\n".into()));
            };
            return Some(match result {
                Ok(_) => text(StatusCode::OK, "ok".into()),
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("internal server error: {e}\n"),
                ),
            });
        }
        let params: Vec<(String, String)> = query
            .unwrap_or("")
            .split('&')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (k, v) = p.split_once('=').unwrap_or((p, ""));
                (k.to_string(), v.to_string())
            })
            .collect();
        let verbose = params.iter().any(|(k, _)| k == "verbose");
        let mut excluded: Vec<String> = params
            .iter()
            .filter(|(k, _)| k == "exclude")
            .map(|(_, v)| v.clone())
            .collect();
        let mut out = String::new();
        let mut failed = false;
        for (i, (name, result)) in checks.iter().enumerate() {
            if let Some(i) = excluded.iter().position(|e| e == name) {
                excluded.remove(i);
                out.push_str(&format!("[+]{name} excluded: ok\n"));
                continue;
            }
            match result {
                Ok(None) => out.push_str(&format!("[+]{name} ok\n")),
                Ok(Some(note)) => out.push_str(&format!("[+]{name} ok: {note}\n")),
                Err(why) if i >= own => {
                    failed = true;
                    out.push_str(&format!("[-]{name} failed: {why}\n"));
                }
                Err(_) => {
                    failed = true;
                    // The apiserver withholds reasons from this listing; /<endpoint>/<name>
                    // and the logs have them.
                    out.push_str(&format!("[-]{name} failed: reason withheld\n"));
                }
            }
        }
        if !excluded.is_empty() {
            out.push_str(&format!(
                "warn: some health checks cannot be excluded: no matches for {}\n",
                excluded
                    .iter()
                    .map(|e| format!("\"{e}\""))
                    .collect::<Vec<_>>()
                    .join(",")
            ));
        }
        Some(if failed {
            text(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{out}{} check failed\n", ep.name()),
            )
        } else if verbose {
            text(StatusCode::OK, format!("{out}{} check passed\n", ep.name()))
        } else {
            text(StatusCode::OK, "ok".into())
        })
    }
}

fn text(code: StatusCode, s: String) -> Response<Body> {
    let mut r = Response::new(body::full(s));
    *r.status_mut() = code;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r.headers_mut().insert(
        "x-content-type-options",
        http::HeaderValue::from_static("nosniff"),
    );
    r
}

/// A tiny lock-protected slot; checks are read per health request, written every few
/// seconds.
mod slot {
    use parking_lot::Mutex;

    use super::Unready;

    #[derive(Debug, Default)]
    pub struct Slot(Mutex<Option<Unready>>);

    impl Slot {
        pub fn set(&self, r: Result<(), Unready>) {
            *self.0.lock() = r.err();
        }

        pub fn get(&self) -> Result<(), Unready> {
            match &*self.0.lock() {
                None => Ok(()),
                Some(e) => Err(e.clone()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn get(h: &Health, path: &str, q: Option<&str>) -> (u16, String) {
        let r = h.respond(path, q).expect("a health path");
        let code = r.status().as_u16();
        let b = r.into_body().collect().await.unwrap().to_bytes();
        (code, String::from_utf8(b.to_vec()).unwrap())
    }

    #[tokio::test]
    async fn healthy_endpoints_answer_ok_and_list_checks_when_verbose() {
        let h = Health::new();
        h.upstream.set(Ok(()));
        assert_eq!(get(&h, "/readyz", None).await, (200, "ok".into()));
        assert_eq!(
            get(&h, "/readyz", Some("verbose")).await,
            (
                200,
                "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\nreadyz check passed\n".into()
            )
        );
        assert_eq!(
            get(&h, "/livez", Some("verbose=1")).await,
            (200, "[+]ping ok\nlivez check passed\n".into())
        );
    }

    #[tokio::test]
    async fn a_failed_check_fails_the_endpoint_with_the_reason_withheld() {
        let h = Health::new();
        h.upstream.set(Err(
            UpstreamNotReady::Send("connection refused".into()).into()
        ));
        let (code, body) = get(&h, "/readyz", None).await;
        assert_eq!(code, 500);
        assert_eq!(
            body,
            "[+]ping ok\n[+]shutdown ok\n[-]upstream failed: reason withheld\nreadyz check failed\n"
        );
        assert_eq!(
            get(&h, "/readyz/upstream", None).await,
            (
                500,
                "internal server error: GET /readyz: connection refused\n".into()
            )
        );
        // Liveness does not follow the upstream.
        assert_eq!(get(&h, "/livez", None).await.0, 200);
    }

    #[tokio::test]
    async fn resource_checks_show_their_reason_when_verbose() {
        let h = Health::new();
        h.upstream.set(Err(
            UpstreamNotReady::Send("connection refused".into()).into()
        ));
        let extra = vec![
            ("cache:pods".to_string(), Ok(None)),
            (
                "cache:deployment.apps".to_string(),
                Err(Unready::NotDiscovered(
                    "deployment.apps is not served".to_string(),
                )),
            ),
        ];
        let r = h
            .respond_with("/readyz", Some("verbose"), None, extra, View::Full)
            .unwrap();
        assert_eq!(r.status(), 500);
        let b = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            String::from_utf8(b.to_vec()).unwrap(),
            "[+]ping ok\n[+]shutdown ok\n[-]upstream failed: reason withheld\n[+]cache:pods ok\n\
             [-]cache:deployment.apps failed: not discovered yet: deployment.apps is not served\n\
             readyz check failed\n"
        );
    }

    /// What a probe or an anonymous caller sees: no cached resource by name, passing or
    /// failing, only whether the caches as a whole are ready.
    #[tokio::test]
    async fn the_public_view_names_no_cached_resource() {
        let h = Health::new();
        h.upstream.set(Ok(()));
        let extra = |failing: bool| {
            vec![
                ("cache:pods".to_string(), Ok(Some("note".to_string()))),
                (
                    "cache:widgets.secret-project.example.com".to_string(),
                    if failing {
                        Err(Unready::NotSynced(
                            "widgets.secret-project.example.com".into(),
                        ))
                    } else {
                        Ok(None)
                    },
                ),
            ]
        };
        let body = async |r: Response<Body>| {
            let code = r.status().as_u16();
            let b = r.into_body().collect().await.unwrap().to_bytes();
            (code, String::from_utf8(b.to_vec()).unwrap())
        };
        let r = h
            .respond_with("/readyz", Some("verbose"), None, extra(false), View::Public)
            .unwrap();
        assert_eq!(
            body(r).await,
            (
                200,
                "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\n[+]caches ok\nreadyz check passed\n"
                    .into()
            )
        );
        let r = h
            .respond_with("/readyz", None, None, extra(true), View::Public)
            .unwrap();
        assert_eq!(
            body(r).await,
            (
                500,
                "[+]ping ok\n[+]shutdown ok\n[+]upstream ok\n[-]caches failed: reason withheld\n\
                 readyz check failed\n"
                    .into()
            )
        );
        let r = h
            .respond_with(
                "/readyz",
                Some("exclude=caches"),
                None,
                extra(true),
                View::Public,
            )
            .unwrap();
        assert_eq!(body(r).await, (200, "ok".into()));
        // The full view is the per-resource listing.
        let r = h
            .respond_with("/readyz", Some("verbose"), None, extra(true), View::Full)
            .unwrap();
        let (code, full) = body(r).await;
        assert_eq!(code, 500);
        assert!(
            full.contains("[-]cache:widgets.secret-project.example.com failed: not synced yet"),
            "{full}"
        );
    }

    #[tokio::test]
    async fn excluded_checks_are_skipped_and_unknown_exclusions_warned() {
        let h = Health::new();
        h.upstream.set(Err(UpstreamNotReady::Status(
            StatusCode::SERVICE_UNAVAILABLE,
        )
        .into()));
        let (code, body) = get(&h, "/readyz", Some("verbose&exclude=upstream&exclude=nope")).await;
        assert_eq!(code, 200);
        assert_eq!(
            body,
            "[+]ping ok\n[+]shutdown ok\n[+]upstream excluded: ok\nwarn: some health checks cannot be excluded: no matches for \"nope\"\nreadyz check passed\n"
        );
    }

    #[tokio::test]
    async fn shutdown_fails_readiness_only() {
        let h = Health::new();
        h.upstream.set(Ok(()));
        h.begin_shutdown();
        assert_eq!(get(&h, "/readyz", None).await.0, 500);
        assert_eq!(get(&h, "/readyz/shutdown", None).await.0, 500);
        assert_eq!(get(&h, "/livez", None).await.0, 200);
        assert_eq!(get(&h, "/healthz", None).await.0, 200);
    }

    #[tokio::test]
    async fn a_degraded_upstream_passes_with_its_note_and_a_stale_one_fails() {
        let h = Health::new();
        h.upstream.set(Err(
            UpstreamNotReady::Send("connection refused".into()).into()
        ));
        let note = "degraded: the apiserver has been unreachable for 12s".to_string();
        let r = h
            .respond_with(
                "/readyz",
                Some("verbose"),
                Some(Ok(Some(note))),
                Vec::new(),
                View::Full,
            )
            .unwrap();
        assert_eq!(r.status(), 200);
        let b = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            String::from_utf8(b.to_vec()).unwrap(),
            "[+]ping ok\n[+]shutdown ok\n\
             [+]upstream ok: degraded: the apiserver has been unreachable for 12s\n\
             readyz check passed\n"
        );
        let stale = Unready::TooStale {
            unreachable: std::time::Duration::from_secs(61),
            max: std::time::Duration::from_secs(60),
            cause: "GET /readyz timed out after 5s".to_string(),
        };
        let r = h
            .respond_with(
                "/readyz/upstream",
                None,
                Some(Err(stale)),
                Vec::new(),
                View::Full,
            )
            .unwrap();
        assert_eq!(r.status(), 500);
        let b = r.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            String::from_utf8(b.to_vec()).unwrap(),
            "internal server error: the apiserver has been unreachable for 61s, longer than \
             cache.maxStaleness (60s): GET /readyz timed out after 5s\n"
        );
    }

    #[tokio::test]
    async fn unknown_single_checks_are_404() {
        let h = Health::new();
        assert_eq!(get(&h, "/readyz/nope", None).await.0, 404);
        assert!(h.respond("/readyzz", None).is_none());
        // A trailing slash or a deeper path names no check (kube-apiserver 1.36: 404
        // `404 page not found` for a caller allowed the path), not the listing.
        for path in [
            "/readyz/",
            "/livez/",
            "/healthz/",
            "/readyz/a/b",
            "/readyz//",
        ] {
            assert_eq!(
                get(&h, path, None).await,
                (404, "404 page not found\n".into()),
                "{path}"
            );
        }
    }
}
