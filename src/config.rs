//! Typed configuration: the YAML file, then `KCP_*` environment variables and flags on top.
//!
//! Every field has its default implemented once, here, with the reason for it. The commented
//! example `config/kube-cache-proxy.yaml` lists the same fields; `check-config` validates a
//! file and reports every problem at once, each with its field path ([`Config::parse_all`]).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

mod otel;
mod paging;
pub use otel::{OtlpConfig, OtlpProtocol, TracingConfig, check_endpoint};
pub use paging::{LoadConfig, PagingConfig};

/// The whole configuration file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct Config {
    /// TLS listener (HTTP/1.1 and HTTP/2 by ALPN). Only started when `tls.certFile` and
    /// `tls.keyFile` are set. Default `0.0.0.0:8443`: the Service maps 443 to it, and a
    /// non-root container cannot bind 443.
    pub listen: SocketAddr,
    /// Plain-HTTP listener for local development (HTTP/1.1 and h2c prior knowledge). Off by
    /// default. A non-loopback address is refused unless `allowInsecureNonLoopback` is set,
    /// because callers' bearer tokens would cross the network in clear text.
    pub insecure_listen: Option<SocketAddr>,
    pub allow_insecure_non_loopback: bool,
    pub tls: TlsConfig,
    pub upstream: UpstreamConfig,
    pub server: ServerConfig,
    pub shutdown: ShutdownConfig,
    pub log: LogConfig,
    pub cache: CacheConfig,
    pub lists: ListsConfig,
    pub tokens: TokensConfig,
    pub paging: PagingConfig,
    pub authentication: AuthenticationConfig,
    /// How cache-served reads are authorized (see [`AuthorizationConfig`]).
    pub authorization: AuthorizationConfig,
    /// Tenants: who belongs to which, their namespaces and quotas (see [`TenantConfig`]).
    /// Callers no tenant matches belong to the unnamed tenant `""`, without quotas.
    pub tenants: Vec<TenantConfig>,
    /// OpenTelemetry spans (off unless an OTLP endpoint is set; see `docs/tracing.md`).
    pub tracing: TracingConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([0, 0, 0, 0], 8443)),
            insecure_listen: None,
            allow_insecure_non_loopback: false,
            tls: TlsConfig::default(),
            upstream: UpstreamConfig::default(),
            server: ServerConfig::default(),
            shutdown: ShutdownConfig::default(),
            log: LogConfig::default(),
            cache: CacheConfig::default(),
            lists: ListsConfig::default(),
            tokens: TokensConfig::default(),
            paging: PagingConfig::default(),
            authentication: AuthenticationConfig::default(),
            authorization: AuthorizationConfig::default(),
            tenants: Vec::new(),
            tracing: TracingConfig::default(),
        }
    }
}

/// How callers of cache-served requests are authenticated (see `authn`). Passthrough requests
/// are authenticated by the apiserver itself.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct AuthenticationConfig {
    /// Serve callers without credentials as `system:anonymous` (group
    /// `system:unauthenticated`, authorized like anyone else). Off: they get 401.
    pub anonymous: bool,
    /// A kube-apiserver `--token-auth-file` CSV (`token,user,uid,"group1,group2"`), for
    /// development and tests. Read at start.
    pub token_auth_file: Option<PathBuf>,
    /// Verify ServiceAccount JWTs offline against the apiserver's OIDC discovery document and
    /// JWKS (fetched with the proxy's credentials). Off: every token goes to TokenReview.
    pub service_account_jwt: bool,
    /// Accepted `aud` values of ServiceAccount JWTs. Empty: the issuer (kube-apiserver's
    /// `--api-audiences` default).
    pub audiences: Vec<String>,
    /// Clock skew allowed on `exp`/`nbf` (go-jose's default leeway, used by kube-apiserver).
    #[serde(with = "duration")]
    pub leeway: Duration,
    /// The JWKS is refetched this often in the background (and at start; a failure keeps the
    /// previous keys), and on a token with an unknown `kid`...
    #[serde(with = "duration")]
    pub jwks_refresh_interval: Duration,
    /// ...but not more often than this (a flood of forged `kid`s cannot hammer the apiserver).
    #[serde(with = "duration")]
    pub jwks_min_refresh_interval: Duration,
    /// Which offline-verified tokens are also checked by TokenReview, which sees revocation
    /// (a deleted ServiceAccount, or the pod/secret/node a bound token names): `None`,
    /// `BoundObjects` (tokens that name a pod, secret or node) or `Always`.
    pub revocation_check: RevocationCheck,
    /// Check on every request that the ServiceAccount a token authenticates exists with the
    /// token's uid (and the pod or node it is bound to, when those are cached), as
    /// kube-apiserver's `--service-account-lookup`: the proxy watches ServiceAccounts for this
    /// (one upstream watch; needs list and watch on them). When its copy disagrees (a deleted
    /// or re-created account, a bound pod gone), TokenReview decides. Off: a deleted
    /// account's token keeps reading the cache until it expires (or, with `revocationCheck`,
    /// until its cached verdict does).
    pub service_account_lookup: bool,
    /// Ask the apiserver (TokenReview) about tokens the proxy cannot verify itself (other
    /// issuers, legacy Secret tokens, OIDC). Off: such tokens get 401 on cache-served requests.
    pub token_review: bool,
    /// How long a successful authentication is remembered (kube-apiserver's token cache: 10 s).
    /// Never beyond the token's own expiry.
    #[serde(with = "duration")]
    pub cache_ttl: Duration,
    /// How long a failed one is (kube-apiserver: 0). A few seconds bound a flood of bad
    /// tokens to one review per token per interval.
    #[serde(with = "duration")]
    pub failure_cache_ttl: Duration,
    /// While the apiserver is unreachable (no answer at all: refused, reset, timed out), a
    /// caller it authenticated before, and a request it authorized before, keep being
    /// accepted from the decisions at hand for this long past their TTLs (`cacheTtl`,
    /// `cache.authorizationAllowTtl`), so reads the cache can answer go on through an outage
    /// (see `docs/architecture.md`). Only positive decisions the apiserver actually made, for
    /// the same token or the same identity and request; a refusal obtained since voids them,
    /// and a token is never accepted past its `exp`. Tokens the proxy verifies itself (the
    /// token file, ServiceAccount JWTs without a revocation check) keep verifying regardless.
    /// 5 minutes: longer than an apiserver restart or a control-plane upgrade takes, and no
    /// more than kube-apiserver's webhook authorizer already lets an allowed decision stand
    /// (5 minutes); a permission revoked during an outage the proxy cannot learn anyway. 0:
    /// off (the caller gets 503 once the decision's TTL is over, as before).
    #[serde(with = "duration")]
    pub stale_while_unreachable: Duration,
}

