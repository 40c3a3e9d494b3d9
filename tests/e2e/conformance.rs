//! The conformance tier: Kubernetes' own e2e tests (k8s.io/kubernetes `test/e2e/apimachinery`
//! and the API-only tests of `test/e2e/common/node`, at the version pinned in
//! `tests/e2e/go/go.mod`) run twice against one real control plane (etcd, kube-apiserver with
//! `--etcd-compaction-interval=1m`, kube-controller-manager): once directly, once through the
//! proxy (`cache.resources: [all]`, the caller authenticated by its bearer token). Every test
//! that passes directly must pass through the proxy; a test that fails both ways is listed but
//! is not the proxy's failure.
//!
//! Each run writes a side-by-side table (test | direct | proxy | proxy-only failure message) to
//! `<target>/conformance/<selection>.md` and stdout, the ginkgo JSON reports and the e2e.test
//! logs beside it.
//!
//! - `ci_subset` is meant for `cargo test`: lists and chunking (with the compaction test),
//!   watches, WatchList, Table and metadata, server-side apply, leases, health, server version.
//!   It runs with the other e2e tests (about 7 minutes: both runs, with the compaction test).
//! - `whole_selection` (ignored; `cargo test --test e2e conformance::whole_selection --
//!   --ignored --nocapture`) runs everything linked in, minus [`SKIPS`] (each with its reason,
//!   also tabled in docs/architecture.md); with `KCP_CONFORMANCE_FOCUS=<ginkgo focus>`, only
//!   the specs that focus selects.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use crate::support::proxy::TestProxy;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions, ensure_conformance_binaries};

/// The API-only tests of `test/e2e/common/node`: the rest of that package starts pods, which
/// need a kubelet.
const NODE_API_TESTS: &str = r"\[sig-node\] (ConfigMap should (fail to create ConfigMap with empty key|update ConfigMap successfully|run through a ConfigMap lifecycle)|Secrets should (fail to create secret due to empty secret key|patch a secret)|PodTemplates |Lease )";

/// Tests of the selection that cannot run against this control plane, as ginkgo `--skip`
/// regular expressions with the reason. Keep docs/architecture.md's table in step.
pub const SKIPS: &[(&str, &str)] = &[
    (
        r"\[Feature:",
        "needs an optional cluster feature or a feature gate this control plane does not enable",
    ),
    (r"\[Flaky\]", "marked flaky upstream"),
    (
        r"\[Disruptive\]",
        "restarts or breaks control-plane components over SSH (etcd failure)",
    ),
    (
        r"AdmissionWebhook|CustomResourceConversionWebhook|CustomResourceFieldSelectors",
        "deploys a webhook server pod (admission or CRD conversion) from a container image: \
         needs nodes and images",
    ),
    (
        r"\[sig-api-machinery\] Aggregator|OpenAPIV3 should contain OpenAPI V3 for Aggregated APIServer",
        "deploys sample-apiserver as a pod from a container image: needs nodes and images",
    ),
    (
        r"Garbage collector should (orphan pods created by rc if delete options say so|keep the rc around until all its pods are deleted|not delete dependents that have both valid owner)",
        "sizes its ReplicationController from the Ready schedulable nodes: needs a kubelet",
    ),
    (
        r"Namespaces \[Serial\] should ensure that all pods are removed|OrderedNamespaceDeletion namespace deletion should delete pod first|Generated clientset should create pods, set the deletionTimestamp",
        "waits for a pod to be running: needs a kubelet",
    ),
];

/// One selection of tests: a ginkgo focus plus the skips.
struct Selection {
    name: &'static str,
    focus: String,
    /// Extra skips of this selection, on top of [`SKIPS`].
    skip: &'static [&'static str],
}

fn ci_subset() -> Selection {
    Selection {
        name: "ci-subset",
        focus: [
            r"\[sig-api-machinery\] Servers with support for API chunking ",
            r"\[sig-api-machinery\] Watchers ",
            r"\[sig-api-machinery\] API Streaming \(aka\. WatchList\) ",
            r"\[sig-api-machinery\] Servers with support for Table transformation ",
            r"\[sig-api-machinery\] ServerSideApply ",
            r"\[sig-api-machinery\] health handlers ",
            r"\[sig-api-machinery\] server version ",
            r"\[sig-node\] Lease ",
        ]
        .join("|"),
        skip: &[],
    }
}

