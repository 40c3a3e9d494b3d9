//! The command line: `serve`, `check-config`, `dev`. Every flag can also come from a `KCP_*`
//! environment variable; flags and variables override the configuration file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::config::{AdminAuth, Config, ConfigError, LogFormat};

/// `--version`: the package version and the source revision it was built from (as in
/// `kube_cache_proxy_build_info`; `build.rs`).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (revision ",
    env!("KUBE_CACHE_PROXY_REVISION"),
    ")"
);

#[derive(Debug, Parser)]
#[command(
    name = "kube-cache-proxy",
    version = VERSION,
    about = "A watch-aware caching proxy for kube-apiserver"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
#[allow(
    clippy::large_enum_variant,
    reason = "parsed once per process; without `dev`, `serve` is by far the largest"
)]
pub enum Command {
    /// Serve as a proxy in front of the apiserver named by kubeconfig or in-cluster config.
    Serve(ServeArgs),
    /// Validate a configuration file: every error at once, one per line with its field path;
    /// exits 1 on any error (usable as a CI or pre-deploy gate).
    CheckConfig(CheckConfigArgs),
    /// Start a local kube-apiserver + etcd, the proxy in front of them, and write
    /// ./kube-cache-proxy.kubeconfig and ./upstream.kubeconfig. Ctrl-C stops everything (and
    /// removes the kubeconfigs). A busy --listen or --admin-listen port fails at once.
    #[cfg(feature = "dev")]
    Dev(DevArgs),
}

#[derive(Debug, Args, Default, Clone)]
pub struct CheckConfigArgs {
    /// The YAML file to check.
    pub file: PathBuf,
    /// Skip the files the configuration names (serving certificate and key, client CA, token
    /// auth file, continue-token keys, upstream kubeconfig): for a file written for the pod,
    /// checked where its Secrets are not mounted. Without it each must exist and parse.
    #[arg(long)]
    pub no_files: bool,
    /// Check `cache.resources` against this cluster's discovery: each named resource must be
    /// served and support list and watch (`all` is always accepted).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context for `--kubeconfig` (default: its current context).
    #[arg(long, requires = "kubeconfig")]
    pub context: Option<String>,
}

#[derive(Debug, Args, Default)]
pub struct ServeArgs {
    /// YAML configuration file (see config/kube-cache-proxy.yaml).
    #[arg(long, env = "KCP_CONFIG")]
    pub config: Option<PathBuf>,
    /// Kubeconfig of the upstream apiserver (default: in-cluster, else $KUBECONFIG or ~/.kube/config).
    #[arg(long, env = "KCP_KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context.
    #[arg(long, env = "KCP_CONTEXT")]
    pub context: Option<String>,
    /// TLS listen address (default 0.0.0.0:8443).
    #[arg(long, env = "KCP_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// Serving certificate (PEM, chain first) of the TLS listener; reloaded when it changes.
    #[arg(long, env = "KCP_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert-file.
    #[arg(long, env = "KCP_TLS_KEY_FILE")]
    pub tls_key_file: Option<PathBuf>,
    /// CA bundle for client certificates (mTLS).
    #[arg(long, env = "KCP_CLIENT_CA_FILE")]
    pub client_ca_file: Option<PathBuf>,
    /// Plain-HTTP listen address for local use (loopback only unless allowed).
    #[arg(long, env = "KCP_INSECURE_LISTEN")]
    pub insecure_listen: Option<SocketAddr>,
    /// Allow --insecure-listen on a non-loopback address (plain HTTP: bearer tokens travel
    /// in the clear; only behind a trusted network hop).
    #[arg(long, env = "KCP_ALLOW_INSECURE_NON_LOOPBACK")]
    pub allow_insecure_non_loopback: bool,
    /// Admin listener (the proxy's own health, /metrics, /debug/*; default 0.0.0.0:8444 with
    /// TLS, 127.0.0.1:8444 without).
    #[arg(long, env = "KCP_ADMIN_LISTEN")]
    pub admin_listen: Option<SocketAddr>,
    /// Who may read the admin listener's /metrics and /debug/*: `kubernetes` (TokenReview +
    /// SubjectAccessReview on the path, as kube-rbac-proxy) or `none` (local use only).
    #[arg(long, env = "KCP_ADMIN_AUTH")]
    pub admin_auth: Option<AdminAuth>,
    /// Delay between failing /readyz and closing listeners on SIGTERM (e.g. 10s).
    #[arg(long, env = "KCP_SHUTDOWN_DELAY", value_parser = humantime::parse_duration)]
    pub shutdown_delay: Option<Duration>,
    /// Log filter, e.g. info or kube_cache_proxy=debug.
    #[arg(long, env = "KCP_LOG_LEVEL")]
    pub log_level: Option<String>,
    /// Log line format: json (one object per line) or text.
    #[arg(long, env = "KCP_LOG_FORMAT")]
    pub log_format: Option<LogFormat>,
    /// The access log, one line per request at info level: on or off (default on).
    #[arg(long, env = "KCP_LOG_ACCESS", value_parser = crate::config::parse_on_off)]
    pub log_access: Option<bool>,
    /// The fraction of requests the access log writes, 0 to 1 (default 1).
    #[arg(long, env = "KCP_LOG_ACCESS_SAMPLING")]
    pub log_access_sampling: Option<f64>,
}

