//! `kube-cache-proxy check-config` as a gate: the binary, run as users run it. The shipped
//! configurations pass exactly as their header comments say to check them; a broken file gets
//! every error at once and exit status 1. (`--kubeconfig`, the discovery check, needs a real
//! apiserver: `tests/e2e/deploy.rs`.)

use std::path::Path;
use std::process::{Command, Output};

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn check_config(args: &[&str], cwd: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kube-cache-proxy"))
        .arg("check-config")
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("running kube-cache-proxy check-config")
}

/// The `kube-cache-proxy check-config ...` command in the leading comment block of `file`.
fn header_command(file: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo().join(file)).unwrap();
    let line = text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .find_map(|l| {
            l.trim_start_matches('#')
                .trim()
                .strip_prefix("kube-cache-proxy check-config ")
        })
        .unwrap_or_else(|| panic!("{file}: the header says how to check it"));
    line.split_whitespace().map(String::from).collect()
}

#[test]
fn the_shipped_configurations_pass_as_their_headers_say_to_check_them() {
    for file in [
        "config/kube-cache-proxy.yaml",
        "deploy/kustomize/base/config.yaml",
    ] {
        let args = header_command(file);
        assert_eq!(args.last().map(String::as_str), Some(file), "{args:?}");
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = check_config(&args, repo());
        assert!(
            o.status.success(),
            "{file}: {args:?}\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{file}: ok\n"));
    }
    // The pod's file names files that exist only in the pod: without --no-files, that is
    // what check-config says (so the flag in the header is needed, and checks something).
    let o = check_config(&["deploy/kustomize/base/config.yaml"], repo());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(
        stderr.contains("tls.certFile: reading /etc/kube-cache-proxy/tls/tls.crt")
            && stderr.contains("tokens.keyFile: /etc/kube-cache-proxy/tokens/keys"),
        "{stderr}"
    );
}

#[test]
fn a_broken_file_gets_every_error_at_once_and_exit_status_1() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("c.yaml"),
        "listen: not-an-address\nshutdown:\n  dealy: 5s\nserver:\n  maxConnections: 0\n\
         cache:\n  resources: [pods, Deployments]\ntls:\n  keyFile: /k\n",
    )
    .unwrap();
    let o = check_config(&["c.yaml"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&o.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    // (No "no listener" beside the unparsable `listen` and the incomplete TLS pair: it
    // follows from them.)
    assert_eq!(lines[0], "c.yaml: 5 error(s)", "{stderr}");
    let mut paths: Vec<&str> = lines[1..]
        .iter()
        .map(|l| l.split(": ").nth(1).unwrap())
        .collect();
    paths.sort_unstable();
    assert_eq!(
        paths,
        [
            "cache.resources[1]",
            "listen",
            "server.maxConnections",
            "shutdown.dealy",
            "tls.certFile",
        ],
        "{stderr}"
    );
    // --no-files does not hide errors in the file itself.
    let o = check_config(&["--no-files", "c.yaml"], dir.path());
    assert_eq!(String::from_utf8_lossy(&o.stderr), stderr);
}

/// Both files of the serving pair are named and neither exists: both are reported.
#[test]
fn a_missing_key_file_is_reported_beside_a_missing_certificate() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("c.yaml"),
        "tls:\n  certFile: /nonexistent/tls.crt\n  keyFile: /nonexistent/tls.key\n",
    )
    .unwrap();
    let o = check_config(&["c.yaml"], dir.path());
    assert_eq!(o.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(stderr.starts_with("c.yaml: 2 error(s)\n"), "{stderr}");
    assert!(
        stderr.contains("c.yaml: tls.certFile: ") && stderr.contains("/nonexistent/tls.crt"),
        "{stderr}"
    );
    assert!(
        stderr.contains("c.yaml: tls.keyFile: reading /nonexistent/tls.key: "),
        "{stderr}"
    );
}

/// An address that does not parse is the error; the "no listener" it would lead to is not
/// reported as a second one.
#[test]
fn an_unparsable_listener_is_one_error() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.yaml"), "insecureListen: nowhere\n").unwrap();
    let o = check_config(&["c.yaml"], dir.path());
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr.starts_with("c.yaml: 1 error(s)\nc.yaml: insecureListen: "),
        "{stderr}"
    );
}
