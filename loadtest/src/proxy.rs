//! The proxy under test as a child process, so its CPU and RSS are its own.
//!
//! By default the child is this binary again (`loadtest serve-proxy ...`), which runs exactly
//! what `kube-cache-proxy serve` runs (the same flags, [`ServeArgs::resolve`] and
//! [`kube_cache_proxy::app::start::start`]) from the library this driver was built with: no separate
//! binary to build or to go stale, same build profile as the driver. `--proxy-bin` runs another
//! `kube-cache-proxy` binary with the same arguments instead.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser as _;
use http::Method;
use kube_cache_proxy::app::cli::{Cli, Command};

use serde::Serialize;

use crate::client::{Target, fetch};
use crate::stats::{metrics, sum};

/// `loadtest serve-proxy ARGS`: the `serve` command of `kube-cache-proxy`, with ARGS.
pub fn serve_main(args: Vec<String>) -> anyhow::Result<()> {
    // As the real binary's `main` does (a kernel without the setting only warns).
    if let Err(e) = kube_cache_proxy::app::memory::disable_transparent_huge_pages() {
        eprintln!("warning: transparent huge pages stay as the system sets them: {e}");
    }
    let argv = ["kube-cache-proxy".to_string(), "serve".to_string()]
        .into_iter()
        .chain(args);
    let Command::Serve(args) = Cli::parse_from(argv).command else {
        bail!("serve-proxy takes the flags of `kube-cache-proxy serve`");
    };
    let cfg = args.resolve()?;
    #[cfg(feature = "count-alloc")]
    crate::alloc_trace::start();
    let rt = kube_cache_proxy::app::memory::runtime(crate::release_idle_memory)?;
    rt.block_on(async move {
        kube_cache_proxy::app::cli::init_logging(
            &cfg.log.level,
            cfg.log.format,
            cfg.log.access_flush_interval,
        );
        kube_cache_proxy::http::tls::install_crypto_provider();
        let kube = kube_cache_proxy::upstream::load_kube_config(&cfg.upstream).await?;
        let running = kube_cache_proxy::app::start::start(cfg, &kube).await?;
        kube_cache_proxy::app::cli::termination_signal().await;
        running.shutdown().await;
        kube_cache_proxy::app::cli::flush_logs();
        anyhow::Ok(())
    })
}

/// Files the proxy child needs: upstream kubeconfig, its serving certificate and its config.
pub struct ProxyFiles {
    pub kubeconfig: PathBuf,
    pub config: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca_pem: String,
    pub log: PathBuf,
    /// `--proxy-extra-config`, kept for [`ProxyFiles::variant`].
    extra: Option<String>,
}

impl ProxyFiles {
    /// `extra`: YAML appended to the proxy's configuration (`--proxy-extra-config`).
    pub fn write(
        dir: &Path,
        upstream_kubeconfig: &str,
        extra: Option<&str>,
    ) -> anyhow::Result<ProxyFiles> {
        let (ca_pem, cert, key) =
            kube_cache_proxy::http::tls::generate_serving_pair(&["127.0.0.1", "localhost"])?;
        let f = ProxyFiles {
            kubeconfig: dir.join("upstream.kubeconfig"),
            config: dir.join("proxy-config.yaml"),
            cert: dir.join("proxy-tls.crt"),
            key: dir.join("proxy-tls.key"),
            ca_pem,
            log: dir.join("proxy.log"),
            extra: extra.map(str::to_string),
        };
        std::fs::write(&f.kubeconfig, upstream_kubeconfig)?;
        std::fs::write(&f.config, config(&[extra]))?;
        std::fs::write(&f.cert, cert)?;
        std::fs::write(&f.key, key)?;
        Ok(f)
    }

    /// The same files with `yaml` added to the configuration (in `proxy-config-{name}.yaml`
    /// beside the first), for a phase that compares a setting in the same run. The run's
    /// `--proxy-extra-config` is kept (it must not set the same top-level key as `yaml`).
    pub fn variant(&self, name: &str, yaml: &str) -> anyhow::Result<ProxyFiles> {
        let dir = self
            .config
            .parent()
            .context("the proxy's config directory")?;
        let path = dir.join(format!("proxy-config-{name}.yaml"));
        std::fs::write(&path, config(&[self.extra.as_deref(), Some(yaml)]))?;
        Ok(ProxyFiles {
            kubeconfig: self.kubeconfig.clone(),
            config: path,
            cert: self.cert.clone(),
            key: self.key.clone(),
            ca_pem: self.ca_pem.clone(),
            log: self.log.clone(),
            extra: self.extra.clone(),
        })
    }
}

