//! Percentiles, process CPU/RSS from /proc, request counters from `/metrics` texts (the
//! apiserver's and the proxy's), and the loopback TCP measurement.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use http::Method;
use serde::Serialize;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::client::{Target, fetch};

/// Latency summary in milliseconds.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    pub count: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    pub mean_ms: f64,
}

/// Summarises samples given in microseconds.
pub fn summarize(mut us: Vec<u64>) -> Summary {
    if us.is_empty() {
        return Summary::default();
    }
    us.sort_unstable();
    let q = |p: f64| {
        let i = ((us.len() as f64 * p).ceil() as usize).clamp(1, us.len()) - 1;
        us[i] as f64 / 1000.0
    };
    Summary {
        count: us.len(),
        p50_ms: q(0.50),
        p99_ms: q(0.99),
        max_ms: *us.last().unwrap_or(&0) as f64 / 1000.0,
        mean_ms: us.iter().sum::<u64>() as f64 / us.len() as f64 / 1000.0,
    }
}

/// CPU and memory of one process over one phase.
#[derive(Debug, Clone, Serialize)]
pub struct ProcUsage {
    pub name: String,
    pub pid: u32,
    /// User + system CPU seconds used during the phase.
    pub cpu_s: f64,
    /// `cpu_s` over the phase's wall time, in percent of one core.
    pub cpu_pct: f64,
    pub rss_peak_mb: f64,
    pub rss_end_mb: f64,
}

/// `utime + stime` of `pid` in clock ticks (fields 14 and 15 of `/proc/PID/stat`).
fn cpu_ticks(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain spaces.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    // `rest` starts at field 3 (state): utime is field 14, stime 15.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// CPU seconds (`utime + stime`) `pid` has used since it started.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    static TCK: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    Some(cpu_ticks(pid)? as f64 / *TCK.get_or_init(clk_tck))
}

/// VmRSS of `pid` in KiB.
pub fn rss_kb(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 on every Linux this runs on).
pub fn clk_tck() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// Samples CPU (start/end) and RSS (every 200 ms, for the peak) of a set of processes.
pub struct Sampler {
    procs: Vec<(String, u32, u64)>,
    started: Instant,
    peaks: std::sync::Arc<parking_lot::Mutex<BTreeMap<u32, u64>>>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Sampler {
    pub fn start(procs: &[(String, u32)]) -> Sampler {
        let procs: Vec<(String, u32, u64)> = procs
            .iter()
            .map(|(n, p)| (n.clone(), *p, cpu_ticks(*p).unwrap_or(0)))
            .collect();
        let pids: Vec<u32> = procs.iter().map(|p| p.1).collect();
        let peaks = std::sync::Arc::new(parking_lot::Mutex::new(BTreeMap::new()));
        let (stop, mut stopped) = tokio::sync::watch::channel(false);
        let p2 = peaks.clone();
        let task = tokio::spawn(async move {
            loop {
                for pid in &pids {
                    if let Some(r) = rss_kb(*pid) {
                        let mut g = p2.lock();
                        let e = g.entry(*pid).or_insert(0);
                        *e = (*e).max(r);
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    _ = stopped.changed() => break,
                }
            }
        });
        Sampler {
            procs,
            started: Instant::now(),
            peaks,
            stop,
            task,
        }
    }

    pub async fn finish(self) -> Vec<ProcUsage> {
        let wall = self.started.elapsed().as_secs_f64().max(1e-6);
        let _ = self.stop.send(true);
        let _ = self.task.await;
        let tck = clk_tck();
        let peaks = self.peaks.lock().clone();
        self.procs
            .into_iter()
            .map(|(name, pid, t0)| {
                let cpu_s = cpu_ticks(pid).unwrap_or(t0).saturating_sub(t0) as f64 / tck;
                let end = rss_kb(pid).unwrap_or(0);
                ProcUsage {
                    name,
                    pid,
                    cpu_s,
                    cpu_pct: cpu_s / wall * 100.0,
                    rss_peak_mb: peaks.get(&pid).copied().unwrap_or(end).max(end) as f64 / 1024.0,
                    rss_end_mb: end as f64 / 1024.0,
                }
            })
            .collect()
    }
}

/// What the apiserver's `/metrics` says about one resource, and its total request count.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ApiCounts {
    /// `apiserver_request_total` for the resource, summed by verb (LIST, WATCH, GET, PATCH, ...).
    /// WATCH requests are counted when they end.
    pub requests: BTreeMap<String, u64>,
    /// `apiserver_longrunning_requests{verb="WATCH"}` for the resource: watches open now.
    pub open_watches: u64,
    /// `apiserver_request_total` over every resource and verb.
    pub all_requests: u64,
    /// `apiserver_request_total` for (self)subjectaccessreviews: the proxy's authorization of
    /// cache-served reads.
    pub access_reviews: u64,
}

impl ApiCounts {
    pub fn parse(text: &str, resource: &str) -> ApiCounts {
        let mut c = ApiCounts::default();
        let res = format!("resource=\"{resource}\"");
        for l in text.lines() {
            let value = || {
                l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .unwrap_or(0.0) as u64
            };
            if l.starts_with("apiserver_request_total{") {
                let v = value();
                c.all_requests += v;
                if l.contains("resource=\"selfsubjectaccessreviews\"")
                    || l.contains("resource=\"subjectaccessreviews\"")
                {
                    c.access_reviews += v;
                }
                if l.contains(&res)
                    && l.contains("subresource=\"\"")
                    && let Some(verb) = label(l, "verb")
                {
                    *c.requests.entry(verb.to_string()).or_default() += v;
                }
            } else if l.starts_with("apiserver_longrunning_requests{")
                && l.contains("verb=\"WATCH\"")
                && l.contains(&res)
            {
                c.open_watches += value();
            }
        }
        c
    }