#[cfg(feature = "dev")]
#[derive(Debug, Args)]
pub struct DevArgs {
    /// Where the proxy listens (TLS with a generated certificate, loopback). client-go sends
    /// bearer tokens only over TLS, so dev mode is TLS too.
    #[arg(long, env = "KCP_DEV_LISTEN", default_value = "127.0.0.1:8443")]
    pub listen: SocketAddr,
    /// The proxy's admin listener (its own health, /metrics, /debug/*; TLS, loopback).
    #[arg(long, env = "KCP_DEV_ADMIN_LISTEN", default_value = "127.0.0.1:8444")]
    pub admin_listen: SocketAddr,
    /// Directory for the kubeconfigs written (default: the current directory).
    #[arg(long, env = "KCP_DEV_OUT", default_value = ".")]
    pub out: PathBuf,
    /// Log filter. kube's client logs every non-2xx answer at error level, which is noise
    /// while the apiserver starts (its /readyz answers 500 until ready), hence the default.
    #[arg(long, env = "KCP_LOG_LEVEL", default_value = "info,kube_client=off")]
    pub log_level: String,
}

impl ServeArgs {
    /// The configuration file (or defaults) with flags and environment applied.
    pub fn resolve(&self) -> Result<Config, ConfigError> {
        let mut cfg = match &self.config {
            Some(p) => Config::from_file(p)?,
            None => Config::default(),
        };
        if let Some(v) = &self.kubeconfig {
            cfg.upstream.kubeconfig = Some(v.clone());
        }
        if let Some(v) = &self.context {
            cfg.upstream.context = Some(v.clone());
        }
        if let Some(v) = self.listen {
            cfg.listen = v;
        }
        if let Some(v) = &self.tls_cert_file {
            cfg.tls.cert_file = Some(v.clone());
        }
        if let Some(v) = &self.tls_key_file {
            cfg.tls.key_file = Some(v.clone());
        }
        if let Some(v) = &self.client_ca_file {
            cfg.tls.client_ca_file = Some(v.clone());
        }
        if let Some(v) = self.insecure_listen {
            cfg.insecure_listen = Some(v);
        }
        if self.allow_insecure_non_loopback {
            cfg.allow_insecure_non_loopback = true;
        }
        if let Some(v) = self.admin_listen {
            cfg.server.admin_listen = Some(v);
        }
        if let Some(v) = self.admin_auth {
            cfg.server.admin_auth = v;
        }
        if let Some(v) = self.shutdown_delay {
            cfg.shutdown.delay = v;
        }
        if let Some(v) = &self.log_level {
            cfg.log.level = v.clone();
        }
        if let Some(v) = self.log_format {
            cfg.log.format = v;
        }
        if let Some(v) = self.log_access {
            cfg.log.access = v;
        }
        if let Some(v) = self.log_access_sampling {
            cfg.log.access_sampling = v;
        }
        Ok(cfg)
    }
}

/// Sets up tracing once per process: to stderr, `RUST_LOG` if set, else `level` (see
/// [`log_filter`]); colours only when stderr is a terminal. Access lines are gathered and
/// written at least every `access_flush` (`app::log_sink`); [`flush_logs`] writes them at
/// exit, and a panic writes them before its message.
pub fn init_logging(level: &str, format: LogFormat, access_flush: std::time::Duration) {
    use std::io::IsTerminal;
    let env = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty());
    let filter = log_filter(env.as_deref().unwrap_or(level), env.is_some());
    let ansi = std::io::stderr().is_terminal();
    let sink = SINK.get_or_init(|| crate::app::log_sink::LogSink::stderr(access_flush));
    if tracing::subscriber::set_global_default(subscriber(&filter, format, ansi, sink.clone()))
        .is_ok()
    {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if let Some(s) = SINK.get() {
                s.try_flush();
            }
            previous(info);
        }));
    }
}

