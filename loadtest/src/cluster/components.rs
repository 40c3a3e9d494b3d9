//! The simulated cluster's real components as child processes: kube-controller-manager and
//! kube-scheduler (the pinned k8s.io/kubernetes, `tests/e2e/build-control-plane.sh
//! conformance`), KWOK and kube-state-metrics (`tests/e2e/build-cluster-components.sh`), each
//! with its own identity (a client certificate from the control plane's client CA) and
//! client-go's defaults, pointed at the apiserver or at the proxy.

use std::path::{Path, PathBuf};
use std::process::Stdio;

use anyhow::Context as _;
use kube_cache_proxy::app::dev::ControlPlane;

/// The bin directory of `tests/e2e/build-cluster-components.sh` (kwok, kwok-stages.yaml,
/// kube-state-metrics), building them the first time (minutes).
pub fn ensure_cluster_binaries() -> anyhow::Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("tests/e2e/build-cluster-components.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    anyhow::ensure!(
        out.status.success(),
        "{} failed ({})",
        script.display(),
        out.status
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let bin = stdout.lines().last().context("no bin directory printed")?;
    Ok(PathBuf::from(bin.trim()))
}

/// One running component; killed when dropped.
pub struct Component {
    pub name: &'static str,
    child: tokio::process::Child,
    pub log: PathBuf,
    /// The HTTP port it serves metrics on (kube-state-metrics).
    pub port: Option<u16>,
}

impl Component {
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    fn spawn(
        name: &'static str,
        bin: &Path,
        args: &[String],
        log: PathBuf,
    ) -> anyhow::Result<Self> {
        let out = std::fs::File::create(&log)?;
        let child = tokio::process::Command::new(bin)
            .args(args)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Component {
            name,
            child,
            log,
            port: None,
        })
    }

    /// Whether it still runs; an error with its log's tail when it exited.
    pub fn alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let text = std::fs::read_to_string(&self.log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(15).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            anyhow::bail!("{} exited ({status}):\n{}", self.name, tail.join("\n"));
        }
        Ok(())
    }

    /// SIGTERM, then SIGKILL after 10 s.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = tokio::process::Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        if tokio::time::timeout(std::time::Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.kill().await;
        }
    }
}

/// Where the components connect: the server URL and the CA of its serving certificate.
pub struct Endpoint {
    pub url: String,
    pub ca_pem: String,
}

/// Writes a kubeconfig for `user` (groups `groups`) with a fresh client certificate.
fn kubeconfig(
    cp: &ControlPlane,
    ep: &Endpoint,
    dir: &Path,
    user: &str,
    groups: &[&str],
) -> anyhow::Result<PathBuf> {
    let (cert, key) = cp.mint_client_cert(user, groups);
    let yaml = ControlPlane::kubeconfig_yaml(&ep.url, Some(&ep.ca_pem), None, Some((&cert, &key)));
    let path = dir.join(format!("{}.kubeconfig", user.replace(':', "_")));
    std::fs::write(&path, yaml)?;
    Ok(path)
}

/// Sizes and ports of the components.
pub struct ComponentOpts<'a> {
    pub k8s_bin: &'a Path,
    pub cluster_bin: &'a Path,
    pub dir: &'a Path,
}

/// Starts kube-controller-manager, kube-scheduler, kwok and kube-state-metrics against `ep`.
pub fn start_all(
    cp: &ControlPlane,
    ep: &Endpoint,
    o: &ComponentOpts<'_>,
) -> anyhow::Result<Vec<Component>> {
    let pki = cp.dir.join("pki");
    let dir = o.dir;
    std::fs::create_dir_all(dir)?;
    let mut v = Vec::new();
    let kcm = kubeconfig(cp, ep, dir, "system:kube-controller-manager", &[])?;
    v.push(Component::spawn(
        "kube-controller-manager",
        &o.k8s_bin.join("kube-controller-manager"),
        &[
            format!("--kubeconfig={}", kcm.display()),
            "--secure-port=0".into(),
            "--leader-elect=false".into(),
            "--controllers=*".into(),
            "--use-service-account-credentials=true".into(),
            format!(
                "--service-account-private-key-file={}",
                pki.join("sa.key").display()
            ),
            format!("--root-ca-file={}", pki.join("serving-ca.crt").display()),
            "--service-cluster-ip-range=10.96.0.0/24".into(),
            // As production clusters of this size set them (client-go's default is 20/30).
            "--kube-api-qps=100".into(),
            "--kube-api-burst=200".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ],
        dir.join("kube-controller-manager.log"),
    )?);
    let sched = kubeconfig(cp, ep, dir, "system:kube-scheduler", &[])?;
    v.push(Component::spawn(
        "kube-scheduler",
        &o.k8s_bin.join("kube-scheduler"),
        &[
            format!("--kubeconfig={}", sched.display()),
            "--secure-port=0".into(),
            "--leader-elect=false".into(),
            "--kube-api-qps=100".into(),
            "--kube-api-burst=200".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ],
        dir.join("kube-scheduler.log"),
    )?);
    // KWOK acts for every simulated node (node status, leases, pod status): a privileged
    // controller of its own name.
    let kwok = kubeconfig(cp, ep, dir, "kwok-controller", &["system:masters"])?;
    v.push(Component::spawn(
        "kwok",
        &o.cluster_bin.join("kwok"),
        &[
            format!("--kubeconfig={}", kwok.display()),
            format!(
                "--config={}",
                o.cluster_bin.join("kwok-stages.yaml").display()
            ),
            "--manage-all-nodes=false".into(),
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake".into(),
            "--node-lease-duration-seconds=40".into(),
            "--cidr=10.0.0.0/16".into(),
            "--node-ip=127.0.0.1".into(),
        ],
        dir.join("kwok.log"),
    )?);
    v.push(kube_state_metrics(
        cp,
        ep,
        o.cluster_bin,
        dir,
        "kube-state-metrics",
    )?);
    Ok(v)
}

/// kube-state-metrics (identity `user`, group `lt:ksm`) against `ep`; its metrics port is
/// [`Component::port`].
pub fn kube_state_metrics(
    cp: &ControlPlane,
    ep: &Endpoint,
    cluster_bin: &Path,
    dir: &Path,
    user: &'static str,
) -> anyhow::Result<Component> {
    let ksm = kubeconfig(cp, ep, dir, user, &["lt:ksm"])?;
    let [port, tport] = kube_cache_proxy::app::dev::free_loopback_ports::<2>()?;
    let mut c = Component::spawn(
        "kube-state-metrics",
        &cluster_bin.join("kube-state-metrics"),
        &[
            format!("--kubeconfig={}", ksm.display()),
            "--host=127.0.0.1".into(),
            format!("--port={port}"),
            "--telemetry-host=127.0.0.1".into(),
            format!("--telemetry-port={tport}"),
        ],
        dir.join(format!("{user}.log")),
    )?;
    c.port = Some(port);
    Ok(c)
}