impl Default for AuthenticationConfig {
    fn default() -> Self {
        AuthenticationConfig {
            anonymous: false,
            token_auth_file: None,
            service_account_jwt: true,
            audiences: Vec::new(),
            leeway: Duration::from_secs(60),
            jwks_refresh_interval: Duration::from_secs(300),
            jwks_min_refresh_interval: Duration::from_secs(10),
            revocation_check: RevocationCheck::BoundObjects,
            service_account_lookup: true,
            token_review: true,
            cache_ttl: Duration::from_secs(10),
            failure_cache_ttl: Duration::from_secs(2),
            stale_while_unreachable: Duration::from_secs(300),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub enum RevocationCheck {
    None,
    BoundObjects,
    Always,
}

/// How cache-served reads are authorized. Passthrough requests are the apiserver's to
/// authorize.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct AuthorizationConfig {
    /// `auto` (default): evaluate RBAC in the proxy from the Roles, ClusterRoles and
    /// bindings it follows (`cache.authorizationFollowRbac`), once a probe confirmed that the
    /// apiserver enforces them; an RBAC allow is final, everything else goes to
    /// SubjectAccessReview. `off`: every question goes to SubjectAccessReview. Set `off`
    /// when the apiserver's authorizer chain has an authorizer that can deny before RBAC
    /// (a webhook listed first in `--authorization-config`): an RBAC allow is then not final.
    pub local_rbac: LocalRbacMode,
}

/// `authorization.localRbac`.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum LocalRbacMode {
    #[default]
    Auto,
    Off,
}

/// One tenant: which callers belong to it, what they may see, and their quotas.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TenantConfig {
    /// Unique, non-empty; bound into continue tokens.
    pub name: String,
    /// A caller belongs to the first tenant (in file order) with any matching rule.
    #[serde(rename = "match", default)]
    pub matches: TenantMatch,
    /// Namespaces of the tenant: a static list...
    #[serde(default)]
    pub namespaces: Vec<String>,
    /// ...and/or a label selector on Namespace objects (from the cache), e.g. `team=a`.
    #[serde(default)]
    pub namespace_selector: Option<String>,
    /// A cluster-scoped list/watch of a namespaced resource by a caller allowed only in some
    /// namespaces: false gives the apiserver's 403; true serves only the objects in the
    /// tenant's namespaces the caller may list.
    #[serde(default)]
    pub filtered_cluster_view: bool,
    /// How often an open watch through a filtered cluster view re-derives the view (tenant
    /// namespaces, then per-namespace access, from the decision cache). A changed view ends
    /// the watch with a 410 Expired ERROR event, so the client relists into the new view
    /// instead of missing a namespace that joined or keeping one that left. Each recheck
    /// costs one decision-cache lookup per tenant namespace per open filtered watch.
    #[serde(default = "default_view_recheck_interval", with = "duration")]
    pub view_recheck_interval: Duration,
    #[serde(default)]
    pub quotas: TenantQuotas,
}

