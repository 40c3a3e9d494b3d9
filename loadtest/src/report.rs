//! The run's JSON, markdown report, SVG plot, correctness checks and README headline.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::fields::FieldsResult;
use crate::proxy::ServedBy;
use crate::scenarios::{Encoding, FanoutResult, GetKind, ListResult, StartMode};
use crate::stats::Summary;
use crate::sweep::{Capacity, FanoutPhase, P99_TARGET_MS, cpu_ratio, watches_from_cache};
use crate::{Check, GetRow, Machine, Row, Run, Usage};

pub fn utc_now() -> String {
    cmd("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_else(|| "unknown".into())
}

fn cmd(prog: &str, args: &[&str]) -> Option<String> {
    let o = std::process::Command::new(prog).args(args).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().to_string())
}

/// `git describe`-like: short commit, `+dirty` when the tree has changes.
pub fn commit(dir: &Path) -> String {
    let d = dir.display().to_string();
    let head = cmd("git", &["-C", &d, "rev-parse", "--short", "HEAD"]).unwrap_or_default();
    let dirty = cmd(
        "git",
        &["-C", &d, "status", "--porcelain", "--untracked-files=no"],
    )
    .is_some_and(|s| !s.is_empty());
    format!("{head}{}", if dirty { "+dirty" } else { "" })
}

pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let field = |text: &str, key: &str| {
        text.lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_default()
    };
    let mem_kb: f64 = field(&meminfo, "MemTotal")
        .split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    Machine {
        cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model: field(&cpuinfo, "model name"),
        mem_gb: (mem_kb / 1024.0 / 1024.0 * 10.0).round() / 10.0,
        kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string(),
        loadavg_at_start: loadavg(),
    }
}

/// The 1, 5 and 15 minute load averages (`/proc/loadavg`).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split_whitespace()
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

fn check(name: impl Into<String>, pass: bool, detail: String) -> Check {
    Check {
        name: name.into(),
        pass,
        detail,
    }
}

fn fanout_checks(scenario: &str, side: &str, r: &FanoutResult, out: &mut Vec<Check>) {
    let scenario = format!("{scenario} {side}");
    let scenario = scenario.trim_end();
    out.push(check(
        format!("{scenario}: no missed or duplicated events"),
        r.missed == 0 && r.duplicated == 0 && r.watch_errors == 0,
        format!(
            "missed {}, duplicated {}, watch errors {}, rewatches {}",
            r.missed, r.duplicated, r.watch_errors, r.rewatches
        ),
    ));
    out.push(check(
        format!("{scenario}: every write reached every watcher"),
        r.write_errors == 0 && r.deliveries == (r.writes * r.watchers) as u64,
        format!(
            "{} writes ({} failed) x {} watchers, {} deliveries",
            r.writes, r.write_errors, r.watchers, r.deliveries
        ),
    ));
}

/// Correctness checks; any failure makes the driver exit 1.
pub fn checks(run: &Run) -> Vec<Check> {
    let mut out = Vec::new();
    // Every write reaches every watcher at each side's first (lowest) rate; above it the sweep
    // looks for the rate where a side falls behind, and a miss there ends the sweep (it
    // limits the capacity) rather than failing the run. Nothing is ever delivered twice.
    for (i, r) in run.a.iter().enumerate() {
        let what = format!("a {} at {}/s", r.side, r.rate);
        if run.a[..i].iter().all(|q| q.side != r.side) {
            fanout_checks(&what, "", &r.result, &mut out);
        } else {
            out.push(check(
                format!("{what}: no duplicated events"),
                r.result.duplicated == 0,
                format!("duplicated {}", r.result.duplicated),
            ));
        }
        if r.side == "proxy" && r.watches != ServedBy::default() {
            out.push(watches_from_cache(&what, &r.watches));
        }
    }
    let clients = run.profile.b_clients as u64;
    for r in &run.b {
        let s = &r.result;
        out.push(check(
            format!(
                "b {} {:?}: every informer synced with every object",
                r.side, r.mode
            ),
            s.errors == 0 && s.wrong_counts == 0 && s.synced == s.clients,
            format!(
                "{} of {} synced, {} errors, {} wrong counts",
                s.synced, s.clients, s.errors, s.wrong_counts
            ),
        ));
        let (lists, watches) = match (r.side, r.mode) {
            // Counted from before the proxy started: its cache's LIST and WATCH, one of each
            // (a built-in resource's protobuf is written from its JSON objects,
            // `cache.protobufTranscode`: no protobuf side's WATCH).
            ("proxy", StartMode::Legacy) => (1, 1),
            ("proxy", StartMode::WatchList) => (0, 0),
            (_, StartMode::Legacy) => (clients, clients as i64),
            (_, StartMode::WatchList) => (0, clients as i64),
        };
        out.push(check(
            format!("b {} {:?}: upstream LISTs and WATCHes", r.side, r.mode),
            r.upstream_lists == lists && r.upstream_watches_opened == watches,
            format!(
                "LIST {} (expected {lists}), WATCH opened {} (expected {watches})",
                r.upstream_lists, r.upstream_watches_opened
            ),
        ));
    }
    for r in &run.c {
        let l = &r.result;
        out.push(check(
            format!("c {}: every walk returned every object", r.side),
            l.errors == 0 && l.wrong_counts == 0 && l.walks > 0,
            format!(
                "{} walks, {} errors, {} wrong counts",
                l.walks, l.errors, l.wrong_counts
            ),
        ));
        out.push(check(
            format!("c {}: full pages of `limit` items", r.side),
            l.short_pages == 0,
            format!("{} short pages before a walk's last", l.short_pages),
        ));
    }
    if run.c.len() > 1 {
        let per_walk: Vec<String> = run
            .c
            .iter()
            .map(|r| format!("{} {:.1}", r.side, pages_per_walk(&r.result)))
            .collect();
        out.push(check(
            "c: the same pages per walk on both sides (equal `limit` semantics)",
            run.c
                .windows(2)
                .all(|w| pages_per_walk(&w[0].result) == pages_per_walk(&w[1].result)),
            format!("pages per walk: {}", per_walk.join(", ")),
        ));
    }
    for r in &run.d {
        let what = format!("d {} {}", r.side, r.label());
        out.push(check(
            format!("{what}: no errors"),
            r.result.errors == 0,
            format!("{} of {} failed", r.result.errors, r.result.requests),
        ));
        // On the driver's own proxy (its metrics readable): what must have served them.
        if r.side != "proxy" || r.served == ServedBy::default() {
            continue;
        }
        let expected = match r.result.kind {
            GetKind::Passthrough => Some(("upstream", r.served.cache == 0)),
            GetKind::Rv0 => Some(("the cache", r.served.upstream == 0)),
            GetKind::Quorum => None,
        };
        if let Some((by, pass)) = expected {
            out.push(check(
                format!("{what}: every GET served by {by}"),
                pass,
                format!(
                    "{} from the cache, {} passed through",
                    r.served.cache, r.served.upstream
                ),
            ));
        }
    }
    for r in &run.f {
        fields_checks(r, &mut out);
    }
    for r in &run.e {
        fanout_checks("e", r.side, &r.result.watch, &mut out);
        let m = &r.result;
        out.push(check(
            format!("e {}: lists and GETs without errors", r.side),
            m.lists.errors == 0 && m.lists.wrong_counts == 0 && m.gets.errors == 0,
            format!(
                "list errors {}, wrong counts {}, GET errors {}",
                m.lists.errors, m.lists.wrong_counts, m.gets.errors
            ),
        ));
    }
    out
}