/// The proxy's configuration file: its defaults, except a fixed upstream page size (500): the
/// scenarios measure serving, and scenario b checks that the proxy's initial sync is ONE
/// upstream LIST request per resource; adaptive upstream pages (tests/integration/paging.rs)
/// would split it into a varying number of page requests. Then each of `extra`.
fn config(extra: &[Option<&str>]) -> String {
    let mut config = "paging:\n  adaptUpstream: false\n".to_string();
    for e in extra.iter().flatten() {
        config.push_str(e);
        config.push('\n');
    }
    config
}

/// A proxy's requests for one resource and verb, by what served them
/// (`kube_cache_proxy_requests_total{served_by}` on its admin listener).
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ServedBy {
    pub cache: u64,
    pub upstream: u64,
    /// Why the passed-through ones went to the apiserver
    /// (`kube_cache_proxy_passthrough_total{reason}`).
    pub reasons: std::collections::BTreeMap<String, u64>,
}

impl ServedBy {
    /// Reads `resource` (plural, e.g. `configmaps`) and `verb` (`GET`, `LIST`, `WATCH`) from
    /// the proxy's metrics text.
    pub fn read(text: &str, resource: &str, verb: &str) -> ServedBy {
        let (resource, verb) = (
            format!("resource=\"{resource}\""),
            format!("verb=\"{verb}\""),
        );
        let by = |b: &str| {
            let b = format!("served_by=\"{b}\"");
            sum(
                text,
                "kube_cache_proxy_requests_total",
                &[&resource, &verb, &b],
            ) as u64
        };
        let mut reasons = std::collections::BTreeMap::new();
        for l in text.lines().filter(|l| {
            l.starts_with("kube_cache_proxy_passthrough_total{")
                && l.contains(&resource)
                && l.contains(&verb)
        }) {
            let reason = l
                .split_once("reason=\"")
                .and_then(|(_, r)| r.split_once('"'))
                .map_or("?", |(r, _)| r);
            let n = l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
            *reasons.entry(reason.to_string()).or_default() += n.unwrap_or(0.0) as u64;
        }
        ServedBy {
            cache: by("cache"),
            upstream: by("upstream"),
            reasons,
        }
    }

    /// What was served between `before` and `self`.
    pub fn since(self, before: ServedBy) -> ServedBy {
        let mut reasons = self.reasons;
        for (r, n) in reasons.iter_mut() {
            *n = n.saturating_sub(before.reasons.get(r).copied().unwrap_or(0));
        }
        reasons.retain(|_, n| *n > 0);
        ServedBy {
            cache: self.cache.saturating_sub(before.cache),
            upstream: self.upstream.saturating_sub(before.upstream),
            reasons,
        }
    }

    /// `; N: reason` for each reason, for a check's detail.
    pub fn reasons_text(&self) -> String {
        self.reasons
            .iter()
            .map(|(r, n)| format!("; {n}: {r}"))
            .collect()
    }
}

/// [`ServedBy`] of the proxy `px` so far (zero without one, or for a proxy the driver did not
/// start: it has no admin listener to read).
pub async fn served(
    px: Option<&ProxyChild>,
    resource: &str,
    verb: &str,
) -> anyhow::Result<ServedBy> {
    match px.and_then(|p| p.admin.as_ref()) {
        Some(admin) => Ok(ServedBy::read(&metrics(admin).await?, resource, verb)),
        None => Ok(ServedBy::default()),
    }
}

/// The proxy under test: a child process of the driver, or one already running in a cluster
/// (`--proxy-kubeconfig`), which the driver neither starts nor stops.
pub struct ProxyChild {
    child: Option<tokio::process::Child>,
    pub pid: Option<u32>,
    pub target: Target,
    /// Its admin listener (`/metrics`), when the driver started it.
    pub admin: Option<Target>,
}

