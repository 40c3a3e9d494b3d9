//! Scenario `warm-restart`: how fast a restarted proxy is ready, and what it asks the
//! apiserver for, with and without its saved state (`cache.stateDir`).
//!
//! The namespace `lt-w` is seeded with N ConfigMaps (1 KB each) beside the control plane's
//! own objects. The proxy (a child process, the default cached resources, state saved to a
//! directory of the run) is started cold, stopped with SIGTERM (it saves its caches), and
//! started again (warm). For each start: the time from spawning the process until its
//! `/readyz` passes (polled every 25 ms), the LIST requests the apiserver counted meanwhile
//! (`apiserver_request_total{verb="LIST"}`, the proxy being the only client), and the
//! proxy's own view (`kube_cache_proxy_upstream_relists_total`, and how many caches started
//! from their saved state, `kube_cache_proxy_cache_warm_start`). The stop is timed too (drain
//! plus the save) and the state files are measured.

use std::time::Instant;

use serde::Serialize;

use crate::client::Target;
use crate::proxy::{ProxyChild, ProxyFiles};
use crate::stats::{metrics, sum};

#[derive(Debug, Clone, Serialize)]
pub struct WarmResult {
    pub objects: usize,
    pub cold_ready_s: f64,
    pub cold_apiserver_lists: f64,
    pub cold_proxy_lists: f64,
    pub stop_s: f64,
    pub state_files: usize,
    pub state_mb: f64,
    pub warm_ready_s: f64,
    pub warm_apiserver_lists: f64,
    pub warm_proxy_lists: f64,
    pub warm_started_caches: usize,
    pub caches: usize,
}

/// One start: (seconds to ready, apiserver LISTs meanwhile, the proxy's own metrics).
async fn start(
    files: &ProxyFiles,
    proxy_bin: Option<&std::path::Path>,
    token: &str,
    direct: &Target,
) -> anyhow::Result<(ProxyChild, f64, f64, String)> {
    let lists = async || -> anyhow::Result<f64> {
        Ok(sum(
            &metrics(direct).await?,
            "apiserver_request_total",
            &["verb=\"LIST\""],
        ))
    };
    let before = lists().await?;
    let t = Instant::now();
    let px = ProxyChild::start(files, proxy_bin, token).await?;
    let ready = t.elapsed().as_secs_f64();
    let after = lists().await?;
    let own = match &px.admin {
        Some(a) => metrics(a).await?,
        None => String::new(),
    };
    Ok((px, ready, after - before, own))
}

pub async fn run(
    work: &std::path::Path,
    upstream_kubeconfig: &str,
    extra: Option<&str>,
    proxy_bin: Option<&std::path::Path>,
    token: &str,
    direct: &Target,
    objects: usize,
) -> anyhow::Result<WarmResult> {
    let state = work.join("warm-state");
    let dir = work.join("warm");
    std::fs::create_dir_all(&dir)?;
    // A continue-token key file, as the deploy manifests mount: the state files are then
    // sealed, and Secrets are saved too.
    let keys = dir.join("token-keys");
    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
        .map_err(|_| anyhow::anyhow!("random"))?;
    use base64::Engine as _;
    let line = base64::engine::general_purpose::STANDARD.encode(secret);
    std::fs::write(&keys, format!("k1 {line}\n"))?;
    let mut config = format!(
        "cache:\n  stateDir: {}\ntokens:\n  keyFile: {}\n",
        state.display(),
        keys.display()
    );
    if let Some(e) = extra {
        config.push_str(e);
    }
    let files = ProxyFiles::write(&dir, upstream_kubeconfig, Some(&config))?;

    let (px, cold_ready_s, cold_apiserver_lists, own) =
        start(&files, proxy_bin, token, direct).await?;
    let cold_proxy_lists = sum(&own, "kube_cache_proxy_upstream_relists_total", &[]);
    let t = Instant::now();
    px.stop().await;
    let stop_s = t.elapsed().as_secs_f64();
    let mut state_files = 0;
    let mut state_bytes = 0u64;
    for e in std::fs::read_dir(&state)? {
        let e = e?;
        if e.path().extension().is_some_and(|x| x == "state") {
            state_files += 1;
            state_bytes += e.metadata()?.len();
        }
    }

    let (px, warm_ready_s, warm_apiserver_lists, own) =
        start(&files, proxy_bin, token, direct).await?;
    let warm_proxy_lists = sum(&own, "kube_cache_proxy_upstream_relists_total", &[]);
    let warm_started_caches = sum(&own, "kube_cache_proxy_cache_warm_start", &[]) as usize;
    let caches = own
        .lines()
        .filter(|l| l.starts_with("kube_cache_proxy_cache_warm_start{"))
        .count();
    px.stop().await;
    Ok(WarmResult {
        objects,
        cold_ready_s,
        cold_apiserver_lists,
        cold_proxy_lists,
        stop_s,
        state_files,
        state_mb: state_bytes as f64 / 1e6,
        warm_ready_s,
        warm_apiserver_lists,
        warm_proxy_lists,
        warm_started_caches,
        caches,
    })
}

pub fn markdown(r: &WarmResult) -> String {
    format!(
        "## Warm restart ({} ConfigMaps of 1 KB in lt-w, the default cached resources)\n\n\
         | | cold start | warm start (saved state) |\n|---|---|---|\n\
         | process spawn to /readyz passing | {:.2} s | {:.2} s |\n\
         | LISTs the apiserver counted meanwhile | {} | {} |\n\
         | the proxy's upstream LISTs (`kube_cache_proxy_upstream_relists_total`) | {} | {} |\n\
         | caches started from their saved state | 0 of {} | {} of {} |\n\n\
         Stop (SIGTERM: drain, then the save): {:.2} s; {} state files, {:.1} MB.\n",
        r.objects,
        r.cold_ready_s,
        r.warm_ready_s,
        r.cold_apiserver_lists,
        r.warm_apiserver_lists,
        r.cold_proxy_lists,
        r.warm_proxy_lists,
        r.caches,
        r.warm_started_caches,
        r.caches,
        r.stop_s,
        r.state_files,
        r.state_mb,
    )
}