/// Pages per walk (the same on both sides when `limit` means the same).
fn pages_per_walk(l: &ListResult) -> f64 {
    l.pages as f64 / l.walks.max(1) as f64
}

pub struct Paths {
    pub json: PathBuf,
    pub md: PathBuf,
    pub svg: PathBuf,
}

pub(crate) fn lat(s: &Summary) -> String {
    format!("{:.1} / {:.1} / {:.1}", s.p50_ms, s.p99_ms, s.max_ms)
}

pub(crate) fn proc<'a>(u: &'a Usage, name: &str) -> Option<&'a crate::stats::ProcUsage> {
    u.proc(name)
}

/// Scenario b's time-to-sync p99 of `mode`, per side.
fn sync_p99_by_side(run: &Run, mode: StartMode) -> Vec<(&'static str, f64)> {
    run.b
        .iter()
        .filter(|r| r.mode == mode)
        .map(|r| (r.side, r.result.time_to_sync.p99_ms))
        .collect()
}

/// A fan-out report row's last cells: the proxy's watches by what served them, then CPU and
/// RSS of the proxy, kube-apiserver and the driver, with the first two's µs per delivery.
pub(crate) fn served_and_cost_cells(p: &FanoutPhase) -> String {
    let us = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
    let watches = if p.side == "proxy" {
        format!("{} / {}", p.watches.cache, p.watches.upstream)
    } else {
        "-".into()
    };
    format!(
        "{watches} | {} | {} | {} | {} | {}",
        cpu_rss(&p.usage, "proxy"),
        us(p.cpu_us_per_delivery("proxy")),
        cpu_rss(&p.usage, "kube-apiserver"),
        us(p.cpu_us_per_delivery("kube-apiserver")),
        cpu_rss(&p.usage, "driver"),
    )
}

pub(crate) fn cpu_rss(u: &Usage, name: &str) -> String {
    proc(u, name).map_or("-".into(), |p| {
        format!(
            "{:.1} s ({:.0}%), {:.0} MB",
            p.cpu_s, p.cpu_pct, p.rss_peak_mb
        )
    })
}

