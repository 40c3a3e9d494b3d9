//! The set of cached resources: discovery of each configured resource, one cache and one
//! reflector each. Until a resource is discovered and synced, its requests pass through.

use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use http::Request;
use http_body_util::BodyExt;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use super::{ReflectorSink, Resource, ResourceCache, StoreConfig};
use crate::body;
use crate::reflector::{Reflector, ReflectorConfig, ReflectorHandle};
use crate::upstream::{As, Upstream};

pub struct CacheEntry {
    pub cache: Arc<ResourceCache>,
    pub reflector: ReflectorHandle,
}

/// Cached resources by (group, version, resource).
#[derive(Default)]
pub struct Caches {
    map: DashMap<(String, String, String), Arc<CacheEntry>>,
    /// Configured names not (yet) found in discovery, with the reason.
    pub missing: DashMap<String, String>,
    /// Configured names that will not be cached (custom resources for now), with the reason.
    pub refused: DashMap<String, String>,
}

impl std::fmt::Debug for Caches {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Caches")
            .field("resources", &self.map.len())
            .finish()
    }
}

#[derive(Deserialize)]
struct ApiGroup {
    #[serde(rename = "preferredVersion")]
    preferred_version: Option<GroupVersion>,
}

#[derive(Deserialize)]
struct GroupVersion {
    version: String,
}

#[derive(Deserialize)]
struct ResourceList {
    resources: Vec<ApiResource>,
}

#[derive(Deserialize)]
struct ApiResource {
    name: String,
    kind: String,
    namespaced: bool,
    #[serde(default)]
    verbs: Vec<String>,
}

impl Caches {
    pub fn get(&self, group: &str, version: &str, resource: &str) -> Option<Arc<ResourceCache>> {
        self.map
            .get(&(group.to_string(), version.to_string(), resource.to_string()))
            .map(|e| e.cache.clone())
    }

    pub fn entries(&self) -> Vec<Arc<CacheEntry>> {
        let mut v: Vec<_> = self.map.iter().map(|e| e.value().clone()).collect();
        v.sort_by_key(|e| e.cache.resource.label());
        v
    }

    /// Registers an already-built cache (tests, or resources known without discovery).
    pub fn insert(&self, entry: CacheEntry) {
        let r = &entry.cache.resource;
        self.map.insert(
            (r.group.clone(), r.version.clone(), r.resource.clone()),
            Arc::new(entry),
        );
    }

    /// Discovers each of `names` (`pods`, `deployments.apps`) on the apiserver, then starts a
    /// cache and a reflector for it. Runs in the background, retrying discovery until it
    /// succeeds or `shutdown` fires.
    pub fn start(
        names: Vec<String>,
        upstream: Upstream,
        store: StoreConfig,
        reflector: ReflectorConfig,
        shutdown: CancellationToken,
    ) -> Arc<Caches> {
        let caches = Arc::new(Caches::default());
        for n in &names {
            caches
                .missing
                .insert(n.clone(), "not discovered yet".into());
        }
        let c = caches.clone();
        tokio::spawn(async move {
            let mut delay = Duration::from_millis(500);
            loop {
                let pending: Vec<String> = c.missing.iter().map(|e| e.key().clone()).collect();
                if pending.is_empty() {
                    return;
                }
                for name in pending {
                    match discover(&upstream, &name).await {
                        Ok(resource) => {
                            let cache = ResourceCache::new(resource.clone(), store.clone());
                            let handle = Reflector::spawn(
                                resource,
                                upstream.clone(),
                                cache.clone() as Arc<dyn ReflectorSink>,
                                reflector.clone(),
                                shutdown.clone(),
                            );
                            c.insert(CacheEntry {
                                cache,
                                reflector: handle,
                            });
                            // Only now, so readiness never sees the name in neither map.
                            c.missing.remove(&name);
                        }
                        Err(Discovery::Refused(e)) => {
                            tracing::warn!(resource = %name, reason = %e, "not caching this resource; its requests pass through");
                            c.missing.remove(&name);
                            c.refused.insert(name, e);
                        }
                        Err(Discovery::Retry(e)) => {
                            tracing::warn!(resource = %name, error = %e, "cannot cache this resource yet");
                            c.missing.insert(name, e);
                        }
                    }
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(delay) => {}
                }
                delay = (delay * 2).min(Duration::from_secs(30));
            }
        });
        caches
    }
}