/// The process's log sink, once [`init_logging`] made it.
static SINK: std::sync::OnceLock<crate::app::log_sink::LogSink> = std::sync::OnceLock::new();

/// Writes the access lines gathered so far (the process calls it as it exits).
pub fn flush_logs() {
    if let Some(s) = SINK.get() {
        s.flush();
    }
}

/// The libraries whose own debug and trace lines would drown the proxy's at
/// `--log-level debug` (a line per frame, per record, per poll).
const QUIET_BY_DEFAULT: &[&str] = &["rustls", "h2", "hyper", "hyper_util", "tower", "mio"];

/// The filter directives for `level`: unless `verbatim` (it came from `RUST_LOG`), each of
/// `QUIET_BY_DEFAULT` the filter does not name is capped at `info`.
pub fn log_filter(level: &str, verbatim: bool) -> String {
    if verbatim {
        return level.to_string();
    }
    let named = |krate: &str| {
        level.split(',').any(|d| {
            let target = d.split('=').next().unwrap_or("").trim();
            target == krate || target.starts_with(&format!("{krate}::"))
        })
    };
    let mut out = level.to_string();
    for krate in QUIET_BY_DEFAULT.iter().filter(|k| !named(k)) {
        out.push_str(&format!(",{krate}=info"));
    }
    out
}

/// The log subscriber, writing to `writer` (stderr; a buffer in tests).
pub fn subscriber<W>(
    filter: &str,
    format: LogFormat,
    ansi: bool,
    writer: W,
) -> Box<dyn tracing::Subscriber + Send + Sync>
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_new(filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    match format {
        LogFormat::Json => Box::new(b.json().flatten_event(true).finish()),
        LogFormat::Text => Box::new(b.finish()),
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn termination_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {},
            _ = term.recv() => {},
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

/// `check-config`: every problem of the file, one line each (`field.path: message`); empty
/// when the file is valid. Parse errors come first; relations between fields and the files
/// they name are checked on what parsed (fields that failed to parse are not judged again).
pub async fn check_config(args: &CheckConfigArgs) -> Vec<String> {
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => return vec![format!("reading {}: {e}", args.file.display())],
    };
    let (cfg, mut errs) = Config::parse_all(&text);
    let Some(cfg) = cfg else {
        return errs.iter().map(ToString::to_string).collect();
    };
    if let Err(ConfigError::Invalid(more)) =
        crate::app::start::validate_with_files(&cfg, !args.no_files)
    {
        // A field that did not parse has its default here: say nothing more about it.
        let failed: Vec<String> = errs.iter().map(|e| e.path.clone()).collect();
        let tls_named = more
            .iter()
            .any(|e| !is_no_listener(e) && e.path.starts_with("tls."));
        // "No listener" follows from a listener address that did not parse (it has its
        // default here), and says nothing new beside another error about the TLS pair.
        let listener_failed = failed
            .iter()
            .any(|f| f == "listen" || f == "insecureListen" || f == "tls" || f.starts_with("tls."));
        errs.extend(more.into_iter().filter(|e| {
            !failed
                .iter()
                .any(|f| e.path == *f || e.path.starts_with(&format!("{f}.")))
                && !(is_no_listener(e) && (listener_failed || tls_named))
        }));
    }
    let mut out: Vec<String> = errs.iter().map(ToString::to_string).collect();
    if let Some(kc) = &args.kubeconfig {
        // Names the file already refuses are not looked up again.
        let refused: Vec<String> = errs.iter().map(|e| e.path.clone()).collect();
        out.extend(check_resources(&cfg, kc, args.context.as_deref(), &refused).await);
    }
    out
}

/// The error [`Config::validate`] gives a configuration without any listener.
fn is_no_listener(e: &crate::config::FieldError) -> bool {
    e.path == "tls.certFile" && e.message.starts_with("no listener")
}

/// Served resources of `group` whose name is close to `resource` (a prefix either way, or
/// within two edits: `deploymens`, `deployment`), as `resource[.group]`.
fn near_resources<'a>(
    served: impl Iterator<Item = &'a (String, String)>,
    group: &str,
    resource: &str,
) -> Vec<String> {
    let mut near: Vec<String> = served
        .filter(|(g, r)| {
            g == group
                && (r.starts_with(resource)
                    || resource.starts_with(r.as_str())
                    || edit_distance(r, resource) <= 2)
        })
        .map(|(g, r)| {
            if g.is_empty() {
                r.clone()
            } else {
                format!("{r}.{g}")
            }
        })
        .collect();
    near.sort();
    near
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb))
                .min(prev[j + 1] + 1)
                .min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// `cache.resources` against the discovery documents of the cluster `kubeconfig` names, read