fn verbs(u: &Usage) -> String {
    if u.configmaps_requests.is_empty() {
        return "-".into();
    }
    u.configmaps_requests
        .iter()
        .map(|(k, v)| format!("{k} {v}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn usage_row(md: &mut String, scenario: &str, side: &str, u: &Usage) {
    let _ = writeln!(
        md,
        "| {scenario} | {side} | {:.1} | {} | {} | {} | {} | {} | {} | {} |",
        u.wall_s,
        cpu_rss(u, "proxy"),
        cpu_rss(u, "kube-apiserver"),
        cpu_rss(u, "etcd"),
        cpu_rss(u, "driver"),
        verbs(u),
        u.access_reviews,
        u.all_requests
    );
}

/// A fan-out's base latency and its own duration, per write: the median over the writes of
/// each one's first delivery, and of its last.
pub fn first_last(r: &crate::scenarios::FanoutResult) -> String {
    if r.first_delivery.count == 0 {
        return "-".into();
    }
    format!(
        "{:.1} / {:.1}",
        r.first_delivery.p50_ms, r.last_delivery.p50_ms
    )
}

fn fanout_sweep_table(md: &mut String, phases: &[FanoutPhase]) {
    md.push_str(
        "| side | rate/s (achieved) | watchers (connections) | deliveries | deliveries/s | latency p50 / p99 / max (ms) | a write's first / last delivery, median (ms) | missed | duplicated | rewatches | within target | watches cache / passed through | proxy CPU, RSS | proxy µs/delivery | kube-apiserver CPU, RSS | apiserver µs/delivery | driver CPU |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for p in phases {
        let r = &p.result;
        let _ = writeln!(
            md,
            "| {} | {} ({:.1}) | {} ({}) | {} | {:.0} | {} | {} | {} | {} | {} | {} | {} |",
            p.side,
            p.rate,
            r.write_rate,
            r.watchers,
            r.connections,
            r.deliveries,
            r.deliveries_per_s,
            lat(&r.latency),
            first_last(r),
            r.missed,
            r.duplicated,
            r.rewatches,
            if p.passes() { "yes" } else { "**no**" },
            served_and_cost_cells(p),
        );
    }
}

fn fields_checks(r: &Row<FieldsResult>, out: &mut Vec<Check>) {
    let x = &r.result;
    let scope = format!("f {} (filters: {})", r.side, x.filters);
    out.push(check(
        format!("{scope}: writes made"),
        x.writes > 0 && x.spec_writes > 0 && x.write_errors == 0,
        format!(
            "{} writes ({} spec), {} failed",
            x.writes, x.spec_writes, x.write_errors
        ),
    ));
    let u = &x.unfiltered;
    out.push(check(
        format!("{scope}: unfiltered watchers got every write exactly once"),
        u.missed == 0 && u.duplicated == 0 && u.watch_errors == 0,
        format!(
            "{} watchers: {} missed, {} duplicated, {} errors",
            u.watchers, u.missed, u.duplicated, u.watch_errors
        ),
    ));
    if x.filters == "half" {
        let f = &x.filtered;
        out.push(check(
            format!(
                "{scope}: filtered watchers got every spec write once and no status-only write"
            ),
            f.watchers > 0
                && f.missed == 0
                && f.duplicated == 0
                && f.unexpected == 0
                && f.watch_errors == 0,
            format!(
                "{} watchers: {} missed, {} duplicated, {} status-only delivered, {} errors",
                f.watchers, f.missed, f.duplicated, f.unexpected, f.watch_errors
            ),
        ));
        out.push(check(
            format!("{scope}: every filtered watch was filtered and its resourceVersion reached the last write"),
            f.applied == f.watchers && f.behind == 0 && u.behind == 0,
            format!(
                "{} of {} said applied; {} filtered and {} unfiltered watchers behind the last write",
                f.applied, f.watchers, f.behind, u.behind
            ),
        ));
    }
}

/// The markdown report.
pub fn markdown(run: &Run, svg_name: &str) -> String {
    let p = &run.profile;
    let m = &run.machine;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "# Load test: kube-cache-proxy vs kube-apiserver ({} profile)\n",
        p.name
    );
    let _ = writeln!(
        md,
        "- date: {}; commit: {}; run time {:.0} s\n- machine: {} CPUs ({}), {} GB RAM, Linux {}; load average at start {} (the machine is shared: other work moves wall-clock figures between runs; compare rows of one run)\n- loopback TCP throughput (one connection, 1 MiB writes): **{:.2} GB/s**\n- everything runs on these cores at once: etcd, kube-apiserver, the proxy and this driver (its CPU is in the tables too)\n- writes always go straight to the apiserver; reads and watches go to the side named in each row. The proxy is restarted for each scenario (a child process; its CPU and RSS are its own)",
        run.date,
        run.commit,
        run.wall_s,
        m.cpus,
        m.cpu_model,
        m.mem_gb,
        m.kernel,
        m.loadavg_at_start,
        run.loopback_gbps
    );
    let _ = writeln!(md, "\n![p99 latency, proxy vs apiserver]({svg_name})\n");
    let _ = writeln!(md, "## Real path\n\n{}", real_path(run));

    md.push_str("## Checks\n\n| check | result | detail |\n|---|---|---|\n");
    for c in &run.checks {
        let _ = writeln!(
            md,
            "| {} | {} | {} |",
            c.name,
            if c.pass { "pass" } else { "**FAIL**" },
            c.detail
        );
    }

    if !run.a.is_empty() {
        let _ = writeln!(
            md,
            "\n## a. Watch fan-out\n\n{} watchers on the ConfigMaps of one namespace ({} B each in JSON as seeded), {} HTTP/2 streams per connection, JSON, while merge patches over {} objects go straight to the apiserver for {} s at each rate of {:?}/s: one phase per rate and side, in increasing order, a side's sweep ending at its first rate that misses the target (p99 ≤ {P99_TARGET_MS} ms with nothing missed or duplicated). The proxy's phases run on one proxy process. Latency is from the timestamp the writer puts in the object (just before its PATCH) to the watcher reading the event, so both sides include the apiserver's write path. Missed and duplicated events are counted per watcher against the resourceVersions the writer got back. CPU per delivery: each process's CPU over the phase (opening the watches included) over the deliveries; the apiserver also serves the writes in both sides' phases.\n",
            p.a.watchers,
            run.a_object_bytes.map_or("?".into(), |b| b.to_string()),
            p.a.streams_per_conn,
            p.a.objects,
            p.a.duration_s,
            p.a_rates
        );
        fanout_sweep_table(&mut md, &run.a);
        let _ = writeln!(
            md,
            "\nCapacity, the highest rate within target (at one rate, deliveries/s are that rate × the watchers on both sides, not a capacity):\n\n- apiserver: {}\n- proxy: {}",
            Capacity::of(&run.a, "apiserver", Encoding::Json),
            Capacity::of(&run.a, "proxy", Encoding::Json),
        );
    }

    if !run.b.is_empty() {
        let _ = writeln!(
            md,
            "\n## b. Informer start storm\n\n{} clients, each on its own TLS connection, start at once on a namespace of {} ConfigMaps. Legacy: LIST `resourceVersion=0&limit=500`, then WATCH from its resourceVersion (synced when the watch is open). WatchList: one WATCH `sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true`, synced at the `k8s.io/initial-events-end` bookmark. Upstream counts are the apiserver's own (`apiserver_request_total` LIST delta; WATCHes open with every client synced, `apiserver_longrunning_requests`, minus before). Through the proxy they are counted from before the proxy started, so its own initial LIST+WATCH is included in the legacy row. Each side first gets one warm-up informer of each mode (not in the times; through the proxy its upstream requests are in the legacy row's counts).\n",
            p.b_clients, p.b_objects
        );
        md.push_str("| side | mode | synced | time to sync p50 / p99 / max (ms) | all synced after (s) | upstream LISTs | upstream WATCHes opened |\n|---|---|---|---|---|---|---|\n");
        for r in &run.b {
            let _ = writeln!(
                md,
                "| {} | {:?} | {} / {} | {} | {:.2} | {} | {} |",
                r.side,
                r.mode,
                r.result.synced,
                r.result.clients,
                lat(&r.result.time_to_sync),
                r.result.wall_s,
                r.upstream_lists,
                r.upstream_watches_opened
            );
        }
    }

    if !run.c.is_empty() {
        let _ = writeln!(
            md,
            "\n## c. Paginated list storm\n\n{} clients in parallel (one connection each) walk {} ConfigMaps (256-byte payloads) with `limit={}` and continue tokens ({} walk(s) each). Seeding created them at {:.0}/s straight to the apiserver.\n",
            p.c_clients,
            p.c_objects,
            p.c_limit,
            p.c_walks,
            run.c_create_rate.unwrap_or(0.0)
        );
        if let Some(r) = run.c.iter().find(|r| r.side == "proxy") {
            let upstream = r
                .usage
                .configmaps_requests
                .get("LIST")
                .copied()
                .unwrap_or(0);
            let how = if upstream as usize >= r.result.pages {
                "passed these lists through to the apiserver (one upstream LIST per page)"
            } else if upstream == 0 {
                "served every page from its cache"
            } else {
                "served part of the pages from its cache"
            };
            let _ = writeln!(
                md,
                "Through the proxy the apiserver received {upstream} LIST requests for {} pages: at this commit the proxy {how}.\n",
                r.result.pages
            );
        }
        md.push_str("A short page is one before a walk's last with fewer than `limit` items: the apiserver returns min(limit, remaining), so both sides must show none and the same pages per walk (checked).\n\n| side | walks | pages | pages per walk | short pages | page latency p50 / p99 / max (ms) | walk time p50 / max (s) | objects/s | MB/s | upstream LISTs |\n|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &run.c {
            let l = &r.result;
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {} | {} | {:.2} / {:.2} | {:.0} | {:.1} | {} |",
                r.side,
                l.walks,
                l.pages,
                pages_per_walk(l),
                l.short_pages,
                lat(&l.page_latency),
                l.walk_time.p50_ms / 1000.0,
                l.walk_time.max_ms / 1000.0,
                l.items_per_s,
                l.mb_per_s,
                r.usage
                    .configmaps_requests
                    .get("LIST")
                    .copied()
                    .unwrap_or(0)
            );
        }
    }

    if !run.d.is_empty() {
        let _ = writeln!(
            md,
            "\n## d. GETs at a fixed rate\n\n{:.0} GETs/s for {:.0} s, open loop, over one HTTP/2 connection, of {} ConfigMaps. `quorum` (no resourceVersion) asks for the most recent state: the apiserver reads it at etcd's current revision; the proxy answers under its consistency mode, named in the row: `bounded` (its default) serves it from its cache while its upstream watch is up and after its own writes are reflected, so it is not a consistent read; `strict` (a second proxy with `lists.consistency: strict`) confirms the apiserver's current revision first (one probe shared by the reads waiting for it) and then serves from the cache. `rv0` (`resourceVersion=0`) may be served from a cache: the proxy's, or the apiserver's watch cache.\n",
            p.d_rate, p.d_secs, p.d_objects
        );
        md.push_str("`passthrough`: GETs of Leases (coordination.k8s.io), which the proxy's default configuration does not cache, so every one passes through to the apiserver: the proxy's own cost on the path. `served by`: the proxy's own count of the row's GETs by what served them (`kube_cache_proxy_requests_total{served_by}` on its admin listener); `probes`: its upstream current-revision probes (`kube_cache_proxy_consistency_probes_total`, strict only); `upstream configmaps GETs`: the apiserver's count.\n\n| side | kind | achieved/s | latency p50 / p99 / max (ms) | errors | served by (proxy: cache / passed through) | probes | upstream configmaps GETs |\n|---|---|---|---|---|---|---|---|\n");
        for r in &run.d {
            let g = &r.result;
            let _ = writeln!(
                md,
                "| {} | {} | {:.0} | {} | {} | {} | {} | {} |",
                r.side,
                r.label(),
                g.achieved_rate,
                lat(&g.latency),
                g.errors,
                served_by(r),
                if r.side == "proxy" {
                    r.probes.to_string()
                } else {
                    "-".into()
                },
                r.usage.configmaps_requests.get("GET").copied().unwrap_or(0)
            );
        }
        if let Some(d) = passthrough_delta(run) {
            let _ = writeln!(
                md,
                "\nPassthrough, proxy minus apiserver: p50 {:+.2} ms (target ≤ +0.2), p99 {:+.2} ms (target ≤ +2).",
                d.0, d.1
            );
        }
        if let Some(line) = passthrough_split(run) {
            let _ = writeln!(md, "\n{line}");
        }
    }

    if !run.e.is_empty() {
        let _ = writeln!(
            md,
            "\n## e. Mixed\n\nFor {:.0} s at once: {} watchers under {:.0} writes/s (as in a), {} clients walking the {} ConfigMaps of scenario b with `limit={}` in a loop, and {:.0} quorum GETs/s.\n",
            p.e_secs,
            p.e_watchers,
            p.e_churn_rate,
            p.e_list_clients,
            p.b_objects,
            p.e_list_limit,
            p.e_get_rate
        );
        md.push_str("| side | watch deliveries/s | watch latency p50 / p99 / max (ms) | missed / duplicated | list walks | list page p50 / p99 (ms) | GET p50 / p99 (ms) |\n|---|---|---|---|---|---|---|\n");
        for r in &run.e {
            let x = &r.result;
            let _ = writeln!(
                md,
                "| {} | {:.0} | {} | {} / {} | {} | {:.1} / {:.1} | {:.1} / {:.1} |",
                r.side,
                x.watch.deliveries_per_s,
                lat(&x.watch.latency),
                x.watch.missed,
                x.watch.duplicated,
                x.lists.walks,
                x.lists.page_latency.p50_ms,
                x.lists.page_latency.p99_ms,
                x.gets.latency.p50_ms,
                x.gets.latency.p99_ms
            );
        }
    }

    if !run.f.is_empty() {
        let o = &p.f;
        let _ = writeln!(
            md,
            "\n## f. Watch-field filtering (the proxy's opt-in extension)\n\n{} watchers on the Deployments of one namespace ({} objects), {} HTTP/2 streams per connection, while {:.0} writes/s go straight to the apiserver for {:.0} s: every {}th write (the first included) changes `spec` (a pod-template annotation), the others only `status` (`deployments/status`, a new `observedGeneration`). Phases: the apiserver (nothing can filter there), the proxy with no watcher filtering, the proxy with every second watcher sending `X-Kube-Cache-Proxy-Watch-Fields: spec`. Bytes are the watch lines the watchers read (bookmarks included). Proxy CPU per write is the proxy's CPU seconds over the phase divided by the writes (it includes opening the watches). Latency is of spec writes, which both groups receive.\n",
            o.watchers, o.objects, o.streams_per_conn, o.rate, o.duration_s, o.spec_every
        );
        md.push_str("| side | filters | writes (spec) | group | watchers | deliveries | bookmarks | MB read | spec latency p50 / p99 / max (ms) | missed | status-only delivered | behind |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for r in &run.f {
            let x = &r.result;
            for (name, g) in [
                ("unfiltered", &x.unfiltered),
                ("filtered: spec", &x.filtered),
            ] {
                if g.watchers == 0 {
                    continue;
                }
                let _ = writeln!(
                    md,
                    "| {} | {} | {} ({}) | {name} | {} | {} | {} | {:.1} | {} | {} | {} | {} |",
                    r.side,
                    x.filters,
                    x.writes,
                    x.spec_writes,
                    g.watchers,
                    g.deliveries,
                    g.bookmarks,
                    g.bytes as f64 / 1e6,
                    lat(&g.spec_latency),
                    g.missed,
                    g.unexpected,
                    g.behind
                );
            }
        }
        md.push_str("\n| side | filters | deliveries (all watchers) | MB read | proxy CPU (s) | proxy CPU per write (ms) | kube-apiserver CPU (s) | driver CPU (s) |\n|---|---|---|---|---|---|---|---|\n");
        for r in &run.f {
            let x = &r.result;
            let cpu = |n: &str| proc(&r.usage, n).map(|p| p.cpu_s);
            let per_write = cpu("proxy")
                .filter(|_| x.writes > 0)
                .map_or("-".to_string(), |c| {
                    format!("{:.1}", c * 1000.0 / x.writes as f64)
                });
            let show = |c: Option<f64>| c.map_or("-".to_string(), |c| format!("{c:.1}"));
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.1} | {} | {per_write} | {} | {} |",
                r.side,
                x.filters,
                x.deliveries(),
                x.bytes() as f64 / 1e6,
                show(cpu("proxy")),
                show(cpu("kube-apiserver")),
                show(cpu("driver"))
            );
        }
    }

    md.push_str("\n## CPU, memory and apiserver requests per phase\n\nCPU seconds during the phase (percent of one core over the phase), peak RSS. Requests: the apiserver's `apiserver_request_total` for configmaps during the phase by verb (WATCH is counted when a watch ends), access reviews (the proxy authorizes each cache-served read with a SelfSubjectAccessReview, remembered per caller, verb, namespace and name), and requests over all resources (also the proxy's start-up lists of its other cached resources).\n\n| scenario | side | wall (s) | proxy | kube-apiserver | etcd | driver | configmaps requests | access reviews | all requests |\n|---|---|---|---|---|---|---|---|---|---|\n");
    fn rows<T>(md: &mut String, s: &str, v: &[Row<T>]) {
        for r in v {
            usage_row(md, s, r.side, &r.usage);
        }
    }
    for r in &run.a {
        usage_row(&mut md, &format!("a {}/s", r.rate), r.side, &r.usage);
    }
    for r in &run.b {
        usage_row(&mut md, &format!("b {:?}", r.mode), r.side, &r.usage);
    }
    rows(&mut md, "c", &run.c);
    for r in &run.d {
        usage_row(&mut md, &format!("d {}", r.label()), r.side, &r.usage);
    }
    rows(&mut md, "e", &run.e);
    for r in &run.f {
        usage_row(
            &mut md,
            &format!("f filters {}", r.result.filters),
            r.side,
            &r.usage,
        );
    }
    md
}

