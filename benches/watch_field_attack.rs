//! Micro-benchmark (in-process: no HTTP, no TLS, no kube-apiserver) of what many *distinct*
//! field filters (`X-Kube-Cache-Proxy-Watch-Fields`, `docs/watch-fields.md`) cost per write,
//! the cross-namespace denial of service of issue 50: one user opens watches each with a
//! different filter, and every write of the resource paid one evaluation per distinct filter
//! over the whole of both objects. Each row is one `Hub::dispatch` of a MODIFIED event plus
//! every watcher taking its queued frames (what the HTTP writer does first), timed together;
//! the rows of one group are measured in the same run.
//!
//! - `select`: a ~3 KB pod, 6,000 watchers: no filter (the baseline), one shared 32-path
//!   filter, 6,000 distinct 32-path filters (each its own annotation keys and `spec`); status
//!   writes (suppressed for the filtered) and spec writes (delivered to all).
//! - `ignore`: a ConfigMap of 40,000 keys × 8 B whose one key changes per write, 100
//!   watchers: one shared ignore filter (`-data[k0]`) against 100 distinct ones
//!   (`-data[k<i>]`).
//! - `direct`: the first evaluation (each distinct filter compares the two objects under
//!   its paths, `WatchFields::changed`) of the same filters, for scale.
//!
//! The watchers' filters are interned by `Hub::subscribe` (each distinct filter a slot of the
//! hub's `watch_fields::Registry`, the select filters' paths one trie), so a select write is
//! decided by one walk of its changed paths whatever the number of distinct filters. The
//! last column counts `HubStats::change_evaluations` per write: one per walk of the select
//! filters' trie, one per distinct ignore filter decided.
//!
//! ```text
//! cargo bench --bench watch_field_attack
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{Criterion, criterion_group, criterion_main};
use kube_cache_proxy::cache::event::{Encoding, Event};
use kube_cache_proxy::cache::hub::{Filter, Hub, Subscription};
use kube_cache_proxy::cache::{CachedObject, EventKind, Resource};
use kube_cache_proxy::k8s::watch_fields::WatchFields;

fn pods() -> Resource {
    Resource::core("pods", "Pod", true)
}

fn configmaps() -> Resource {
    Resource::core("configmaps", "ConfigMap", true)
}

/// A pod of about 3 KB whose spec (`s`) or status heartbeat (`n`) varies.
fn pod(rv: u64, s: u64, n: u64) -> Arc<CachedObject> {
    let containers: Vec<_> = (0..4)
        .map(|i| serde_json::json!({"name": format!("c{i}"), "image": "registry.k8s.io/pause:3.10",
            "env": [{"name": "A", "value": "b".repeat(100)}], "resources": {"limits": {"cpu": "1"}}}))
        .collect();
    let annotations: serde_json::Map<String, serde_json::Value> = (0..8)
        .map(|i| (format!("example.com/a{i}"), serde_json::json!("v")))
        .collect();
    let v = serde_json::json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u", "resourceVersion": rv.to_string(),
                     "labels": {"app": "a"}, "annotations": annotations,
                     "managedFields": [{"manager": "kubelet", "time": n.to_string()}]},
        "spec": {"containers": containers, "nodeName": "node-1", "generation": s},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "lastProbeTime": n.to_string()}]},
    });
    Arc::new(CachedObject::parse(Bytes::from(v.to_string()), &pods()).unwrap())
}

/// A ConfigMap of `keys` keys of 8 bytes, key `k<changed>` holding `rv`.
fn big_configmap(rv: u64, keys: usize, changed: usize) -> Arc<CachedObject> {
    let mut data = String::with_capacity(keys * 24);
    for k in 0..keys {
        if k > 0 {
            data.push(',');
        }
        let v = if k == changed {
            format!("{:08}", rv % 100_000_000)
        } else {
            "xxxxxxxx".to_string()
        };
        data.push_str(&format!("\"k{k}\":\"{v}\""));
    }
    let raw = format!(
        r#"{{"metadata":{{"name":"big","namespace":"ns","resourceVersion":"{rv}"}},"data":{{{data}}}}}"#
    );
    Arc::new(CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap())
}

fn drain(subs: &mut [Subscription], r: &Resource) -> u64 {
    let mut n = 0;
    for s in subs {
        while let Ok((e, d)) = s.rx.try_recv() {
            n += 1;
            black_box(e.frame(r, d, Encoding::Json).len());
        }
    }
    n
}

fn watchers(hub: &Arc<Hub>, filters: &[Option<Arc<WatchFields>>]) -> Vec<Subscription> {
    filters
        .iter()
        .map(|f| {
            hub.subscribe(Arc::new(Filter {
                changes: f.clone(),
                ..Filter::default()
            }))
        })
        .collect()
}

