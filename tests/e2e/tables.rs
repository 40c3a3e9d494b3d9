//! Tables (`as=Table;v=v1;g=meta.k8s.io`, what `kubectl get` asks for, and v1beta1) from the
//! cache against
//! a real kube-apiserver + etcd: pods, a deployment, configmaps, a running Job and a
//! scheduled CronJob (their Duration and Last Schedule re-rendered) and custom resources
//! whose CRD has printer columns (integer, string of priority 1, number, a date of a spec
//! field, re-rendered, and the creation date). Every Table the
//! proxy writes — GET, LIST, a LIST at an exact resourceVersion, a paginated walk with
//! `limit=2`, each with `includeObject` None, Metadata and Object — equals the apiserver's
//! as JSON values, its age cells being the age of the object at the moment of the request
//! (kube-apiserver prints them relative to its clock, so two answers a second apart may
//! differ there and only there); and every one of them was written by the cache (the table
//! side's counters), with no Table LIST reaching the apiserver. Then real kubectl prints the
//! same `get`, `get -A`, `get -o wide`, `get --chunk-size=2` and custom resources' columns
//! through the proxy as direct, from the cache.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::proxy::TestProxy;
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use kube_cache_proxy::cache::table::{human_duration, now_ms, parse_time};
use serde_json::{Value, json};

/// Guard against hangs only.
const BOUND: Duration = Duration::from_secs(60);
const NS: &str = "e2e-tables";
const TABLE: &str = "application/json;as=Table;v=v1;g=meta.k8s.io";
/// An older client's Table.
const TABLE_V1BETA1: &str = "application/json;as=Table;v=v1beta1;g=meta.k8s.io";
/// kubectl get's Accept.
const KUBECTL: &str = "application/json;as=Table;v=v1;g=meta.k8s.io,application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json";

async fn kube_config(yaml: &str) -> kube::Config {
    let kc = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap()
}

async fn send(
    c: &kube::Client,
    method: &str,
    path: &str,
    accept: &str,
    body: Option<Value>,
) -> Value {
    let req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("accept", accept)
        .header("content-type", "application/json")
        .body(
            body.map(|b| serde_json::to_vec(&b).unwrap())
                .unwrap_or_default(),
        )
        .unwrap();
    let text = c
        .request_text(req)
        .await
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}: {text}"))
}

/// A Table watch's events up to and including its initial-events-end bookmark.
async fn table_watch_until_initial_end(c: &kube::Client, path: &str) -> Vec<Value> {
    use futures_util::{AsyncBufReadExt as _, StreamExt as _};
    let req = http::Request::get(path)
        .header("accept", TABLE)
        .body(Vec::new())
        .unwrap();
    let body = c
        .request_stream(req)
        .await
        .unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut lines = std::pin::pin!(body.lines());
    let mut events = Vec::new();
    loop {
        let line = tokio::time::timeout(BOUND, lines.next())
            .await
            .unwrap_or_else(|_| {
                panic!("{path}: no initial-events-end bookmark within {BOUND:?}: {events:?}")
            })
            .unwrap_or_else(|| panic!("{path}: the watch ended before its bookmark: {events:?}"))
            .unwrap();
        if line.trim().is_empty() {
            continue;
        }
        let e: Value =
            serde_json::from_str(&line).unwrap_or_else(|e| panic!("{path}: {e}: {line}"));
        let end = e["type"] == "BOOKMARK"
            && e["object"]["rows"][0]["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"]
                == "true";
        events.push(e);
        if end {
            return events;
        }
    }
}

/// The columns printing an age (a built-in's `Age`, a custom resource's date of the creation
/// timestamp: both named Age here).
fn age_columns(t: &Value) -> Vec<usize> {
    t["columnDefinitions"]
        .as_array()
        .map(|cols| {
            cols.iter()
                .enumerate()
                .filter(|(_, c)| c["name"] == "Age")
                .map(|(i, _)| i)
                .collect()
        })
        .unwrap_or_default()
}