/// What served a proxy row's requests, in a few words.
fn served_label(s: &ServedBy) -> &'static str {
    match (s.cache, s.upstream) {
        (0, 0) => "served by: not read",
        (_, 0) => "from the cache",
        (0, _) => "passed through",
        _ => "cache and passed through",
    }
}

/// A d row's served-by cell: the proxy's own count, `-` on the apiserver.
fn served_by(r: &GetRow) -> String {
    if r.side != "proxy" {
        return "-".into();
    }
    format!("{} / {}", r.served.cache, r.served.upstream)
}

/// The passthrough GETs' (p50, p99) through the proxy minus straight, in ms.
pub fn passthrough_delta(run: &Run) -> Option<(f64, f64)> {
    let at = |side: &str| {
        run.d
            .iter()
            .find(|r| r.side == side && r.result.kind == GetKind::Passthrough)
            .map(|r| &r.result.latency)
    };
    let (a, p) = (at("apiserver")?, at("proxy")?);
    Some((p.p50_ms - a.p50_ms, p.p99_ms - a.p99_ms))
}

/// Where the passed-through GETs' added latency goes, from the means of the driver's two
/// passthrough rows and the proxy's own account of its row ([`crate::ProxySplit`]).
pub fn passthrough_split(run: &Run) -> Option<String> {
    let row = |side: &str| {
        run.d
            .iter()
            .find(|r| r.side == side && r.result.kind == GetKind::Passthrough)
    };
    let (a, p) = (row("apiserver")?, row("proxy")?);
    let s = p.proxy_split?;
    let (direct, via) = (a.result.latency.mean_ms, p.result.latency.mean_ms);
    Some(format!(
        "Where it goes, in means over the rows' GETs (the proxy's from its own metrics, over \
         {} GETs): the driver saw {via:.3} ms through the proxy and {direct:.3} ms direct \
         ({:+.3}). The proxy's own request took {:.3} ms, of which {:.3} ms was its upstream \
         round trip (until the apiserver's response head). So: the client's leg to the proxy \
         and back {:.3} ms; the proxy's own work around the upstream call {:.3} ms; its \
         upstream round trip {:+.3} ms against the GET direct.",
        s.requests,
        via - direct,
        s.request_mean_ms,
        s.upstream_mean_ms,
        via - s.request_mean_ms,
        s.request_mean_ms - s.upstream_mean_ms,
        s.upstream_mean_ms - direct,
    ))
}