async fn get_json<T: for<'de> Deserialize<'de>>(
    upstream: &Upstream,
    path: &str,
) -> Result<T, String> {
    let mut req = Request::new(body::empty());
    *req.uri_mut() = upstream.uri(path);
    req.headers_mut().insert(
        http::header::ACCEPT,
        http::HeaderValue::from_static("application/json"),
    );
    let resp = tokio::time::timeout(
        Duration::from_secs(30),
        upstream.send(req, As::Proxy, false),
    )
    .await
    .map_err(|_| format!("GET {path} timed out"))?
    .map_err(|e| format!("GET {path}: {e}"))?;
    let status = resp.status();
    let b = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!("GET {path} returned {status}"));
    }
    serde_json::from_slice(&b).map_err(|e| format!("GET {path}: {e}"))
}

/// Whether a CustomResourceDefinition serves `resource.group` (any answer but 200 counts as
/// no: built-in and aggregated resources have no CRD).
async fn is_custom_resource(upstream: &Upstream, resource: &str, group: &str) -> bool {
    let mut req = Request::new(body::empty());
    *req.uri_mut() = upstream.uri(&format!(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{resource}.{group}"
    ));
    req.headers_mut().insert(
        http::header::ACCEPT,
        http::HeaderValue::from_static("application/json"),
    );
    matches!(
        tokio::time::timeout(Duration::from_secs(30), upstream.send(req, As::Proxy, false)).await,
        Ok(Ok(r)) if r.status().is_success()
    )
}

/// Why a configured resource has no cache.
enum Discovery {
    /// Try again later (apiserver unreachable, resource not served yet).
    Retry(String),
    /// Never (a kind the cache does not model).
    Refused(String),
}

impl From<String> for Discovery {
    fn from(s: String) -> Self {
        Discovery::Retry(s)
    }
}

impl From<&str> for Discovery {
    fn from(s: &str) -> Self {
        Discovery::Retry(s.to_string())
    }
}

/// Resolves `resource[.group]` to its preferred version, kind and scope.
async fn discover(upstream: &Upstream, name: &str) -> Result<Resource, Discovery> {
    let (resource, group) = name.split_once('.').unwrap_or((name, ""));
    if !group.is_empty() && is_custom_resource(upstream, resource, group).await {
        // Custom resources differ on the wire: list items carry apiVersion/kind and the
        // encoder orders keys differently, which the store's bodies do not model yet. They
        // pass through until they do.
        return Err(Discovery::Refused(format!(
            "{name} is a custom resource; custom resources are not cached yet"
        )));
    }
    let version = if group.is_empty() {
        "v1".to_string()
    } else {
        let g: ApiGroup = get_json(upstream, &format!("/apis/{group}")).await?;
        g.preferred_version.ok_or("no preferred version")?.version
    };
    let path = if group.is_empty() {
        "/api/v1".to_string()
    } else {
        format!("/apis/{group}/{version}")
    };
    let list: ResourceList = get_json(upstream, &path).await?;
    let r = list
        .resources
        .into_iter()
        .find(|r| r.name == resource)
        .ok_or_else(|| format!("{name} is not served by the apiserver"))?;
    if !(r.verbs.iter().any(|v| v == "list") && r.verbs.iter().any(|v| v == "watch")) {
        return Err(Discovery::Refused(format!(
            "{name} cannot be listed and watched"
        )));
    }
    Ok(Resource {
        group: group.to_string(),
        version,
        resource: resource.to_string(),
        kind: r.kind,
        namespaced: r.namespaced,
    })
}
