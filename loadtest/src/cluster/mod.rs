//! Scenario `cluster` (issue 52): a simulated cluster, the same bounded workload once straight
//! at kube-apiserver and once through the proxy, each side on its own fresh control plane, in
//! one run.
//!
//! Per side: etcd + kube-apiserver (`ControlPlane::start`); on the proxy's side a proxy child
//! with `cache.resources: [all]` (and the control plane's client CA, so node certificates
//! authenticate to it), otherwise its defaults; kube-controller-manager, kube-scheduler, KWOK
//! and kube-state-metrics, each with its own client certificate, pointed at the apiserver or
//! the proxy; per simulated node a kubelet-like agent and K DaemonSet-agent-like agents
//! (`agents.rs`). The driver's own writes (nodes, deployments, the latency probes) go straight
//! to the apiserver on both sides.
//!
//! Phases, each measured on each side: cluster up (proxy start, components, deployments until
//! every pod is Running), agents' first connect, steady churn (scale down, env-change rollout,
//! scale up), agent rollout (every DaemonSet agent restarts with a new token), kube-apiserver
//! restart (SIGKILL, start again; measured for a fixed window from its readiness); on the
//! proxy's sides, a rolling restart of two proxy replicas behind a loopback balancer
//! (`balancer.rs`), once cold and once warm (from `cache.stateDir`). A third side with other
//! proxy settings (`--also-proxy-config`) runs the same phases on a control plane of its own.

pub mod agents;
pub mod balancer;
pub mod components;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use http::Method;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use serde::Serialize;
use serde_json::{Value, json};

use crate::client::{Target, fetch, unix_nanos};
use crate::proxy::{ProxyChild, ProxyFiles};
use crate::stats::{self, ProcUsage, Sampler, Summary};
use agents::{Agent, CounterValues, Counters};
use components::{Component, ComponentOpts, Endpoint};

/// Sizes of the scenario.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterOpts {
    pub nodes: usize,
    pub agents_per_node: usize,
    pub deployments: usize,
    /// Replicas of each Deployment (pods = deployments × replicas).
    pub replicas: usize,
    /// The driver's Node annotation writes per second (the agents' latency probes).
    pub probe_rate: f64,
    /// Bound on each convergence wait.
    pub converge_timeout_s: f64,
    /// The apiserver-restart phase's window, from the new apiserver's readiness.
    pub restart_window_s: f64,
    /// YAML added to the proxy's configuration (`--proxy-extra-config`), e.g.
    /// `authorization: {localRbac: "off"}` to compare with every read reviewed. It must not set
    /// `cache` or `tokens` (the scenario writes them).
    pub proxy_extra_config: Option<String>,
    /// A third side: the proxy with this YAML added too (`--also-proxy-config`), on its own
    /// control plane, in the same run.
    pub also_proxy_config: Option<String>,
    /// The proxy's rolling-restart phases (two replicas behind the balancer, cold then warm).
    pub rolling_restart: bool,
    /// The size's name in the report (`default`, `large`, `custom`).
    pub size: String,
}

/// What one phase cost and did on one side.
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub name: &'static str,
    pub wall_s: f64,
    pub converged: bool,
    /// Seconds from the phase's start until it converged.
    pub converge_s: f64,
    pub procs: Vec<ProcUsage>,
    pub api: ApiDelta,
    /// Watches open at the apiserver at the phase's end.
    pub open_watches: u64,
    /// ...by resource (`resource` or `resource.group`).
    pub watches_by_resource: BTreeMap<String, u64>,
    pub agents: CounterValues,
    /// Write → receipt of the driver's Node annotation writes at the agents.
    pub latency: Summary,
    pub proxy: Option<ProxyDelta>,
    /// Each proxy replica's memory against what it caches, at the phase's end.
    pub proxy_mem: Vec<ProxyMem>,
    pub notes: Vec<String>,
}

/// A proxy replica's RSS against its cache (`kube_cache_proxy_cache_bytes`,
/// `_cache_objects`, `_cache_protobuf_bytes`, `_watchers`) at one instant.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyMem {
    pub replica: String,
    pub rss_mb: f64,
    /// The cached objects' JSON bodies.
    pub json_bytes: u64,
    /// Their protobuf envelopes (the protobuf side).
    pub protobuf_bytes: u64,
    pub objects: u64,
    /// Downstream watchers served from the cache.
    pub watchers: u64,
}

impl ProxyMem {
    /// The issue's memory target: 1.5 × the cached JSON + 4 KB per watch, in MiB.
    pub fn budget_mb(&self) -> f64 {
        (1.5 * self.json_bytes as f64 + 4096.0 * self.watchers as f64) / 1048576.0
    }

    fn parse(replica: &str, text: &str, rss_mb: f64) -> ProxyMem {
        let s = |m: &str| stats::sum(text, m, &[]) as u64;
        ProxyMem {
            replica: replica.to_string(),
            rss_mb,
            json_bytes: s("kube_cache_proxy_cache_bytes"),
            protobuf_bytes: s("kube_cache_proxy_cache_protobuf_bytes"),
            objects: s("kube_cache_proxy_cache_objects"),
            watchers: s("kube_cache_proxy_watchers"),
        }
    }
}

/// The apiserver's `apiserver_request_total` over a phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ApiDelta {
    pub total: u64,
    pub by_verb: BTreeMap<String, u64>,
    /// `resource verb` (subresources as `resource/sub`), the ten largest.
    pub top: Vec<(String, u64)>,
    pub subject_access_reviews: u64,
    pub token_reviews: u64,
}

/// A parse of the apiserver's `/metrics`.
#[derive(Debug, Clone, Default)]
pub struct ApiSnap {
    by_key: BTreeMap<(String, String), u64>,
    open_watches: u64,
    watches_by_resource: BTreeMap<String, u64>,
}

impl ApiSnap {
    pub fn parse(text: &str) -> ApiSnap {
        let mut s = ApiSnap::default();
        for l in text.lines() {
            let v = || {
                l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0) as u64
            };
            if l.starts_with("apiserver_request_total{") {
                let res = label(l, "resource").unwrap_or("");
                let sub = label(l, "subresource").unwrap_or("");
                let res = if sub.is_empty() {
                    res.to_string()
                } else {
                    format!("{res}/{sub}")
                };
                let verb = label(l, "verb").unwrap_or("").to_string();
                *s.by_key.entry((res, verb)).or_default() += v();
            } else if l.starts_with("apiserver_longrunning_requests{")
                && l.contains("verb=\"WATCH\"")
            {
                s.open_watches += v();
                let res = label(l, "resource").unwrap_or("?");
                let key = match label(l, "group").unwrap_or("") {
                    "" => res.to_string(),
                    g => format!("{res}.{g}"),
                };
                if v() > 0 {
                    *s.watches_by_resource.entry(key).or_default() += v();
                }
            }
        }
        s
    }

    pub fn delta(&self, before: &ApiSnap) -> ApiDelta {
        let mut d = ApiDelta::default();
        let mut per: Vec<(String, u64)> = Vec::new();
        for ((res, verb), v) in &self.by_key {
            let n = v.saturating_sub(
                before
                    .by_key
                    .get(&(res.clone(), verb.clone()))
                    .copied()
                    .unwrap_or(0),
            );
            if n == 0 {
                continue;
            }
            d.total += n;
            *d.by_verb.entry(verb.clone()).or_default() += n;
            match res.as_str() {
                "subjectaccessreviews" => d.subject_access_reviews += n,
                "tokenreviews" => d.token_reviews += n,
                _ => {}
            }
            per.push((format!("{res} {verb}"), n));
        }
        per.sort_by_key(|b| std::cmp::Reverse(b.1));
        per.truncate(10);
        d.top = per;
        d
    }
}

fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let i = line.find(&key)? + key.len();
    let j = line[i..].find('"')?;
    Some(&line[i..i + j])
}

/// The proxy's requests over a phase (`kube_cache_proxy_requests_total`,
/// `kube_cache_proxy_passthrough_total`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct ProxyDelta {
    /// `verb served_by` → requests.
    pub served: BTreeMap<String, u64>,
    /// `verb resource: reason` → requests passed through.
    pub passthrough: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Default)]
struct ProxySnap(BTreeMap<String, u64>, BTreeMap<String, u64>);

impl ProxySnap {
    fn parse(text: &str) -> ProxySnap {
        let mut s = ProxySnap::default();
        for l in text.lines() {
            let v = l
                .rsplit(' ')
                .next()
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0) as u64;
            if l.starts_with("kube_cache_proxy_requests_total{") {
                let k = format!(
                    "{} {}",
                    label(l, "verb").unwrap_or("?"),
                    label(l, "served_by").unwrap_or("?")
                );
                *s.0.entry(k).or_default() += v;
            } else if l.starts_with("kube_cache_proxy_passthrough_total{") {
                let k = format!(
                    "{} {}: {}",
                    label(l, "verb").unwrap_or("?"),
                    label(l, "resource").unwrap_or("?"),
                    label(l, "reason").unwrap_or("?")
                );
                *s.1.entry(k).or_default() += v;
            }
        }
        s
    }

    fn delta(&self, before: &ProxySnap) -> ProxyDelta {
        let d = |a: &BTreeMap<String, u64>, b: &BTreeMap<String, u64>| {
            a.iter()
                .map(|(k, v)| (k.clone(), v.saturating_sub(b.get(k).copied().unwrap_or(0))))
                .filter(|(_, v)| *v > 0)
                .collect()
        };
        ProxyDelta {
            served: d(&self.0, &before.0),
            passthrough: d(&self.1, &before.1),
        }
    }
}