/// The issue's real-path table: target, apiserver, proxy and their ratio per benchmark, with
/// the machine's loopback throughput, load average and the commit.
pub fn real_path(run: &Run) -> String {
    let mut s = format!(
        "Commit {}, {} CPUs, loopback TCP {:.2} GB/s, load average {} at start and {} at the end.\n\n\
         | | benchmark | target | kube-apiserver | proxy | ratio (> 1: the proxy better) | met |\n|---|---|---|---|---|---|---|\n",
        run.commit,
        run.machine.cpus,
        run.loopback_gbps,
        run.machine.loadavg_at_start,
        run.loadavg_at_end,
    );
    fn row(s: &mut String, cells: [&str; 7]) {
        let _ = writeln!(s, "| {} |", cells.join(" | "));
    }
    fn ms(v: f64) -> String {
        format!("{v:.1} ms")
    }
    fn ratio(a: f64, p: f64) -> String {
        if p > 0.0 {
            format!("{:.1}×", a / p)
        } else {
            "-".into()
        }
    }
    /// A row comparing the apiserver's p99 and the proxy's, when both were measured.
    fn pair(s: &mut String, id: &str, what: &str, rows: &[(&str, f64)]) {
        let side = |name: &str| rows.iter().find(|r| r.0 == name).map(|r| r.1);
        if let (Some(a), Some(p)) = (side("apiserver"), side("proxy")) {
            row(s, [id, what, "-", &ms(a), &ms(p), &ratio(a, p), "-"]);
        }
    }
    let yes = |b: bool| if b { "yes" } else { "**no**" };
    // P1: the sweep's first rate (both sides ran it), the capacity, CPU per delivery.
    let first = |side: &str| run.a.iter().find(|p| p.side == side);
    if let (Some(a), Some(p)) = (first("apiserver"), first("proxy")) {
        let bytes = run.a_object_bytes.map_or("?".into(), |b| b.to_string());
        let what = format!(
            "watch fan-out, {} watchers ({} per connection), {bytes} B ConfigMaps, {}/s: p99 write → receipt",
            p.result.watchers, run.profile.a.streams_per_conn, p.rate
        );
        let met = if p.result.watchers >= 10_000 {
            yes(p.passes())
        } else {
            "- (fewer watchers)"
        };
        row(
            &mut s,
            [
                "P1",
                &what,
                "≤ 50 ms at 10,000 watchers",
                &ms(a.result.latency.p99_ms),
                &ms(p.result.latency.p99_ms),
                &ratio(a.result.latency.p99_ms, p.result.latency.p99_ms),
                met,
            ],
        );
        let cap = |side: &str| Capacity::of(&run.a, side, Encoding::Json);
        let (ca, cp) = (cap("apiserver"), cap("proxy"));
        // Higher is better here: the proxy's over the apiserver's, a lower bound while the
        // proxy passed its highest rate, unknown while the apiserver passed its own.
        let cap_ratio = match (ca.deliveries_per_s, cp.deliveries_per_s) {
            (Some(_), Some(_)) if ca.at_highest_tried => "-".into(),
            (Some(a), Some(p)) if cp.at_highest_tried => format!("≥ {}", ratio(p, a)),
            (Some(a), Some(p)) => ratio(p, a),
            _ => "-".into(),
        };
        row(
            &mut s,
            [
                "P1",
                &format!(
                    "capacity: the highest write rate of {:?}/s within p99 ≤ {P99_TARGET_MS} ms, nothing missed",
                    run.profile.a_rates
                ),
                "-",
                &ca.to_string(),
                &cp.to_string(),
                &cap_ratio,
                "-",
            ],
        );
        let us = |p: &FanoutPhase, name| {
            p.cpu_us_per_delivery(name)
                .map_or("-".into(), |v| format!("{v:.2} µs"))
        };
        let r = cpu_ratio(&run.a, Encoding::Json, p.rate);
        row(
            &mut s,
            [
                "P1",
                &format!("CPU per delivery at {}/s (each side's own process)", p.rate),
                "proxy ≥ 5× fewer",
                &us(a, "kube-apiserver"),
                &us(p, "proxy"),
                &r.map_or("-".into(), |r| format!("{r:.1}×")),
                r.map_or("-", |r| yes(r >= 5.0)),
            ],
        );
    }
    let c: Vec<_> = run
        .c
        .iter()
        .map(|r| (r.side, r.result.page_latency.p99_ms))
        .collect();
    let per_walk: Vec<String> = run
        .c
        .iter()
        .map(|r| format!("{:.0}", pages_per_walk(&r.result)))
        .collect();
    pair(
        &mut s,
        "P2",
        &format!(
            "list page p99, {} ConfigMaps, `limit={}` (pages per walk: {})",
            run.profile.c_objects,
            run.profile.c_limit,
            per_walk.join(" / ")
        ),
        &c,
    );
    row(
        &mut s,
        [
            "P3",
            "idle watch stream memory: `--only idle-streams`, not this profile",
            "-",
            "-",
            "-",
            "-",
            "-",
        ],
    );
    for mode in [StartMode::Legacy, StartMode::WatchList] {
        let b = sync_p99_by_side(run, mode);
        pair(
            &mut s,
            "P4",
            &format!(
                "informer sync p99, {mode:?}, {} clients at once",
                run.profile.b_clients
            ),
            &b,
        );
    }
    let proxied = run
        .d
        .iter()
        .filter(|r| r.side == "proxy" && r.result.kind != GetKind::Passthrough);
    for r in proxied {
        let rows: Vec<_> = run
            .d
            .iter()
            .filter(|a| a.side == "apiserver" && a.result.kind == r.result.kind)
            .chain([r])
            .map(|r| (r.side, r.result.latency.p99_ms))
            .collect();
        pair(
            &mut s,
            "P5/P6",
            &format!(
                "GET p99, {} at {:.0}/s (proxy: {})",
                r.label(),
                r.result.target_rate,
                served_label(&r.served)
            ),
            &rows,
        );
    }
    if let Some((d50, d99)) = passthrough_delta(run) {
        let at = |side: &str| {
            run.d
                .iter()
                .find(|r| r.side == side && r.result.kind == GetKind::Passthrough)
                .map_or("-".into(), |r| {
                    let l = &r.result.latency;
                    format!("{:.2} / {:.2} ms", l.p50_ms, l.p99_ms)
                })
        };
        row(
            &mut s,
            [
                "P7",
                "passthrough GET p50 / p99 (Leases, not cached); proxy minus apiserver",
                "+≤ 0.2 ms p50, +≤ 2 ms p99",
                &at("apiserver"),
                &format!("{} ({d50:+.2} / {d99:+.2} ms)", at("proxy")),
                "-",
                yes(d50 <= 0.2 && d99 <= 2.0),
            ],
        );
    }
    row(
        &mut s,
        [
            "P8",
            "ingest GB per CPU-second: `--only ingest`, not this profile",
            "-",
            "-",
            "-",
            "-",
            "-",
        ],
    );
    s
}