    /// Request counts of `self` minus `before`, by verb (only verbs that moved).
    pub fn delta(&self, before: &ApiCounts) -> BTreeMap<String, u64> {
        self.requests
            .iter()
            .map(|(k, v)| {
                (
                    k.clone(),
                    v.saturating_sub(before.requests.get(k).copied().unwrap_or(0)),
                )
            })
            .filter(|(_, v)| *v > 0)
            .collect()
    }
}

fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let key = format!("{name}=\"");
    let i = line.find(&key)? + key.len();
    let j = line[i..].find('"')?;
    Some(&line[i..i + j])
}

/// Loopback TCP throughput in GB/s: one connection, 1 MiB writes, `total` bytes.
pub async fn loopback_gbps(total: u64) -> anyhow::Result<f64> {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    let server = tokio::spawn(async move {
        let (mut s, _) = l.accept().await?;
        let mut buf = vec![0u8; 1 << 20];
        let mut got = 0u64;
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got += n as u64,
            }
        }
        anyhow::Ok((got, Instant::now()))
    });
    let mut c = tokio::net::TcpStream::connect(addr).await?;
    let buf = vec![7u8; 1 << 20];
    let t0 = Instant::now();
    let mut sent = 0u64;
    while sent < total {
        c.write_all(&buf).await?;
        sent += buf.len() as u64;
    }
    c.shutdown().await?;
    let (got, end) = server.await??;
    Ok(got as f64 / end.duration_since(t0).as_secs_f64() / 1e9)
}

/// Sum of the samples of `metric` (lines starting with `metric{` or `metric `) whose labels
/// contain every one of `with`.
pub fn sum(text: &str, metric: &str, with: &[&str]) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")) || l.starts_with(&format!("{metric} ")))
        .filter(|l| with.iter().all(|w| l.contains(w)))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A target's `/metrics` text.
pub async fn metrics(t: &Target) -> anyhow::Result<String> {
    let c = t.connect().await?;
    let b = fetch(&c, t.request(Method::GET, "/metrics", None)).await?;
    Ok(String::from_utf8_lossy(&b).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_samples_by_labels() {
        let text = "a_total{verb=\"LIST\",x=\"1\"} 3\na_total{verb=\"GET\"} 5\na_total{verb=\"LIST\"} 2\nab_total{verb=\"LIST\"} 7\n";
        assert_eq!(sum(text, "a_total", &["verb=\"LIST\""]), 5.0);
        assert_eq!(sum(text, "a_total", &[]), 10.0);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let s = summarize((1..=100).map(|i| i * 1000).collect());
        assert_eq!(s.count, 100);
        assert_eq!(s.p50_ms, 50.0);
        assert_eq!(s.p99_ms, 99.0);
        assert_eq!(s.max_ms, 100.0);
        assert_eq!(summarize(vec![]).count, 0);
    }

    #[test]
    fn api_counts_sum_verbs_of_one_resource_and_open_watches() {
        let text = r#"# HELP apiserver_request_total x
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="configmaps",scope="namespace",subresource="",verb="LIST",version="v1"} 7
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="configmaps",scope="cluster",subresource="",verb="LIST",version="v1"} 1
apiserver_request_total{code="200",component="apiserver",dry_run="",group="",resource="pods",scope="cluster",subresource="",verb="LIST",version="v1"} 2
apiserver_request_total{code="0",component="apiserver",dry_run="",group="",resource="configmaps",scope="namespace",subresource="",verb="WATCH",version="v1"} 3
apiserver_request_total{code="201",component="apiserver",dry_run="",group="authorization.k8s.io",resource="selfsubjectaccessreviews",scope="cluster",subresource="",verb="POST",version="v1"} 5
apiserver_longrunning_requests{component="apiserver",group="",resource="configmaps",scope="namespace",subresource="",verb="WATCH",version="v1"} 4
apiserver_longrunning_requests{component="apiserver",group="",resource="pods",scope="namespace",subresource="",verb="WATCH",version="v1"} 9
"#;
        let c = ApiCounts::parse(text, "configmaps");
        assert_eq!(c.requests["LIST"], 8);
        assert_eq!(c.requests["WATCH"], 3);
        assert_eq!(c.open_watches, 4);
        assert_eq!(c.all_requests, 18);
        assert_eq!(c.access_reviews, 5);
        let mut before = c.clone();
        before.requests.insert("LIST".into(), 5);
        assert_eq!(c.delta(&before), BTreeMap::from([("LIST".to_string(), 3)]));
    }

    #[test]
    fn cpu_and_rss_of_this_process_are_readable() {
        let me = std::process::id();
        assert!(cpu_ticks(me).is_some());
        assert!(rss_kb(me).unwrap() > 0);
    }
}