/// One side's run.
#[derive(Debug, Clone, Serialize)]
pub struct Side {
    pub side: String,
    /// `/proc/loadavg` when the side started and when it ended (the machine is shared).
    pub loadavg_start: String,
    pub loadavg_end: String,
    pub phases: Vec<Phase>,
    /// The proxy's side: kube-state-metrics through the proxy against one started straight at
    /// the apiserver, scraped at the same instant after the steady churn.
    pub ksm: Option<KsmCompare>,
}

/// Two kube-state-metrics outputs compared line by line (comments left out, nothing else).
#[derive(Debug, Clone, Default, Serialize)]
pub struct KsmCompare {
    /// Sample lines of the one through the proxy.
    pub lines: usize,
    /// Lines in one output and not in the other (both ways), at the best of the attempts.
    pub differing: usize,
    /// Scrape pairs taken (until one with no difference, at most 20, 2 s apart).
    pub attempts: usize,
    /// Some of the differing lines, `<` through the proxy, `>` direct.
    pub examples: Vec<String>,
}

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterRun {
    pub opts: ClusterOpts,
    pub sides: Vec<Side>,
    pub checks: Vec<crate::Check>,
    /// The issue's targets, met or not: figures, not checks (a miss does not fail the run).
    pub targets: Vec<crate::Check>,
}

/// Everything one side runs.
struct Ctx {
    cp: ControlPlane,
    direct: Target,
    proxy: Option<ProxyChild>,
    /// The second replica (started before the rolling restart) and the balancer in front of
    /// the replicas (from the proxy's start).
    proxy_b: Option<ProxyChild>,
    balancer: Option<balancer::Balancer>,
    /// The replicas' files (a, b) and state directories.
    proxy_files: Vec<ProxyFiles>,
    state_dirs: Vec<PathBuf>,
    /// The proxy configuration's additions on this side.
    side_extra: Option<String>,
    /// Replicas that exited during the phase: their CPU from the phase's start to their exit.
    exited: Vec<ProcUsage>,
    /// The proxies' counters restarted during the phase (their deltas count from zero).
    proxy_counters_reset: bool,
    components: Vec<Component>,
    counters: Arc<Counters>,
    kubelets: Vec<Agent>,
    daemons: Vec<Agent>,
    /// Where agents connect: the apiserver's or the proxy's address and CA.
    agent_addr: std::net::SocketAddr,
    agent_ca: String,
    o: ClusterOpts,
    /// The template generation (the `LT_GEN` env) and replicas now asked for.
    generation: u32,
    replicas: usize,
    ksm: Option<KsmCompare>,
    cluster_bin: PathBuf,
    dir: PathBuf,
}

const NS: &str = "lt-work";
const AGENTS_NS: &str = "lt-agents";

fn node_name(i: usize) -> String {
    format!("kwok-node-{i}")
}

/// Runs both sides and returns their phases.
pub async fn run(
    o: &ClusterOpts,
    work: &Path,
    k8s_bin: Option<PathBuf>,
) -> anyhow::Result<ClusterRun> {
    say!("cluster: building or finding the components ...");
    let k8s_bin = match k8s_bin {
        Some(b) => b,
        None => {
            tokio::task::spawn_blocking(kube_cache_proxy::app::dev::ensure_conformance_binaries)
                .await??
        }
    };
    let cluster_bin = tokio::task::spawn_blocking(components::ensure_cluster_binaries).await??;
    let mut specs: Vec<(String, Option<String>)> = vec![
        ("apiserver".into(), None),
        (
            "proxy".into(),
            Some(o.proxy_extra_config.clone().unwrap_or_default()),
        ),
    ];
    if let Some(also) = &o.also_proxy_config {
        let base = o.proxy_extra_config.clone().unwrap_or_default();
        // One line in the report's tables, whatever the YAML's layout.
        let name = also.split_whitespace().collect::<Vec<_>>().join(" ");
        specs.push((format!("proxy, {name}"), Some(format!("{base}\n{also}"))));
    }
    let mut sides = Vec::new();
    for (i, (name, extra)) in specs.into_iter().enumerate() {
        say!("cluster: side {name}");
        let dir = work.join(format!("cluster-{i}"));
        let loadavg_start = loadavg();
        let (phases, ksm) = run_side(o, extra, &dir, &k8s_bin, &cluster_bin)
            .await
            .with_context(|| {
                format!("cluster scenario, side {name} (logs in {})", dir.display())
            })?;
        sides.push(Side {
            side: name,
            loadavg_start,
            loadavg_end: loadavg(),
            phases,
            ksm,
        });
    }
    let checks = checks(&sides);
    let targets = targets(&sides);
    Ok(ClusterRun {
        opts: o.clone(),
        sides,
        checks,
        targets,
    })
}

/// The first three fields of `/proc/loadavg` (1, 5 and 15 minutes).
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

async fn run_side(
    o: &ClusterOpts,
    side_extra: Option<String>,
    dir: &Path,
    k8s_bin: &Path,
    cluster_bin: &Path,
) -> anyhow::Result<(Vec<Phase>, Option<KsmCompare>)> {
    std::fs::create_dir_all(dir)?;
    let cp = ControlPlane::start(ControlPlaneOptions {
        dir: Some(dir.join("cp")),
        ..ControlPlaneOptions::default()
    })
    .await
    .context("starting the control plane")?;
    let api_addr: std::net::SocketAddr = cp.url.trim_start_matches("https://").parse()?;
    let direct = Target::new("apiserver", api_addr, &cp.ca_pem, cp.admin_token());
    setup(&direct, o).await?;
    let via_proxy = side_extra.is_some();
    let mut ctx = Ctx {
        direct: direct.clone(),
        proxy: None,
        proxy_b: None,
        balancer: None,
        proxy_files: Vec::new(),
        state_dirs: Vec::new(),
        side_extra,
        exited: Vec::new(),
        proxy_counters_reset: false,
        components: Vec::new(),
        counters: Arc::new(Counters::default()),
        kubelets: Vec::new(),
        daemons: Vec::new(),
        agent_addr: api_addr,
        agent_ca: cp.ca_pem.clone(),
        o: o.clone(),
        generation: 0,
        replicas: o.replicas,
        ksm: None,
        cluster_bin: cluster_bin.to_path_buf(),
        dir: dir.to_path_buf(),
        cp,
    };
    let mut phases = Vec::new();
    let r = phases_of(&mut ctx, via_proxy, dir, k8s_bin, cluster_bin, &mut phases).await;
    ctx.kubelets.clear();
    ctx.daemons.clear();
    for c in ctx.components.drain(..) {
        c.stop().await;
    }
    for px in [ctx.proxy.take(), ctx.proxy_b.take()].into_iter().flatten() {
        px.stop().await;
    }
    ctx.balancer.take();
    ctx.cp.stop().await;
    r.map(|()| (phases, ctx.ksm.take()))
}

async fn phases_of(
    ctx: &mut Ctx,
    via_proxy: bool,
    dir: &Path,
    k8s_bin: &Path,
    cluster_bin: &Path,
    phases: &mut Vec<Phase>,
) -> anyhow::Result<()> {
    // Phase: cluster up (the proxy's start, the components, the workload created).
    let p = measure(ctx, "cluster up", async |ctx: &mut Ctx| {
        let endpoint = if via_proxy {
            let files = replica_files(ctx, dir)?;
            let px = ProxyChild::start(&files[0], None, ctx.cp.admin_token()).await?;
            // Everything reaches the proxy through the balancer (a Service's address), so
            // the rolling restart can add and replace replicas behind it.
            let lb = balancer::Balancer::start(2, px.target.addr).await?;
            ctx.agent_addr = lb.addr;
            ctx.agent_ca = files[0].ca_pem.clone();
            let ep = Endpoint {
                url: format!("https://{}", lb.addr),
                ca_pem: files[0].ca_pem.clone(),
            };
            ctx.proxy = Some(px);
            ctx.balancer = Some(lb);
            ctx.proxy_files = files;
            ep
        } else {
            Endpoint {
                url: ctx.cp.url.clone(),
                ca_pem: ctx.cp.ca_pem.clone(),
            }
        };
        ctx.components = components::start_all(
            &ctx.cp,
            &endpoint,
            &ComponentOpts {
                k8s_bin,
                cluster_bin,
                dir: &dir.join("components"),
            },
        )?;
        create_deployments(&ctx.direct, &ctx.o).await?;
        converge(ctx, false).await
    })
    .await?;
    phases.push(p);

    // The latency probes: Node annotation writes, straight at the apiserver, from here on.
    let probes = tokio::spawn(probe_writer(ctx.direct.clone(), ctx.o.clone()));
    let r = later_phases(ctx, phases).await;
    probes.abort();
    r
}