/// Checks every age cell of `t` is the age of its object at some moment in
/// `[from_ms - 2 s, to_ms + 1 s]` (HumanDuration's seconds; the apiserver's clock is this
/// machine's), by the creation timestamp `created` gives for a row's name, and blanks it.
fn check_and_blank_ages(
    t: &mut Value,
    cols: &[usize],
    created: &dyn Fn(&str) -> i64,
    from_ms: i64,
    to_ms: i64,
) {
    let Some(rows) = t["rows"].as_array_mut() else {
        return;
    };
    for r in rows {
        let name = r["cells"][0].as_str().unwrap().to_string();
        let c = created(&name) * 1000;
        for &i in cols {
            let cell = r["cells"][i].as_str().unwrap().to_string();
            // HumanDuration changes only at whole seconds of the age: each second of the
            // window, and its ends.
            let (lo, hi) = (from_ms - 2000, to_ms + 1000);
            let ok = (lo / 1000..=hi / 1000)
                .map(|s| (s * 1000).clamp(lo, hi))
                .chain([lo, hi])
                .any(|t| human_duration(t - c) == cell);
            assert!(
                ok,
                "age {cell:?} of {name} is not its age between {from_ms} and {to_ms} (created {c})"
            );
            r["cells"][i] = json!("<age>");
        }
        // A pod's restarts printed relative to the clock (`"2 (20m ago)"`): the time since
        // the one finishedAt the test wrote.
        for cell in r["cells"].as_array_mut().unwrap() {
            let Some(text) = cell.as_str().and_then(|c| c.strip_suffix(" ago)")) else {
                continue;
            };
            let (count, x) = text.split_once(" (").unwrap();
            let f = parse_time(FINISHED.get().expect("a finishedAt written")).unwrap() * 1000;
            let (lo, hi) = (from_ms - 2000, to_ms + 1000);
            let ok = (lo / 1000..=hi / 1000)
                .map(|s| (s * 1000).clamp(lo, hi))
                .chain([lo, hi])
                .any(|t| human_duration(t - f) == x);
            assert!(ok, "restarts {text:?} of {name}");
            RESTARTS_SEEN.fetch_add(1, Relaxed);
            *cell = json!(format!("{count} (<t> ago)"));
        }
    }
}

