//! The composition root: validates the configuration, builds every component, binds the
//! listeners and serves in the background ([`start`]); the CLI, dev mode and tests use it.

use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use crate::config::Config;
use crate::http::listener::{Listeners, run};
use crate::metrics::Metrics;
use crate::serve::health::Health;
use crate::serve::state::State;
use crate::upstream::Upstream;

/// Validates a configuration completely: [`Config::validate`] plus what needs the crate's own
/// parsers (tenants' namespace selectors) and the files it names ([`check_files`]). All
/// errors at once.
pub fn validate(config: &Config) -> Result<(), crate::config::ConfigError> {
    validate_with_files(config, true)
}

/// [`validate`], with or without [`check_files`] (`check-config --no-files`: a file written
/// for the pod, checked where its Secrets are not mounted).
pub fn validate_with_files(config: &Config, files: bool) -> Result<(), crate::config::ConfigError> {
    config.validate_with(|c, err| {
        for (i, t) in c.tenants.iter().enumerate() {
            if let Some(sel) = &t.namespace_selector
                && let Err(e) = crate::k8s::selector::LabelSelector::parse(sel)
            {
                err(
                    &format!("tenants[{i}].namespaceSelector"),
                    format!("invalid label selector: {e}"),
                );
            }
        }
        if files {
            check_files(c, err);
        }
    })
}