async fn later_phases(ctx: &mut Ctx, phases: &mut Vec<Phase>) -> anyhow::Result<()> {
    // Phase: the agents' first connect. Their identities (node certificates, ServiceAccount
    // tokens from TokenRequest, as the kubelet gets them for a pod) are made before it.
    let kubelets = kubelet_targets(ctx)?;
    let daemons = daemon_targets(ctx).await?;
    let p = measure(ctx, "agents connect", async |ctx: &mut Ctx| {
        for (t, node) in kubelets {
            ctx.kubelets.push(Agent::kubelet(t, &ctx.counters, &node));
        }
        for (t, node) in daemons {
            ctx.daemons.push(Agent::daemon(t, &ctx.counters, &node));
        }
        converge(ctx, true).await
    })
    .await?;
    phases.push(p);

    // Phase: steady churn: scale down, env-change rollout, scale up.
    let p = measure(ctx, "steady churn", async |ctx: &mut Ctx| {
        let mut notes = Vec::new();
        let full = ctx.o.replicas;
        let steps: [(&str, usize, u32); 3] = [
            ("scale down", (full / 2).max(1), ctx.generation),
            ("rollout", (full / 2).max(1), ctx.generation + 1),
            ("scale up", full, ctx.generation + 1),
        ];
        let t0 = Instant::now();
        let mut all = true;
        for (what, replicas, generation) in steps {
            let t = Instant::now();
            ctx.replicas = replicas;
            ctx.generation = generation;
            patch_deployments(&ctx.direct, &ctx.o, replicas, generation).await?;
            let (ok, _, _) = converge(ctx, true).await?;
            all &= ok;
            notes.push(format!(
                "{what}: {:.1} s{}",
                t.elapsed().as_secs_f64(),
                if ok { "" } else { " (not converged)" }
            ));
        }
        Ok((all, t0.elapsed().as_secs_f64(), notes))
    })
    .await?;
    phases.push(p);

    // Between phases, on the proxy's side: kube-state-metrics through the proxy against one
    // straight at the apiserver.
    if ctx.proxy.is_some() {
        match ksm_compare(ctx).await {
            Ok(c) => {
                say!(
                    "cluster: kube-state-metrics through the proxy vs direct: {} of {} lines differ",
                    c.differing,
                    c.lines
                );
                ctx.ksm = Some(c);
            }
            Err(e) => say!("cluster: kube-state-metrics comparison failed: {e:#}"),
        }
    }

    // Phase: agent rollout: every DaemonSet agent restarts with a new token (requested before
    // the phase, as the new pods' kubelets would).
    let daemons = daemon_targets(ctx).await?;
    let p = measure(ctx, "agent rollout", async |ctx: &mut Ctx| {
        ctx.daemons.clear();
        for (t, node) in daemons {
            ctx.daemons.push(Agent::daemon(t, &ctx.counters, &node));
        }
        converge(ctx, true).await
    })
    .await?;
    phases.push(p);

    // Phase: kube-apiserver restart.
    let p = restart_phase(ctx).await?;
    phases.push(p);

    // Phases (the proxy's sides only): a rolling restart of two replicas, cold, then warm.
    if ctx.proxy.is_some() && ctx.o.rolling_restart {
        start_second_replica(ctx).await?;
        for warm in [false, true] {
            let p = rolling_phase(ctx, warm).await?;
            phases.push(p);
        }
    }
    Ok(())
}

/// The two replicas' files: one serving certificate (the balancer passes TLS through), one
/// continue-token key file (a token from one replica is good at the other, and the state
/// files are sealed with it, Secrets included), a state directory and a log each.
fn replica_files(ctx: &mut Ctx, dir: &Path) -> anyhow::Result<Vec<ProxyFiles>> {
    let keys = dir.join("token-keys");
    let mut secret = [0u8; 32];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
        .map_err(|_| anyhow::anyhow!("random"))?;
    use base64::Engine as _;
    let line = base64::engine::general_purpose::STANDARD.encode(secret);
    std::fs::write(&keys, format!("k1 {line}\n"))?;
    let a = ProxyFiles::write(dir, &ctx.cp.admin_kubeconfig_yaml(), None)?;
    let mut b = a.variant("b", "")?;
    b.log = dir.join("proxy-b.log");
    let mut files = Vec::new();
    let (cache_more, rest) = split_cache_block(ctx.side_extra.as_deref().unwrap_or(""));
    for (name, f) in [("a", a), ("b", b)] {
        let state = dir.join(format!("state-{name}"));
        std::fs::write(
            &f.config,
            format!(
                "cache:\n  resources: [all]\n  stateDir: {}\n{cache_more}tokens:\n  keyFile: {}\ntls:\n  clientCaFile: {}\n{rest}\n",
                state.display(),
                keys.display(),
                ctx.cp.dir.join("pki/client-ca.crt").display(),
            ),
        )?;
        ctx.state_dirs.push(state);
        files.push(f);
    }
    Ok(files)
}

/// A side's extra YAML split into the lines of its block-style `cache:` section (indented,
/// merged into the replicas' own `cache:`) and the rest, so a side may change a cache
/// setting (`--also-proxy-config $'cache:\n  historyFramesKept: 150s'`).
fn split_cache_block(extra: &str) -> (String, String) {
    let (mut cache, mut rest, mut inside) = (String::new(), String::new(), false);
    for l in extra.lines() {
        if l.trim_end() == "cache:" {
            inside = true;
            continue;
        }
        inside &= l.starts_with(' ') || l.is_empty();
        let to = if inside { &mut cache } else { &mut rest };
        to.push_str(l);
        to.push('\n');
    }
    (cache, rest)
}

/// The second replica, started before the rolling restart (its start is not measured) and put
/// behind the balancer.
async fn start_second_replica(ctx: &mut Ctx) -> anyhow::Result<()> {
    say!("cluster: starting the second proxy replica");
    let px = ProxyChild::start(&ctx.proxy_files[1], None, ctx.cp.admin_token()).await?;
    if let Some(lb) = &ctx.balancer {
        lb.set(1, Some(px.target.addr));
    }
    ctx.proxy_b = Some(px);
    Ok(())
}

/// The rolling restart: each replica in turn taken out of the balancer, drained (SIGTERM),
/// started again (`warm`: from the state it saved; otherwise its state directory emptied
/// first) and put back; then until every pod and informer converged.
async fn rolling_phase(ctx: &mut Ctx, warm: bool) -> anyhow::Result<Phase> {
    let name = if warm {
        "proxy rolling restart (warm)"
    } else {
        "proxy rolling restart (cold)"
    };
    ctx.proxy_counters_reset = true;
    // The replicas' CPU at the phase's start (the sampler loses a process that exits).
    let at_start: BTreeMap<u32, f64> = [&ctx.proxy, &ctx.proxy_b]
        .into_iter()
        .flatten()
        .filter_map(|p| p.pid)
        .filter_map(|pid| Some((pid, stats::cpu_seconds(pid)?)))
        .collect();
    let p = measure(ctx, name, async move |ctx: &mut Ctx| {
        let mut notes = Vec::new();
        for slot in 0..2 {
            let t = Instant::now();
            let old = if slot == 0 {
                ctx.proxy.take()
            } else {
                ctx.proxy_b.take()
            }
            .context("a proxy replica")?;
            if let Some(lb) = &ctx.balancer {
                lb.set(slot, None);
            }
            let pid = old.pid.context("replica pid")?;
            let peak = hwm_kb(pid).unwrap_or(0) as f64 / 1024.0;
            let cpu_end = drain(pid).await;
            let start = at_start.get(&pid).copied().unwrap_or(0.0);
            ctx.exited.push(ProcUsage {
                name: replica_name(slot).into(),
                pid,
                cpu_s: (cpu_end - start).max(0.0),
                cpu_pct: 0.0,
                rss_peak_mb: peak,
                rss_end_mb: 0.0,
            });
            old.stop().await;
            let drained_s = t.elapsed().as_secs_f64();
            if !warm {
                let _ = std::fs::remove_dir_all(&ctx.state_dirs[slot]);
                use std::os::unix::fs::DirBuilderExt as _;
                std::fs::DirBuilder::new()
                    .mode(0o700)
                    .create(&ctx.state_dirs[slot])?;
            }
            let t = Instant::now();
            let px = ProxyChild::start(&ctx.proxy_files[slot], None, ctx.cp.admin_token()).await?;
            if let Some(lb) = &ctx.balancer {
                lb.set(slot, Some(px.target.addr));
            }
            notes.push(format!(
                "replica {}: drained in {drained_s:.1} s, ready in {:.1} s",
                ["a", "b"][slot],
                t.elapsed().as_secs_f64()
            ));
            if slot == 0 {
                ctx.proxy = Some(px);
            } else {
                ctx.proxy_b = Some(px);
            }
        }
        let (ok, s, more) = converge(ctx, true).await?;
        notes.extend(more);
        if let Some(lb) = &ctx.balancer {
            notes.push(format!(
                "connections the balancer handed to a / b since the proxy's start: {:?}",
                lb.handed()
            ));
        }
        Ok((ok, s, notes))
    })
    .await;
    ctx.proxy_counters_reset = false;
    p
}

fn replica_name(slot: usize) -> &'static str {
    if slot == 0 { "proxy" } else { "proxy-b" }
}

/// SIGTERM to `pid`, then until it exited (a zombie until reaped: its CPU is still readable),
/// at most 45 s; returns its CPU-s at the end.
async fn drain(pid: u32) -> f64 {
    let _ = tokio::process::Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status()
        .await;
    let mut last = stats::cpu_seconds(pid).unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(45);
    while Instant::now() < deadline {
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            break;
        };
        last = stats::cpu_seconds(pid).unwrap_or(last);
        let state = stat
            .rsplit_once(')')
            .and_then(|(_, r)| r.split_whitespace().next());
        if matches!(state, Some("Z" | "X")) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    last
}