fn default_view_recheck_interval() -> Duration {
    Duration::from_secs(10)
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TenantMatch {
    /// Any of these groups.
    pub groups: Vec<String>,
    /// ServiceAccounts of these namespaces.
    pub service_account_namespaces: Vec<String>,
    /// User names matching any of these patterns (`*` matches any run of characters).
    pub username_patterns: Vec<String>,
}

/// Per-tenant limits on cache-served requests, and on passthrough lists and watches of callers
/// the proxy names without asking the apiserver (see `tenancy`); unset means unlimited.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TenantQuotas {
    /// Concurrent watches served from the cache.
    pub max_watches: Option<u32>,
    /// Sustained LIST/GET rate (per second) and burst.
    pub list_qps: Option<f64>,
    pub list_burst: Option<u32>,
    /// Most objects an unpaginated (no `limit`) list may return; larger gets 429.
    pub max_list_objects: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TlsConfig {
    /// PEM certificate chain served to clients. Reloaded when the file changes.
    pub cert_file: Option<PathBuf>,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1). Reloaded with the certificate.
    pub key_file: Option<PathBuf>,
    /// PEM bundle of CAs whose client certificates identify callers (CN = user, O = groups),
    /// as kube-apiserver's `--client-ca-file`. Callers without a certificate are still
    /// accepted and authenticate by bearer token.
    #[serde(rename = "clientCaFile")]
    pub client_ca_file: Option<PathBuf>,
    /// How often the certificate and key files are checked for changes. Polling (not inotify)
    /// because Kubernetes updates mounted Secrets by swapping a symlink.
    #[serde(with = "duration")]
    pub reload_interval: Duration,
    /// Bound on a TLS handshake, so half-open connections cannot pin resources.
    #[serde(with = "duration")]
    pub handshake_timeout: Duration,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig {
            cert_file: None,
            key_file: None,
            client_ca_file: None,
            reload_interval: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Kubeconfig of the upstream apiserver. Unset: in-cluster config when running in a pod,
    /// else `$KUBECONFIG`, else `~/.kube/config`.
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context; unset means the current context.
    pub context: Option<String>,
    /// Directory of the ServiceAccount `token`, `ca.crt` and `namespace` used by the
    /// in-cluster config. Unset: `/var/run/secrets/kubernetes.io/serviceaccount`, where the
    /// kubelet mounts them; set it only when they are elsewhere (tests use it).
    pub service_account_dir: Option<PathBuf>,
    /// TCP+TLS connect timeout to the apiserver.
    #[serde(with = "duration")]
    pub connect_timeout: Duration,
    /// How often `/readyz` of the upstream is probed for the proxy's own readiness.
    #[serde(with = "duration")]
    pub health_check_interval: Duration,
    /// HTTP/2 keepalive ping interval on upstream connections: detects a dead apiserver
    /// connection under a long watch (client-go uses 30 s for the same purpose).
    #[serde(with = "duration")]
    pub keepalive_interval: Duration,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            kubeconfig: None,
            context: None,
            service_account_dir: None,
            connect_timeout: Duration::from_secs(10),
            health_check_interval: Duration::from_secs(5),
            keepalive_interval: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Concurrent streams per HTTP/2 connection. client-go multiplexes every request and
    /// watch of a process over one connection and opens another only when the server's limit
    /// is reached; 1000 keeps even a large controller manager on one connection. (kube-apiserver
    /// itself allows 100 since its rapid-reset hardening.) Memory is bounded by bytes
    /// (`connectionBufferBytes`), not by this count: 10 × 1,000 watch streams that are never
    /// read cost the proxy about 150 MB (docs/architecture.md, Memory bounds).
    pub http2_max_concurrent_streams: u32,
    /// Bytes HTTP/2 buffers per stream while the client's flow-control window is open and its
    /// socket is not (hyper's `max_send_buf_size`, default 400 KiB, above a watch's initial
    /// chunk of 256 KiB). The connection's budget (`connectionBufferBytes`) bounds the sum
    /// over its streams; 64 KiB changed neither the memory of 10,000 non-reading streams nor
    /// a 10 MB LIST's time (docs/architecture.md, Memory bounds), so hyper's default stays.
    pub http2_max_send_buffer_bytes: usize,
    /// Bytes a connection's responses may have produced that its socket has not taken yet.
    /// Beyond it the connection's response bodies wait until its client reads (watch events
    /// queue in the watcher's queue, `cache.watcherQueueBytes`, and a watcher that overflows
    /// it is closed as before). This, not the stream count, is what bounds the memory a
    /// client that does not read can hold: 10 connections × 1,000 watch streams of a 250 KB
    /// namespace held 2.5–3.8 GB without it. Default 4 MiB: above the TCP send buffer, so a
    /// large LIST still streams at full speed.
    pub connection_buffer_bytes: u64,
    /// The same over all connections of the process. Once reached, connections holding more
    /// than 256 KiB wait too (those holding less always proceed, so slow clients together
    /// cannot stop the others). `kube_cache_proxy_downstream_buffered_bytes` is the sum now.
    /// Default 256 MiB: 64 connections' full budgets.
    pub downstream_buffer_bytes: u64,
    /// Server-initiated HTTP/2 PING interval; dead clients are dropped after the timeout.
    #[serde(with = "duration")]
    pub http2_keepalive_interval: Duration,
    #[serde(with = "duration")]
    pub http2_keepalive_timeout: Duration,
    /// Streams a client may open and reset before the server accepts them (CVE-2023-44487
    /// "rapid reset"); hyper's default is 20.
    pub http2_max_pending_accept_reset_streams: usize,
    /// Streams the server may reset for protocol errors before closing the connection
    /// (CVE-2024-27316-class floods); hyper's default is 1024.
    pub http2_max_local_error_reset_streams: usize,
    /// Largest request head (all header names and values) accepted; larger gets 431.
    /// kube-apiserver (Go's net/http default) allows 1 MiB; the proxy must not be stricter
    /// than the server it stands for.
    pub max_header_bytes: usize,
    /// Largest body of a non-streaming request (create/update/patch); larger gets 413.
    /// kube-apiserver's own limit is 3 MiB (`MaxRequestBodyBytes`).
    pub max_request_body_bytes: u64,
    /// Concurrent downstream connections; further connections wait in the accept backlog.
    pub max_connections: usize,
    /// Time allowed to receive a request head on HTTP/1.1 (slowloris protection).
    #[serde(with = "duration")]
    pub header_read_timeout: Duration,
    /// The admin listener: the proxy's own `/livez`, `/readyz`, `/healthz` (open, for
    /// probes), `/metrics` and `/debug/*` (authenticated and authorized, see `adminAuth`).
    /// The API port (`listen`) is the apiserver's whole surface: these paths there are the
    /// apiserver's. TLS with the serving certificate (`tls.certFile`); without one (local
    /// use with `insecureListen` only) plain HTTP, loopback only unless
    /// `allowInsecureNonLoopback`. Unset: `0.0.0.0:8444` with TLS, `127.0.0.1:8444` without
    /// ([`Config::admin_addr`]); 8444 is the port next to the API port's 8443.
    pub admin_listen: Option<SocketAddr>,
    /// Who may read `/metrics` and `/debug/*` on the admin listener: `kubernetes` (default,
    /// as kube-rbac-proxy: the caller is authenticated as reads are, then a
    /// SubjectAccessReview for the non-resource URL, e.g. `get` on `/metrics`; 401/403
    /// otherwise) or `none` (anyone who reaches the port: for local use only).
    pub admin_auth: AdminAuth,
}

/// Who may read the admin listener's `/metrics` and `/debug/*` (`server.adminAuth`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum AdminAuth {
    /// Authentication as for reads, then a SubjectAccessReview on the non-resource URL.
    #[default]
    Kubernetes,
    /// No authentication or authorization: anyone who reaches the port (local use only).
    None,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            http2_max_concurrent_streams: 1000,
            http2_max_send_buffer_bytes: 400 * 1024,
            connection_buffer_bytes: 4 * 1024 * 1024,
            downstream_buffer_bytes: 256 * 1024 * 1024,
            http2_keepalive_interval: Duration::from_secs(30),
            http2_keepalive_timeout: Duration::from_secs(20),
            http2_max_pending_accept_reset_streams: 20,
            http2_max_local_error_reset_streams: 1024,
            max_header_bytes: 1024 * 1024,
            max_request_body_bytes: 3 * 1024 * 1024,
            max_connections: 10_000,
            header_read_timeout: Duration::from_secs(30),
            admin_listen: None,
            admin_auth: AdminAuth::Kubernetes,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ShutdownConfig {
    /// Time between failing `/readyz` and closing listeners, so load balancers and
    /// Endpoints stop sending new connections first (kube-apiserver's
    /// `--shutdown-delay-duration`). 0 for local use; the deploy manifests set 10 s.
    #[serde(with = "duration")]
    pub delay: Duration,
    /// Bound on draining open requests and watch streams after the listeners close.
    #[serde(with = "duration")]
    pub drain_timeout: Duration,
}

impl Default for ShutdownConfig {
    fn default() -> Self {
        ShutdownConfig {
            delay: Duration::ZERO,
            drain_timeout: Duration::from_secs(30),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Resources served from memory, as `resource` (core) or `resource.group` (custom
    /// resources too), or `all`: every resource that can be listed and watched, minus
    /// `exclude` (see [`crate::cache::discovery`]). The version is the one discovery prefers.
    /// Everything else passes through. Leases are left out: they change every few seconds
    /// per holder and are read by few. Secrets are left out too (opt-in): caching them
    /// takes `list`/`watch` on every Secret of the cluster for the proxy's ServiceAccount and
    /// holds them in its memory and state files; controllers that read Secrets at scale
    /// gain the fan-out when an operator adds `secrets` (README, "Secrets").
    pub resources: Vec<String>,
    /// Resources `all` leaves out, named like `resources` (they pass through; a resource
    /// named in `resources` is cached regardless). Events are left out by default: written
    /// constantly, rarely watched cluster-wide, and the largest cache in most clusters.
    pub exclude: Vec<String>,
    /// Events kept per resource for resuming watches from a resourceVersion.
    pub history_max_events: usize,
    /// Events older than this leave the history (kube-apiserver keeps at least 75 s).
    #[serde(with = "duration")]
    pub history_max_age: Duration,
    /// Past this age the history keeps an event without the watch frames encoded for it
    /// (the watchers it was dispatched to hold their own; a watch that starts or resumes
    /// later encodes them again): a few kilobytes per event less in churn.
    #[serde(with = "duration")]
    pub history_frames_kept: Duration,
    /// Events queued per watcher; a watcher whose queue stays full is closed.
    pub watcher_queue: usize,
    /// ...and object bytes queued per watcher (one event always fits): a watcher that falls
    /// this far behind is closed like one whose queue is full, so a slow reader of large
    /// objects holds little and costs its neighbours one dispatch budget at most.
    pub watcher_queue_bytes: usize,
    /// How long the dispatcher may wait for watchers with full queues before they are
    /// closed: one budget for all events, refilled at half of it per second, so a watcher
    /// that frees a slot just in time cannot make every event wait (k8s.io/apiserver's
    /// cacher: 100 ms, 50 ms per second). Default 0: a watcher whose queue (`watcherQueue`
    /// events, `watcherQueueBytes`) is full is closed at once. The cacher waits because its
    /// buffers are small; these hold over a thousand events, and every wait delays every
    /// other watcher's events (measured with one watcher that stops reading during 16 KiB
    /// updates, the others' p99: with 100 ms 31–130 ms over nine runs, kube-apiserver 35–124
    /// ms in the same runs; with 0 19–28 ms, kube-apiserver 39–59 ms in the same runs;
    /// `loadtest/results/slow-watcher-*`). A closed watcher's client
    /// re-watches from its last resourceVersion, served from the history.
    #[serde(with = "duration")]
    pub dispatch_budget: Duration,
    /// Interval of BOOKMARK events to watchers that allow them (kube-apiserver: ~1 minute).
    #[serde(with = "duration")]
    pub bookmark_interval: Duration,
    /// Interval of BOOKMARK events to watchers with a field-level change filter (the opt-in
    /// `X-Kube-Cache-Proxy-Watch-Fields` header): their resourceVersion keeps advancing while
    /// events are suppressed, so a resume never starts far behind.
    #[serde(with = "duration")]
    pub filtered_bookmark_interval: Duration,
    /// Bounds on the distinct field-level change filters (`X-Kube-Cache-Proxy-Watch-Fields`)
    /// of one resource's open watches (`docs/watch-fields.md`).
    pub watch_fields: WatchFieldsConfig,
    /// When the proxy must relist a resource (its upstream watch expired after compaction,
    /// or the apiserver restarted), keep downstream watches open and send them the
    /// difference between the old and the new state as ordinary ADDED/MODIFIED/DELETED
    /// events and a bookmark at the new list's resourceVersion, so informers behind the
    /// proxy need no relist of their own. `false`: close them; they come back, get 410
    /// Expired and relist, as behind a kube-apiserver whose watch cache relisted.
    pub absorb_relists: bool,
    /// A watch from a resourceVersion older than the cache's history (a client resuming
    /// after a proxy restart without saved state, on a replica that listed after its last
    /// event, or past the history's window) is served by extending the history back from
    /// the apiserver: an Exact list at that resourceVersion and a watch from it, joined to
    /// the history only when they lead exactly to its start, once for every client in the
    /// stretch. Where the apiserver's watch no longer has the events (older than its own
    /// watch cache) but etcd still has the state (the Exact list works), the stretch is the
    /// difference from that state to the history's start, as after an absorbed relist
    /// (with `absorbRelists`); only a compacted resourceVersion gets its 410 as before. `false`: always 410 Expired
    /// (the client relists from the cache), as a kube-apiserver past its watch cache.
    pub backfill: bool,
    /// Bound on the protobuf representation over all resources, in bytes. A built-in
    /// resource's protobuf side (a second upstream watch, in protobuf, started with the
    /// resource or by its first protobuf reader: `protobufSide`) keeps each cached object version's exact protobuf bytes so protobuf
    /// clients are served from the cache; the bytes are reported per resource
    /// (`kube_cache_proxy_cache_protobuf_bytes`). A resource whose envelopes would take the
    /// total over this bound is shed: its protobuf side stops, its objects drop their
    /// envelopes and its protobuf requests go to the apiserver until the proxy restarts (a
    /// warning in the log, `kube_cache_proxy_cache_protobuf_shed`). 0: no protobuf side at
    /// all, every protobuf request passes through.
    pub protobuf_max_bytes: u64,
    /// When a built-in resource's protobuf side starts. `eager` (default): with the
    /// resource's cache, so protobuf clients (client-go's default) are served from the cache
    /// from its first sync, after a cold start as after a warm one. `lazy`: when the first
    /// protobuf reader of the resource comes (memory-tight deployments whose protobuf
    /// clients read few resources: a resource nobody reads in protobuf then holds no
    /// envelopes). Either way the envelopes count against `protobufMaxBytes`, and a read
    /// that comes while the side it needs is starting waits for it or is asked to retry
    /// (429), as at a kube-apiserver whose watch cache initializes.
    pub protobuf_side: ProtobufSide,
    /// Write a built-in object's protobuf from its JSON (`k8s::transcode`, byte for byte
    /// the apiserver's, from a schema generated from the k8s.io/api the proxy was built
    /// with), so each built-in resource takes one upstream watch, not two. A kind the
    /// schema does not describe, and a resource one of whose objects it cannot write (a
    /// field newer than the schema), gets the protobuf side of `protobufSide` instead.
    /// Default on; off: every built-in resource has its protobuf side.
    pub protobuf_transcode: bool,
    /// Bound on the table side over all resources, in bytes: the rows kube-apiserver's
    /// printers computed for each cached object version (`cache::table`), kept so Table
    /// reads (`kubectl get`) are served from the cache. A resource's side starts with its
    /// first Table reader. A resource whose rows would take the total over this bound is
    /// shed: its side stops and its Tables go to the apiserver until the proxy restarts.
    /// 0: no table side, every Table request passes through. Default 512 MiB: rows are
    /// a few hundred bytes, about a quarter of a small pod.
    pub table_max_bytes: u64,
    /// Bound on one backfill (the client's watch waits for it; then 410).
    #[serde(with = "duration")]
    pub backfill_timeout: Duration,
    /// Warm restart: a directory (the Deployment mounts an `emptyDir`, which survives
    /// container restarts) where each cache's state — objects, resourceVersion, event
    /// history — is written at shutdown and read back at start, so the restarted proxy
    /// resumes its upstream watches without a LIST and clients resume their watches without
    /// 410 or relist. Files are sealed (ChaCha20-Poly1305: authenticated and encrypted) and
    /// bound to the upstream and resource, with a key derived from `tokens.keyFile`, or
    /// without one from a local key made once beside them (`<stateDir>/.state-key`, 0600);
    /// an unsealed or tampered file is refused (that cache starts cold). The directory is
    /// 0700 and the files 0600 whatever the umask. Secrets are written only with
    /// `tokens.keyFile` (a key beside the files authenticates them but hides nothing from a
    /// reader of the directory). Unset: off (a restart lists every resource again).
    pub state_dir: Option<std::path::PathBuf>,
    /// A saved state written longer ago than this is ignored: twice kube-apiserver's default
    /// etcd compaction interval (5 minutes), past which resuming from it would most likely
    /// be refused as compacted, while `resourceVersion=0` reads would be served from a state
    /// that old until the upstream watch caught up.
    #[serde(with = "duration")]
    pub state_max_age: Duration,
    /// Besides at shutdown, the caches that changed are saved this often, so a proxy that
    /// crashed (OOM kill, a lost node's container restarted elsewhere in the pod) restarts
    /// from a state at most this old and catches up with its upstream watch, and its clients
    /// still resume without a relist while etcd has not compacted that far. A save costs
    /// about one serialization of the cache (skipped while nothing changed). 0: only at
    /// shutdown.
    #[serde(with = "duration")]
    pub state_save_interval: Duration,
    /// Items per page of the proxy's own upstream LISTs when `paging.adaptUpstream` is off.
    pub upstream_page_size: u32,
    /// A cached decision that a caller may read something lasts this long (kube-apiserver's
    /// `--authorization-webhook-cache-authorized-ttl`: 5 minutes; it bounds how long a
    /// revoked permission can still read the cache).
    #[serde(with = "duration")]
    pub authorization_allow_ttl: Duration,
    /// A cached "not allowed" lasts this long (the webhook authorizer's default: 30 s).
    #[serde(with = "duration")]
    pub authorization_deny_ttl: Duration,
    /// Watch Roles, RoleBindings, ClusterRoles and ClusterRoleBindings (one upstream watch
    /// each) and forget cached decisions when they change: a revoked or granted RBAC
    /// permission takes effect at the proxy as at the apiserver, not after the TTLs above
    /// (which still bound decisions of other authorizers, e.g. a webhook). Needs list and
    /// watch on those four resources.
    pub authorization_follow_rbac: bool,
    /// While the apiserver is unreachable, the proxy stays ready (`/readyz` of the admin
    /// listener, `[+]upstream ok: degraded ...` in `?verbose`) for this long, serving reads
    /// that accept any state from memory (with a `Warning`); after that its caches are too
    /// old to be worth the traffic and it leaves the Service. Every replica loses the same
    /// apiserver at once, so failing readiness at the first missed probe took them all out
    /// together, with nothing better to send the traffic to. 60 s: longer than an apiserver
    /// restart takes to answer again, short enough that controllers do not act on minute-old
    /// state for long without their operators seeing the proxy unready. 0: leave at once, as
    /// before.
    #[serde(with = "duration")]
    pub max_staleness: Duration,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            resources: [
                "pods",
                "configmaps",
                "services",
                "endpointslices.discovery.k8s.io",
                "nodes",
                "namespaces",
                "serviceaccounts",
                "deployments.apps",
                "replicasets.apps",
                "statefulsets.apps",
                "daemonsets.apps",
                "jobs.batch",
            ]
            .map(String::from)
            .to_vec(),
            exclude: vec!["events".into(), "events.events.k8s.io".into()],
            history_max_events: 100_000,
            history_max_age: Duration::from_secs(150),
            history_frames_kept: Duration::from_secs(5),
            watcher_queue: 1024,
            watcher_queue_bytes: 4 << 20,
            dispatch_budget: Duration::ZERO,
            bookmark_interval: Duration::from_secs(60),
            filtered_bookmark_interval: Duration::from_secs(5),
            watch_fields: WatchFieldsConfig::default(),
            absorb_relists: true,
            backfill: true,
            protobuf_max_bytes: 2 << 30,
            protobuf_side: ProtobufSide::Eager,
            protobuf_transcode: true,
            table_max_bytes: 512 << 20,
            backfill_timeout: Duration::from_secs(10),
            state_dir: None,
            state_max_age: Duration::from_secs(600),
            state_save_interval: Duration::from_secs(60),
            upstream_page_size: 500,
            authorization_allow_ttl: Duration::from_secs(300),
            authorization_deny_ttl: Duration::from_secs(30),
            authorization_follow_rbac: true,
            max_staleness: Duration::from_secs(60),
        }
    }
}

/// Bounds on the distinct field-level change filters of one resource's open watches
/// (`cache.watchFields`). Each event of the resource is decided once per distinct filter (a
/// cost bounded by the filter's size, after one comparison of the two objects), and equal
/// filters share the decision; these bound how many there are, so one user cannot make every
/// event of a resource cost what thousands of filters do. A watch beyond them gets 429
/// TooManyRequests with Retry-After; one whose filter is already in use (by anyone, for the
/// resource's bound; by the same user, for the user's) is always admitted.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct WatchFieldsConfig {
    /// Distinct filters on one resource, all users together. 0: no filtered watch.
    pub max_filters_per_resource: usize,
    /// Distinct filters one user (the authenticated user name) holds on one resource.
    pub max_filters_per_identity: usize,
}

impl Default for WatchFieldsConfig {
    fn default() -> Self {
        WatchFieldsConfig {
            max_filters_per_resource: 1000,
            max_filters_per_identity: 100,
        }
    }
}

/// When a built-in resource's protobuf side starts (`cache.protobufSide`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ProtobufSide {
    /// With the resource's cache.
    #[default]
    Eager,
    /// With the resource's first protobuf reader.
    Lazy,
}