/// `secs` since the epoch as the apiserver writes a time (RFC 3339, UTC, seconds).
fn rfc3339(secs: i64) -> String {
    // Howard Hinnant's civil_from_days.
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Restarts cells relative to the clock met in the Tables compared.
static RESTARTS_SEEN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The finishedAt written into a pod's last container state.
static FINISHED: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Whether a kubectl cell is a HumanDuration (`5m`, `3m12s`, `2d5h`), in or out of
/// parentheses (`(20m`).
fn duration_like(c: &str) -> bool {
    let c = c.trim_start_matches('(').trim_end_matches(')');
    let mut parts = 0;
    let mut rest = c;
    while !rest.is_empty() {
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let unit = rest[digits..].chars().next();
        if digits == 0 || !matches!(unit, Some('s' | 'm' | 'h' | 'd' | 'y')) {
            return false;
        }
        rest = &rest[digits + 1..];
        parts += 1;
    }
    parts > 0
}

fn kubectl(cp: &ControlPlane, kubeconfig: &std::path::Path, args: &[&str]) -> String {
    crate::support::e2e::kubectl_ok(&cp.kubectl(), kubeconfig, args)
}

/// kubectl's table output split into cells, the AGE column and every duration (a pod's
/// restarts `2 (20m ago)`) blanked.
fn cells(out: &str) -> Vec<Vec<String>> {
    let mut age = None;
    out.lines()
        .map(|l| {
            let row: Vec<&str> = l.split_whitespace().collect();
            if age.is_none() {
                age = row.iter().position(|h| *h == "AGE");
                return row.iter().map(|c| c.to_string()).collect();
            }
            row.iter()
                .enumerate()
                .map(|(k, c)| {
                    if Some(k) == age || duration_like(c) {
                        "<t>".to_string()
                    } else {
                        c.to_string()
                    }
                })
                .collect()
        })
        .collect()
}

fn widgets_crd() -> Value {
    json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {"group": "example.com", "scope": "Namespaced",
                 "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
                 "versions": [{"name": "v1", "served": true, "storage": true,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
                    "additionalPrinterColumns": [
                        {"name": "Size", "type": "integer", "jsonPath": ".spec.size"},
                        {"name": "Color", "type": "string", "jsonPath": ".spec.color", "priority": 1},
                        {"name": "Ratio", "type": "number", "jsonPath": ".spec.ratio"},
                        {"name": "Seen", "type": "date", "jsonPath": ".spec.seen"},
                        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]}]}
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_from_the_cache_equal_the_apiservers_and_kubectl_prints_the_same() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let upstream = kube_config(&cp.admin_kubeconfig_yaml()).await;
    let admin = kube::Client::try_from(upstream.clone()).unwrap();
    send(
        &admin,
        "POST",
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
        "application/json",
        Some(widgets_crd()),
    )
    .await;
    eventually("the widgets CRD to be served", BOUND, async || {
        let req = http::Request::get(format!("/apis/example.com/v1/namespaces/{NS}/widgets"))
            .body(Vec::new())
            .unwrap();
        ok_if(admin.request_text(req).await.is_ok(), "not yet")
    })
    .await;
    let proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec![
            "configmaps".into(),
            "pods".into(),
            "deployments.apps".into(),
            "widgets.example.com".into(),
        ];
        // The rest of what `kubectl get all` and `get crd` ask for.
        c.cache.resources.extend(
            [
                "jobs.batch",
                "cronjobs.batch",
                "services",
                "replicationcontrollers",
                "replicasets.apps",
                "statefulsets.apps",
                "daemonsets.apps",
                "horizontalpodautoscalers.autoscaling",
                "customresourcedefinitions.apiextensions.k8s.io",
            ]
            .map(String::from),
        );
    })
    .await;
    let via = kube::Client::try_from(kube_config(&proxy.kubeconfig_yaml(cp.admin_token())).await)
        .unwrap();
    let state = proxy.running.as_ref().unwrap().state.clone();

    // The objects: no kubelet runs, so pods stay Pending with no restarts.
    for i in 0..5 {
        send(
            &admin,
            "POST",
            &format!("/api/v1/namespaces/{NS}/configmaps"),
            "application/json",
            Some(
                json!({"metadata": {"name": format!("cm-{i}")}, "data": {"k": "v".repeat(i + 1)}}),
            ),
        )
        .await;
    }
    for i in 0..3 {
        let cs: Vec<_> = (0..=i)
            .map(|c| json!({"name": format!("c{c}"), "image": "busybox"}))
            .collect();
        send(&admin, "POST", &format!("/api/v1/namespaces/{NS}/pods"), "application/json",
            Some(json!({"metadata": {"name": format!("pod-{i}"), "labels": {"app": "t"}}, "spec": {"containers": cs}}))).await;
    }
    // pod-2's first container restarted twice, the last time 20 minutes ago: its restarts
    // cell is printed relative to the clock (`2 (20m ago)`), re-rendered by the cache.
    let finished = rfc3339(now_ms() / 1000 - 20 * 60);
    FINISHED.set(finished.clone()).unwrap();
    let status = json!({"status": {"containerStatuses": [{"name": "c0", "image": "busybox", "imageID": "", "ready": false, "restartCount": 2,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": 1, "startedAt": finished, "finishedAt": finished}}}]}});
    let req = http::Request::patch(format!("/api/v1/namespaces/{NS}/pods/pod-2/status"))
        .header("content-type", "application/merge-patch+json")
        .body(serde_json::to_vec(&status).unwrap())
        .unwrap();
    admin.request_text(req).await.unwrap();
    // A Job started and a CronJob last scheduled 10 hours and a minute ago (no controller
    // runs: their status stays as written): their Duration and Last Schedule print `10h`,
    // relative to the clock, re-rendered by the cache (the same for the next 59 minutes).
    let ten_hours_ago = rfc3339(now_ms() / 1000 - 10 * 3600 - 60);
    let template = json!({"spec": {"restartPolicy": "Never", "containers": [{"name": "c", "image": "busybox"}]}});
    send(
        &admin,
        "POST",
        &format!("/apis/batch/v1/namespaces/{NS}/jobs"),
        "application/json",
        Some(json!({"metadata": {"name": "job"}, "spec": {"template": template}})),
    )
    .await;
    send(&admin, "POST", &format!("/apis/batch/v1/namespaces/{NS}/cronjobs"), "application/json",
        Some(json!({"metadata": {"name": "cron"}, "spec": {"schedule": "*/5 * * * *", "jobTemplate": {"spec": {"template": template}}}}))).await;
    for (path, status) in [
        (
            format!("/apis/batch/v1/namespaces/{NS}/jobs/job/status"),
            json!({"status": {"startTime": &ten_hours_ago}}),
        ),
        (
            format!("/apis/batch/v1/namespaces/{NS}/cronjobs/cron/status"),
            json!({"status": {"lastScheduleTime": &ten_hours_ago}}),
        ),
    ] {
        let req = http::Request::patch(path)
            .header("content-type", "application/merge-patch+json")
            .body(serde_json::to_vec(&status).unwrap())
            .unwrap();
        admin.request_text(req).await.unwrap();
    }
    send(&admin, "POST", &format!("/apis/apps/v1/namespaces/{NS}/deployments"), "application/json",
        Some(json!({"metadata": {"name": "d"}, "spec": {"selector": {"matchLabels": {"app": "d"}}, "template": {"metadata": {"labels": {"app": "d"}}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}}}}))).await;
    for (i, (size, color, ratio)) in [
        (1, "red", 0.5),
        (2, "green", 1.25),
        (3, "blue", 2.0),
        (4, "red", 1e-7),
    ]
    .into_iter()
    .enumerate()
    {
        send(&admin, "POST", &format!("/apis/example.com/v1/namespaces/{NS}/widgets"), "application/json",
            Some(json!({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": format!("w-{i}")}, "spec": {"size": size, "color": color, "ratio": ratio, "seen": ten_hours_ago}}))).await;
    }
    let collections = [
        (
            "",
            "v1",
            "configmaps",
            format!("/api/v1/namespaces/{NS}/configmaps"),
            5,
        ),
        ("", "v1", "pods", format!("/api/v1/namespaces/{NS}/pods"), 3),
        (
            "apps",
            "v1",
            "deployments",
            format!("/apis/apps/v1/namespaces/{NS}/deployments"),
            1,
        ),
        (
            "example.com",
            "v1",
            "widgets",
            format!("/apis/example.com/v1/namespaces/{NS}/widgets"),
            4,
        ),
        (
            "batch",
            "v1",
            "jobs",
            format!("/apis/batch/v1/namespaces/{NS}/jobs"),
            1,
        ),
        (
            "batch",
            "v1",
            "cronjobs",
            format!("/apis/batch/v1/namespaces/{NS}/cronjobs"),
            1,
        ),
    ];
    // Each resource's first Table reader starts its table side; until it synced (and the
    // cache holds every object), Tables are the apiserver's.
    for (g, v, r, path, n) in &collections {
        eventually(&format!("{r}: a Table from the cache"), BOUND, async || {
            let cache = state.caches.get(g, v, r).ok_or("no cache")?;
            let before = cache.table.stats.served.load(Relaxed);
            let t = send(&via, "GET", path, TABLE, None).await;
            let rows = t["rows"].as_array().map_or(0, Vec::len);
            ok_if(
                cache.table.stats.served.load(Relaxed) > before && rows == *n,
                format!("{rows} rows"),
            )
        })
        .await;
    }
    // The other resources' table sides, started as `kubectl get all` and `get crd` would.
    for path in [
        format!("/api/v1/namespaces/{NS}/services"),
        format!("/api/v1/namespaces/{NS}/replicationcontrollers"),
        format!("/apis/apps/v1/namespaces/{NS}/replicasets"),
        format!("/apis/apps/v1/namespaces/{NS}/statefulsets"),
        format!("/apis/apps/v1/namespaces/{NS}/daemonsets"),
        format!("/apis/autoscaling/v2/namespaces/{NS}/horizontalpodautoscalers"),
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions".to_string(),
    ] {
        eventually(
            &format!("{path}: a Table from the cache"),
            BOUND,
            async || {
                let count = || {
                    state
                        .caches
                        .entries()
                        .iter()
                        .map(|e| e.cache.table.stats.served.load(Relaxed))
                        .sum::<u64>()
                };
                let before = count();
                send(&via, "GET", &path, TABLE, None).await;
                ok_if(count() > before, "not yet")
            },
        )
        .await;
    }
    // Tables every cache wrote, and passed through.
    let served = || -> (u64, u64) {
        state.caches.entries().iter().fold((0, 0), |(s, p), e| {
            let t = &e.cache.table.stats;
            (
                s + t.served.load(Relaxed),
                p + t.passed_through.load(Relaxed),
            )
        })
    };
    let (served_before, passed_before) = served();

    // Creation timestamps, by name, for the age cells.
    let mut created = std::collections::HashMap::new();
    for (_, _, _, path, _) in &collections {
        let l = send(&admin, "GET", path, "application/json", None).await;
        for i in l["items"].as_array().unwrap() {
            let name = i["metadata"]["name"].as_str().unwrap().to_string();
            created.insert(
                name,
                parse_time(i["metadata"]["creationTimestamp"].as_str().unwrap()).unwrap(),
            );
        }
    }
    let created = |n: &str| created[n];
    // One Table through the proxy and one direct, compared as JSON values after their age
    // cells were checked against the moments of the requests.
    let proxied = std::cell::Cell::new(0u64);
    let compare =
        async |path: &str, accept: &str, what: &str, drop_continue: bool| -> (Value, Value) {
            let t0 = now_ms();
            let mut p = send(&via, "GET", path, accept, None).await;
            let mut d = send(&admin, "GET", path, accept, None).await;
            let t1 = now_ms();
            proxied.set(proxied.get() + 1);
            let cols = age_columns(&d);
            assert_eq!(cols, age_columns(&p), "{what}: columns");
            check_and_blank_ages(&mut p, &cols, &created, t0, t1);
            check_and_blank_ages(&mut d, &cols, &created, t0, t1);
            let (pm, dm) = (p["metadata"].take(), d["metadata"].take());
            if drop_continue {
                assert_eq!(
                    pm["remainingItemCount"], dm["remainingItemCount"],
                    "{what}: remainingItemCount"
                );
                assert_eq!(
                    pm["continue"].is_string(),
                    dm["continue"].is_string(),
                    "{what}: continue"
                );
            } else {
                assert_eq!(pm, dm, "{what}: metadata");
            }
            assert_eq!(p, d, "{what}: through the proxy (left) and direct (right)");
            assert!(
                p["rows"].as_array().is_some_and(|r| !r.is_empty()),
                "{what}: no rows"
            );
            (pm, dm)
        };
    for (_, _, r, path, _) in &collections {
        let list = send(&admin, "GET", path, "application/json", None).await;
        let rv = list["metadata"]["resourceVersion"]
            .as_str()
            .unwrap()
            .to_string();
        let first = list["items"][0]["metadata"]["name"]
            .as_str()
            .unwrap()
            .to_string();
        for io in [
            "",
            "&includeObject=None",
            "&includeObject=Metadata",
            "&includeObject=Object",
        ] {
            for accept in [TABLE, KUBECTL, TABLE_V1BETA1] {
                // Exact: both answer at the same resourceVersion, metadata included.
                let exact = format!("{path}?resourceVersion={rv}&resourceVersionMatch=Exact{io}");
                compare(&exact, accept, &format!("{r} list at {rv} {io}"), false).await;
                // Most recent: the same objects (nothing is written meanwhile); the list's
                // resourceVersion is etcd's current revision, read at two moments.
                let latest = format!("{path}?limit=500{io}");
                compare(&latest, accept, &format!("{r} list {io}"), true).await;
                let get = format!("{path}/{first}?{}", io.trim_start_matches('&'));
                compare(&get, accept, &format!("{r} get {first} {io}"), false).await;
            }
            // A walk of two per page: the same rows page by page, the proxy's own tokens.
            let (mut pc, mut dc) = (String::new(), String::new());
            loop {
                let t0 = now_ms();
                let page = |c: &str| {
                    let c = if c.is_empty() {
                        String::new()
                    } else {
                        format!("&continue={c}")
                    };
                    format!("{path}?limit=2{io}{c}")
                };
                let mut p = send(&via, "GET", &page(&pc), TABLE, None).await;
                let mut d = send(&admin, "GET", &page(&dc), TABLE, None).await;
                let t1 = now_ms();
                proxied.set(proxied.get() + 1);
                let cols = age_columns(&d);
                check_and_blank_ages(&mut p, &cols, &created, t0, t1);
                check_and_blank_ages(&mut d, &cols, &created, t0, t1);
                let (pm, dm) = (p["metadata"].take(), d["metadata"].take());
                assert_eq!(p, d, "{r} page after {pc:?} {io}");
                assert_eq!(
                    pm["remainingItemCount"], dm["remainingItemCount"],
                    "{r} page {io}"
                );
                match (pm["continue"].as_str(), dm["continue"].as_str()) {
                    (Some(a), Some(b)) => (pc, dc) = (a.to_string(), b.to_string()),
                    (None, None) => break,
                    other => panic!("{r} {io}: continue {other:?}"),
                }
            }
        }
    }
    // Across namespaces.
    compare("/api/v1/pods?limit=500", KUBECTL, "pods -A", true).await;
    let (served_after, passed_after) = served();
    assert_eq!(passed_after - passed_before, 0, "Tables passed through");
    assert_eq!(
        served_after - served_before,
        proxied.get(),
        "Tables written by the cache"
    );
    // Both sides printed pod-2's restarts relative to the clock, and they agreed.
    assert!(
        RESTARTS_SEEN.load(Relaxed) > 0,
        "no restarts cell printed relative to the clock"
    );
    let proxied = proxied.get();
    println!("tables: {proxied} Tables through the proxy equal to direct, all from the cache");

    // kubectl, through the proxy and direct.
    let dir = tempfile::tempdir().unwrap();
    let pk = dir.path().join("proxy.kubeconfig");
    std::fs::write(&pk, proxy.kubeconfig_yaml(cp.admin_token())).unwrap();
    let dk = dir.path().join("direct.kubeconfig");
    std::fs::write(&dk, cp.admin_kubeconfig_yaml()).unwrap();
    let (served_before, passed_before) = served();
    let pod_lists = crate::support::e2e::apiserver_lists(&admin, "pods").await;
    let cases: [&[&str]; 10] = [
        &["get", "pods", "-n", NS],
        &["get", "pods", "-A"],
        &["get", "pods", "-n", NS, "-o", "wide"],
        &["get", "cm", "-n", NS, "--chunk-size=2"],
        &["get", "deploy", "-n", NS],
        &["get", "widgets", "-n", NS],
        &["get", "widgets", "-n", NS, "-o", "wide"],
        &["get", "widgets", "-n", NS, "--chunk-size=2", "-o", "wide"],
        &["get", "all", "-n", NS],
        &["get", "crd"],
    ];
    for args in cases {
        let p = kubectl(&cp, &pk, args);
        let d = kubectl(&cp, &dk, args);
        assert_eq!(
            cells(&p),
            cells(&d),
            "kubectl {args:?}: through the proxy:\n{p}\ndirect:\n{d}"
        );
        assert!(cells(&p).len() > 1, "kubectl {args:?}: {p}");
        if args[1] == "pods" {
            assert!(
                p.contains(" ago)"),
                "kubectl {args:?}: pod-2's restarts: {p}"
            );
        }
    }
    let (served_after, passed_after) = served();
    assert_eq!(
        passed_after - passed_before,
        0,
        "kubectl's Tables passed through"
    );
    // Only the direct kubectl's four lists of pods (`get all` one of them) reached the
    // apiserver.
    assert_eq!(
        crate::support::e2e::apiserver_lists(&admin, "pods").await - pod_lists,
        4,
        "pod LISTs upstream"
    );
    // One page each, three for configmaps and two for widgets by twos; `get all` one
    // Table per resource of the category (10), `get crd` one.
    assert_eq!(
        served_after - served_before,
        6 + 3 + 2 + 10 + 1,
        "kubectl's Tables written by the cache"
    );
    // The per-encoding metrics count them as Tables.
    let (code, m) = proxy.admin_get("/metrics").await;
    assert_eq!(code, 200);
    let tables = crate::support::watch_validator::sum_metric(
        &m,
        "kube_cache_proxy_responses_total",
        &["encoding=\"table\"", "served_by=\"cache\""],
    );
    assert!(
        tables >= (served_after - served_before) as f64,
        "{tables} Table responses from the cache in the metrics"
    );
    println!(
        "tables: kubectl {} gets equal to direct, {} Tables from the cache",
        cases.len(),
        served_after - served_before
    );

    // kubectl get -w: its LIST, then a watch from the list's resourceVersion, each event a
    // Table of one row; a create, a relabel, a delete and a last create both must print.
    let (served_before, passed_before) = served();
    let watch = |kubeconfig: &std::path::Path| {
        crate::support::e2e::kubectl_watch_pods(&cp.kubectl(), kubeconfig, NS)
    };
    let watches = [watch(&pk), watch(&dk)];
    let mut lines: Vec<Vec<String>> = watches
        .iter()
        .map(|(_, rx)| {
            (0..4)
                .map(|_| rx.recv_timeout(BOUND).expect("header and three pods"))
                .collect()
        })
        .collect();
    let pods = format!("/api/v1/namespaces/{NS}/pods");
    let pod = |name: &str| json!({"metadata": {"name": name}, "spec": {"containers": [{"name": "c", "image": "busybox"}]}});
    send(
        &admin,
        "POST",
        &pods,
        "application/json",
        Some(pod("pod-new")),
    )
    .await;
    let req = http::Request::patch(format!("{pods}/pod-0"))
        .header("content-type", "application/merge-patch+json")
        .body(serde_json::to_vec(&json!({"metadata": {"labels": {"touched": "yes"}}})).unwrap())
        .unwrap();
    admin.request_text(req).await.unwrap();
    send(
        &admin,
        "DELETE",
        &format!("{pods}/pod-1"),
        "application/json",
        None,
    )
    .await;
    send(
        &admin,
        "POST",
        &pods,
        "application/json",
        Some(pod("zz-end")),
    )
    .await;
    crate::support::e2e::kubectl_watches_until(watches.into(), &mut lines, "zz-end", BOUND);
    assert_eq!(
        cells(&lines[0].join("\n")),
        cells(&lines[1].join("\n")),
        "kubectl get -w through the proxy (left) and direct (right)"
    );
    let (served_after, passed_after) = served();
    assert_eq!(
        passed_after - passed_before,
        0,
        "kubectl get -w passed through"
    );
    assert_eq!(
        served_after - served_before,
        2,
        "kubectl get -w's LIST and WATCH from the cache"
    );
    println!(
        "tables: kubectl get -w printed {} lines through the proxy as direct",
        lines[0].len()
    );

    // Table watches with bookmarks, as a dashboard's informer opens them: initial events
    // (`sendInitialEvents=true`) end with the initial-events-end bookmark, whose row is the
    // one the apiserver prints for an empty object. Through the proxy from the cache, equal
    // to direct but for the bookmark's resourceVersion (etcd's revision when each answered).
    // `includeObject=Object` shows a bookmark's empty object as the apiserver writes it,
    // whose fields after the metadata the cache learns from its upstream watch's bookmarks
    // (the apiserver's first comes about a minute after a watch starts).
    eventually(
        "the apiserver's JSON bookmarks seen by every cache",
        Duration::from_secs(180),
        async || {
            let missing: Vec<_> = collections
                .iter()
                .filter(|(g, v, r, _, _)| {
                    state
                        .caches
                        .get(g, v, r)
                        .unwrap()
                        .json_bookmark_rest()
                        .is_none()
                })
                .map(|c| c.2)
                .collect();
            ok_if(missing.is_empty(), format!("not yet: {missing:?}"))
        },
    )
    .await;
    let (served_before, passed_before) = served();
    let mut watched = 0u64;
    // Creation timestamps again: pods were created since.
    let mut born = std::collections::HashMap::new();
    for (_, _, _, path, _) in &collections {
        let l = send(&admin, "GET", path, "application/json", None).await;
        for i in l["items"].as_array().unwrap() {
            let name = i["metadata"]["name"].as_str().unwrap().to_string();
            let at = i["metadata"]["creationTimestamp"].as_str().unwrap();
            born.insert(name, parse_time(at).unwrap());
        }
    }
    let created = |n: &str| born[n];
    for (_, _, r, path, _) in &collections {
        for io in ["", "&includeObject=None", "&includeObject=Object"] {
            let q = format!(
                "{path}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=60{io}"
            );
            let t0 = now_ms();
            let mut p = table_watch_until_initial_end(&via, &q).await;
            let mut d = table_watch_until_initial_end(&admin, &q).await;
            let t1 = now_ms();
            watched += 1;
            // Objects and the bookmark (the pods changed above: the apiserver's count).
            assert!(d.len() > 1, "{r} {io}: no object direct: {d:?}");
            assert_eq!(
                p.len(),
                d.len(),
                "{r} {io}: events through the proxy: {p:?}"
            );
            for (side, events) in [("proxy", &mut p), ("direct", &mut d)] {
                // The columns come with the first event only.
                let cols = age_columns(&events[0]["object"]);
                let (last, added) = events.split_last_mut().unwrap();
                assert_eq!(last["type"], "BOOKMARK", "{side} {r} {io}");
                // The bookmark's resourceVersion, in the Table and in its row's object.
                let t = &mut last["object"];
                assert!(t["metadata"]["resourceVersion"].is_string(), "{side}: {t}");
                t["metadata"]["resourceVersion"] = Value::Null;
                let o = &mut t["rows"][0]["object"];
                if !o.is_null() {
                    assert!(o["metadata"]["resourceVersion"].is_string(), "{side}: {o}");
                    o["metadata"]["resourceVersion"] = Value::Null;
                }
                for e in added.iter_mut() {
                    assert_eq!(e["type"], "ADDED", "{side} {r} {io}");
                    check_and_blank_ages(&mut e["object"], &cols, &created, t0, t1);
                    // Only the first event carries the columns, in whichever order.
                    t["columnDefinitions"] = Value::Null;
                }
                last["object"]["columnDefinitions"] = Value::Null;
                added.sort_by_key(|e| e["object"]["rows"][0]["cells"][0].to_string());
            }
            assert_eq!(
                p, d,
                "{r} Table watch with initial events {io}: proxy (left), direct"
            );
        }
    }
    let (served_after, passed_after) = served();
    assert_eq!(
        passed_after - passed_before,
        0,
        "Table watches passed through"
    );
    assert_eq!(
        served_after - served_before,
        watched,
        "Table watches with bookmarks written by the cache"
    );
    println!(
        "tables: {watched} Table watches with initial events and bookmarks equal to direct, from the cache"
    );

    // The CRD gets one more printer column: the proxy's widgets Tables carry it from the
    // cache once the table side fetched its rows again (columns checked against the CRD).
    let widgets = state.caches.get("example.com", "v1", "widgets").unwrap();
    let changes = widgets.table.stats.column_changes.load(Relaxed);
    let req = http::Request::patch(
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/widgets.example.com",
    )
    .header("content-type", "application/json-patch+json")
    .body(
        serde_json::to_vec(
            &json!([{"op": "add", "path": "/spec/versions/0/additionalPrinterColumns/-",
            "value": {"name": "Shape", "type": "string", "jsonPath": ".spec.shape"}}]),
        )
        .unwrap(),
    )
    .unwrap();
    admin.request_text(req).await.unwrap();
    let path = format!("/apis/example.com/v1/namespaces/{NS}/widgets?limit=500");
    eventually(
        "the widgets' new column, from the cache",
        BOUND,
        async || {
            let before = widgets.table.stats.served.load(Relaxed);
            let t0 = now_ms();
            let mut p = send(&via, "GET", &path, KUBECTL, None).await;
            let mut d = send(&admin, "GET", &path, KUBECTL, None).await;
            let t1 = now_ms();
            let cached = widgets.table.stats.served.load(Relaxed) > before;
            let cols = age_columns(&d);
            check_and_blank_ages(&mut d, &cols, &created, t0, t1);
            if age_columns(&p) == cols {
                check_and_blank_ages(&mut p, &cols, &created, t0, t1);
            }
            let (_, _) = (p["metadata"].take(), d["metadata"].take());
            let shape = d["columnDefinitions"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["name"] == "Shape");
            ok_if(
                cached && shape && p == d,
                format!("from the cache: {cached}; proxy:\n{p}\ndirect:\n{d}"),
            )
        },
    )
    .await;
    assert!(widgets.table.stats.column_changes.load(Relaxed) > changes);
    let (pw, dw) = (
        kubectl(&cp, &pk, &["get", "widgets", "-n", NS, "-o", "wide"]),
        kubectl(&cp, &dk, &["get", "widgets", "-n", NS, "-o", "wide"]),
    );
    assert_eq!(
        cells(&pw),
        cells(&dw),
        "kubectl get widgets -o wide after the CRD changed"
    );
    assert!(pw.contains("SHAPE"), "{pw}");
    proxy.shutdown().await;
    cp.stop().await;
}

/// A warm restart (`cache.stateDir`) keeps the table side: the restarted proxy answers
/// Tables from rows it saved, equal to the apiserver's, before any row came from upstream;
/// its side resumes its watch and brings the rows of versions written afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_restart_keeps_the_table_side() {
    const NS: &str = "e2e-tables-warm";
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    cp.create_default_service_account(NS).await.unwrap();
    let upstream = kube_config(&cp.admin_kubeconfig_yaml()).await;
    let admin = kube::Client::try_from(upstream.clone()).unwrap();
    let cms = format!("/api/v1/namespaces/{NS}/configmaps");
    for i in 0..4 {
        send(
            &admin,
            "POST",
            &cms,
            "application/json",
            Some(
                json!({"metadata": {"name": format!("cm-{i}")}, "data": {"k": "v".repeat(i + 1)}}),
            ),
        )
        .await;
    }
    let state_dir = tempfile::tempdir().unwrap();
    let dir = state_dir.path().to_path_buf();
    let mut proxy = TestProxy::start_with_kube(upstream, |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.cache.state_dir = Some(dir);
    })
    .await;
    let via = kube::Client::try_from(kube_config(&proxy.kubeconfig_yaml(cp.admin_token())).await)
        .unwrap();
    let cache_of = |p: &TestProxy| {
        let state = &p.running.as_ref().unwrap().state;
        state.caches.get("", "v1", "configmaps")
    };
    let cache = || cache_of(&proxy);
    let path = format!("{cms}?limit=500");
    // The side starts with the first Table reader.
    eventually("configmaps: a Table from the cache", BOUND, async || {
        let c = cache().ok_or("no cache")?;
        let before = c.table.stats.served.load(Relaxed);
        let t = send(&via, "GET", &path, TABLE, None).await;
        let rows = t["rows"].as_array().map_or(0, Vec::len);
        ok_if(
            c.table.stats.served.load(Relaxed) > before && rows == 4,
            format!("{rows} rows"),
        )
    })
    .await;

    proxy.restart(|_| {}).await;
    let cache = || cache_of(&proxy);
    let via = kube::Client::try_from(kube_config(&proxy.kubeconfig_yaml(cp.admin_token())).await)
        .unwrap();
    let mut created = std::collections::HashMap::new();
    let l = send(&admin, "GET", &cms, "application/json", None).await;
    for i in l["items"].as_array().unwrap() {
        let at = i["metadata"]["creationTimestamp"].as_str().unwrap();
        created.insert(
            i["metadata"]["name"].as_str().unwrap().to_string(),
            parse_time(at).unwrap(),
        );
    }
    let created = |n: &str| created[n];
    eventually(
        "after the restart: the saved rows, from the cache",
        BOUND,
        async || {
            let c = cache().ok_or("no cache")?;
            let before = c.table.stats.served.load(Relaxed);
            let t0 = now_ms();
            let mut p = send(&via, "GET", &path, KUBECTL, None).await;
            let mut d = send(&admin, "GET", &path, KUBECTL, None).await;
            let t1 = now_ms();
            let from_cache = c.table.stats.served.load(Relaxed) > before;
            let cols = age_columns(&d);
            check_and_blank_ages(&mut p, &cols, &created, t0, t1);
            check_and_blank_ages(&mut d, &cols, &created, t0, t1);
            let (_, _) = (p["metadata"].take(), d["metadata"].take());
            ok_if(
                from_cache && p == d,
                format!("from the cache: {from_cache}; proxy:\n{p}\ndirect:\n{d}"),
            )
        },
    )
    .await;
    let c = cache().unwrap();
    assert_eq!(
        c.table.stats.rows_in.load(Relaxed),
        0,
        "rows fetched from the apiserver after a warm restart"
    );
    // A version written after the restart: its row comes from the resumed watch.
    let req = http::Request::patch(format!("{cms}/cm-0"))
        .header("content-type", "application/merge-patch+json")
        .body(serde_json::to_vec(&json!({"data": {"k": "changed", "k2": "new"}})).unwrap())
        .unwrap();
    admin.request_text(req).await.unwrap();
    eventually(
        "the changed configmap's row, from the cache",
        BOUND,
        async || {
            let before = c.table.stats.served.load(Relaxed);
            let t = send(&via, "GET", &format!("{cms}/cm-0"), TABLE, None).await;
            let data = t["rows"][0]["cells"][1].clone();
            let from_cache = c.table.stats.served.load(Relaxed) > before;
            ok_if(
                from_cache && data == 2,
                format!("from the cache: {from_cache}; data {data}"),
            )
        },
    )
    .await;
    assert!(c.table.stats.rows_in.load(Relaxed) > 0);
    println!("tables: a warm restart kept the table side; its watch resumed");
    proxy.shutdown().await;
    cp.stop().await;
}
