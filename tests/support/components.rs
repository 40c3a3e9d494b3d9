//! kube-controller-manager and kube-scheduler as children of an end-to-end test, pointed at
//! any kubeconfig (the proxy's, for the tests that put them behind it). Built with the
//! `conformance` set of `tests/e2e/build-control-plane.sh` (`ensure_conformance_binaries`),
//! from the same pinned k8s.io/kubernetes as the apiserver. `ControlPlaneOptions::
//! controller_manager` runs kube-controller-manager too, but always against the apiserver
//! itself; this one can be stopped, restarted with other flags, and its log
//! read.
//!
//! Each start logs to its own file, `<log dir>/<name>.<n>.log`. A child is killed when its
//! [`Component`] is dropped (also while a test panics); [`Component::stop`] stops it with
//! SIGTERM first.

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use kube_cache_proxy::app::dev::ControlPlane;
use tokio::process::{Child, Command};

/// How long [`Component::stop`] waits after SIGTERM before SIGKILL (kube-controller-manager
/// and kube-scheduler stop their informers and return within a second or two).
const STOP_GRACE: Duration = Duration::from_secs(15);
/// Lines of a log quoted by [`Component::alive`].
const TAIL_LINES: usize = 40;

/// One control-plane component: its command line, and its process while it runs.
pub struct Component {
    pub name: &'static str,
    bin: PathBuf,
    args: Vec<String>,
    log_dir: PathBuf,
    /// Starts so far; the current process logs to `<name>.<starts>.log`.
    starts: u32,
    child: Option<Child>,
}

impl Component {
    /// kube-controller-manager with every default controller (`--controllers=*`), no leader
    /// election, no serving port, talking to the apiserver through `kubeconfig`; the
    /// ServiceAccount key and root CA are `cp`'s, as [`ControlPlane`] gives its own.
    ///
    /// The Node objects of these tests have no kubelet renewing their Lease or status, so
    /// the node lifecycle controller would mark them `Unknown` after its 50 s grace period
    /// and taint them `unreachable`, and the scheduler would then bind nothing to them: on a
    /// loaded machine a test can take that long. The grace periods are an hour instead.
    pub fn controller_manager(
        bin_dir: &Path,
        cp: &ControlPlane,
        kubeconfig: &Path,
        log_dir: &Path,
    ) -> Component {
        let pki = cp.dir.join("pki");
        Component::new(
            bin_dir,
            "kube-controller-manager",
            vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
                "--controllers=*".into(),
                format!(
                    "--service-account-private-key-file={}",
                    pki.join("sa.key").display()
                ),
                format!("--root-ca-file={}", pki.join("serving-ca.crt").display()),
                "--service-cluster-ip-range=10.96.0.0/24".into(),
                "--node-monitor-grace-period=1h".into(),
                "--node-startup-grace-period=1h".into(),
                "--profiling=false".into(),
                "--v=2".into(),
            ],
            log_dir,
        )
    }

    /// kube-scheduler with its default profile, no leader election and no serving port (so
    /// no delegated authentication either), talking to the apiserver through `kubeconfig`.
    pub fn scheduler(bin_dir: &Path, kubeconfig: &Path, log_dir: &Path) -> Component {
        Component::new(
            bin_dir,
            "kube-scheduler",
            vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                "--secure-port=0".into(),
                "--leader-elect=false".into(),
                "--profiling=false".into(),
                "--v=2".into(),
            ],
            log_dir,
        )
    }

    fn new(bin_dir: &Path, name: &'static str, args: Vec<String>, log_dir: &Path) -> Component {
        Component {
            name,
            bin: bin_dir.join(name),
            args,
            log_dir: log_dir.to_path_buf(),
            starts: 0,
            child: None,
        }
    }

    /// Sets `--name=value` for the next starts, replacing an earlier value, e.g.
    /// `feature-gates` (the components read client-go's gates, `WatchListClient` among them,
    /// from their own `--feature-gates`, not from client-go's `KUBE_FEATURE_*` variables).
    pub fn set_flag(&mut self, name: &str, value: &str) {
        let prefix = format!("--{name}=");
        self.args.retain(|a| !a.starts_with(&prefix));
        self.args.push(format!("{prefix}{value}"));
    }

    /// Drops `--name=...` for the next starts (the component's default again).
    pub fn unset_flag(&mut self, name: &str) {
        let prefix = format!("--{name}=");
        self.args.retain(|a| !a.starts_with(&prefix));
    }

    /// Starts the process (a new log file).
    ///
    /// # Panics
    /// If it is running already, or the binary cannot be started.
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "{} is running already", self.name);
        self.starts += 1;
        let log = self.log_path();
        let out = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("creating {}: {e}", log.display()));
        let err = out.try_clone().unwrap();
        let child = Command::new(&self.bin)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("starting {}: {e}", self.bin.display()));
        self.child = Some(child);
    }

    /// The current (or last) start's log file.
    pub fn log_path(&self) -> PathBuf {
        self.log_dir
            .join(format!("{}.{}.log", self.name, self.starts))
    }

    /// The current (or last) start's log.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `Err` with the exit status and the log's last lines if the process has exited; for
    /// polls, so a component that dies is reported as such rather than as a timeout.
    pub fn alive(&mut self) -> Result<(), String> {
        let Some(child) = self.child.as_mut() else {
            return Err(format!("{} is not started", self.name));
        };
        match child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => Err(self.exited(status)),
            Err(e) => Err(format!("{}: {e}", self.name)),
        }
    }

    fn exited(&self, status: ExitStatus) -> String {
        let log = self.log();
        let lines: Vec<&str> = log.lines().collect();
        format!(
            "{} exited ({status}); last lines of {}:\n{}",
            self.name,
            self.log_path().display(),
            lines[lines.len().saturating_sub(TAIL_LINES)..].join("\n")
        )
    }

    /// Stops the process: SIGTERM, then SIGKILL after [`STOP_GRACE`]. Its log stays.
    pub async fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Some(pid) = child.id() {
            // The crate forbids unsafe code, so no libc::kill; kill(1) sends SIGTERM.
            let _ = Command::new("kill")
                .arg("-TERM")
                .arg(pid.to_string())
                .status()
                .await;
        }
        if tokio::time::timeout(STOP_GRACE, child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }

    /// Stops the process and starts it again (a new log file), with the current flags.
    pub async fn restart(&mut self) {
        self.stop().await;
        self.start();
    }
}

impl Drop for Component {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            // SIGKILL now, synchronously; tokio reaps the zombie.
            let _ = child.start_kill();
        }
    }
}