/// Runs `f` as one measured phase; `f` returns (converged, seconds to convergence, notes).
async fn measure<F>(ctx: &mut Ctx, name: &'static str, f: F) -> anyhow::Result<Phase>
where
    F: AsyncFnOnce(&mut Ctx) -> anyhow::Result<(bool, f64, Vec<String>)>,
{
    say!("cluster: phase {name}");
    let api_before = api_snap(&ctx.direct).await?;
    let proxy_before = proxy_snap(ctx).await?;
    let counters_before = ctx.counters.values();
    ctx.counters.latencies.lock().clear();
    ctx.counters.gone_by.lock().clear();
    // The proxy starts within the first phase: sample what runs at each check.
    let sampler = Sampler::start(&procs(ctx));
    let t0 = Instant::now();
    // Convergence counts from the phase's start: `f` returns once converged (or timed out).
    let (converged, _, notes) = f(ctx).await?;
    let wall_s = t0.elapsed().as_secs_f64();
    let converge_s = wall_s;
    let mut procs_used = sampler.finish().await;
    // Replicas that exited during the phase: their CPU until they exited.
    for e in ctx.exited.drain(..) {
        procs_used.retain(|p| p.pid != e.pid);
        procs_used.push(e);
    }
    // Processes started during the phase (the proxy, the components): their whole life.
    for (n, pid) in procs(ctx) {
        if !procs_used.iter().any(|p| p.pid == pid) {
            let rss = stats::rss_kb(pid).unwrap_or(0) as f64 / 1024.0;
            let cpu_s = stats::cpu_seconds(pid).unwrap_or(0.0);
            procs_used.push(ProcUsage {
                name: n,
                pid,
                cpu_s,
                cpu_pct: cpu_s / wall_s.max(1e-6) * 100.0,
                rss_peak_mb: hwm_kb(pid).map_or(rss, |k| k as f64 / 1024.0),
                rss_end_mb: rss,
            });
        }
    }
    finish(
        ctx,
        name,
        wall_s,
        (converged, converge_s, notes),
        procs_used,
        &api_before,
        proxy_before,
        counters_before,
    )
    .await
}

#[allow(clippy::too_many_arguments, reason = "one phase's parts, in one place")]
async fn finish(
    ctx: &mut Ctx,
    name: &'static str,
    wall_s: f64,
    (converged, converge_s, notes): (bool, f64, Vec<String>),
    procs: Vec<ProcUsage>,
    api_before: &ApiSnap,
    proxy_before: Option<ProxySnap>,
    counters_before: CounterValues,
) -> anyhow::Result<Phase> {
    // WATCH requests are counted when they end; give closed streams a moment.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let api_after = api_snap(&ctx.direct).await?;
    let proxy_after = proxy_snap(ctx).await?;
    let latency = stats::summarize(std::mem::take(&mut *ctx.counters.latencies.lock()));
    let gone_by = std::mem::take(&mut *ctx.counters.gone_by.lock());
    let mut notes = notes;
    if !gone_by.is_empty() {
        notes.push(format!(
            "410s by collection: {}",
            gone_by
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let proxy_before = if ctx.proxy_counters_reset {
        Some(ProxySnap::default())
    } else {
        proxy_before
    };
    let mut proxy_mem = Vec::new();
    for (slot, px) in [&ctx.proxy, &ctx.proxy_b].into_iter().enumerate() {
        if let Some((pid, admin)) = px.as_ref().and_then(|p| Some((p.pid?, p.admin.as_ref()?))) {
            let rss = stats::rss_kb(pid).unwrap_or(0) as f64 / 1024.0;
            if let Ok(text) = stats::metrics(admin).await {
                proxy_mem.push(ProxyMem::parse(["a", "b"][slot], &text, rss));
            }
        }
    }
    let p = Phase {
        name,
        wall_s,
        converged,
        converge_s,
        procs,
        api: api_after.delta(api_before),
        open_watches: api_after.open_watches,
        watches_by_resource: api_after.watches_by_resource.clone(),
        agents: ctx.counters.values().since(counters_before),
        latency,
        proxy: match (proxy_before, proxy_after) {
            (Some(b), Some(a)) => Some(a.delta(&b)),
            (None, Some(a)) => Some(a.delta(&ProxySnap::default())),
            _ => None,
        },
        proxy_mem,
        notes,
    };
    say!(
        "cluster: {name}: {:.1} s, converged {} in {:.1} s, apiserver {:.1} CPU-s, {} requests, {} open watches, relists {}",
        p.wall_s,
        p.converged,
        p.converge_s,
        p.procs
            .iter()
            .find(|u| u.name == "kube-apiserver")
            .map_or(0.0, |u| u.cpu_s),
        p.api.total,
        p.open_watches,
        p.agents.relists
    );
    Ok(p)
}

/// The apiserver restart: SIGKILL, start again; measured from the new apiserver's readiness for
/// the restart window (its counters start at zero); convergence from the kill.
async fn restart_phase(ctx: &mut Ctx) -> anyhow::Result<Phase> {
    let name = "apiserver restart";
    say!("cluster: phase {name}");
    let proxy_before = proxy_snap(ctx).await?;
    let counters_before = ctx.counters.values();
    ctx.counters.latencies.lock().clear();
    ctx.counters.gone_by.lock().clear();
    let t0 = Instant::now();
    ctx.cp
        .kill_and_restart_apiserver()
        .await
        .context("restarting kube-apiserver")?;
    let ready_s = t0.elapsed().as_secs_f64();
    let sampler = Sampler::start(&procs(ctx));
    let window_end = Instant::now() + Duration::from_secs_f64(ctx.o.restart_window_s);
    let (converged, _, mut notes) = converge(ctx, true).await?;
    let converge_s = t0.elapsed().as_secs_f64();
    if let Some(rest) = window_end.checked_duration_since(Instant::now()) {
        tokio::time::sleep(rest).await;
    }
    let procs_used = sampler.finish().await;
    notes.push(format!(
        "new apiserver ready {ready_s:.1} s after the kill; CPU, RSS and requests over its first {:.0} s",
        ctx.o.restart_window_s
    ));
    let wall_s = t0.elapsed().as_secs_f64();
    finish(
        ctx,
        name,
        wall_s,
        (converged, converge_s, notes),
        procs_used,
        &ApiSnap::default(),
        proxy_before,
        counters_before,
    )
    .await
}

/// Starts a kube-state-metrics straight at the apiserver, waits until it serves as many lines
/// as the one through the proxy (bounded), then scrapes both at once until they agree (at most
/// 20 pairs, 2 s apart), and stops it.
async fn ksm_compare(ctx: &mut Ctx) -> anyhow::Result<KsmCompare> {
    let proxied = ctx
        .components
        .iter()
        .find_map(|c| c.port)
        .context("no kube-state-metrics port")?;
    let ep = Endpoint {
        url: ctx.cp.url.clone(),
        ca_pem: ctx.cp.ca_pem.clone(),
    };
    let direct = components::kube_state_metrics(
        &ctx.cp,
        &ep,
        &ctx.cluster_bin,
        &ctx.dir.join("components"),
        "kube-state-metrics-direct",
    )?;
    let port = direct.port.context("no port")?;
    let r = async {
        // Its first sync: until it serves at least as many lines (bounded: 90 s).
        for _ in 0..90 {
            let (a, b) = tokio::join!(scrape_plain(proxied), scrape_plain(port));
            if let (Ok(a), Ok(b)) = (a, b)
                && samples(&b).len() >= samples(&a).len()
            {
                break;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let mut best: Option<KsmCompare> = None;
        for attempt in 1..=20 {
            let (a, b) = tokio::join!(scrape_plain(proxied), scrape_plain(port));
            let c = diff_lines(&a?, &b?, attempt);
            let done = c.differing == 0;
            if best.as_ref().is_none_or(|b| c.differing < b.differing) {
                best = Some(c);
            }
            if done {
                break;
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
        }
        let mut best = best.unwrap_or_default();
        best.attempts = best.attempts.max(1);
        anyhow::Ok(best)
    }
    .await;
    direct.stop().await;
    r
}

/// `GET /metrics` over plain HTTP/1.0 on loopback (kube-state-metrics' listener).
async fn scrape_plain(port: u16) -> anyhow::Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let r = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
            .await?;
        let mut buf = Vec::new();
        s.read_to_end(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").context("no HTTP header end")?;
        anyhow::ensure!(
            head.starts_with("HTTP/1.") && head.contains(" 200 "),
            "{head}"
        );
        anyhow::Ok(body.to_string())
    };
    tokio::time::timeout(Duration::from_secs(30), r).await?
}

/// The sample lines of a metrics text, sorted (comments and empty lines left out).
fn samples(text: &str) -> Vec<&str> {
    let mut v: Vec<&str> = text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    v.sort_unstable();
    v
}

/// Lines of `a` not in `b` and of `b` not in `a` (as multisets).
fn diff_lines(a: &str, b: &str, attempt: usize) -> KsmCompare {
    let (a, b) = (samples(a), samples(b));
    let (mut i, mut j) = (0, 0);
    let mut examples = Vec::new();
    let mut differing = 0;
    let mut note = |side: char, l: &str, examples: &mut Vec<String>| {
        differing += 1;
        if examples.len() < 10 {
            examples.push(format!("{side} {}", &l[..l.len().min(200)]));
        }
    };
    while i < a.len() || j < b.len() {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => {
                i += 1;
                j += 1;
            }
            (Some(x), Some(y)) if x < y => {
                note('<', x, &mut examples);
                i += 1;
            }
            (Some(_), Some(y)) => {
                note('>', y, &mut examples);
                j += 1;
            }
            (Some(x), None) => {
                note('<', x, &mut examples);
                i += 1;
            }
            (None, Some(y)) => {
                note('>', y, &mut examples);
                j += 1;
            }
            (None, None) => break,
        }
    }
    KsmCompare {
        lines: a.len(),
        differing,
        attempts: attempt,
        examples,
    }
}

/// VmHWM (peak RSS over the process's life) of `pid` in KiB.
fn hwm_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

fn procs(ctx: &Ctx) -> Vec<(String, u32)> {
    let pids = ctx.cp.pids();
    let mut v = vec![
        ("etcd".to_string(), pids[0]),
        ("kube-apiserver".to_string(), pids[1]),
    ];
    for (slot, px) in [&ctx.proxy, &ctx.proxy_b].into_iter().enumerate() {
        if let Some(pid) = px.as_ref().and_then(|p| p.pid) {
            v.push((replica_name(slot).into(), pid));
        }
    }
    for c in &ctx.components {
        if let Some(pid) = c.pid() {
            v.push((c.name.to_string(), pid));
        }
    }
    v.push(("driver".into(), std::process::id()));
    v
}

async fn api_snap(direct: &Target) -> anyhow::Result<ApiSnap> {
    // Bounded: the apiserver may be restarting.
    for _ in 0..60 {
        if let Ok(t) = stats::metrics(direct).await {
            return Ok(ApiSnap::parse(&t));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    anyhow::bail!("the apiserver's /metrics did not answer in 30 s")
}

/// The proxy replicas' counters, summed.
async fn proxy_snap(ctx: &Ctx) -> anyhow::Result<Option<ProxySnap>> {
    let mut sum: Option<ProxySnap> = None;
    for admin in [&ctx.proxy, &ctx.proxy_b]
        .into_iter()
        .flatten()
        .filter_map(|p| p.admin.as_ref())
    {
        let s = ProxySnap::parse(&stats::metrics(admin).await?);
        let acc = sum.get_or_insert_with(ProxySnap::default);
        for (k, v) in s.0 {
            *acc.0.entry(k).or_default() += v;
        }
        for (k, v) in s.1 {
            *acc.1.entry(k).or_default() += v;
        }
    }
    Ok(sum)
}

/// Objects every phase needs: namespaces, the agents' ServiceAccounts and RBAC,
/// kube-state-metrics' RBAC, the Nodes, and per Deployment its ConfigMap, Secret and headless
/// Service.
async fn setup(d: &Target, o: &ClusterOpts) -> anyhow::Result<()> {
    let conn = d.connect().await?;
    for ns in [NS, AGENTS_NS] {
        crate::scenarios::create_namespace(d, &conn, ns).await?;
    }
    let post = |path: &str, body: Value| {
        let (conn, d, path) = (conn.clone(), d.clone(), path.to_string());
        async move {
            let resp = crate::client::send(
                &conn,
                d.request(Method::POST, &path, Some(body.to_string().into())),
            )
            .await?;
            let s = resp.status();
            if !(s.is_success() || s == http::StatusCode::CONFLICT) {
                crate::client::expect_ok(resp, &path).await?;
            }
            anyhow::Ok(())
        }
    };
    let rbac = "/apis/rbac.authorization.k8s.io/v1";
    post(
        &format!("{rbac}/clusterroles"),
        json!({"metadata": {"name": "lt-agent"}, "rules": [
            {"apiGroups": [""], "resources": ["pods", "nodes"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
        ]}),
    )
    .await?;
    post(
        &format!("{rbac}/clusterrolebindings"),
        json!({"metadata": {"name": "lt-agent"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lt-agent"},
               "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": format!("system:serviceaccounts:{AGENTS_NS}")}]}),
    )
    .await?;
    post(
        &format!("{rbac}/clusterroles"),
        json!({"metadata": {"name": "lt-ksm"}, "rules": [
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["list", "watch"]},
        ]}),
    )
    .await?;
    post(
        &format!("{rbac}/clusterrolebindings"),
        json!({"metadata": {"name": "lt-ksm"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "lt-ksm"},
               "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "lt:ksm"}]}),
    )
    .await?;
    for k in 0..o.agents_per_node {
        post(
            &format!("/api/v1/namespaces/{AGENTS_NS}/serviceaccounts"),
            json!({"metadata": {"name": format!("agent-{k}")}}),
        )
        .await?;
    }
    crate::scenarios::create_objects(d, "/api/v1/nodes", o.nodes, 32, |i| {
        let n = node_name(i);
        let res = json!({"cpu": "32", "memory": "256Gi", "pods": "110"});
        json!({"metadata": {"name": n,
                 "annotations": {"kwok.x-k8s.io/node": "fake", "node.alpha.kubernetes.io/ttl": "0"},
                 "labels": {"type": "kwok", "kubernetes.io/hostname": n, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64"}},
               "status": {"allocatable": res, "capacity": res}})
        .to_string()
    })
    .await?;
    for i in 0..o.deployments {
        post(
            &format!("/api/v1/namespaces/{NS}/configmaps"),
            json!({"metadata": {"name": format!("cfg-{i}")}, "data": {"APP_MODE": "sim", "APP_INDEX": i.to_string()}}),
        )
        .await?;
        post(
            &format!("/api/v1/namespaces/{NS}/secrets"),
            json!({"metadata": {"name": format!("sec-{i}")}, "stringData": {"APP_PASSWORD": format!("pw-{i}")}}),
        )
        .await?;
        post(
            &format!("/api/v1/namespaces/{NS}/services"),
            json!({"metadata": {"name": format!("svc-{i}")},
                   "spec": {"clusterIP": "None", "selector": {"app": format!("app-{i}")}, "ports": [{"port": 80}]}}),
        )
        .await?;
    }
    Ok(())
}

/// Deployment `i`'s pod containers at template generation `generation`.
fn containers(i: usize, generation: u32) -> Value {
    json!([{"name": "app", "image": "registry.example/app:1",
            "env": [{"name": "LT_GEN", "value": generation.to_string()}],
            "envFrom": [{"configMapRef": {"name": format!("cfg-{i}")}}, {"secretRef": {"name": format!("sec-{i}")}}],
            "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}}])
}

async fn create_deployments(d: &Target, o: &ClusterOpts) -> anyhow::Result<()> {
    let path = format!("/apis/apps/v1/namespaces/{NS}/deployments");
    crate::scenarios::create_objects(d, &path, o.deployments, 16, |i| {
        let app = format!("app-{i}");
        json!({"metadata": {"name": app},
               "spec": {"replicas": o.replicas,
                        "selector": {"matchLabels": {"app": app}},
                        "strategy": {"rollingUpdate": {"maxSurge": "25%", "maxUnavailable": "25%"}},
                        "template": {"metadata": {"labels": {"app": app}},
                                     "spec": {"containers": containers(i, 0),
                                              "nodeSelector": {"type": "kwok"}}}}})
        .to_string()
    })
    .await?;
    Ok(())
}

async fn patch_deployments(
    d: &Target,
    o: &ClusterOpts,
    replicas: usize,
    generation: u32,
) -> anyhow::Result<()> {
    crate::scenarios::send_each(d, o.deployments, 8, "patch deployment", |i| {
        let body = json!({"spec": {"replicas": replicas,
                                   "template": {"spec": {"containers": containers(i, generation)}}}});
        d.request(
            Method::PATCH,
            &format!("/apis/apps/v1/namespaces/{NS}/deployments/app-{i}"),
            Some(body.to_string().into()),
        )
    })
    .await?;
    Ok(())
}

/// The ServiceAccount token of a new agent pod (TokenRequest, straight at the apiserver, as
/// the kubelet asks for a projected token).
async fn token(d: &Target, conn: &crate::client::Conn, sa: &str) -> anyhow::Result<String> {
    let body = json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                      "spec": {"expirationSeconds": 3600}});
    let b = fetch(
        conn,
        d.request(
            Method::POST,
            &format!("/api/v1/namespaces/{AGENTS_NS}/serviceaccounts/{sa}/token"),
            Some(body.to_string().into()),
        ),
    )
    .await?;
    let v: Value = serde_json::from_slice(&b)?;
    v["status"]["token"]
        .as_str()
        .map(str::to_string)
        .context("TokenRequest without a token")
}

/// Each node's kubelet identity: a client certificate `system:node:<node>`, `system:nodes`.
fn kubelet_targets(ctx: &Ctx) -> anyhow::Result<Vec<(Target, String)>> {
    (0..ctx.o.nodes)
        .map(|i| {
            let node = node_name(i);
            let (cert, key) = ctx
                .cp
                .mint_client_cert(&format!("system:node:{node}"), &["system:nodes"]);
            let t = Target::with_client_cert("agent", ctx.agent_addr, &ctx.agent_ca, &cert, &key)?;
            Ok((t, node))
        })
        .collect()
}

/// A new token for each DaemonSet agent of each node (ServiceAccount `agent-<k>`).
async fn daemon_targets(ctx: &Ctx) -> anyhow::Result<Vec<(Target, String)>> {
    let conn = ctx.direct.connect().await?;
    let base = Target::new("agent", ctx.agent_addr, &ctx.agent_ca, "");
    let mut v = Vec::new();
    for i in 0..ctx.o.nodes {
        for k in 0..ctx.o.agents_per_node {
            let tok = token(&ctx.direct, &conn, &format!("agent-{k}")).await?;
            v.push((base.with_token(&tok), node_name(i)));
        }
    }
    Ok(v)
}

/// Node annotation writes at `probe_rate` per second, round robin over the nodes, each carrying
/// its send time (`loadtest/ts`); errors (the apiserver restarting) are skipped.
async fn probe_writer(d: Target, o: ClusterOpts) {
    let period = Duration::from_secs_f64(1.0 / o.probe_rate.max(0.01));
    let mut tick = tokio::time::interval(period);
    let mut conn = None;
    let mut i = 0usize;
    loop {
        tick.tick().await;
        if conn
            .as_ref()
            .is_none_or(|c: &crate::client::Conn| c.is_closed())
        {
            conn = d.connect().await.ok();
        }
        let Some(c) = conn.as_ref() else { continue };
        let body = json!({"metadata": {"annotations": {"loadtest/ts": unix_nanos().to_string()}}});
        let req = d.request(
            Method::PATCH,
            &format!("/api/v1/nodes/{}", node_name(i % o.nodes)),
            Some(body.to_string().into()),
        );
        if fetch(c, req).await.is_err() {
            conn = None;
        }
        i += 1;
    }
}

/// Waits (bounded by `converge_timeout_s`) until every Deployment's pods are Running at the
/// current generation and replicas (the apiserver's view, `resourceVersion=0`), and, with
/// `agents`, every informer synced and watching and the kubelets seeing exactly those pods
/// Running. Returns (converged, seconds, notes).
async fn converge(ctx: &mut Ctx, agents: bool) -> anyhow::Result<(bool, f64, Vec<String>)> {
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs_f64(ctx.o.converge_timeout_s);
    let expected = ctx.o.deployments * ctx.replicas;
    let gen_s = ctx.generation.to_string();
    let mut last = String::new();
    while Instant::now() < deadline {
        for c in &mut ctx.components {
            c.alive()?;
        }
        let (running, total) = match pods_state(&ctx.direct, &gen_s).await {
            Ok(v) => v,
            Err(e) => {
                last = format!("listing pods: {e}");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let pods_ok = running == expected && total == expected;
        let (synced, watching, all, seen) = if agents {
            let states = ctx
                .kubelets
                .iter()
                .chain(&ctx.daemons)
                .flat_map(|a| &a.informers);
            let (mut s, mut w, mut n) = (0, 0, 0);
            for st in states {
                n += 1;
                s += st.synced.load(Relaxed) as usize;
                w += st.watching.load(Relaxed) as usize;
            }
            (s, w, n, ctx.counters.running_seen.load(Relaxed))
        } else {
            (0, 0, 0, expected as i64)
        };
        last = format!(
            "pods Running at generation {gen_s}: {running} of {expected} ({total} pods); informers synced {synced}/{all}, watching {watching}/{all}; kubelets see {seen} Running"
        );
        if pods_ok && synced == all && watching == all && seen == expected as i64 {
            return Ok((true, t0.elapsed().as_secs_f64(), vec![]));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    say!("cluster: not converged: {last}");
    Ok((
        false,
        t0.elapsed().as_secs_f64(),
        vec![format!("not converged: {last}")],
    ))
}

/// (pods Running at generation `generation` and not being deleted, all pods) in the workload
/// namespace.
async fn pods_state(d: &Target, generation: &str) -> anyhow::Result<(usize, usize)> {
    let conn = d.connect().await?;
    let b = fetch(
        &conn,
        d.request(
            Method::GET,
            &format!("/api/v1/namespaces/{NS}/pods?resourceVersion=0"),
            None,
        ),
    )
    .await?;
    let v: Value = serde_json::from_slice(&b)?;
    let items = v["items"].as_array().cloned().unwrap_or_default();
    let running = items
        .iter()
        .filter(|p| {
            p["status"]["phase"] == "Running"
                && p["metadata"]["deletionTimestamp"].is_null()
                && p["spec"]["containers"][0]["env"][0]["value"] == generation
        })
        .count();
    Ok((running, items.len()))
}

/// Correctness checks: every phase converged on both sides; no relist through the proxy.
fn checks(sides: &[Side]) -> Vec<crate::Check> {
    let mut v = Vec::new();
    for s in sides {
        for p in &s.phases {
            v.push(crate::Check {
                name: format!("cluster: {} converged via {}", p.name, s.side),
                pass: p.converged,
                detail: format!("{:.1} s; {}", p.converge_s, p.notes.join("; ")),
            });
        }
        if let Some(k) = &s.ksm {
            v.push(crate::Check {
                name: "cluster: kube-state-metrics through the proxy as direct".into(),
                pass: k.differing == 0 && k.lines > 0,
                detail: format!("{} of {} lines differ", k.differing, k.lines),
            });
        }
        if s.side.starts_with("proxy") {
            // The rolling restart's relists are a figure (the issue's target, in `targets`),
            // not a correctness check: a replica resumes a watch only from its own history.
            let relists: u64 = s
                .phases
                .iter()
                .filter(|p| !p.name.starts_with("proxy rolling restart"))
                .map(|p| p.agents.relists)
                .sum();
            v.push(crate::Check {
                name: format!("cluster: no agent relisted through the proxy ({})", s.side),
                pass: relists == 0,
                detail: format!("{relists} relists"),
            });
        }
    }
    v
}

/// The issue's targets (figures of the run, ratios of the sides; a miss fails nothing).
fn targets(sides: &[Side]) -> Vec<crate::Check> {
    let mut v = Vec::new();
    let phase = |s: &Side, n: &str| s.phases.iter().find(|p| p.name == n).cloned();
    let api_cpu = |p: &Phase| cpu(p, "kube-apiserver").map_or(0.0, |u| u.cpu_s);
    let direct = sides.iter().find(|s| s.side == "apiserver");
    for s in sides.iter().filter(|s| s.side.starts_with("proxy")) {
        let mut ratio = |phase_name: &str, what: &str, max: f64| {
            if let (Some(d), Some(x)) = (
                direct.and_then(|d| phase(d, phase_name)),
                phase(s, phase_name),
            ) {
                let (a, b) = (api_cpu(&x), api_cpu(&d));
                v.push(crate::Check {
                    name: format!("{phase_name}: apiserver CPU-s {what} ({})", s.side),
                    pass: a <= b * max,
                    detail: format!("{a:.1} against {b:.1} direct ({:.2}×)", a / b.max(1e-9)),
                });
            }
        };
        ratio("agent rollout", "≤ 1/10 of direct", 0.1);
        ratio("agents connect", "≤ 1/2 of direct", 0.5);
        ratio("apiserver restart", "≤ 1/2 of direct", 0.5);
        ratio("steady churn", "≤ direct", 1.0);
        if let (Some(d), Some(x)) = (
            direct.and_then(|d| phase(d, "steady churn")),
            phase(s, "steady churn"),
        ) {
            v.push(crate::Check {
                name: format!(
                    "steady churn: open watches at the apiserver ≤ 1/5 of direct ({})",
                    s.side
                ),
                pass: x.open_watches * 5 <= d.open_watches,
                detail: format!("{} against {}", x.open_watches, d.open_watches),
            });
        }
        for p in &s.phases {
            v.push(crate::Check {
                name: format!("{}: 0 client relists ({})", p.name, s.side),
                pass: p.agents.relists == 0,
                detail: format!("{} relists, {} 410s", p.agents.relists, p.agents.gone),
            });
            for m in &p.proxy_mem {
                v.push(crate::Check {
                    name: format!(
                        "{}: proxy RSS ≤ 1.5 × cached JSON + 4 KB per watch (replica {}, {})",
                        p.name, m.replica, s.side
                    ),
                    pass: m.rss_mb <= m.budget_mb(),
                    detail: format!(
                        "RSS {:.0} MiB, budget {:.1} MiB ({:.1} MiB JSON, {} watches)",
                        m.rss_mb,
                        m.budget_mb(),
                        m.json_bytes as f64 / 1048576.0,
                        m.watchers
                    ),
                });
            }
        }
    }
    v
}

fn cpu<'a>(p: &'a Phase, name: &str) -> Option<&'a ProcUsage> {
    p.procs.iter().find(|u| u.name == name)
}

/// Every replica of the proxy (`proxy`, `proxy-b`, restarted ones too): CPU-s summed, peak
/// RSS the largest.
fn proxy_usage(p: &Phase) -> Option<(f64, f64, usize)> {
    let v: Vec<&ProcUsage> = p
        .procs
        .iter()
        .filter(|u| u.name.starts_with("proxy"))
        .collect();
    if v.is_empty() {
        return None;
    }
    Some((
        v.iter().map(|u| u.cpu_s).sum(),
        v.iter().map(|u| u.rss_peak_mb).fold(0.0, f64::max),
        v.len(),
    ))
}

/// The marginal RSS per watch on a proxy side: between the cluster's start and the agents'
/// first connect (same objects, the agents' watches added), replica a.
fn rss_per_watch(s: &Side) -> Option<(f64, u64)> {
    let at = |n: &str| {
        s.phases
            .iter()
            .find(|p| p.name == n)?
            .proxy_mem
            .iter()
            .find(|m| m.replica == "a")
            .cloned()
    };
    let (up, connect) = (at("cluster up")?, at("agents connect")?);
    let dw = connect
        .watchers
        .checked_sub(up.watchers)
        .filter(|d| *d > 0)?;
    Some(((connect.rss_mb - up.rss_mb) * 1048576.0 / dw as f64, dw))
}

/// The report: per phase a table of both sides.
pub fn markdown(r: &ClusterRun) -> String {
    let o = &r.opts;
    let mut md = format!(
        "# Simulated cluster: kube-apiserver direct vs through kube-cache-proxy\n\n\
         {} nodes (KWOK), {} kubelet-like agents and {} DaemonSet-like agents ({} per node), \
         {} Deployments × {} replicas ({} pods), node-annotation probes at {}/s; \
         kube-controller-manager, kube-scheduler, KWOK and kube-state-metrics through the side's \
         endpoint; each side on its own fresh etcd + kube-apiserver.\n\n",
        o.nodes,
        o.nodes,
        o.nodes * o.agents_per_node,
        o.agents_per_node,
        o.deployments,
        o.replicas,
        o.deployments * o.replicas,
        o.probe_rate
    );
    md.insert_str(
        md.find("\n\n").map_or(0, |i| i + 2),
        &format!("Size: {}.\n\n", o.size),
    );
    if let Some(extra) = &o.proxy_extra_config {
        md.push_str(&format!("Proxy configuration added: `{extra}`\n\n"));
    }
    if let Some(also) = &o.also_proxy_config {
        let also = also.split_whitespace().collect::<Vec<_>>().join(" ");
        md.push_str(&format!(
            "A third side, `proxy, {also}`: the proxy with `{also}` added, on a control plane of its own, same phases.\n\n"
        ));
    }
    md.push_str(
        "The proxy's sides reach the proxy through a loopback TCP balancer in the driver's process (the rolling restart's Service; the driver's CPU there includes copying the proxy's bytes). The proxy runs with `cache.stateDir` and `tokens.keyFile` set (used only by the warm rolling restart).\n\n\
         **Noise**: the machine has 2 cores shared with other engineers' builds and tests while this ran; absolute CPU-s move by tens of percent between runs. Both sides run in the same run, one after the other, so the ratios are the figures of record. Load average (1/5/15 min) per side, at its start → end: ",
    );
    md.push_str(
        &r.sides
            .iter()
            .map(|s| format!("{}: {} → {}", s.side, s.loadavg_start, s.loadavg_end))
            .collect::<Vec<_>>()
            .join("; "),
    );
    md.push_str(".\n\n");
    let failed: Vec<&crate::Check> = r.checks.iter().filter(|c| !c.pass).collect();
    if failed.is_empty() {
        md.push_str("All checks passed.\n\n");
    } else {
        for c in failed {
            md.push_str(&format!("- **CHECK FAILED** {}: {}\n", c.name, c.detail));
        }
        md.push('\n');
    }
    let mut names: Vec<&str> = Vec::new();
    for s in &r.sides {
        for p in &s.phases {
            if !names.contains(&p.name) {
                names.push(p.name);
            }
        }
    }
    for &name in &names {
        let ps: Vec<Option<&Phase>> = r
            .sides
            .iter()
            .map(|s| s.phases.iter().find(|p| p.name == name))
            .collect();
        md.push_str(&format!(
            "## {name}\n\n| | {} |\n|---|",
            r.sides
                .iter()
                .map(|s| s.side.as_str())
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        md.push_str(&"---|".repeat(r.sides.len()));
        md.push('\n');
        let row = |label: &str, f: &dyn Fn(&Phase) -> String| {
            let cells: Vec<String> = ps.iter().map(|p| p.map_or("-".into(), f)).collect();
            format!("| {label} | {} |\n", cells.join(" | "))
        };
        let proc_cell = |n: &'static str| {
            move |p: &Phase| {
                cpu(p, n).map_or("-".into(), |u| {
                    format!("{:.1} CPU-s, peak {:.0} MiB", u.cpu_s, u.rss_peak_mb)
                })
            }
        };
        md.push_str(&row("wall / converged in", &|p| {
            format!(
                "{:.1} s / {}",
                p.wall_s,
                if p.converged {
                    format!("{:.1} s", p.converge_s)
                } else {
                    "**not converged**".into()
                }
            )
        }));
        md.push_str(&row("kube-apiserver", &proc_cell("kube-apiserver")));
        md.push_str(&row("etcd", &proc_cell("etcd")));
        md.push_str(&row("proxy (all replicas)", &|p| {
            proxy_usage(p).map_or("-".into(), |(c, peak, n)| {
                format!("{c:.1} CPU-s, peak {peak:.0} MiB ({n} processes)")
            })
        }));
        md.push_str(&row("driver (agents)", &proc_cell("driver")));
        md.push_str(&row("components (kcm, sched, kwok, ksm) CPU-s", &|p| {
            let c: Vec<String> = [
                "kube-controller-manager",
                "kube-scheduler",
                "kwok",
                "kube-state-metrics",
            ]
            .iter()
            .map(|n| cpu(p, n).map_or("-".into(), |u| format!("{:.1}", u.cpu_s)))
            .collect();
            c.join(" / ")
        }));
        md.push_str(&row("apiserver requests", &|p| p.api.total.to_string()));
        md.push_str(&row("… by verb", &|p| {
            p.api
                .by_verb
                .iter()
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }));
        md.push_str(&row("… largest", &|p| {
            p.api
                .top
                .iter()
                .take(5)
                .map(|(k, v)| format!("{k} {v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }));
        md.push_str(&row(
            "SubjectAccessReviews / TokenReviews at the apiserver",
            &|p| format!("{} / {}", p.api.subject_access_reviews, p.api.token_reviews),
        ));
        md.push_str(&row("open WATCHes at the apiserver (end)", &|p| {
            p.open_watches.to_string()
        }));
        md.push_str(&row(
            "agents: LISTs / relists / WATCHes / watch restarts",
            &|p| {
                let a = &p.agents;
                format!(
                    "{} / {} / {} / {}",
                    a.lists, a.relists, a.watches, a.watch_restarts
                )
            },
        ));
        md.push_str(&row("agents: 410s / 403s / errors / events / GETs", &|p| {
            let a = &p.agents;
            format!(
                "{} / {} / {} / {} / {}",
                a.gone, a.forbidden, a.errors, a.events, a.gets
            )
        }));
        md.push_str(&row(
            "probe latency write → agent p50 / p99 / max (n)",
            &|p| {
                let l = &p.latency;
                if l.count == 0 {
                    "-".into()
                } else {
                    format!(
                        "{:.1} / {:.1} / {:.1} ms ({})",
                        l.p50_ms, l.p99_ms, l.max_ms, l.count
                    )
                }
            },
        ));
        md.push_str(&row("proxy requests by verb, served_by", &|p| {
            p.proxy.as_ref().map_or("-".into(), |x| {
                x.served
                    .iter()
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
        }));
        md.push_str(&row("proxy passthrough reasons", &|p| {
            p.proxy.as_ref().map_or("-".into(), |x| {
                let mut v: Vec<(&String, &u64)> = x.passthrough.iter().collect();
                v.sort_by(|a, b| b.1.cmp(a.1));
                v.iter()
                    .take(8)
                    .map(|(k, n)| format!("{k} ({n})"))
                    .collect::<Vec<_>>()
                    .join("; ")
            })
        }));
        md.push_str(&row(
            "proxy memory (end): RSS / cached JSON / protobuf / objects / watches",
            &|p| {
                if p.proxy_mem.is_empty() {
                    return "-".into();
                }
                p.proxy_mem
                    .iter()
                    .map(|m| {
                        format!(
                            "{}: {:.0} MiB / {:.1} MiB / {:.1} MiB / {} / {}",
                            m.replica,
                            m.rss_mb,
                            m.json_bytes as f64 / 1048576.0,
                            m.protobuf_bytes as f64 / 1048576.0,
                            m.objects,
                            m.watchers
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        ));
        md.push_str(&row(
            "proxy bytes per cached object: JSON / RSS; RSS ≤ 1.5 × JSON + 4 KB per watch",
            &|p| {
                if p.proxy_mem.is_empty() {
                    return "-".into();
                }
                p.proxy_mem
                    .iter()
                    .map(|m| {
                        let o = m.objects.max(1) as f64;
                        format!(
                            "{}: {:.0} B / {:.0} B; {:.0} ≤ {:.1} MiB {}",
                            m.replica,
                            m.json_bytes as f64 / o,
                            m.rss_mb * 1048576.0 / o,
                            m.rss_mb,
                            m.budget_mb(),
                            if m.rss_mb <= m.budget_mb() {
                                "met"
                            } else {
                                "**missed**"
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ")
            },
        ));
        md.push_str(&row("notes", &|p| p.notes.join("; ")));
        md.push('\n');
        let absent: Vec<&str> = r
            .sides
            .iter()
            .zip(&ps)
            .filter(|(_, p)| p.is_none())
            .map(|(s, _)| s.side.as_str())
            .collect();
        if !absent.is_empty() {
            md.push_str(&format!(
                "No equivalent on the {} side (no proxy there): nothing runs, the column shows \"-\".\n\n",
                absent.join(", ")
            ));
        }
    }
    if r.sides.len() > 2 {
        md.push_str("## SubjectAccessReviews at the apiserver, side by side\n\n| phase |");
        for s in &r.sides {
            md.push_str(&format!(" {} |", s.side));
        }
        md.push_str("\n|---|");
        md.push_str(&"---|".repeat(r.sides.len()));
        md.push('\n');
        for name in &names {
            md.push_str(&format!("| {name} |"));
            for s in &r.sides {
                let c = s
                    .phases
                    .iter()
                    .find(|p| p.name == *name)
                    .map_or("-".into(), |p| {
                        let cached: u64 = p.proxy.as_ref().map_or(0, |x| {
                            x.served
                                .iter()
                                .filter(|(k, _)| k.ends_with(" cache"))
                                .map(|(_, v)| *v)
                                .sum()
                        });
                        if p.proxy.is_some() {
                            format!(
                                "{} ({cached} cache-served requests)",
                                p.api.subject_access_reviews
                            )
                        } else {
                            p.api.subject_access_reviews.to_string()
                        }
                    });
                md.push_str(&format!(" {c} |"));
            }
            md.push('\n');
        }
        md.push('\n');
    }
    let per_watch: Vec<String> = r
        .sides
        .iter()
        .filter_map(|s| {
            let (b, n) = rss_per_watch(s)?;
            Some(format!(
                "{}: {:.1} KiB per watch ({n} watches added)",
                s.side,
                b / 1024.0
            ))
        })
        .collect();
    if !per_watch.is_empty() {
        md.push_str(&format!(
            "## Proxy memory per watch\n\nThe proxy's RSS from the end of \"cluster up\" to the end of \"agents connect\" (the same objects, the agents' watches added) over the watches added, replica a: {}.\n\n",
            per_watch.join("; ")
        ));
    }
    md.push_str(&watches_by_resource(r));
    if !r.targets.is_empty() {
        md.push_str("## The issue's targets in this run\n\nFigures, not checks: a miss does not fail the run.\n\n");
        for t in &r.targets {
            md.push_str(&format!(
                "- {} {}: {}\n",
                if t.pass { "met" } else { "**missed**" },
                t.name,
                t.detail
            ));
        }
        md.push('\n');
    }
    for s in &r.sides {
        if let Some(k) = &s.ksm {
            md.push_str(&format!(
                "## kube-state-metrics through the proxy vs direct\n\nAfter the steady churn, a second kube-state-metrics straight at the apiserver, both scraped at once: {} of {} sample lines differ (best of {} scrape pairs; nothing is left out but comment lines).\n",
                k.differing, k.lines, k.attempts
            ));
            for e in &k.examples {
                md.push_str(&format!("\n    {e}"));
            }
            md.push_str("\n\n");
        }
    }
    md
}

/// The apiserver's open WATCHes by resource at the end of "cluster up" (the components
/// alone, before the agents), side by side: which resources the proxy watches that the
/// components would not, and the other way round.
fn watches_by_resource(r: &ClusterRun) -> String {
    let up: Vec<(&str, &BTreeMap<String, u64>)> = r
        .sides
        .iter()
        .filter_map(|s| {
            let p = s.phases.iter().find(|p| p.name == "cluster up")?;
            Some((s.side.as_str(), &p.watches_by_resource))
        })
        .collect();
    if up.len() < 2 {
        return String::new();
    }
    let resources: std::collections::BTreeSet<&String> =
        up.iter().flat_map(|(_, m)| m.keys()).collect();
    let mut md = String::from(
        "## Open WATCHes at the apiserver by resource, end of \"cluster up\"\n\nThe components' watches (direct) against the proxy's own upstream watches plus the apiserver's internal ones (through the proxy); resources with the same count on every side are left out.\n\n| resource |",
    );
    for (side, _) in &up {
        md.push_str(&format!(" {side} |"));
    }
    md.push_str("\n|---|");
    md.push_str(&"---|".repeat(up.len()));
    md.push('\n');
    let (mut same, mut total) = (0usize, vec![0u64; up.len()]);
    for res in resources {
        let counts: Vec<u64> = up
            .iter()
            .map(|(_, m)| m.get(res).copied().unwrap_or(0))
            .collect();
        for (t, c) in total.iter_mut().zip(&counts) {
            *t += c;
        }
        if counts.iter().all(|c| *c == counts[0]) {
            same += 1;
            continue;
        }
        md.push_str(&format!("| {res} |"));
        for c in counts {
            md.push_str(&format!(" {c} |"));
        }
        md.push('\n');
    }
    md.push_str(&format!("| **total** ({same} resources alike left out) |"));
    for t in total {
        md.push_str(&format!(" **{t}** |"));
    }
    md.push_str("\n\n");
    md
}

/// Writes the run's report (`cluster-<time>.md`, `.json`) under `out`, returning the md path.
pub fn write(out: &Path, r: &ClusterRun) -> anyhow::Result<PathBuf> {
    let md = markdown(r);
    crate::write_scenario_report(out, "cluster", md, None, r)?;
    Ok(out.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sides_cache_settings_join_the_replicas_cache_section() {
        let (cache, rest) = split_cache_block(
            "authorization: {localRbac: \"off\"}\ncache:\n  historyFramesKept: 150s\nlog:\n  level: info\n",
        );
        assert_eq!(cache, "  historyFramesKept: 150s\n");
        assert_eq!(
            rest,
            "authorization: {localRbac: \"off\"}\nlog:\n  level: info\n"
        );
        assert_eq!(
            split_cache_block("a: 1"),
            (String::new(), "a: 1\n".to_string())
        );
    }

    #[test]
    fn apiserver_requests_are_summed_by_verb_and_reviews_counted() {
        let t = |n: u64| {
            format!(
                "apiserver_request_total{{code=\"201\",group=\"authorization.k8s.io\",resource=\"subjectaccessreviews\",subresource=\"\",verb=\"POST\"}} {n}\n\
                 apiserver_request_total{{code=\"201\",group=\"authentication.k8s.io\",resource=\"tokenreviews\",subresource=\"\",verb=\"POST\"}} 2\n\
                 apiserver_request_total{{code=\"200\",group=\"\",resource=\"pods\",subresource=\"status\",verb=\"PATCH\"}} {n}\n\
                 apiserver_request_total{{code=\"200\",group=\"\",resource=\"pods\",subresource=\"\",verb=\"LIST\"}} 7\n\
                 apiserver_longrunning_requests{{group=\"\",resource=\"pods\",verb=\"WATCH\"}} 4\n\
                 apiserver_longrunning_requests{{group=\"\",resource=\"nodes\",verb=\"WATCH\"}} 5\n"
            )
        };
        let before = ApiSnap::parse(&t(3));
        let after = ApiSnap::parse(&t(10));
        assert_eq!(after.open_watches, 9);
        assert_eq!(
            after.watches_by_resource,
            BTreeMap::from([("nodes".to_string(), 5), ("pods".to_string(), 4)])
        );
        let d = after.delta(&before);
        assert_eq!(d.total, 14);
        assert_eq!(d.subject_access_reviews, 7);
        assert_eq!(d.token_reviews, 0);
        assert_eq!(d.by_verb["PATCH"], 7);
        assert_eq!(d.top[0].1, 7);
        let from_zero = after.delta(&ApiSnap::default());
        assert_eq!(from_zero.total, 10 + 2 + 10 + 7);
        assert_eq!(from_zero.token_reviews, 2);
    }

    #[test]
    fn metrics_texts_differ_by_their_sample_lines_only() {
        let a = "# HELP x\nx{a=\"1\"} 1\nx{a=\"2\"} 1\n";
        let b = "x{a=\"2\"} 1\n# HELP x other\nx{a=\"1\"} 1\n";
        assert_eq!(diff_lines(a, b, 1).differing, 0);
        let c = "x{a=\"1\"} 1\nx{a=\"3\"} 1\n";
        let d = diff_lines(a, c, 2);
        assert_eq!((d.lines, d.differing, d.attempts), (2, 2, 2));
        assert_eq!(d.examples, ["< x{a=\"2\"} 1", "> x{a=\"3\"} 1"]);
    }

    #[test]
    fn proxy_requests_by_served_by_and_reason() {
        let t = |n: u64| {
            format!(
                "kube_cache_proxy_requests_total{{verb=\"WATCH\",resource=\"pods\",served_by=\"cache\"}} {n}\n\
                 kube_cache_proxy_requests_total{{verb=\"WATCH\",resource=\"nodes\",served_by=\"cache\"}} 1\n\
                 kube_cache_proxy_passthrough_total{{verb=\"list\",resource=\"pods\",reason=\"r\"}} {n}\n"
            )
        };
        let d = ProxySnap::parse(&t(5)).delta(&ProxySnap::parse(&t(2)));
        assert_eq!(d.served["WATCH cache"], 3);
        assert_eq!(d.passthrough["list pods: r"], 3);
    }
}