/// (label, proxy p99, apiserver p99) per scenario, for the plot and the headline.
pub fn p99_pairs(run: &Run) -> Vec<(String, f64, f64)> {
    let mut v = Vec::new();
    let pair = |v: &mut Vec<(String, f64, f64)>, label: String, p: Option<f64>, a: Option<f64>| {
        if let (Some(p), Some(a)) = (p, a) {
            v.push((label, p, a));
        }
    };
    let find = |rows: &[(&str, f64)], side: &str| rows.iter().find(|r| r.0 == side).map(|r| r.1);
    let a: Vec<_> = run
        .a
        .iter()
        .map(|r| (r.side, r.result.latency.p99_ms))
        .collect();
    // Each side's first phase: the sweep's lowest rate, run by both.
    if let Some(first) = run.a.first() {
        pair(
            &mut v,
            format!("a. watch delivery at {}/s", first.rate),
            find(&a, "proxy"),
            find(&a, "apiserver"),
        );
    }
    for mode in [StartMode::Legacy, StartMode::WatchList] {
        let b = sync_p99_by_side(run, mode);
        pair(
            &mut v,
            format!("b. {mode:?} time to sync"),
            find(&b, "proxy"),
            find(&b, "apiserver"),
        );
    }
    let c: Vec<_> = run
        .c
        .iter()
        .map(|r| (r.side, r.result.page_latency.p99_ms))
        .collect();
    // Until lists are served from the cache, say so next to the figure.
    let passed_through = run.c.iter().any(|r| {
        r.side == "proxy"
            && r.usage
                .configmaps_requests
                .get("LIST")
                .copied()
                .unwrap_or(0) as usize
                >= r.result.pages
    });
    let label = if passed_through {
        "c. list page (passthrough)"
    } else {
        "c. list page"
    };
    pair(
        &mut v,
        label.into(),
        find(&c, "proxy"),
        find(&c, "apiserver"),
    );
    // Each proxy row of d beside the apiserver's row of the same kind, named with the
    // consistency mode and what served it.
    for r in run.d.iter().filter(|r| r.side == "proxy") {
        let direct = run
            .d
            .iter()
            .find(|a| a.side == "apiserver" && a.result.kind == r.result.kind);
        pair(
            &mut v,
            format!("d. GET {} ({})", r.label(), served_label(&r.served)),
            Some(r.result.latency.p99_ms),
            direct.map(|a| a.result.latency.p99_ms),
        );
    }
    let e: Vec<_> = run
        .e
        .iter()
        .map(|r| (r.side, r.result.watch.latency.p99_ms))
        .collect();
    pair(
        &mut v,
        "e. watch delivery (mixed)".into(),
        find(&e, "proxy"),
        find(&e, "apiserver"),
    );
    v
}