/// How fresh an unset-resourceVersion read must be (`lists.consistency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum ConsistencyMode {
    /// Each read is confirmed against the upstream's current revision.
    Strict,
    /// From the cache while its upstream watch is up, after the proxy's own writes.
    #[default]
    Bounded,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct ListsConfig {
    /// How reads with resourceVersion unset ("most recent") are served: `bounded` (from the
    /// cache while its upstream watch is up and confirmed, after the proxy's own writes are
    /// reflected) or `strict` (exactly as fresh as the apiserver: each read is confirmed
    /// against the upstream's current revision; costlier). See src/read/consistency.rs.
    pub consistency: ConsistencyMode,
    /// Per-resource overrides of `consistency`, keyed like `cache.resources`.
    pub consistency_by_resource: std::collections::BTreeMap<String, ConsistencyMode>,
    /// How long a consistent read may wait for confirmation before it passes through.
    #[serde(with = "duration")]
    pub consistency_timeout: Duration,
    /// A snapshot used by a paginated list stays available this long after its last page
    /// (KEP-4988: 75 s). Older walks continue from the event history while it covers them,
    /// else get 410 Expired with an inconsistent-continue token, as from the apiserver.
    #[serde(with = "duration")]
    pub snapshot_retention: Duration,
    /// Snapshots retained per resource at most (least recently used dropped first).
    pub snapshot_max: usize,
    /// A retained snapshot is dropped this long after it was taken, however often it is
    /// used: a client polling with one continue token does not pin old objects forever.
    #[serde(with = "duration")]
    pub snapshot_max_age: Duration,
    /// Object bytes retained snapshots may keep alive per resource (an estimate: the states
    /// replaced after the oldest one); beyond it the oldest snapshots go first, and their walks
    /// continue from the event history or get 410 Expired.
    pub snapshot_max_bytes: usize,
    /// Continue tokens at least this old are checked against the apiserver's compaction
    /// before a page is served from the proxy's snapshot: a token whose resourceVersion etcd
    /// compacted gets the apiserver's 410 Expired. kube-apiserver compacts to the revision it
    /// saw one `--etcd-compaction-interval` earlier (5 min by default), so no younger
    /// revision can be gone; keep this below half of that interval.
    #[serde(with = "duration")]
    pub compaction_check_after: Duration,
    /// How long a list or watch waits for the cache to reach a requested resourceVersion
    /// before the apiserver answers it instead; and how long a watch (or a list the
    /// apiserver's cacher would not delegate) that comes while the cache or the protobuf
    /// side it needs initializes waits for it before it gets 429 "storage is
    /// (re)initializing" with `Retry-After` (kube-apiserver's watch cache waits 3 s for a
    /// resourceVersion, `waitUntilFreshAndBlock`).
    #[serde(with = "duration")]
    pub wait_for_resource_version: Duration,
    /// Responses at least this large are gzipped for clients that accept it (kube-apiserver:
    /// 128 KiB); 0 turns compression off.
    pub gzip_min_bytes: usize,
    /// 1 (fastest) to 9 (smallest).
    pub gzip_level: u32,
}

