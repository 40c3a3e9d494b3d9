//! Scenario `table-list`: `kubectl get pods -A` (a Table, `--chunk-size=500`, kubectl's
//! default) over many pods, the apiserver straight and the proxy in one run, with the pinned
//! kubectl built beside the control plane.
//!
//! P pods of about 1 KB are created straight at the apiserver (as `pb-list` seeds them). Each
//! side then runs `kubectl get pods -A` R times in a row, timing each run from the start of
//! the process to the end of its output; the side's apiserver CPU, requests and the proxy's
//! CPU are read over its R runs. Before the proxy's runs, one untimed `kubectl get` starts
//! its table side for pods (the first Table reader does) and the driver waits, bounded, until
//! the side holds a row for every pod, as a proxy that has served Tables for a while would.
//! The apiserver's side gets one untimed run too. Checks: every run printed every pod; the
//! last run of each side printed the same rows but for the AGE column (both printed at other
//! moments); the proxy's pods Tables were served from its cache.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use serde::Serialize;

use crate::client::Target;
use crate::proxy::{ProxyChild, ServedBy, served};
use crate::report::{cpu_rss, lat};
use crate::stats::{Summary, metrics, sum, summarize};
use crate::{Check, Cluster, Env, Usage};

/// The namespace of the listed pods.
const NS: &str = "lt-tbl";
/// How long the proxy's table side may take to hold every pod's row.
const SYNC_WITHIN: Duration = Duration::from_secs(300);

/// Sizes (`--table-*`).
#[derive(Debug, Clone, Serialize)]
pub struct TableOpts {
    pub pods: usize,
    pub runs: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    pub side: &'static str,
    /// Wall time of each `kubectl get pods -A`, start to end of output.
    pub runs: Summary,
    /// Lines printed (header excluded) by each run.
    pub lines: Vec<usize>,
    pub usage: Usage,
    /// The apiserver's pods LISTs during the runs (through the proxy: what it sent upstream).
    pub apiserver_lists: u64,
    /// The proxy's pods LISTs during the runs, by what served them.
    pub pages: ServedBy,
    /// `kube_cache_proxy_table_responses_total` during the runs: cache, apiserver.
    pub tables: (f64, f64),
    /// Seconds the proxy's table side took to hold every pod's row after its first reader.
    pub table_sync_s: Option<f64>,
    /// `kube_cache_proxy_cache_table_bytes{resource="pods"}` after the runs.
    pub table_bytes: Option<f64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub opts: TableOpts,
    pub create_rate: f64,
    pub pod_json_bytes: usize,
    pub phases: Vec<Phase>,
    /// Rows of the last run that differ between the sides, the AGE column left out.
    pub differing_rows: usize,
}

