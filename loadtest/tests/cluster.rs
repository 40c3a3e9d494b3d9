//! The cluster scenario at a tiny size, for correctness only (no timing assertions): a real
//! etcd + kube-apiserver per side, kube-controller-manager, kube-scheduler, KWOK and
//! kube-state-metrics, kubelet-like and DaemonSet-like agents, straight at the apiserver and
//! through the proxy. Every phase converges on both sides (every pod Running at the current
//! generation, every informer synced and watching, the kubelets seeing exactly those pods),
//! no agent relists through the proxy, and the proxy serves the agents' reads from its cache.
//!
//! Builds KWOK and kube-state-metrics (`tests/e2e/build-cluster-components.sh`) and the
//! `conformance` set of `tests/e2e/build-control-plane.sh` the first time: minutes.

use std::process::Command;

use serde_json::Value;

const NODES: u64 = 6;
const AGENTS_PER_NODE: u64 = 1;

#[test]
fn a_tiny_cluster_converges_on_both_sides_and_the_proxy_serves_its_agents_from_the_cache() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args([
            "--only",
            "cluster",
            "--cluster-nodes",
            &NODES.to_string(),
            "--cluster-agents-per-node",
            &AGENTS_PER_NODE.to_string(),
            "--cluster-deployments",
            "3",
            "--cluster-pods",
            "18",
            "--cluster-restart-window",
            "5",
            "--cluster-timeout",
            "120",
            "--out",
        ])
        .arg(out.path())
        .status()
        .expect("running the driver");
    let files: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    let json = files
        .iter()
        .find(|p| p.extension().is_some_and(|x| x == "json"))
        .unwrap_or_else(|| panic!("no JSON written (exit {status}): {files:?}"));
    let run: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let failed: Vec<&Value> = run["checks"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["pass"] != true)
        .collect();
    assert!(failed.is_empty(), "failed checks: {failed:#?}");
    assert!(status.success(), "driver exit {status}");
    assert!(
        files
            .iter()
            .any(|p| p.extension().is_some_and(|x| x == "md")),
        "no .md report"
    );

    let sides = run["sides"].as_array().unwrap();
    let names: Vec<&str> = sides.iter().map(|s| s["side"].as_str().unwrap()).collect();
    assert_eq!(names, ["apiserver", "proxy"]);
    let phase = |side: usize, name: &str| -> &Value {
        sides[side]["phases"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .unwrap_or_else(|| panic!("no phase {name} on side {side}"))
    };
    // Informers: a kubelet's two (pods, its Node), a DaemonSet agent's three.
    let informers = NODES * 2 + NODES * AGENTS_PER_NODE * 3;
    for side in 0..2 {
        for name in [
            "cluster up",
            "agents connect",
            "steady churn",
            "agent rollout",
            "apiserver restart",
        ] {
            let p = phase(side, name);
            assert_eq!(p["converged"], true, "{name} on side {side}: {p}");
        }
        let connect = &phase(side, "agents connect")["agents"];
        assert_eq!(connect["lists"].as_u64(), Some(informers), "{connect}");
        assert_eq!(connect["watches"].as_u64(), Some(informers), "{connect}");
        // Each kubelet fetched what its pods reference (a ConfigMap and a Secret per
        // Deployment, the root CA ConfigMap) without a 403 left.
        assert!(connect["gets"].as_u64().unwrap() >= NODES, "{connect}");
    }
    // Through the proxy: no relist in any phase, the rolling restarts of its replicas (cold
    // and warm) included, and the agents' LISTs, WATCHes and GETs were served from its cache
    // (their phases open nothing else through it).
    for p in sides[1]["phases"].as_array().unwrap() {
        assert_eq!(p["agents"]["relists"], 0, "{}: {p}", p["name"]);
    }
    // The rolling restart of two replicas behind the balancer, cold and warm: converged.
    for name in [
        "proxy rolling restart (cold)",
        "proxy rolling restart (warm)",
    ] {
        let p = phase(1, name);
        assert_eq!(p["converged"], true, "{name}: {p}");
    }
    for name in ["agents connect", "agent rollout"] {
        let p = phase(1, name);
        let served = &p["proxy"]["served"];
        let n = |k: &str| served[k].as_u64().unwrap_or(0);
        let agents = &p["agents"];
        assert!(
            n("WATCH cache") >= agents["watches"].as_u64().unwrap(),
            "{name}: {served} {agents}"
        );
        assert!(
            n("LIST cache") >= agents["lists"].as_u64().unwrap(),
            "{name}: {served} {agents}"
        );
        assert_eq!(n("WATCH upstream"), 0, "{name}: {served}");
        assert_eq!(n("LIST upstream"), 0, "{name}: {served}");
    }
    // The apiserver restart: the proxy's clients kept their watches (nothing re-watched).
    let restart = &phase(1, "apiserver restart")["agents"];
    assert_eq!(restart["watches"], 0, "{restart}");
}