impl Default for ListsConfig {
    fn default() -> Self {
        ListsConfig {
            consistency: ConsistencyMode::Bounded,
            consistency_by_resource: Default::default(),
            consistency_timeout: Duration::from_secs(3),
            snapshot_retention: Duration::from_secs(75),
            snapshot_max: 256,
            snapshot_max_age: Duration::from_secs(600),
            snapshot_max_bytes: 512 << 20,
            compaction_check_after: Duration::from_secs(15),
            wait_for_resource_version: Duration::from_secs(3),
            gzip_min_bytes: 128 * 1024,
            gzip_level: 1,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct TokensConfig {
    /// The continue-token HMAC keys: one `<id> <base64 secret>` per line (secrets of at least
    /// 32 bytes), the first signs, the others still verify (rotation: add the new key on top,
    /// drop the old one after `ttl`). Shared by all replicas (a Secret); re-read when it
    /// changes. Unset: a random key per process, with a warning.
    pub key_file: Option<PathBuf>,
    /// How long a continue token is accepted.
    #[serde(with = "duration")]
    pub ttl: Duration,
    /// How often the key file is checked for changes.
    #[serde(with = "duration")]
    pub reload_interval: Duration,
}

impl Default for TokensConfig {
    fn default() -> Self {
        TokensConfig {
            key_file: None,
            ttl: Duration::from_secs(600),
            reload_interval: Duration::from_secs(10),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase", deny_unknown_fields, default)]
pub struct LogConfig {
    /// A tracing filter: `info`, `debug`, or per-module `kube_cache_proxy=debug,hyper=info`.
    /// The HTTP and TLS libraries (rustls, h2, hyper, tower) stay at `info` unless the
    /// filter names them; `RUST_LOG`, when set, replaces this filter.
    pub level: String,
    pub format: LogFormat,
    /// One line per request on the API port at info level (target
    /// `kube_cache_proxy::access`), when the response ends: `on` (default) or `off`.
    /// Operators expect a request log; sampling bounds its volume.
    #[serde(deserialize_with = "on_off")]
    pub access: bool,
    /// The fraction of requests the access log writes, 0 to 1 (default 1: every request).
    pub access_sampling: f64,
    /// Access lines are gathered in memory and written together at least this often (and
    /// whenever 32 KiB are gathered); every other line is written at once. `0s`: each access
    /// line at once too. A process killed outright loses at most this much of its access
    /// log (`app::log_sink`).
    #[serde(with = "duration")]
    pub access_flush_interval: Duration,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            level: "info".into(),
            format: LogFormat::Text,
            access: true,
            access_sampling: 1.0,
            access_flush_interval: Duration::from_secs(1),
        }
    }
}

/// `on`/`off` (also `true`/`false`: YAML 1.1 readers turn `on` into a boolean).
fn on_off<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OnOff {
        Bool(bool),
        Text(String),
    }
    match OnOff::deserialize(d)? {
        OnOff::Bool(b) => Ok(b),
        OnOff::Text(t) => parse_on_off(&t).map_err(serde::de::Error::custom),
    }
}

/// Parses `on`/`off`/`true`/`false` (the `--log-access` flag, `log.access`).
pub fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" | "true" => Ok(true),
        "off" | "false" => Ok(false),
        _ => Err(format!("expected on or off, got {s:?}")),
    }
}

/// One problem in a configuration, with the path of the field it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub path: String,
    pub message: String,
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path, self.message)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    Invalid(Vec<FieldError>),
}

