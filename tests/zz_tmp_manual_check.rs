// TEMPORARY manual check by the devcluster helper; deleted after use.
use kube_cache_proxy::devcluster::*;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn manual() {
    let clients = ensure_client_binaries().unwrap();
    let cp = ControlPlane::start(ControlPlaneOptions::default()).await.unwrap();
    cp.seed().await.unwrap();
    let kc = cp.dir.join("admin.kubeconfig");
    std::fs::write(&kc, cp.admin_kubeconfig_yaml()).unwrap();
    let kubectl = |args: &[&str]| {
        let o = Command::new(cp.kubectl()).arg("--kubeconfig").arg(&kc).args(args).output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    for (mode, res, ns) in [("legacy", "configmaps", "demo-a"), ("watchlist", "configmaps", ""), ("metadata", "pods", "demo-b"), ("watchlist", "pods", "demo-b")] {
        let errlog = format!("/tmp/kcp-manual/ic-{mode}-{res}.err");
        let mut child = Command::new(clients.join("informer-check"))
            .args(["--kubeconfig", kc.to_str().unwrap(), "--namespace", ns, "--mode", mode, "--resource", res])
            .stdin(Stdio::piped()).stdout(Stdio::piped())
            .stderr(std::fs::File::create(&errlog).unwrap())
            .spawn().unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap(); eprintln!("{mode}/{res}: {}", line.trim());
        line.clear(); out.read_line(&mut line).unwrap(); eprintln!("{mode}/{res}: {}", line.trim());
        let name = format!("new-{mode}-{res}");
        let created = kubectl(&["-n", if ns.is_empty() { "demo-a" } else { ns }, "create", "configmap", &name, "-o", "jsonpath={.metadata.resourceVersion}"]);
        let mut stdin = child.stdin.take().unwrap();
        writeln!(stdin, "WAIT {created}").unwrap();
        line.clear(); out.read_line(&mut line).unwrap();
        eprintln!("{mode}/{res}: {}", &line.trim()[..line.trim().len().min(400)]);
        drop(stdin);
        let st = child.wait().unwrap();
        eprintln!("{mode}/{res}: exit {st}; stderr: {}", std::fs::read_to_string(&errlog).unwrap().lines().filter(|l| l.starts_with("REQUEST")).collect::<Vec<_>>().join(" | "));
    }
    let py = String::from_utf8(Command::new("bash").arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/python/setup.sh")).output().unwrap().stdout).unwrap();
    let py = py.lines().last().unwrap().to_string();
    let mut child = Command::new(&py).arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/python/list_watch.py")).args([kc.to_str().unwrap(), "demo-b", "2", "20"]).stdout(Stdio::piped()).spawn().unwrap();
    std::thread::sleep(std::time::Duration::from_secs(3));
    kubectl(&["-n", "demo-b", "create", "configmap", "py-1"]);
    kubectl(&["-n", "demo-b", "delete", "configmap", "py-1"]);
    let o = child.wait_with_output().unwrap();
    eprintln!("python: {} {}", o.status, String::from_utf8_lossy(&o.stdout));
    let mut child = Command::new(&py).arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/python/list_watch.py")).args([kc.to_str().unwrap(), "demo-b", "5", "3"]).stdout(Stdio::piped()).spawn().unwrap();
    let o = child.wait_with_output().unwrap();
    eprintln!("python timeout: {} {}", o.status, String::from_utf8_lossy(&o.stdout));
    cp.stop().await;
}
