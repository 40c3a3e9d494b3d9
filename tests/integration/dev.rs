//! `kube-cache-proxy dev` refuses a busy port before it builds, starts or writes anything.

use std::net::TcpListener;
use std::process::Command;

/// Runs `dev` with `out` as its output directory and the given listen flags.
fn dev(out: &std::path::Path, listen: &str, admin: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kube-cache-proxy"))
        .args(["dev", "--listen", listen, "--admin-listen", admin, "--out"])
        .arg(out)
        .env_remove("KCP_DEV_LISTEN")
        .env_remove("KCP_DEV_ADMIN_LISTEN")
        .output()
        .expect("running kube-cache-proxy dev")
}

#[test]
fn dev_on_a_busy_port_fails_before_starting_anything_and_writes_no_kubeconfig() {
    let held = TcpListener::bind("127.0.0.1:0").unwrap();
    let busy = held.local_addr().unwrap();
    for (flag, listen, admin) in [
        ("--listen", busy.to_string(), "127.0.0.1:0".to_string()),
        (
            "--admin-listen",
            "127.0.0.1:0".to_string(),
            busy.to_string(),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        let o = dev(&out, &listen, &admin);
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{flag}: exits non-zero\n{stderr}");
        assert!(
            stderr.contains(&format!("{flag} {busy}"))
                && stderr.contains(&format!("port {}", busy.port())),
            "{flag}: the message names the flag and the port:\n{stderr}"
        );
        // Nothing was prepared: no output directory, so no kubeconfig, no logs of a control
        // plane (the port check comes before all of it).
        assert!(!out.exists(), "{flag}: {} was created", out.display());
        assert!(
            !stderr.contains("preparing kube-apiserver"),
            "{flag}: started building:\n{stderr}"
        );
    }
    drop(held);
}