/// The whole selection, or the part of it that `KCP_CONFORMANCE_FOCUS` (a ginkgo focus
/// regular expression) names, to look at a few specs both ways without the whole run.
fn whole_selection() -> Selection {
    match std::env::var("KCP_CONFORMANCE_FOCUS") {
        Ok(focus) if !focus.is_empty() => Selection {
            name: "focused",
            focus,
            skip: &[],
        },
        _ => Selection {
            name: "whole-selection",
            focus: format!(r"\[sig-api-machinery\] |{NODE_API_TESTS}"),
            skip: &[],
        },
    }
}

/// What one spec did in one run.
#[derive(Debug, Clone)]
struct Outcome {
    /// ginkgo's state: passed, failed, skipped, panicked, timedout, interrupted, aborted.
    state: String,
    message: String,
    seconds: f64,
}

impl Outcome {
    fn passed(&self) -> bool {
        self.state == "passed"
    }
}

/// Specs that ran (or were skipped at run time, with a message) by full name, from a ginkgo
/// JSON report. Specs the focus/skip filtered out are left out.
fn parse_report(path: &Path) -> BTreeMap<String, Outcome> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("reading the ginkgo report {}: {e}", path.display()));
    let reports: serde_json::Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("parsing the ginkgo report {}: {e}", path.display()));
    let mut out = BTreeMap::new();
    for report in reports.as_array().into_iter().flatten() {
        for spec in report["SpecReports"].as_array().into_iter().flatten() {
            let kind = spec["LeafNodeType"].as_str().unwrap_or_default();
            let state = spec["State"].as_str().unwrap_or_default().to_string();
            let mut message = spec["Failure"]["Message"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .to_string();
            let location = &spec["Failure"]["Location"];
            if let (Some(file), Some(line)) = (
                location["FileName"].as_str(),
                location["LineNumber"].as_u64(),
            ) && !message.is_empty()
            {
                let file = file.rsplit('/').next().unwrap_or(file);
                message = format!("{file}:{line}: {message}");
            }
            if kind != "It" {
                // Suite nodes: a failing BeforeSuite fails every spec; report it as one row.
                if state != "passed" && !state.is_empty() {
                    out.insert(
                        format!("[{kind}]"),
                        Outcome {
                            state,
                            message,
                            seconds: 0.0,
                        },
                    );
                }
                continue;
            }
            if state == "skipped" && message.is_empty() {
                continue; // filtered out by focus/skip
            }
            let mut name: Vec<&str> = spec["ContainerHierarchyTexts"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_str())
                .collect();
            name.push(spec["LeafNodeText"].as_str().unwrap_or_default());
            let seconds = spec["RunTime"].as_f64().unwrap_or_default() / 1e9;
            out.insert(
                name.join(" "),
                Outcome {
                    state,
                    message,
                    seconds,
                },
            );
        }
    }
    out
}

/// The directory tables and reports go to: `<cargo target dir>/conformance`.
fn out_dir() -> PathBuf {
    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    tmp.parent().unwrap_or(tmp).join("conformance")
}

