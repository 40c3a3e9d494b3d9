//! Adaptive paging against a real kube-apiserver + etcd: the controller reads the apiserver's
//! real `/metrics` and etcd's, and produces page sizes that follow its formula from populated
//! inputs. The observed inputs and sizes are printed (`--nocapture`).

use std::time::Duration;

use crate::support::eventually::eventually;
use crate::support::proxy::{TestProxy, plain_client};
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_cache_proxy::app::dev::{ControlPlane, ControlPlaneOptions};
use serde_json::{Value, json};

const BOUND: Duration = Duration::from_secs(90);

async fn kube_config(yaml: &str) -> kube::Config {
    let kc = kube::config::Kubeconfig::from_yaml(yaml).unwrap();
    kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .unwrap()
}

fn signal<'a>(record: &'a Value, name: &str) -> Option<&'a Value> {
    record["inputs"]["load"]["signals"]
        .as_array()?
        .iter()
        .find(|s| s["name"] == name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_apiserver_and_etcd_metrics_feed_a_sane_page_size() {
    let cp = ControlPlane::start(ControlPlaneOptions::default())
        .await
        .expect("control plane starts");
    let upstream = kube_config(&cp.admin_kubeconfig_yaml()).await;
    let etcd = cp.etcd_metrics_url.clone();
    let proxy = TestProxy::start_with_kube(upstream.clone(), |c| {
        c.paging.interval = Duration::from_secs(1);
        c.paging.etcd_metrics_url = Some(etcd);
    })
    .await;
    let admin = kube::Client::try_from(upstream).unwrap();
    if let Ok(path) = std::env::var("KCP_DUMP_METRICS") {
        let text = admin
            .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
            .await
            .unwrap();
        std::fs::write(path, text).unwrap();
    }

    // Some writes (etcd commits, etcd requests) and downstream LISTs while samples are taken.
    let cms = Api::<ConfigMap>::namespaced(admin.clone(), "default");
    for i in 0..30 {
        let cm: ConfigMap =
            serde_json::from_value(json!({"metadata": {"name": format!("paging-{i}")}})).unwrap();
        cms.create(&PostParams::default(), &cm).await.unwrap();
    }
    let client = plain_client(false);
    let token = cp.admin_token().to_string();
    let mut round = 0u64;
    let found = eventually("the paging inputs to be populated", BOUND, async || {
        round += 1;
        cms.patch(
            "paging-0",
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"round": round.to_string()}})),
        )
        .await
        .unwrap();
        for path in [
            "/api/v1/namespaces/default/configmaps",
            "/api/v1/namespaces/default/configmaps?resourceVersion=0",
            "/api/v1/namespaces?limit=5",
        ] {
            let req = http::Request::get(proxy.http(path))
                .header("authorization", format!("Bearer {token}"))
                .body(Full::default())
                .unwrap();
            let resp = client.request(req).await.unwrap();
            assert!(resp.status().is_success(), "{path}: {}", resp.status());
            resp.into_body().collect().await.unwrap();
        }
        let (_, b) = proxy.admin_get("/debug/paging").await;
        let j: Value = serde_json::from_str(&b).unwrap();
        let cur = &j["current"];
        // Several samples, so the moving average is seen moving.
        let ready = j["history"].as_array().is_some_and(|h| h.len() >= 8)
            && cur["inputs"]["downstreamLists"].as_u64() > Some(0)
            && cur["inputs"]["upstreamLatencyP95Seconds"].is_number()
            && signal(cur, "etcdRequestP99Seconds").is_some()
            && signal(cur, "etcdCommitP99Seconds").is_some();
        if ready { Ok(j) } else { Err(format!("{j:#}")) }
    })
    .await;
    let cur = &found["current"];
    eprintln!("observed paging sample against the real apiserver:\n{cur:#}");
    for r in found["history"].as_array().unwrap() {
        let i = &r["inputs"];
        eprintln!(
            "sample: listQps={:.1} listP95={} upstreamP95={} load={} factors(qps={:.3} load={} upLat={} downLat={}) -> upstream {} downstream {}",
            i["downstreamListQps"].as_f64().unwrap_or(0.0),
            i["downstreamListLatencyP95Seconds"],
            i["upstreamLatencyP95Seconds"],
            i["load"]["score"],
            r["factors"]["qps"].as_f64().unwrap_or(0.0),
            r["factors"]["load"],
            r["factors"]["upstreamLatency"],
            r["factors"]["downstreamLatency"],
            r["pageSize"]["upstream"],
            r["pageSize"]["downstream"],
        );
    }

    // Inputs populated from the real endpoints.
    let inputs = &cur["inputs"];
    assert!(
        inputs["load"]["errors"].as_array().unwrap().is_empty(),
        "{cur:#}"
    );
    let score = inputs["load"]["score"].as_f64().expect("a load score");
    assert!((0.0..=1.0).contains(&score), "{score}");
    // API Priority and Fairness creates its queue and rejection series only once a request
    // has queued or been rejected: on an idle apiserver those two signals are absent, and
    // the score comes from the others.
    for optional in ["inqueueRequests", "rejectedPerSecond"] {
        eprintln!("{optional}: {:?}", signal(cur, optional));
    }
    // Object counts are refreshed once a minute and read 0 before the first count.
    for name in [
        "etcdRequestP99Seconds",
        "etcdCommitP99Seconds",
        "etcdPendingProposals",
        "storageObjects",
    ] {
        let s = signal(cur, name).unwrap_or_else(|| panic!("{name} missing: {cur:#}"));
        let v = s["value"].as_f64().unwrap();
        let sc = s["score"].as_f64().unwrap();
        assert!(v >= 0.0 && (0.0..=1.0).contains(&sc), "{s}");
        assert!(sc <= score, "the score is the highest signal: {cur:#}");
    }
    assert!(
        signal(cur, "etcdRequestP99Seconds").unwrap()["operation"].is_string(),
        "{cur:#}"
    );
    assert!(inputs["downstreamListQps"].as_f64().unwrap() > 0.0);
    assert!(inputs["downstreamListLatencyP95Seconds"].as_f64().unwrap() > 0.0);
    assert!(inputs["upstreamLatencyP95Seconds"].as_f64().unwrap() > 0.0);

    // Sane output: within bounds and what the formula gives for the factors shown.
    let f = &cur["factors"];
    let num = |v: &Value| v.as_f64().unwrap();
    for (target, latency) in [
        ("upstream", "upstreamLatency"),
        ("downstream", "downstreamLatency"),
    ] {
        let want = (100.0 * num(&f["qps"]) * num(&f["load"]) * num(&f[latency])).clamp(20.0, 500.0);
        let got = num(&cur["target"][target]);
        assert!((got - want).abs() < 1e-9, "{target}: {got} vs {want}");
        let size = cur["pageSize"][target].as_u64().unwrap();
        assert!((20..=500).contains(&size), "{target}: {size}");
    }
    assert_eq!(found["pageSize"]["upstream"], cur["pageSize"]["upstream"]);

    proxy.shutdown().await;
    cp.stop().await;
}