impl ProxyChild {
    /// Starts the proxy and waits until its own `/readyz` (on the admin listener) passes
    /// (every cache synced).
    pub async fn start(
        files: &ProxyFiles,
        proxy_bin: Option<&Path>,
        token: &str,
    ) -> anyhow::Result<ProxyChild> {
        let [port, admin_port] = kube_cache_proxy::app::dev::free_loopback_ports::<2>()?;
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        // The proxy's own readiness is on its admin listener (on the API port, /readyz is the
        // apiserver's).
        let admin_addr: SocketAddr = ([127, 0, 0, 1], admin_port).into();
        let args: Vec<String> = vec![
            "--config".into(),
            files.config.display().to_string(),
            "--kubeconfig".into(),
            files.kubeconfig.display().to_string(),
            "--listen".into(),
            addr.to_string(),
            "--admin-listen".into(),
            admin_addr.to_string(),
            "--tls-cert-file".into(),
            files.cert.display().to_string(),
            "--tls-key-file".into(),
            files.key.display().to_string(),
            "--log-level".into(),
            "warn".into(),
        ];
        let mut cmd = match proxy_bin {
            Some(bin) => {
                let mut c = tokio::process::Command::new(bin);
                c.arg("serve");
                c
            }
            None => {
                let mut c = tokio::process::Command::new(std::env::current_exe()?);
                c.arg("serve-proxy");
                c
            }
        };
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&files.log)?;
        let child = cmd
            .args(&args)
            .env_remove("KCP_CONFIG")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .context("starting the proxy")?;
        let pid = child.id().context("proxy pid")?;
        let target = Target::new("proxy", addr, &files.ca_pem, token);
        let admin = Target::new("proxy", admin_addr, &files.ca_pem, token);
        let mut p = ProxyChild {
            child: Some(child),
            pid: Some(pid),
            target,
            admin: Some(admin.clone()),
        };
        let deadline = Instant::now() + Duration::from_secs(180);
        loop {
            if let Some(status) = p
                .child
                .as_mut()
                .map(|c| c.try_wait())
                .transpose()?
                .flatten()
            {
                bail!("the proxy exited ({status}); see {}", files.log.display());
            }
            let ready = async {
                let c = admin.connect().await?;
                fetch(&c, admin.request(Method::GET, "/readyz", None)).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(5), ready).await {
                return Ok(p);
            }
            if Instant::now() > deadline {
                bail!(
                    "the proxy was not ready in 180s; see {}",
                    files.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// A proxy that is already running (not started or stopped by the driver).
    pub fn external(target: Target) -> ProxyChild {
        ProxyChild {
            child: None,
            pid: None,
            target,
            admin: None,
        }
    }

    /// SIGTERM (graceful drain), then SIGKILL after 15 s; nothing for an external proxy.
    pub async fn stop(self) {
        let (Some(mut child), Some(pid)) = (self.child, self.pid) else {
            return;
        };
        let _ = tokio::process::Command::new("kill")
            .arg("-TERM")
            .arg(pid.to_string())
            .status()
            .await;
        if tokio::time::timeout(Duration::from_secs(15), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::ServedBy;

    #[test]
    fn served_by_reads_counts_and_passthrough_reasons_of_one_resource_and_verb() {
        let at = |watch_cache: u64, not_reached: u64| {
            format!(
                "kube_cache_proxy_requests_total{{verb=\"WATCH\",resource=\"pods\",served_by=\"cache\"}} {watch_cache}\n\
                 kube_cache_proxy_requests_total{{verb=\"WATCH\",resource=\"pods\",served_by=\"upstream\"}} {not_reached}\n\
                 kube_cache_proxy_requests_total{{verb=\"LIST\",resource=\"pods\",served_by=\"upstream\"}} 9\n\
                 kube_cache_proxy_passthrough_total{{verb=\"WATCH\",resource=\"pods\",reason=\"resourceVersion not reached\"}} {not_reached}\n\
                 kube_cache_proxy_passthrough_total{{verb=\"LIST\",resource=\"pods\",reason=\"selector\"}} 9\n\
                 kube_cache_proxy_passthrough_total{{verb=\"WATCH\",resource=\"nodes\",reason=\"selector\"}} 4\n"
            )
        };
        let before = ServedBy::read(&at(10, 2), "pods", "WATCH");
        assert_eq!((before.cache, before.upstream), (10, 2));
        let after = ServedBy::read(&at(25, 5), "pods", "WATCH");
        let d = after.since(before);
        assert_eq!((d.cache, d.upstream), (15, 3));
        assert_eq!(d.reasons_text(), "; 3: resourceVersion not reached");
        let same = ServedBy::read(&at(25, 5), "pods", "WATCH").since(ServedBy::read(
            &at(25, 5),
            "pods",
            "WATCH",
        ));
        assert_eq!(same.reasons_text(), "");
    }
}