/// Runs `e2e.test` once with `kubeconfig`; returns the report's path and the wall time.
async fn run_e2e(
    e2e: &Path,
    kubectl: &Path,
    kubeconfig: &Path,
    sel: &Selection,
    dir: &Path,
    label: &str,
) -> (PathBuf, Duration) {
    let report = dir.join(format!("{label}.json"));
    let _ = std::fs::remove_file(&report);
    let log_path = dir.join(format!("{label}.log"));
    let log = std::fs::File::create(&log_path).unwrap();
    let skip: Vec<&str> = SKIPS
        .iter()
        .map(|(re, _)| *re)
        .chain(sel.skip.iter().copied())
        .collect();
    let work = dir.join(format!("{label}-output"));
    std::fs::create_dir_all(&work).unwrap();
    let started = Instant::now();
    eprintln!(
        ">> conformance {}: e2e.test {label} (log: {})",
        sel.name,
        log_path.display()
    );
    let status = tokio::process::Command::new(e2e)
        .arg(format!("--kubeconfig={}", kubeconfig.display()))
        .arg("--provider=skeleton")
        .arg(format!("--kubectl-path={}", kubectl.display()))
        .arg(format!("--e2e-output-dir={}", work.display()))
        .arg("--num-nodes=0")
        .arg(format!("--ginkgo.focus={}", sel.focus))
        .arg(format!("--ginkgo.skip={}", skip.join("|")))
        .arg(format!("--ginkgo.json-report={}", report.display()))
        // ginkgo's default suite timeout is one hour; the whole selection runs longer.
        .arg("--ginkgo.timeout=6h")
        .arg("--ginkgo.no-color")
        .arg("--ginkgo.v")
        .current_dir(&work)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .kill_on_drop(true)
        .status()
        .await
        .expect("running e2e.test");
    let took = started.elapsed();
    eprintln!(
        ">> conformance {}: e2e.test {label} exited with {status} after {:.0}s",
        sel.name,
        took.as_secs_f64()
    );
    assert!(
        report.exists(),
        "e2e.test {label} wrote no report; see {}",
        log_path.display()
    );
    (report, took)
}

fn cell(o: Option<&Outcome>) -> String {
    match o {
        None => "-".into(),
        Some(o) => format!("{} ({:.0}s)", o.state, o.seconds),
    }
}

/// One line of a failure message, for a table cell: gomega messages dump whole objects before
/// the assertion, so a long one keeps its beginning and its end.
fn one_line(msg: &str) -> String {
    const HEAD: usize = 250;
    const TAIL: usize = 350;
    let s: String = msg
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace('|', "\\|");
    let chars: Vec<char> = s.chars().collect();
    if chars.len() <= HEAD + TAIL + 5 {
        return s;
    }
    let head: String = chars[..HEAD].iter().collect();
    let tail: String = chars[chars.len() - TAIL..].iter().collect();
    format!("{head} ... {tail}")
}

struct Table {
    markdown: String,
    proxy_only: Vec<(String, String)>,
}

fn table(
    sel: &Selection,
    direct: &BTreeMap<String, Outcome>,
    proxy: &BTreeMap<String, Outcome>,
    times: (Duration, Duration),
) -> Table {
    let mut names: Vec<&String> = direct.keys().chain(proxy.keys()).collect();
    names.sort();
    names.dedup();
    let count = |m: &BTreeMap<String, Outcome>| m.values().filter(|o| o.passed()).count();
    let mut proxy_only = Vec::new();
    let mut both_failed = Vec::new();
    let mut rows = String::new();
    for name in &names {
        let (d, p) = (direct.get(*name), proxy.get(*name));
        let d_pass = d.is_some_and(Outcome::passed);
        let p_pass = p.is_some_and(Outcome::passed);
        let note = if d_pass && !p_pass {
            let msg = p.map(|o| one_line(&o.message)).unwrap_or_default();
            proxy_only.push(((*name).clone(), msg.clone()));
            format!("**proxy-only**: {msg}")
        } else if !d_pass && !p_pass && d.is_some_and(|o| o.state != "skipped") {
            both_failed.push((*name).clone());
            format!(
                "fails directly too: {}",
                d.map(|o| one_line(&o.message)).unwrap_or_default()
            )
        } else if !d_pass && p_pass {
            "passes only through the proxy".into()
        } else {
            String::new()
        };
        let _ = writeln!(
            rows,
            "| {} | {} | {} | {} |",
            name.replace('|', "\\|"),
            cell(d),
            cell(p),
            note
        );
    }
    let mut md = String::new();
    let _ = writeln!(md, "# Conformance: {}\n", sel.name);
    let _ = writeln!(md, "- focus: `{}`", sel.focus);
    let _ = writeln!(
        md,
        "- specs: {} direct, {} through the proxy",
        direct.len(),
        proxy.len()
    );
    let _ = writeln!(
        md,
        "- passed: {} direct, {} through the proxy",
        count(direct),
        count(proxy)
    );
    let _ = writeln!(md, "- proxy-only failures: {}", proxy_only.len());
    let _ = writeln!(md, "- failing both ways: {}", both_failed.len());
    let _ = writeln!(
        md,
        "- wall time: {:.0}s direct, {:.0}s through the proxy\n",
        times.0.as_secs_f64(),
        times.1.as_secs_f64()
    );
    md.push_str(
        "| test | direct | proxy | proxy-only failure / note |\n| --- | --- | --- | --- |\n",
    );
    md.push_str(&rows);
    Table {
        markdown: md,
        proxy_only,
    }
}