/// A horizontal bar chart of p99 latencies: per scenario a proxy bar and an apiserver bar,
/// each pair scaled to its larger value (the numbers are printed on the bars).
pub fn svg(run: &Run) -> String {
    let pairs = p99_pairs(run);
    let (w, label_w, row_h, top) = (760.0, 230.0, 46.0, 66.0);
    let h = top + row_h * pairs.len() as f64 + 20.0;
    let bar_w = w - label_w - 90.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"##
    );
    let _ = writeln!(
        s,
        r##"<rect width="100%" height="100%" fill="white"/><text x="10" y="20" font-size="14" font-weight="bold">p99 latency (ms): proxy vs kube-apiserver, {} profile, {}</text><text x="10" y="38" font-size="11">Lower is better. The two bars of a row are scaled to the larger of the two; the value is printed after each bar.</text>"##,
        run.profile.name, run.date
    );
    let _ = writeln!(
        s,
        r##"<rect x="{label_w}" y="46" width="12" height="10" fill="#2b7bba"/><text x="{}" y="55">proxy</text><rect x="{}" y="46" width="12" height="10" fill="#d9822b"/><text x="{}" y="55">kube-apiserver</text>"##,
        label_w + 16.0,
        label_w + 80.0,
        label_w + 96.0
    );
    for (i, (label, p, a)) in pairs.iter().enumerate() {
        let y = top + row_h * i as f64;
        let max = p.max(*a).max(1e-9);
        let _ = writeln!(
            s,
            r##"<text x="{}" y="{}" text-anchor="end">{label}</text>"##,
            label_w - 8.0,
            y + 22.0
        );
        for (j, (v, color)) in [(p, "#2b7bba"), (a, "#d9822b")].iter().enumerate() {
            let by = y + 4.0 + j as f64 * 18.0;
            let bw = (bar_w * *v / max).max(1.0);
            let _ = writeln!(
                s,
                r##"<rect x="{label_w}" y="{by}" width="{bw:.1}" height="15" fill="{color}"/><text x="{:.1}" y="{:.1}">{v:.1}</text>"##,
                label_w + bw + 4.0,
                by + 12.0
            );
        }
    }
    s.push_str("</svg>\n");
    s
}