impl Config {
    /// The admin listener's address: `server.adminListen`, else `0.0.0.0:8444` with the TLS
    /// listener and `127.0.0.1:8444` without (plain HTTP stays on loopback).
    pub fn admin_addr(&self) -> SocketAddr {
        self.server.admin_listen.unwrap_or_else(|| {
            let ip = if self.tls.cert_file.is_some() {
                [0, 0, 0, 0]
            } else {
                [127, 0, 0, 1]
            };
            SocketAddr::from((ip, 8444))
        })
    }

    /// Parses YAML text into a config, reporting syntax and type errors with field paths, all
    /// of them (see [`Config::parse_all`]).
    pub fn from_yaml(text: &str) -> Result<Config, ConfigError> {
        match Config::parse_all(text) {
            (Some(cfg), errs) if errs.is_empty() => Ok(cfg),
            (_, errs) => Err(ConfigError::Invalid(errs)),
        }
    }

    /// Parses YAML text, collecting every type error and unknown field instead of stopping
    /// at the first: the failing field is taken out (its default applies) and the document
    /// parsed again. Returns the config so obtained and the errors, with paths as written in
    /// the file (list indices count the removed elements). A YAML syntax error, or one that
    /// cannot be pinned to a field, ends the collection without a config.
    pub fn parse_all(text: &str) -> (Option<Config>, Vec<FieldError>) {
        use serde_path_to_error::Segment;
        if text.trim().is_empty() {
            return (Some(Config::default()), Vec::new());
        }
        // Parse to a generic value first so serde_path_to_error can name the failing field.
        let mut value: serde_json::Value = match serde_saphyr::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                let err = FieldError {
                    path: "(document)".into(),
                    message: e.to_string(),
                };
                return (None, vec![err]);
            }
        };
        if value.is_null() {
            return (Some(Config::default()), Vec::new());
        }
        let mut errs = Vec::new();
        // Original indices of the elements removed from each list, by the list's path.
        let mut removed: std::collections::HashMap<String, Vec<usize>> = Default::default();
        loop {
            let e = match serde_path_to_error::deserialize::<_, Config>(value.clone()) {
                Ok(cfg) => return (Some(cfg), errs),
                Err(e) => e,
            };
            // The path as written in the file, and the node to take out.
            let mut path = String::new();
            let mut node: Option<&mut serde_json::Value> = Some(&mut value);
            let mut last: Option<(String, Segment)> = None;
            let mut repairable = true;
            let segments: Vec<Segment> = e.path().iter().cloned().collect();
            for (i, seg) in segments.iter().enumerate() {
                let parent_path = path.clone();
                let seg = match seg {
                    Segment::Seq { index } => {
                        let mut orig = *index;
                        if let Some(gone) = removed.get(&parent_path) {
                            for g in gone {
                                if *g <= orig {
                                    orig += 1;
                                }
                            }
                        }
                        path.push_str(&format!("[{orig}]"));
                        Segment::Seq { index: *index }
                    }
                    Segment::Map { key } => {
                        if !path.is_empty() {
                            path.push('.');
                        }
                        path.push_str(key);
                        Segment::Map { key: key.clone() }
                    }
                    Segment::Enum { .. } | Segment::Unknown => {
                        repairable = false;
                        break;
                    }
                };
                if i + 1 == segments.len() {
                    last = Some((parent_path, seg));
                } else {
                    node = node.and_then(|n| match &seg {
                        Segment::Seq { index } => n.get_mut(*index),
                        Segment::Map { key } => n.get_mut(key.as_str()),
                        _ => None,
                    });
                }
            }
            errs.push(FieldError {
                path: if path.is_empty() {
                    "(document)".into()
                } else {
                    path.clone()
                },
                message: e.into_inner().to_string(),
            });
            let taken = match (repairable, node, last) {
                (true, Some(serde_json::Value::Object(m)), Some((_, Segment::Map { key }))) => {
                    m.remove(&key).is_some()
                }
                (true, Some(serde_json::Value::Array(a)), Some((list, Segment::Seq { index })))
                    if index < a.len() =>
                {
                    a.remove(index);
                    let orig: usize = path
                        .rsplit_once('[')
                        .and_then(|(_, i)| i.trim_end_matches(']').parse().ok())
                        .unwrap_or(index);
                    let gone = removed.entry(list).or_default();
                    gone.push(orig);
                    gone.sort_unstable();
                    true
                }
                _ => false,
            };
            if !taken || errs.len() >= 100 {
                // Nothing left to take out (or a runaway): report what was found.
                return (None, errs);
            }
        }
    }

    pub fn from_file(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Config::from_yaml(&text)
    }

    /// Checks the relations between fields that types cannot express.
    /// Checks every field; all errors at once. Only the checks that need no other module
    /// of the crate: [`crate::app::start::validate`] adds the rest.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.validate_with(|_, _| {})
    }

    /// [`Config::validate`] plus the caller's `checks`, which report through the same
    /// `(field path, message)` callback.
    pub fn validate_with(
        &self,
        checks: impl FnOnce(&Config, &mut dyn FnMut(&str, String)),
    ) -> Result<(), ConfigError> {
        let mut errs = Vec::new();
        let mut err = |path: &str, message: String| {
            errs.push(FieldError {
                path: path.into(),
                message,
            })
        };
        match (&self.tls.cert_file, &self.tls.key_file) {
            (Some(_), None) => err("tls.keyFile", "required when tls.certFile is set".into()),
            (None, Some(_)) => err("tls.certFile", "required when tls.keyFile is set".into()),
            _ => {}
        }
        if self.tls.cert_file.is_none() && self.insecure_listen.is_none() {
            err(
                "tls.certFile",
                "no listener: set tls.certFile and tls.keyFile, or insecureListen for local use"
                    .into(),
            );
        }
        if self.tls.client_ca_file.is_some() && self.tls.cert_file.is_none() {
            err(
                "tls.clientCaFile",
                "client certificates need the TLS listener (tls.certFile)".into(),
            );
        }
        if let Some(addr) = self.insecure_listen
            && !addr.ip().is_loopback()
            && !self.allow_insecure_non_loopback
        {
            err(
                "insecureListen",
                format!(
                    "{addr} is not a loopback address; plain HTTP would expose callers' tokens \
                     (set allowInsecureNonLoopback to override)"
                ),
            );
        }
        if self.tls.cert_file.is_none()
            && let Some(addr) = self.server.admin_listen
            && !addr.ip().is_loopback()
            && !self.allow_insecure_non_loopback
        {
            err(
                "server.adminListen",
                format!(
                    "{addr} is not a loopback address and there is no serving certificate \
                     (tls.certFile): plain HTTP would expose callers' tokens (set \
                     allowInsecureNonLoopback to override)"
                ),
            );
        }
        let admin = self.admin_addr();
        if admin.port() != 0
            && (self.tls.cert_file.is_some() && admin.port() == self.listen.port()
                || self
                    .insecure_listen
                    .is_some_and(|i| i.port() == admin.port()))
        {
            err(
                "server.adminListen",
                "must be another port than listen and insecureListen".into(),
            );
        }
        if self.server.http2_max_concurrent_streams == 0 {
            err(
                "server.http2MaxConcurrentStreams",
                "must be at least 1".into(),
            );
        }
        if self.server.http2_max_send_buffer_bytes < 16 * 1024 {
            err(
                "server.http2MaxSendBufferBytes",
                "must be at least 16384 (one HTTP/2 frame)".into(),
            );
        }
        if self.server.connection_buffer_bytes < 64 * 1024 {
            err(
                "server.connectionBufferBytes",
                "must be at least 65536".into(),
            );
        }
        if self.server.downstream_buffer_bytes < self.server.connection_buffer_bytes {
            err(
                "server.downstreamBufferBytes",
                "must be at least server.connectionBufferBytes".into(),
            );
        }
        if self.server.max_header_bytes < 4096 {
            err(
                "server.maxHeaderBytes",
                "must be at least 4096 (a ServiceAccount token alone is ~1 KiB)".into(),
            );
        }
        if self.server.max_connections == 0 {
            err("server.maxConnections", "must be at least 1".into());
        }
        if self.tls.reload_interval.is_zero() {
            err("tls.reloadInterval", "must be greater than 0".into());
        }
        if self.upstream.health_check_interval.is_zero() {
            err(
                "upstream.healthCheckInterval",
                "must be greater than 0".into(),
            );
        }
        if self.cache.watcher_queue == 0 {
            err("cache.watcherQueue", "must be at least 1".into());
        }
        if self.cache.upstream_page_size == 0 {
            err("cache.upstreamPageSize", "must be at least 1".into());
        }
        if self.cache.bookmark_interval.is_zero() {
            err("cache.bookmarkInterval", "must be greater than 0".into());
        }
        self.paging.validate_into(&mut err);
        for (field, names) in [
            ("resources", &self.cache.resources),
            ("exclude", &self.cache.exclude),
        ] {
            for (i, r) in names.iter().enumerate() {
                let ok = !r.is_empty()
                    && r.chars().all(|c| {
                        c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-'
                    });
                if !ok {
                    err(
                        &format!("cache.{field}[{i}]"),
                        format!("{r:?} is not `all`, `resource` or `resource.group`"),
                    );
                }
            }
        }
        let mut names = std::collections::HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            if t.name.is_empty() || !names.insert(t.name.as_str()) {
                err(
                    &format!("tenants[{i}].name"),
                    "must be non-empty and unique".into(),
                );
            }
            if t.view_recheck_interval < Duration::from_millis(100) {
                err(
                    &format!("tenants[{i}].viewRecheckInterval"),
                    "must be at least 100ms".into(),
                );
            }
            if t.quotas
                .list_qps
                .is_some_and(|q| !(q > 0.0 && q.is_finite()))
            {
                err(
                    &format!("tenants[{i}].quotas.listQps"),
                    "must be a positive number".into(),
                );
            }
        }
        if !(1..=9).contains(&self.lists.gzip_level) {
            err("lists.gzipLevel", "must be between 1 and 9".into());
        }
        if self.lists.snapshot_max == 0 {
            err("lists.snapshotMax", "must be at least 1".into());
        }
        if self.lists.snapshot_max_age.is_zero() {
            err("lists.snapshotMaxAge", "must be more than 0".into());
        }
        if self.tokens.ttl.is_zero() {
            err("tokens.ttl", "must be greater than 0".into());
        }
        if self.tokens.reload_interval.is_zero() {
            err("tokens.reloadInterval", "must be greater than 0".into());
        }
        // Checks that need other modules' parsers (label selectors, continue-token keys): the
        // caller supplies them, so this module stays a leaf (see `crate::app::start::validate`).
        checks(self, &mut err);
        if !(0.0..=1.0).contains(&self.log.access_sampling) {
            err("log.accessSampling", "must be between 0 and 1".into());
        }
        if self.log.access_flush_interval > Duration::from_secs(60) {
            err("log.accessFlushInterval", "must be at most 60s".into());
        }
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            err("log.level", format!("invalid filter: {e}"));
        }
        self.tracing.validate_into(&mut err);
        if errs.is_empty() {
            Ok(())
        } else {
            Err(ConfigError::Invalid(errs))
        }
    }
}

/// Durations as humantime strings ("10s", "1m30s") in the YAML file: `humantime_serde`, with
/// an error that says what the value should look like.
mod duration {
    use std::time::Duration;

    use serde::Deserializer;
    use serde::de::Error as _;

    pub use humantime_serde::serialize;

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        humantime_serde::deserialize(d)
            .map_err(|e| D::Error::custom(format!("invalid duration: {e} (use e.g. \"10s\")")))
    }
}

#[cfg(test)]
mod tests;
