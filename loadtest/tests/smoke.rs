//! The smoke profile of the load driver, end to end: a real kube-apiserver + etcd, the proxy
//! as a child process, every scenario on both sides. The driver exits 1 when a correctness
//! check fails; the JSON it writes is checked here too.

use std::process::Command;

use serde_json::Value;

#[test]
fn smoke_profile_runs_every_scenario_on_both_sides_and_passes_its_checks() {
    let out = tempfile::tempdir().unwrap();
    let status = Command::new(env!("CARGO_BIN_EXE_loadtest"))
        .args(["--profile", "smoke", "--out"])
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
    for ext in ["md", "svg"] {
        assert!(
            files
                .iter()
                .any(|p| p.extension().is_some_and(|x| x == ext)),
            "no .{ext} report"
        );
    }

    let sides = |s: &str| -> Vec<String> {
        run[s]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["side"].as_str().unwrap().to_string())
            .collect()
    };
    for s in ["c", "e"] {
        assert_eq!(sides(s), ["apiserver", "proxy"], "scenario {s}");
    }

    // a: a sweep of rates per side, the apiserver's first; at each side's first (lowest) rate
    // every write reached every watcher exactly once, and the proxy served every watch from
    // its cache.
    let a = run["a"].as_array().unwrap();
    let rates: Vec<f64> = run["profile"]["a_rates"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r.as_f64().unwrap())
        .collect();
    assert!(
        sides("a").starts_with(&["apiserver".to_string()]),
        "{:?}",
        sides("a")
    );
    for side in ["apiserver", "proxy"] {
        let first = a
            .iter()
            .find(|r| r["side"] == side)
            .unwrap_or_else(|| panic!("no a phase on the {side}"));
        assert_eq!(first["rate"].as_f64(), Some(rates[0]), "{first}");
        let x = &first["result"];
        assert!(x["writes"].as_u64().unwrap() > 0);
        assert_eq!(x["missed"], 0);
        assert_eq!(x["duplicated"], 0);
        assert_eq!(
            x["deliveries"].as_u64().unwrap(),
            x["writes"].as_u64().unwrap() * x["watchers"].as_u64().unwrap()
        );
        if side == "proxy" {
            assert_eq!(first["watches"]["upstream"], 0, "{first}");
            assert_eq!(first["watches"]["cache"], x["watchers"], "{first}");
        }
    }

    // c: `limit` means the same on both sides: full pages, the same pages per walk.
    let c = run["c"].as_array().unwrap();
    let pages: Vec<(u64, u64)> = c
        .iter()
        .map(|r| {
            let x = &r["result"];
            assert_eq!(x["short_pages"], 0, "{x}");
            (x["pages"].as_u64().unwrap(), x["walks"].as_u64().unwrap())
        })
        .collect();
    assert_eq!(pages[0], pages[1]);

    // d: the apiserver and the default proxy each get quorum, rv0 and passthrough GETs, then
    // a strict proxy quorum GETs; on the proxy the Leases all pass through, rv0 reads all come
    // from the cache, and strict confirms with the apiserver.
    let d: Vec<(String, String, String)> = run["d"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let s = |v: &Value| v.as_str().unwrap().to_string();
            (s(&r["side"]), s(&r["consistency"]), s(&r["result"]["kind"]))
        })
        .collect();
    let want: Vec<(String, String, String)> = [
        ("apiserver", "-", "quorum"),
        ("apiserver", "-", "rv0"),
        ("apiserver", "-", "passthrough"),
        ("proxy", "bounded", "quorum"),
        ("proxy", "bounded", "rv0"),
        ("proxy", "bounded", "passthrough"),
        ("proxy", "strict", "quorum"),
    ]
    .iter()
    .map(|(a, b, c)| (a.to_string(), b.to_string(), c.to_string()))
    .collect();
    assert_eq!(d, want);
    let row = |i: usize| &run["d"][i];
    let requests = |i: usize| row(i)["result"]["requests"].clone();
    assert_eq!(row(5)["served"]["cache"], 0);
    assert_eq!(row(5)["served"]["upstream"], requests(5));
    assert_eq!(row(4)["served"]["cache"], requests(4));
    assert!(row(6)["probes"].as_u64().unwrap() > 0, "{}", row(6));

    // b: K informers cost the apiserver K LISTs and K WATCHes directly, one of each through
    // the proxy (its own), and nothing more for the WatchList storm.
    let k = run["profile"]["b_clients"].as_i64().unwrap();
    let storm = |side: &str, mode: &str| {
        run["b"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["side"] == side && r["mode"] == mode)
            .unwrap_or_else(|| panic!("no b row {side} {mode}"))
            .clone()
    };
    let counts = |r: &Value| {
        (
            r["upstream_lists"].as_i64().unwrap(),
            r["upstream_watches_opened"].as_i64().unwrap(),
        )
    };
    assert_eq!(counts(&storm("apiserver", "Legacy")), (k, k));
    assert_eq!(counts(&storm("apiserver", "WatchList")), (0, k));
    // The proxy's own: its cache's LIST and one WATCH (the protobuf is written from the
    // JSON objects, `cache.protobufTranscode`: no protobuf side's WATCH).
    assert_eq!(counts(&storm("proxy", "Legacy")), (1, 1));
    assert_eq!(counts(&storm("proxy", "WatchList")), (0, 0));

    // f: the apiserver and the unfiltered proxy deliver every write to every watcher; with half
    // the watchers filtered on `spec`, those get exactly the spec writes, the others everything.
    let f: Vec<&Value> = run["f"].as_array().unwrap().iter().collect();
    let phases: Vec<(String, String)> = f
        .iter()
        .map(|r| {
            (
                r["side"].as_str().unwrap().to_string(),
                r["result"]["filters"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        phases,
        [("apiserver", "none"), ("proxy", "none"), ("proxy", "half")]
            .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    for r in &f {
        let x = &r["result"];
        let writes = x["writes"].as_u64().unwrap();
        let spec = x["spec_writes"].as_u64().unwrap();
        assert!(writes > spec && spec > 0, "{x}");
        let u = &x["unfiltered"];
        assert_eq!(
            u["deliveries"].as_u64().unwrap(),
            writes * u["watchers"].as_u64().unwrap(),
            "{x}"
        );
        let g = &x["filtered"];
        if x["filters"] == "half" {
            let n = g["watchers"].as_u64().unwrap();
            assert!(n > 0 && u["watchers"].as_u64().unwrap() > 0, "{x}");
            assert_eq!(g["deliveries"].as_u64().unwrap(), spec * n, "{x}");
            assert_eq!(g["applied"].as_u64().unwrap(), n, "{x}");
            assert_eq!(g["behind"], 0, "{x}");
        } else {
            assert_eq!(g["watchers"], 0, "{x}");
        }
    }

    // Process usage was sampled for the proxy child, the apiserver and etcd.
    let proxy_phase = a.iter().find(|r| r["side"] == "proxy").unwrap();
    let procs: Vec<&str> = proxy_phase["usage"]["procs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    for want in ["etcd", "kube-apiserver", "proxy", "driver"] {
        assert!(procs.contains(&want), "{want} not sampled: {procs:?}");
    }
    assert!(run["loopback_gbps"].as_f64().unwrap() > 0.0);
}