/// as the proxy reads them ([`crate::cache::registry::fetch`]).
async fn check_resources(
    cfg: &Config,
    kubeconfig: &Path,
    context: Option<&str>,
    refused: &[String],
) -> Vec<String> {
    use crate::cache::discovery::{ALL, Selection, split_name};
    crate::http::tls::install_crypto_provider();
    let mut up = cfg.upstream.clone();
    up.kubeconfig = Some(kubeconfig.to_owned());
    up.context = context.map(String::from);
    let upstream = match crate::upstream::load_kube_config(&up)
        .await
        .and_then(|kc| crate::upstream::Upstream::new(&kc, &up))
    {
        Ok(u) => u,
        Err(e) => return vec![format!("--kubeconfig {}: {e}", kubeconfig.display())],
    };
    let names: Vec<String> = cfg
        .cache
        .resources
        .iter()
        .filter(|r| *r != ALL)
        .cloned()
        .collect();
    if names.is_empty() {
        return Vec::new();
    }
    let d = match crate::cache::registry::fetch(&upstream, &Selection::new(&names, &[])).await {
        Ok(d) => d,
        Err(e) => return vec![format!("discovery ({}): {e}", kubeconfig.display())],
    };
    let mut out = Vec::new();
    for (i, name) in cfg.cache.resources.iter().enumerate() {
        if name == ALL || refused.contains(&format!("cache.resources[{i}]")) {
            continue;
        }
        let (resource, group) = split_name(name);
        let key = (group.to_string(), resource.to_string());
        let shown = if group.is_empty() { "core" } else { group };
        let problem = match d.served.get(&key) {
            Some(s) if s.listable => continue,
            Some(_) => "is served but does not support list and watch".to_string(),
            None if d.absent_groups.contains(group) => {
                format!("the apiserver serves no API group {shown:?}")
            }
            None if d.failed_groups.contains_key(group) => format!(
                "discovery of API group {shown:?} failed: {}",
                d.failed_groups[group]
            ),
            None => {
                let near = near_resources(d.served.keys(), group, resource);
                let hint = if near.is_empty() {
                    String::new()
                } else {
                    format!(" (did you mean {}?)", near.join(", "))
                };
                format!(
                    "the apiserver serves no resource {resource:?} in API group {shown:?}{hint}"
                )
            }
        };
        out.push(format!("cache.resources[{i}]: {name:?}: {problem}"));
    }
    out
}