/// One `kubectl get pods -A`: its wall time and its output.
async fn kubectl_get(kubectl: &Path, kubeconfig: &Path) -> anyhow::Result<(Duration, String)> {
    let t0 = Instant::now();
    let out = tokio::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", "pods", "-A"])
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .context("running kubectl")?;
    let took = t0.elapsed();
    anyhow::ensure!(
        out.status.success(),
        "kubectl get pods -A: {}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok((took, String::from_utf8(out.stdout)?))
}

/// The output's rows without the header and without the last column (AGE).
fn rows_without_age(out: &str) -> Vec<String> {
    out.lines()
        .skip(1)
        .map(|l| {
            let mut cells: Vec<&str> = l.split_whitespace().collect();
            cells.pop();
            cells.join(" ")
        })
        .collect()
}

fn table_responses(text: &str) -> (f64, f64) {
    let by = |b: &str| {
        sum(
            text,
            "kube_cache_proxy_table_responses_total",
            &[PODS, &format!("served_by=\"{b}\"")],
        )
    };
    (by("cache"), by("apiserver") + by("upstream"))
}

const PODS: &str = "resource=\"pods\"";

/// Waits until the proxy's table side holds a row for each of `expected` pods, or `within`.
async fn sync_table(admin: &Target, expected: usize, within: Duration) -> anyhow::Result<f64> {
    let t0 = Instant::now();
    loop {
        let rows = sum(
            &metrics(admin).await?,
            "kube_cache_proxy_cache_table_rows",
            &[PODS],
        );
        if rows >= expected as f64 || t0.elapsed() >= within {
            say!(
                "proxy table side for pods: {rows} rows after {:.1}s{}",
                t0.elapsed().as_secs_f64(),
                if rows >= expected as f64 {
                    ""
                } else {
                    " (NOT synced)"
                }
            );
            return Ok(t0.elapsed().as_secs_f64());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn phase(
    env: &Env,
    px: Option<&ProxyChild>,
    kubectl: &Path,
    kubeconfig: &Path,
    o: &TableOpts,
) -> anyhow::Result<(Phase, String)> {
    let side = px.map_or(env.direct.side, |p| p.target.side);
    say!("table-list via {side}: warming up (one untimed kubectl get pods -A)");
    kubectl_get(kubectl, kubeconfig).await?;
    let admin = px.and_then(|p| p.admin.as_ref());
    let table_sync_s = match admin {
        Some(a) => Some(sync_table(a, o.pods, SYNC_WITHIN).await?),
        None => None,
    };
    let tables_before = match admin {
        Some(a) => table_responses(&metrics(a).await?),
        None => (0.0, 0.0),
    };
    let before = (
        env.scrape_resource("pods").await?,
        served(px, "pods", "LIST").await?,
    );
    say!(
        "table-list via {side}: {} runs of kubectl get pods -A",
        o.runs
    );
    let ((times, lines, last), usage) = env
        .measure(px, async {
            let mut times = Vec::with_capacity(o.runs);
            let mut lines = Vec::with_capacity(o.runs);
            let mut last = String::new();
            for _ in 0..o.runs {
                let (took, out) = kubectl_get(kubectl, kubeconfig).await?;
                times.push(took.as_micros() as u64);
                lines.push(out.lines().count().saturating_sub(1));
                last = out;
            }
            anyhow::Ok((times, lines, last))
        })
        .await?;
    let after = (
        env.scrape_resource("pods").await?,
        served(px, "pods", "LIST").await?,
    );
    let (tables, table_bytes) = match admin {
        Some(a) => {
            let text = metrics(a).await?;
            let t = table_responses(&text);
            (
                (t.0 - tables_before.0, t.1 - tables_before.1),
                Some(sum(&text, "kube_cache_proxy_cache_table_bytes", &[PODS])),
            )
        }
        None => ((0.0, 0.0), None),
    };
    let p = Phase {
        side,
        runs: summarize(times),
        lines,
        usage,
        apiserver_lists: after.0.delta(&before.0).get("LIST").copied().unwrap_or(0),
        pages: after.1.since(before.1),
        tables,
        table_sync_s,
        table_bytes,
    };
    say!(
        "table-list via {side}: p50/p99/max {} ms",
        lat(&p.runs).replace(" / ", "/")
    );
    Ok((p, last))
}

/// Scenario table-list: the apiserver, then the proxy.
pub async fn run(
    env: &Env,
    o: &TableOpts,
    out: &std::path::Path,
    work: &Path,
    extra_config: Option<&str>,
) -> anyhow::Result<bool> {
    let Cluster::Local { cp, files, .. } = &env.cluster else {
        anyhow::bail!("table-list reads the proxy's own /metrics: not with --kubeconfig");
    };
    let kubectl = cp.kubectl();
    let direct_kc: PathBuf = work.join("table-direct.kubeconfig");
    std::fs::write(&direct_kc, cp.admin_kubeconfig_yaml())?;
    say!("table-list: seeding {NS} ({} pods) ...", o.pods);
    let (create_rate, _, pod_json_bytes) = crate::pb::seed_pods(env, NS, o.pods, 0).await?;
    say!("table-list: created at {create_rate:.0}/s; a pod is {pod_json_bytes} B in JSON");
    let (direct, direct_out) = phase(env, None, &kubectl, &direct_kc, o).await?;
    let px = env.start_proxy().await?;
    let proxy_kc = work.join("table-proxy.kubeconfig");
    let r = async {
        let url = format!("https://127.0.0.1:{}", px.target.addr.port());
        let yaml = kube_cache_proxy::app::dev::ControlPlane::kubeconfig_yaml(
            &url,
            Some(&files.ca_pem),
            Some(cp.admin_token()),
            None,
        );
        std::fs::write(&proxy_kc, yaml)?;
        phase(env, Some(&px), &kubectl, &proxy_kc, o).await
    }
    .await;
    px.stop().await;
    let (proxy, proxy_out) = r?;
    let (a, b) = (rows_without_age(&direct_out), rows_without_age(&proxy_out));
    let differing_rows =
        a.len().abs_diff(b.len()) + a.iter().zip(&b).filter(|(x, y)| x != y).count();
    let report = Report {
        opts: o.clone(),
        create_rate,
        pod_json_bytes,
        phases: vec![direct, proxy],
        differing_rows,
    };
    let checks = checks(&report);
    crate::write_scenario_report(
        out,
        "table-list",
        markdown(&report, &checks),
        extra_config,
        &report,
    )?;
    for c in checks.iter().filter(|c| !c.pass) {
        say!("CHECK FAILED: {}: {}", c.name, c.detail);
    }
    Ok(checks.iter().all(|c| c.pass))
}

fn checks(r: &Report) -> Vec<Check> {
    let mut out = Vec::new();
    for p in &r.phases {
        let short = p.lines.iter().filter(|&&n| n < r.opts.pods).count();
        out.push(Check {
            name: format!("table-list {}: every run printed every pod", p.side),
            pass: short == 0 && p.lines.len() == r.opts.runs,
            detail: format!(
                "{} runs, {short} printed fewer than {} rows",
                p.lines.len(),
                r.opts.pods
            ),
        });
    }
    out.push(Check {
        name: "table-list: the sides printed the same rows (AGE aside)".into(),
        pass: r.differing_rows == 0,
        detail: format!("{} rows differ", r.differing_rows),
    });
    if let Some(p) = r.phases.iter().find(|p| p.side == "proxy") {
        out.push(Check {
            name: "table-list proxy: pods Tables served from the cache".into(),
            pass: p.tables.1 == 0.0 && p.tables.0 > 0.0 && p.apiserver_lists == 0,
            detail: format!(
                "Tables: {} from the cache, {} from the apiserver; the apiserver counted {} pods LISTs",
                p.tables.0, p.tables.1, p.apiserver_lists
            ),
        });
    }
    out
}

fn markdown(r: &Report, checks: &[Check]) -> String {
    let mut s = format!(
        "## table-list\n\n`kubectl get pods -A` (the pinned kubectl: a Table, `--chunk-size=500`) over \
         {} pods of {} B in JSON (created at {:.0}/s), {} timed runs in a row per side, each \
         after one untimed run; the proxy's after its table side for pods held every pod's row \
         (started by the untimed run). Wall time: from kubectl's start to the end of its \
         output. CPU and requests: over the side's timed runs.\n\n\
         | | apiserver | proxy |\n|---|---|---|\n",
        r.opts.pods, r.pod_json_bytes, r.create_rate, r.opts.runs
    );
    let row = |name: &str, f: &dyn Fn(&Phase) -> String| {
        let cells: Vec<String> = r.phases.iter().map(f).collect();
        format!("| {name} | {} |\n", cells.join(" | "))
    };
    s.push_str(&row("kubectl get pods -A p50 / p99 / max (ms)", &|p| {
        lat(&p.runs)
    }));
    s.push_str(&row("kube-apiserver CPU-s, RSS peak", &|p| {
        cpu_rss(&p.usage, "kube-apiserver")
    }));
    s.push_str(&row("kube-apiserver CPU-s per kubectl get", &|p| {
        crate::report::proc(&p.usage, "kube-apiserver").map_or("-".into(), |u| {
            format!("{:.2}", u.cpu_s / p.lines.len().max(1) as f64)
        })
    }));
    s.push_str(&row("etcd CPU-s, RSS peak", &|p| cpu_rss(&p.usage, "etcd")));
    s.push_str(&row("proxy CPU-s, RSS peak", &|p| {
        cpu_rss(&p.usage, "proxy")
    }));
    s.push_str(&row("apiserver requests (pods LISTs)", &|p| {
        format!("{} ({})", p.usage.all_requests, p.apiserver_lists)
    }));
    s.push_str(&row("proxy pods LISTs cache / apiserver", &|p| {
        if p.side == "proxy" {
            format!("{} / {}", p.pages.cache, p.pages.upstream)
        } else {
            "-".into()
        }
    }));
    s.push_str(&row("proxy Tables cache / apiserver", &|p| {
        if p.side == "proxy" {
            format!("{} / {}", p.tables.0, p.tables.1)
        } else {
            "-".into()
        }
    }));
    s.push_str(&row(
        "proxy table side: synced in, bytes",
        &|p| match (p.table_sync_s, p.table_bytes) {
            (Some(t), Some(b)) => format!("{t:.1} s, {:.1} MB", b / 1e6),
            _ => "-".into(),
        },
    ));
    s.push_str("\nChecks:\n\n");
    for c in checks {
        s.push_str(&format!(
            "- {} {}: {}\n",
            if c.pass { "PASS" } else { "FAIL" },
            c.name,
            c.detail
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_compared_without_the_header_and_the_age_column() {
        let a = "NAMESPACE NAME READY STATUS RESTARTS AGE\nns w-0 0/1 Pending 0 5s\nns w-1 0/1 Pending 0 2m\n";
        let b = "NAMESPACE NAME READY STATUS RESTARTS AGE\nns w-0 0/1 Pending 0 9s\nns w-1 0/1 Pending 0 3m1s\n";
        assert_eq!(rows_without_age(a), rows_without_age(b));
        assert_eq!(
            rows_without_age(a),
            ["ns w-0 0/1 Pending 0", "ns w-1 0/1 Pending 0"]
        );
        let c = "H\nns w-0 0/1 Running 0 5s\n";
        assert_ne!(rows_without_age(a)[0], rows_without_age(c)[0]);
    }

    #[test]
    fn table_responses_are_read_by_who_served_them() {
        let text = "kube_cache_proxy_table_responses_total{resource=\"pods\",served_by=\"cache\"} 7\n\
                    kube_cache_proxy_table_responses_total{resource=\"nodes\",served_by=\"cache\"} 3\n\
                    kube_cache_proxy_table_responses_total{resource=\"pods\",served_by=\"apiserver\"} 2\n";
        assert_eq!(table_responses(text), (7.0, 2.0));
    }
}
