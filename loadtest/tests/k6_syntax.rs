//! The k6 scripts cannot run here (k6 is AGPL and not installed), but they must at least parse:
//! `node --check` on each one (they are ES modules, see loadtest/k6/package.json).

use std::path::{Path, PathBuf};
use std::process::Command;

fn scripts(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            scripts(&p, out);
        } else if p.extension().is_some_and(|x| x == "js") {
            out.push(p);
        }
    }
}

#[test]
fn every_k6_script_parses_and_each_driver_scenario_has_one() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("k6");
    let mut found = Vec::new();
    scripts(&dir, &mut found);
    found.sort();
    let names: Vec<String> = found
        .iter()
        .map(|p| p.strip_prefix(&dir).unwrap().display().to_string())
        .collect();
    // Scenario-for-scenario with the driver: a = watch + churn, b = informer, c = list,
    // d = get, e = mixed.
    for want in [
        "watch.js",
        "churn.js",
        "informer.js",
        "list.js",
        "get.js",
        "mixed.js",
        "lib/kube.js",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "k6/{want} missing: {names:?}"
        );
    }
    if Command::new("node").arg("--version").output().is_err() {
        eprintln!("SKIPPED: node is not installed, so the k6 scripts were not syntax-checked");
        return;
    }
    for p in &found {
        let out = Command::new("node").arg("--check").arg(p).output().unwrap();
        assert!(
            out.status.success(),
            "{}: {}",
            p.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