/// `dev`: a real local control plane with the proxy in front of it, until Ctrl-C.
///
/// This is the proxy's default "embedded" upstream for someone without a cluster. The
/// proxy's own identity (for impersonation and health probes) is the control plane's admin.
#[cfg(feature = "dev")]
pub async fn dev(args: DevArgs) -> anyhow::Result<()> {
    use anyhow::Context;

    use crate::app::dev::{ControlPlane, ControlPlaneOptions};

    init_logging(
        &args.log_level,
        LogFormat::Text,
        crate::config::LogConfig::default().access_flush_interval,
    );
    // Both ports first: a busy port should fail in a second, not after building and starting
    // a control plane. The listeners are released again for `start`, which binds its own.
    for (flag, addr) in [
        ("--listen", args.listen),
        ("--admin-listen", args.admin_listen),
    ] {
        std::net::TcpListener::bind(addr)
            .with_context(|| format!("{flag} {addr}: cannot listen on port {}", addr.port()))?;
    }
    crate::http::tls::install_crypto_provider();
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = std::fs::canonicalize(&args.out)?;
    let upstream_kc = out.join("upstream.kubeconfig");
    let proxy_kc = out.join("kube-cache-proxy.kubeconfig");
    // The kubeconfigs name this run's ports and tokens: removed when it ends, however it ends.
    let _written = RemoveOnDrop(vec![upstream_kc.clone(), proxy_kc.clone()]);
    eprintln!(">> preparing kube-apiserver, etcd and kubectl (cached after the first build)");
    tokio::task::spawn_blocking(crate::app::dev::ensure_binaries)
        .await?
        .context("building the control plane")?;
    let cp = ControlPlane::start(ControlPlaneOptions {
        dir: None,
        log_dir: Some(out.join(".dev").join("logs")),
        ..ControlPlaneOptions::default()
    })
    .await
    .context("starting kube-apiserver and etcd")?;
    eprintln!(
        ">> kube-apiserver ready at {} (logs in {})",
        cp.url,
        cp.log_dir.display()
    );
    cp.seed().await.context("seeding demo objects")?;

    std::fs::write(&upstream_kc, cp.admin_kubeconfig_yaml())?;
    let tls_dir = out.join(".dev").join("proxy-tls");
    std::fs::create_dir_all(&tls_dir)?;
    let (ca_pem, cert_pem, key_pem) =
        crate::http::tls::generate_serving_pair(&["127.0.0.1", "localhost"])?;
    std::fs::write(tls_dir.join("tls.crt"), cert_pem)?;
    std::fs::write(tls_dir.join("tls.key"), key_pem)?;
    std::fs::write(tls_dir.join("client-ca.crt"), cp.client_ca().0)?;
    std::fs::write(tls_dir.join("ca.crt"), &ca_pem)?;
    let mut cfg = Config {
        listen: args.listen,
        ..Config::default()
    };
    cfg.server.admin_listen = Some(args.admin_listen);
    cfg.tls.cert_file = Some(tls_dir.join("tls.crt"));
    cfg.tls.key_file = Some(tls_dir.join("tls.key"));
    // Client certificates minted by the dev control plane's client CA work here too.
    cfg.tls.client_ca_file = Some(tls_dir.join("client-ca.crt"));
    cfg.upstream.kubeconfig = Some(upstream_kc.clone());
    cfg.log.level = args.log_level.clone();
    let kube = crate::upstream::load_kube_config(&cfg.upstream).await?;
    let running = crate::app::start::start(cfg, &kube).await?;
    let addr = running.tls_addr.context("the proxy has no listener")?;
    let admin = running
        .admin_addr
        .context("the proxy has no admin listener")?;
    std::fs::write(
        &proxy_kc,
        ControlPlane::kubeconfig_yaml(
            &format!("https://{addr}"),
            Some(&ca_pem),
            Some(cp.admin_token()),
            None,
        ),
    )?;
    // kubectl as built with the control plane, at a stable path to put on PATH.
    let bin = out.join(".dev").join("bin");
    std::fs::create_dir_all(&bin)?;
    let kubectl = bin.join("kubectl");
    let _ = std::fs::remove_file(&kubectl);
    #[cfg(unix)]
    std::os::unix::fs::symlink(cp.kubectl(), &kubectl)?;
    println!(
        "\nkube-cache-proxy is serving https://{addr} in front of {upstream}\n\n\
         Through the proxy:   kubectl --kubeconfig {pk} get pods -A -w\n\
         Directly upstream:   kubectl --kubeconfig {uk} get ns\n\
         kubectl built here:  {kubectl} (export PATH=\"{bindir}:$PATH\")\n\
         Users (static tokens): {users} (tokens in {tokens})\n\
         Proxy's own health:  https://{admin}/readyz?verbose (the admin listener; on the API\n\
         \x20                    port, /readyz, /metrics, ... are the apiserver's)\n\
         Proxy's /metrics:    curl --cacert {ca} -H \"Authorization: Bearer $(kubectl \
         --kubeconfig {pk} config view --raw -o jsonpath='{{.users[0].user.token}}')\" \
         https://{admin}/metrics\n\n\
         Ctrl-C stops the proxy, kube-apiserver and etcd, and removes the two kubeconfigs.",
        ca = tls_dir.join("ca.crt").display(),
        upstream = cp.url,
        pk = proxy_kc.display(),
        uk = upstream_kc.display(),
        kubectl = kubectl.display(),
        bindir = bin.display(),
        tokens = cp.token_file().display(),
        users = cp
            .users
            .iter()
            .map(|u| u.name.as_str())
            .collect::<Vec<_>>()
            .join(", "),
    );
    termination_signal().await;
    flush_logs();
    eprintln!(">> stopping");
    running.shutdown().await;
    flush_logs();
    cp.stop().await;
    Ok(())
}

