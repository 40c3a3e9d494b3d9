//! Helpers for the end-to-end tier (a real kube-apiserver).

/// Runs `kubectl --kubeconfig KUBECONFIG ARGS`, asserts it succeeded, and returns its output.
pub fn kubectl_ok(
    kubectl: &std::path::Path,
    kubeconfig: &std::path::Path,
    args: &[&str],
) -> String {
    let o = std::process::Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The apiserver's `/metrics` text.
async fn apiserver_metrics(admin: &kube::Client) -> String {
    admin
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .unwrap()
}

/// The apiserver's own count of open WATCH requests for `resource`, from its `/metrics`:
/// (all scopes, cluster scope). The apiserver keeps a couple of internal namespace-scoped
/// watches of its own (configmaps in kube-system, for instance).
pub async fn apiserver_watches(admin: &kube::Client, resource: &str) -> (u64, u64) {
    let text = apiserver_metrics(admin).await;
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_longrunning_requests{")
                && l.contains("verb=\"WATCH\"")
                && l.contains(&format!("resource=\"{resource}\""))
        })
        .filter_map(|l| {
            Some((
                l.contains("scope=\"cluster\""),
                l.rsplit(' ').next()?.parse::<f64>().ok()? as u64,
            ))
        })
        .fold((0, 0), |(all, cluster), (is_cluster, n)| {
            (all + n, cluster + if is_cluster { n } else { 0 })
        })
}

/// `apiserver_request_total` for LISTs of `resource`, summed over codes and scopes.
pub async fn apiserver_lists(admin: &kube::Client, resource: &str) -> u64 {
    let text = apiserver_metrics(admin).await;
    text.lines()
        .filter(|l| {
            l.starts_with("apiserver_request_total{")
                && l.contains("verb=\"LIST\"")
                && l.contains(&format!("resource=\"{resource}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// `kubectl get pods -n NS -w` through `kubeconfig`: the process and its output lines.
pub fn kubectl_watch_pods(
    kubectl: &std::path::Path,
    kubeconfig: &std::path::Path,
    ns: &str,
) -> (std::process::Child, std::sync::mpsc::Receiver<String>) {
    use std::process::{Command, Stdio};
    let mut w = Command::new(kubectl)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["get", "pods", "-n", ns, "-w"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let rx = line_receiver(w.stdout.take().unwrap());
    (w, rx)
}

/// The lines of `out` (a child's output), read on a thread of their own.
pub fn line_receiver(
    out: impl std::io::Read + Send + 'static,
) -> std::sync::mpsc::Receiver<String> {
    use std::io::{BufRead as _, BufReader};
    let (tx, rx) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for l in BufReader::new(out).lines().map_while(Result::ok) {
            let _ = tx.send(l);
        }
    });
    rx
}

/// Reads each `kubectl get -w` of [`kubectl_watch_pods`] into its `lines` up to and including
/// the row of pod `last` (each within `bound`), then ends the watches.
pub fn kubectl_watches_until(
    watches: Vec<(std::process::Child, std::sync::mpsc::Receiver<String>)>,
    lines: &mut [Vec<String>],
    last: &str,
    bound: std::time::Duration,
) {
    for ((_, rx), lines) in watches.iter().zip(lines.iter_mut()) {
        loop {
            let l = rx
                .recv_timeout(bound)
                .unwrap_or_else(|e| panic!("watch rows up to {last}: {e}"));
            let end = l.starts_with(&format!("{last} "));
            lines.push(l);
            if end {
                break;
            }
        }
    }
    for (mut w, _) in watches {
        let _ = w.kill();
        let _ = w.wait();
    }
}