/// Writes `<profile>-<time>.{json,md,svg}` into `out`.
pub fn write(run: &Run, out: &Path) -> anyhow::Result<Paths> {
    let stamp = run.date.replace([':', '-'], "");
    let base = format!("{}-{stamp}", run.profile.name);
    let paths = Paths {
        json: out.join(format!("{base}.json")),
        md: out.join(format!("{base}.md")),
        svg: out.join(format!("{base}.svg")),
    };
    std::fs::write(&paths.json, serde_json::to_string_pretty(run)?)?;
    std::fs::write(&paths.svg, svg(run))?;
    std::fs::write(&paths.md, markdown(run, &format!("{base}.svg")))?;
    Ok(paths)
}

const BEGIN: &str = "<!-- headline:begin (written by the driver) -->";
const END: &str = "<!-- headline:end -->";

/// The headline block of loadtest/README.md.
pub fn headline(run: &Run, md_name: &str) -> String {
    let mut s = format!(
        "Latest `{}` run: {} on {} CPUs ({}), commit {}, loopback TCP {:.2} GB/s; full report: [results/{md_name}](results/{md_name}).\n\n{}\n| p99 latency (ms) | proxy | kube-apiserver |\n|---|---|---|\n",
        run.profile.name,
        run.date,
        run.machine.cpus,
        run.machine.cpu_model,
        run.commit,
        run.loopback_gbps,
        real_path(run)
    );
    for (label, p, a) in p99_pairs(run) {
        let _ = writeln!(s, "| {label} | {p:.1} | {a:.1} |");
    }
    for r in run.b.iter().filter(|r| r.mode == StartMode::Legacy) {
        let _ = writeln!(
            s,
            "\nInformer storm ({} clients), {}: {} upstream LIST(s), {} upstream WATCH(es).",
            r.result.clients, r.side, r.upstream_lists, r.upstream_watches_opened
        );
    }
    for side in ["apiserver", "proxy"] {
        if run.a.iter().any(|p| p.side == side) {
            let _ = writeln!(
                s,
                "\nWatch fan-out capacity, {side}: {}.",
                Capacity::of(&run.a, side, Encoding::Json)
            );
        }
    }
    s
}

pub fn update_readme(run: &Run, readme: &Path, paths: &Paths) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(readme)?;
    let (Some(i), Some(j)) = (text.find(BEGIN), text.find(END)) else {
        anyhow::bail!("{} has no headline markers", readme.display());
    };
    let name = paths
        .md
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let new = format!(
        "{}{BEGIN}\n{}{}",
        &text[..i],
        headline(run, &name),
        &text[j..]
    );
    std::fs::write(readme, new)?;
    Ok(())
}