/// 32 paths, distinct per `i`: 30 annotation keys of its own, `spec` and the shared labels.
fn select_filter(i: usize) -> Arc<WatchFields> {
    let paths: Vec<String> = (0..30)
        .map(|j| format!("metadata.annotations[example.com/w{i}-{j}]"))
        .chain(["spec".to_string(), "metadata.labels".to_string()])
        .collect();
    Arc::new(WatchFields::parse(&paths.join(",")).unwrap())
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let _g = rt.enter();
    let mut rows: Vec<String> = Vec::new();
    let mut time =
        |c: &mut Criterion,
         name: &str,
         filters: Vec<Option<Arc<WatchFields>>>,
         resource: Resource,
         next: &mut dyn FnMut(u64) -> (Arc<CachedObject>, Arc<CachedObject>)| {
            let hub = Hub::new(64, Duration::from_millis(100));
            let mut subs = watchers(&hub, &filters);
            let mut rv = 10;
            let (mut events, mut delivered, mut total) = (0u64, 0u64, Duration::ZERO);
            c.bench_function(name, |b| {
                b.iter_custom(|iters| {
                    let mut t = Duration::ZERO;
                    for _ in 0..iters {
                        rv += 1;
                        let (prev, cur) = next(rv);
                        let e = Arc::new(Event::new(EventKind::Modified, cur, Some(prev)));
                        let start = Instant::now();
                        rt.block_on(hub.dispatch(e));
                        delivered += drain(&mut subs, &resource);
                        t += start.elapsed();
                        events += 1;
                    }
                    total += t;
                    t
                })
            });
            let ms = total.as_secs_f64() * 1e3 / events as f64;
            rows.push(format!(
                "| {name} | {ms:.3} | {:.0} | {} |",
                delivered as f64 / events as f64,
                hub.stats
                    .change_evaluations
                    .load(std::sync::atomic::Ordering::Relaxed)
                    / events.max(1)
            ));
            ms
        };

    // Select form on a pod, 6,000 watchers.
    const W: usize = 6000;
    let shared = select_filter(0);
    let distinct: Vec<_> = (0..W).map(select_filter).collect();
    for (label, spec) in [("status writes", false), ("spec writes", true)] {
        let mut next = |rv: u64| {
            if spec {
                (pod(rv - 1, rv - 1, 0), pod(rv, rv, 0))
            } else {
                (pod(rv - 1, 0, rv - 1), pod(rv, 0, rv))
            }
        };
        time(
            c,
            &format!("select, {W} watchers, no filter, {label}"),
            vec![None; W],
            pods(),
            &mut next,
        );
        time(
            c,
            &format!("select, {W} watchers, one shared 32-path filter, {label}"),
            vec![Some(shared.clone()); W],
            pods(),
            &mut next,
        );
        time(
            c,
            &format!("select, {W} watchers, {W} distinct 32-path filters, {label}"),
            distinct.iter().cloned().map(Some).collect(),
            pods(),
            &mut next,
        );
    }
    // The previous evaluation of the distinct filters: each compares the objects itself.
    {
        let (a, b) = (pod(1, 0, 1), pod(2, 0, 2));
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_slice(&a.body).unwrap(),
            serde_json::from_slice(&b.body).unwrap(),
        );
        c.bench_function(
            &format!("direct: {W} distinct 32-path filters, one status write"),
            |bch| bch.iter(|| distinct.iter().filter(|f| f.changed(&a, &b)).count()),
        );
    }

    // Ignore form on a 40,000-key ConfigMap, 100 watchers.
    const KEYS: usize = 40_000;
    let base = big_configmap(0, KEYS, usize::MAX);
    let mut next = |rv: u64| {
        let k = (rv as usize * 7919) % KEYS;
        (base.clone(), big_configmap(rv, KEYS, k))
    };
    let one = Arc::new(WatchFields::parse("-data[k0]").unwrap());
    time(
        c,
        "ignore, 40,000-key ConfigMap, 100 watchers, one shared filter",
        vec![Some(one.clone()); 100],
        configmaps(),
        &mut next,
    );
    let hundred: Vec<_> = (0..100)
        .map(|i| {
            Some(Arc::new(
                WatchFields::parse(&format!("-data[k{i}]")).unwrap(),
            ))
        })
        .collect();
    time(
        c,
        "ignore, 40,000-key ConfigMap, 100 watchers, 100 distinct filters",
        hundred.clone(),
        configmaps(),
        &mut next,
    );
    {
        let (a, b) = next(11);
        let (a, b): (serde_json::Value, serde_json::Value) = (
            serde_json::from_slice(&a.body).unwrap(),
            serde_json::from_slice(&b.body).unwrap(),
        );
        c.bench_function(
            "direct: 100 distinct ignore filters, 40,000-key ConfigMap, one write",
            |bch| {
                bch.iter(|| {
                    hundred
                        .iter()
                        .flatten()
                        .filter(|f| f.changed(&a, &b))
                        .count()
                })
            },
        );
    }

    println!(
        "\n| micro-benchmark (in-process): dispatch + watchers taking their frames | ms per write | deliveries per write | filter decisions per write |"
    );
    println!("| --- | --- | --- | --- |");
    for r in rows {
        println!("{r}");
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).measurement_time(Duration::from_secs(4)).warm_up_time(Duration::from_secs(1));
    targets = bench
}
criterion_main!(benches);