/// Files removed when dropped (dev mode's kubeconfigs, which are stale once it stops).
#[cfg(feature = "dev")]
struct RemoveOnDrop(Vec<PathBuf>);

#[cfg(feature = "dev")]
impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn near_resource_names_are_suggested() {
        let served = [
            ("apps".to_string(), "deployments".to_string()),
            ("apps".to_string(), "daemonsets".to_string()),
            (String::new(), "pods".to_string()),
            (String::new(), "podtemplates".to_string()),
        ];
        assert_eq!(
            near_resources(served.iter(), "apps", "deploymens"),
            ["deployments.apps"]
        );
        assert_eq!(
            near_resources(served.iter(), "apps", "deployment"),
            ["deployments.apps"]
        );
        assert_eq!(
            near_resources(served.iter(), "", "pod"),
            ["pods", "podtemplates"]
        );
        assert!(near_resources(served.iter(), "apps", "widgets").is_empty());
        assert_eq!(edit_distance("kitten", "sitting"), 3);
        assert_eq!(edit_distance("", "ab"), 2);
    }

    /// Every flag says what it does in `--help`.
    #[test]
    fn every_flag_has_help_text() {
        use clap::CommandFactory;
        let cli = Cli::command();
        let mut missing = Vec::new();
        for sub in cli.get_subcommands() {
            for arg in sub.get_arguments() {
                if arg.get_help().is_none() && arg.get_long_help().is_none() {
                    missing.push(format!("{} --{}", sub.get_name(), arg.get_id()));
                }
            }
        }
        assert!(missing.is_empty(), "flags without help: {missing:?}");
    }

    #[test]
    fn version_names_the_source_revision() {
        use clap::CommandFactory;
        let v = Cli::command().render_version();
        assert!(
            v.contains(&format!("(revision {})", env!("KUBE_CACHE_PROXY_REVISION"))),
            "{v}"
        );
    }

    #[test]
    fn flags_override_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(&p, "shutdown:\n  delay: 3s\nlog:\n  level: debug\n").unwrap();
        let args = ServeArgs {
            config: Some(p),
            shutdown_delay: Some(Duration::from_secs(7)),
            insecure_listen: Some("127.0.0.1:9999".parse().unwrap()),
            ..Default::default()
        };
        let cfg = args.resolve().unwrap();
        assert_eq!(cfg.shutdown.delay, Duration::from_secs(7));
        assert_eq!(cfg.log.level, "debug");
        assert_eq!(cfg.insecure_listen, Some("127.0.0.1:9999".parse().unwrap()));
    }

    fn check(file: &Path, no_files: bool) -> Vec<String> {
        let args = CheckConfigArgs {
            file: file.to_owned(),
            no_files,
            ..Default::default()
        };
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(check_config(&args))
    }

    #[test]
    fn check_config_reports_paths() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        std::fs::write(
            &p,
            "server:\n  maxConnections: 0\ninsecureListen: 127.0.0.1:1\n",
        )
        .unwrap();
        assert_eq!(
            check(&p, false),
            vec!["server.maxConnections: must be at least 1".to_string()]
        );
        std::fs::write(&p, "insecureListen: 127.0.0.1:1\n").unwrap();
        assert!(check(&p, false).is_empty());
        assert_eq!(check(&dir.path().join("missing.yaml"), false).len(), 1);
    }

    #[test]
    fn check_config_reports_parse_relation_and_file_errors_together() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.yaml");
        let missing = dir.path().join("nope");
        let m = missing.display();
        std::fs::write(
            &p,
            format!(
                "shutdown:\n  dealy: 5s\nserver:\n  maxConnections: 0\n  \
                 http2MaxConcurrentStreams: lots\ntls:\n  certFile: {m}/tls.crt\n  \
                 keyFile: {m}/tls.key\n  clientCaFile: {m}/ca.crt\n\
                 authentication:\n  tokenAuthFile: {m}/tokens.csv\ntokens:\n  keyFile: {m}/keys\n"
            ),
        )
        .unwrap();
        let errs = check(&p, false);
        let mut paths: Vec<&str> = errs.iter().map(|e| e.split(": ").next().unwrap()).collect();
        paths.sort_unstable();
        assert_eq!(
            paths,
            [
                "authentication.tokenAuthFile",
                "server.http2MaxConcurrentStreams",
                "server.maxConnections",
                "shutdown.dealy",
                "tls.certFile",
                "tls.clientCaFile",
                // Beside the certificate, not hidden by it.
                "tls.keyFile",
                "tokens.keyFile",
            ],
            "{errs:#?}"
        );
        // Without the files: the same file, only the problems in the file itself.
        let errs = check(&p, true);
        assert_eq!(errs.len(), 3, "{errs:#?}");
        assert!(errs.iter().all(|e| !e.contains("nope")), "{errs:#?}");
    }

    #[test]
    fn check_config_parses_the_files_it_names() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let (_, cert, key) = crate::http::tls::generate_serving_pair(&["localhost"]).unwrap();
        std::fs::write(d.join("tls.crt"), &cert).unwrap();
        std::fs::write(d.join("tls.key"), &key).unwrap();
        std::fs::write(d.join("ca.crt"), &cert).unwrap();
        std::fs::write(d.join("tokens.csv"), "tok,alice,1\n").unwrap();
        let secret = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [7u8; 32]);
        std::fs::write(d.join("keys"), format!("k1 {secret}\n")).unwrap();
        let p = d.join("c.yaml");
        let write = |cert: &str, ca: &str, tokens: &str| {
            let d = d.display();
            std::fs::write(
                &p,
                format!(
                    "tls:\n  certFile: {d}/{cert}\n  keyFile: {d}/tls.key\n  \
                     clientCaFile: {d}/{ca}\nauthentication:\n  tokenAuthFile: {d}/{tokens}\n\
                     tokens:\n  keyFile: {d}/keys\n"
                ),
            )
            .unwrap();
        };
        write("tls.crt", "ca.crt", "tokens.csv");
        assert_eq!(check(&p, false), Vec::<String>::new());
        // Files that exist but are not what they should be: the key as certificate and CA,
        // a token file with too few columns.
        std::fs::write(d.join("bad.csv"), "tok\n").unwrap();
        write("tls.key", "tls.key", "bad.csv");
        let errs = check(&p, false);
        let paths: Vec<&str> = errs.iter().map(|e| e.split(": ").next().unwrap()).collect();
        assert_eq!(
            paths,
            [
                "tls.certFile",
                "tls.clientCaFile",
                "authentication.tokenAuthFile"
            ],
            "{errs:#?}"
        );
    }

    #[test]
    fn library_internals_stay_at_info_unless_named() {
        assert_eq!(
            log_filter("debug", false),
            "debug,rustls=info,h2=info,hyper=info,hyper_util=info,tower=info,mio=info"
        );
        // Named: the filter's own choice.
        let f = log_filter("debug,h2=trace,hyper::proto=debug", false);
        assert!(
            f.starts_with("debug,h2=trace,hyper::proto=debug,rustls=info"),
            "{f}"
        );
        assert!(!f.contains("h2=info") && !f.contains(",hyper=info"), "{f}");
        assert!(f.contains("hyper_util=info"), "{f}");
        // RUST_LOG is taken as it is.
        assert_eq!(log_filter("trace", true), "trace");
        for f in [
            log_filter("debug", false),
            log_filter("info,kube_client=off", false),
        ] {
            assert!(tracing_subscriber::EnvFilter::try_new(&f).is_ok(), "{f}");
        }
    }

    #[test]
    fn access_log_flags_override_the_file() {
        let args = ServeArgs {
            log_access: Some(false),
            log_access_sampling: Some(0.25),
            ..Default::default()
        };
        let cfg = args.resolve().unwrap();
        assert!(!cfg.log.access);
        assert_eq!(cfg.log.access_sampling, 0.25);
        assert!(ServeArgs::default().resolve().unwrap().log.access);
        let cli =
            Cli::try_parse_from(["kube-cache-proxy", "serve", "--log-access", "off"]).unwrap();
        let Command::Serve(a) = cli.command else {
            panic!("serve")
        };
        assert_eq!(a.log_access, Some(false));
        assert!(
            Cli::try_parse_from(["kube-cache-proxy", "serve", "--log-access", "maybe"]).is_err()
        );
    }

    #[test]
    fn the_cli_definition_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