async fn kube_config(yaml: &str) -> kube::Config {
    let kc = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap()
}

async fn run(sel: Selection) {
    let started = Instant::now();
    let bin = tokio::task::spawn_blocking(ensure_conformance_binaries)
        .await
        .unwrap()
        .expect("building kube-controller-manager and e2e.test");
    let cp = ControlPlane::start(ControlPlaneOptions {
        apiserver_args: vec!["--etcd-compaction-interval=1m".into()],
        controller_manager: true,
        ..ControlPlaneOptions::default()
    })
    .await
    .expect("control plane starts");
    // A Node object (there is no kubelet behind it; it goes NotReady): tests that list nodes
    // expect a cluster to have one.
    let admin = cp.admin_client().await.unwrap();
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "conformance-node", "labels": {"kubernetes.io/hostname": "conformance-node"}},
    }))
    .unwrap();
    Api::<Node>::all(admin)
        .create(&PostParams::default(), &node)
        .await
        .expect("creating a Node object");
    let upstream = kube_config(&cp.admin_kubeconfig_yaml()).await;
    let proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["all".into()];
    })
    .await;

    let dir = out_dir().join(sel.name);
    std::fs::create_dir_all(&dir).unwrap();
    let direct_kc = dir.join("direct.kubeconfig");
    std::fs::write(&direct_kc, cp.admin_kubeconfig_yaml()).unwrap();
    // Through the proxy the caller authenticates with its bearer token, as a real client does;
    // the proxy forwards that identity.
    let proxy_kc = dir.join("proxy.kubeconfig");
    std::fs::write(&proxy_kc, proxy.kubeconfig_yaml(cp.admin_token())).unwrap();

    let e2e = bin.join("e2e.test");
    let kubectl = cp.kubectl();
    let (direct_report, direct_time) =
        run_e2e(&e2e, &kubectl, &direct_kc, &sel, &dir, "direct").await;
    let (proxy_report, proxy_time) = run_e2e(&e2e, &kubectl, &proxy_kc, &sel, &dir, "proxy").await;
    let direct = parse_report(&direct_report);
    let proxy_outcomes = parse_report(&proxy_report);
    let mut t = table(&sel, &direct, &proxy_outcomes, (direct_time, proxy_time));
    // Where the proxy's Tables came from (`as=Table`: kubectl's and the Table specs').
    let (mut from_cache, mut passed) = (0, 0);
    for e in proxy.running.as_ref().unwrap().state.caches.entries() {
        let s = &e.cache.table.stats;
        from_cache += s.served.load(std::sync::atomic::Ordering::Relaxed);
        passed += s.passed_through.load(std::sync::atomic::Ordering::Relaxed);
    }
    let _ = writeln!(
        t.markdown,
        "\nTables through the proxy: {from_cache} written by the cache, {passed} passed through to the apiserver (the table sides' counters)."
    );
    let md_path = out_dir().join(format!("{}.md", sel.name));
    std::fs::write(&md_path, &t.markdown).unwrap();
    println!("{}", t.markdown);
    println!(
        "table: {} (reports and e2e.test logs in {}); total {:.0}s",
        md_path.display(),
        dir.display(),
        started.elapsed().as_secs_f64()
    );
    proxy.shutdown().await;
    cp.stop().await;
    assert!(
        !direct.is_empty(),
        "no spec ran directly: the focus matches nothing, or the suite setup failed (see {})",
        dir.display()
    );
    assert!(
        t.proxy_only.is_empty(),
        "{} test(s) fail only through the proxy:\n{}",
        t.proxy_only.len(),
        t.proxy_only
            .iter()
            .map(|(n, m)| format!("- {n}: {m}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ci_subset_passes_through_the_proxy_as_directly() {
    run(ci_subset()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the whole selection takes long; run with `cargo test --test e2e conformance::whole_selection -- --ignored --nocapture`"]
async fn whole_selection_passes_through_the_proxy_as_directly() {
    run(whole_selection()).await;
}