/// Every file the configuration names exists, is readable and parses as what the proxy will
/// read from it, checked with the parsers that will read it: the serving certificate and key
/// (a usable pair), the client CA bundle, the token auth file, the continue-token keys, the
/// upstream kubeconfig (readable; kube parses it at start).
pub fn check_files(c: &Config, err: &mut dyn FnMut(&str, String)) {
    use crate::http::tls::{ReloadingCert, TlsError, client_ca_roots};
    if let (Some(cert), Some(key)) = (&c.tls.cert_file, &c.tls.key_file)
        && let Err(e) = ReloadingCert::load(cert, key)
    {
        let field = match &e {
            TlsError::BadKey { .. } => "tls.keyFile",
            TlsError::Read { path, .. } if path == key => "tls.keyFile",
            _ => "tls.certFile",
        };
        err(field, e.to_string());
        // Loading stops at the certificate: a key file that cannot be read either is an
        // error of its own, reported in the same run.
        if field == "tls.certFile"
            && let Err(ke) = std::fs::File::open(key)
        {
            err("tls.keyFile", format!("reading {}: {ke}", key.display()));
        }
    }
    if let Some(p) = &c.tls.client_ca_file
        && let Err(e) = client_ca_roots(p)
    {
        err("tls.clientCaFile", e.to_string());
    }
    if let Some(p) = &c.authentication.token_auth_file
        && let Err(e) = std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| {
                crate::auth::authn::parse_token_file(&t)
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
    {
        err(
            "authentication.tokenAuthFile",
            format!("{}: {e}", p.display()),
        );
    }
    if let Some(p) = &c.tokens.key_file
        && let Err(e) = std::fs::read_to_string(p)
            .map_err(|e| e.to_string())
            .and_then(|t| crate::read::token::KeySet::parse(&t).map_err(|e| e.to_string()))
    {
        err("tokens.keyFile", format!("{}: {e}", p.display()));
    }
    if let Some(p) = &c.upstream.kubeconfig
        && let Err(e) = std::fs::read(p)
    {
        err("upstream.kubeconfig", format!("{}: {e}", p.display()));
    }
}

/// Builds every component from the configuration and wires them into the shared [`State`].
pub fn build_state(
    config: Config,
    upstream: Upstream,
    authn: crate::auth::authn::Authenticator,
) -> Arc<State> {
    let drain = crate::http::drain::Drain::new();
    let c = &config.cache;
    let store = crate::cache::StoreConfig {
        history_max_events: c.history_max_events,
        history_max_age: c.history_max_age,
        history_frames_kept: c.history_frames_kept,
        watcher_queue: c.watcher_queue,
        watcher_queue_bytes: c.watcher_queue_bytes,
        dispatch_budget: c.dispatch_budget,
        snapshot_retention: config.lists.snapshot_retention,
        snapshot_max: config.lists.snapshot_max,
        snapshot_max_age: config.lists.snapshot_max_age,
        snapshot_max_bytes: config.lists.snapshot_max_bytes,
        absorb_relists: c.absorb_relists,
        proto_budget: std::sync::Arc::new(crate::cache::proto_budget::ProtoBudget::new(
            c.protobuf_max_bytes,
        )),
        protobuf_eager: c.protobuf_side == crate::config::ProtobufSide::Eager,
        protobuf_transcode: c.protobuf_transcode,
        table_budget: std::sync::Arc::new(crate::cache::proto_budget::ProtoBudget::new(
            c.table_max_bytes,
        )),
    };
    let paging = crate::paging::Paging::new(config.paging.clone(), c.upstream_page_size);
    let reflector = crate::cache::reflector::ReflectorConfig {
        page_size: c.upstream_page_size,
        adaptive_page_size: paging.upstream_source(),
        ..Default::default()
    };
    let mut pinned = Vec::new();
    if config.authentication.service_account_lookup {
        pinned.push(crate::auth::authn::liveness::service_accounts());
    }
    if c.authorization_follow_rbac {
        pinned.extend(crate::auth::authz::rbac_resources());
    }
    let keys = crate::read::token::Keys::load(config.tokens.key_file.as_deref(), config.tokens.ttl)
        .unwrap_or_else(|e| {
            // `check-config` and startup validation refuse a bad key file; this only
            // happens if it broke in between.
            tracing::error!(error = %e, "continue-token keys: using a random key");
            crate::read::token::Keys::load(None, config.tokens.ttl).expect("generated keys")
        });
    let persist = c
        .state_dir
        .as_ref()
        .map(|dir| crate::cache::persist::Persist {
            dir: dir.clone(),
            upstream: upstream.base().to_string(),
            max_age: c.state_max_age,
            save_interval: c.state_save_interval,
            // Sealed with a key derived from the token keys only when those are the shared,
            // persistent ones (a generated key dies with the process); otherwise (empty) with
            // a local key file in the state directory (`persist::LOCAL_KEY`).
            keys: match config.tokens.key_file {
                Some(_) => keys.current().derive("kube-cache-proxy/cache-state/v1"),
                None => Vec::new(),
            },
        });
    let caches = crate::cache::registry::Caches::start(
        c.resources.clone(),
        c.exclude.clone(),
        pinned,
        upstream.clone(),
        store,
        reflector.clone(),
        persist,
        drain.token(),
    );
    let authz = Arc::new(
        crate::auth::authz::Authorizer::new(
            upstream.clone(),
            c.authorization_allow_ttl,
            c.authorization_deny_ttl,
        )
        .with_stale_while_unreachable(config.authentication.stale_while_unreachable),
    );
    if c.authorization_follow_rbac {
        authz.follow_rbac(
            &caches,
            config.authorization.local_rbac == crate::config::LocalRbacMode::Auto,
            drain.token(),
        );
    }
    let authn = Arc::new(authn.with_caches(caches.clone()));
    let tenancy = Arc::new(crate::tenancy::Tenancy::new(&config.tenants));
    let l = &config.lists;
    let consistency =
        crate::read::consistency::Consistency::new(upstream.clone(), l.consistency_timeout);
    let watch = crate::read::watch::WatchConfig {
        bookmark_interval: c.bookmark_interval,
        filtered_bookmark_interval: c.filtered_bookmark_interval,
        backfill: c.backfill.then(|| {
            crate::cache::reflector::backfill::Backfiller::new(
                upstream.clone(),
                reflector.clone(),
                c.backfill_timeout,
            )
        }),
        consistency: Some(consistency.clone()),
        // A watch waits for a resourceVersion, or for its initializing cache, as a list does.
        wait_for_rv: l.wait_for_resource_version,
        ..Default::default()
    };
    let lists = crate::read::list::ListConfig {
        wait_for_rv: l.wait_for_resource_version,
        gzip_min_bytes: l.gzip_min_bytes,
        gzip_level: l.gzip_level,
        compaction_check_after: l.compaction_check_after,
        ..Default::default()
    };
    keys.spawn_reloader(config.tokens.reload_interval);
    let metrics = Metrics::new();
    metrics.register_collector(Box::new(crate::read::consistency::ConsistencyCollector(
        consistency.clone(),
    )));
    metrics.register_collector(Box::new(crate::cache::metrics::CacheCollector(
        caches.clone(),
    )));
    metrics.register_collector(Box::new(crate::app::collectors::AuthCollector {
        authn: authn.clone(),
        authz: authz.clone(),
        tenancy: tenancy.clone(),
    }));
    metrics.register_collector(Box::new(crate::paging::PagingCollector(paging.clone())));
    if let Some(b) = &watch.backfill {
        metrics.register_collector(Box::new(crate::app::collectors::BackfillCollector(
            b.counters.clone(),
        )));
    }
    metrics.register_collector(Box::new(crate::app::collectors::UpstreamCollector {
        upstream: upstream.clone(),
        max_staleness: c.max_staleness,
    }));
    let downstream = Arc::new(crate::http::budget::Downstream::new(
        config.server.downstream_buffer_bytes,
        config.server.connection_buffer_bytes,
        metrics.downstream_buffered.clone(),
        budget_waits(&metrics, "connection"),
        budget_waits(&metrics, "process"),
    ));
    Arc::new(State {
        config,
        upstream,
        metrics,
        health: Health::new(),
        caches,
        authn,
        authz,
        tenancy,
        watch,
        lists,
        keys,
        consistency,
        paging,
        drain,
        downstream,
    })
}

fn budget_waits(metrics: &Metrics, budget: &str) -> prometheus_client::metrics::counter::Counter {
    metrics
        .downstream_waits
        .get_or_create(&crate::metrics::BudgetLabels {
            budget: budget.into(),
        })
        .clone()
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid configuration: {0}")]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Upstream(#[from] crate::upstream::UpstreamError),
    #[error(transparent)]
    Tls(#[from] crate::http::tls::TlsError),
    #[error(transparent)]
    Telemetry(#[from] crate::telemetry::TelemetryError),
    #[error(transparent)]
    Authn(#[from] crate::auth::authn::AuthnError),
    #[error("binding {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// A proxy serving in the background (used by the CLI, dev mode and tests).
#[derive(Debug)]
pub struct Running {
    pub state: Arc<State>,
    pub tls_addr: Option<SocketAddr>,
    pub insecure_addr: Option<SocketAddr>,
    /// The admin listener (the proxy's own health, `/metrics`, `/debug/*`).
    pub admin_addr: Option<SocketAddr>,
    /// Whether the admin listener serves TLS (with the serving certificate).
    pub admin_tls: bool,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    /// Cleared by [`Running::crash`]: no final save.
    save_on_stop: Arc<std::sync::atomic::AtomicBool>,
}

impl Running {
    /// Begins graceful shutdown (as SIGTERM does) without waiting for it.
    pub fn begin_shutdown(&self) {
        self.stop.cancel();
    }

    /// Shuts down gracefully and waits for the drain to finish.
    pub async fn shutdown(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }

    /// Stops as a crash would for what a restart finds: no final save of the caches' state,
    /// only what the periodic saves wrote (tests; the streams still end as at a shutdown).
    pub async fn crash(self) {
        self.save_on_stop
            .store(false, std::sync::atomic::Ordering::SeqCst);
        self.stop.cancel();
        let _ = self.task.await;
    }

    /// Waits until the server has stopped (after a shutdown began).
    pub async fn wait(self) {
        let _ = self.task.await;
    }
}

/// Validates `config`, binds its listeners and starts serving against `kube`'s apiserver.
pub async fn start(config: Config, kube: &kube::Config) -> Result<Running, StartError> {
    validate(&config)?;
    crate::http::tls::install_crypto_provider();
    // Tracing (off without an OTLP endpoint): the upstream clients carry it to the cache's
    // reflectors; the pipeline opens its request spans from it.
    let telemetry = crate::telemetry::Telemetry::start(&config.tracing)?;
    let upstream = Upstream::new(kube, &config.upstream)?.with_telemetry(telemetry);
    let bind = async |addr: SocketAddr| {
        TcpListener::bind(addr)
            .await
            .map_err(|source| StartError::Bind { addr, source })
    };
    // The serving certificate (one reloader) serves the API port and the admin listener.
    let acceptor = match (&config.tls.cert_file, &config.tls.key_file) {
        (Some(cert), Some(key)) => {
            let rc = crate::http::tls::ReloadingCert::load(cert, key)?;
            rc.spawn_reloader(config.tls.reload_interval);
            let sc = crate::http::tls::server_config(rc, config.tls.client_ca_file.as_deref())?;
            Some(TlsAcceptor::from(Arc::new(sc)))
        }
        _ => None,
    };
    let tls = match &acceptor {
        Some(a) => Some((bind(config.listen).await?, a.clone())),
        None => None,
    };
    let insecure = match config.insecure_listen {
        Some(addr) => Some(bind(addr).await?),
        None => None,
    };
    // TLS when there is a serving certificate; plain HTTP (loopback, `Config::validate`)
    // otherwise.
    let admin_listener = bind(config.admin_addr()).await?;
    let admin_addr = admin_listener.local_addr().ok();
    let admin_listeners = match &acceptor {
        Some(a) => Listeners {
            tls: Some((admin_listener, a.clone())),
            insecure: None,
        },
        None => Listeners {
            tls: None,
            insecure: Some(admin_listener),
        },
    };
    let admin_tls = acceptor.is_some();
    let tls_addr = tls.as_ref().and_then(|(l, _)| l.local_addr().ok());
    let insecure_addr = insecure.as_ref().and_then(|l| l.local_addr().ok());
    let authn = crate::auth::authn::Authenticator::new(
        config.authentication.clone(),
        crate::tenancy::TenantMapper::new(config.tenants.clone()),
        upstream.clone(),
    )?;
    let state = build_state(config, upstream, authn);
    state.spawn_upstream_probe();
    state.authn.spawn_jwks_refresher(state.drain.token());
    state
        .paging
        .spawn(state.upstream.clone(), state.drain.token());
    let stop = CancellationToken::new();
    let save_on_stop = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let task = {
        let state = state.clone();
        let stop = stop.clone();
        let save_on_stop = save_on_stop.clone();
        tokio::spawn(async move {
            let config = state.config.clone();
            // Both listeners drain together: readiness fails on the admin listener while the
            // API port still accepts for `shutdown.delay`.
            let admin = Arc::new(crate::serve::admin::Admin {
                state: state.clone(),
            });
            let telemetry = state.upstream.telemetry().clone();
            let caches = state.caches.clone();
            tokio::join!(
                run(
                    state,
                    &config,
                    Listeners { tls, insecure },
                    stop.clone().cancelled_owned(),
                ),
                run(admin, &config, admin_listeners, stop.cancelled_owned()),
            );
            // Drained, and the reflectors stopped with it: each cache's state is final.
            if save_on_stop.load(std::sync::atomic::Ordering::SeqCst) {
                caches.save_all(true).await;
            }
            // The last requests' spans are queued; send them before exiting.
            telemetry.shutdown().await;
        })
    };
    if let Some(a) = tls_addr {
        tracing::info!(addr = %a, "serving TLS (HTTP/2 and HTTP/1.1)");
    }
    if let Some(a) = insecure_addr {
        tracing::info!(addr = %a, "serving plain HTTP (HTTP/1.1 and h2c) for local use");
    }
    if let Some(a) = admin_addr {
        let scheme = if admin_tls { "https" } else { "http" };
        tracing::info!(
            url = %format!("{scheme}://{a}"),
            auth = ?state.config.server.admin_auth,
            "serving the admin endpoints (/livez /readyz /healthz /metrics /debug/)"
        );
    }
    Ok(Running {
        state,
        tls_addr,
        insecure_addr,
        admin_addr,
        admin_tls,
        stop,
        task,
        save_on_stop,
    })
}
