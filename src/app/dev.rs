//! A real local control plane (etcd + kube-apiserver) for end-to-end tests and `kube-cache-proxy dev`.
//!
//! [`ControlPlane::start`] builds (once, cached) and runs the same binaries a cluster runs:
//! etcd from `go.etcd.io/etcd/server/v3` and kube-apiserver/kubectl from `k8s.io/kubernetes`,
//! pinned in `tests/e2e/go/go.mod` and built by `tests/e2e/build-control-plane.sh`. Both are
//! embedded in the binary and written out under the cache directory before a build, so an
//! installed binary needs no source tree (only Go, for the first build). Everything listens on
//! loopback ports picked at start, so several control planes can run side by side.
//!
//! What the apiserver is configured with, and why:
//! - TLS serving with a throwaway CA ([`ControlPlane::ca_pem`]) and a cert for `127.0.0.1`,
//!   `localhost` and the in-cluster `kubernetes.default.svc` names;
//! - three kinds of authentication: static tokens ([`ControlPlane::users`]: `admin` in
//!   `system:masters`, `alice` with no extra groups, `bob` in `viewers`), client certificates
//!   from a client CA ([`ControlPlane::mint_client_cert`]), and ServiceAccount tokens signed with
//!   a generated P-256 key (issuer `https://kubernetes.default.svc.cluster.local`);
//! - `--authorization-mode=Node,RBAC`, so authorization decisions are the real ones.
//!
//! By default there is no controller-manager, scheduler or kubelet: namespaces get no `default`
//! ServiceAccount by themselves (use [`ControlPlane::create_default_service_account`]), and pods
//! stay Pending. [`ControlPlaneOptions::controller_manager`] adds kube-controller-manager (built
//! with the `conformance` set): ServiceAccounts, namespace deletion, garbage collection and the
//! other controllers then run as in a cluster (the conformance tier needs them). Children's output goes to files in [`ControlPlane::log_dir`], never to the test
//! output; a failed start includes the tail of the failing child's log in the error.
//!
//! Children are killed when the [`ControlPlane`] is dropped (also while a test panics);
//! [`ControlPlane::stop`] shuts them down gracefully instead. A process killed with SIGKILL cannot
//! clean up after itself, so its children would outlive it.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use kube::api::{Api, PostParams};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::process::{Child, Command};

/// The ServiceAccount token issuer, the one kubeadm clusters use.
pub const SERVICE_ACCOUNT_ISSUER: &str = "https://kubernetes.default.svc.cluster.local";

/// Bound on waiting for kube-controller-manager's first `default` ServiceAccount: its
/// controllers start after it read discovery, a few seconds; more on a loaded 2-core machine.
const CONTROLLER_MANAGER_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// Bound on waiting for etcd's `/health`; etcd starts in well under a second on loopback.
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Bound on waiting for kube-apiserver's `/readyz`: usually 5-15 s, more on a loaded 2-core CI
/// machine (it installs its bootstrap RBAC roles and priority levels before it is ready).
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How long [`ControlPlane::stop`] waits for a child after SIGTERM before it kills it.
const STOP_GRACE: Duration = Duration::from_secs(15);
/// Starts tried by [`ControlPlane::start`] when a child's port was taken.
const START_ATTEMPTS: u32 = 3;

/// Lines of a child's log quoted in start errors.
const LOG_TAIL_LINES: usize = 40;

/// Errors from building or running the local control plane.
#[derive(Debug, thiserror::Error)]
pub enum DevClusterError {
    /// The build script could not be run or failed.
    #[error("building control-plane binaries with {script}: {message}")]
    Build { script: PathBuf, message: String },
    /// A file system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        context: String,
        #[source]
        source: std::io::Error,
    },
    /// Generating a key or certificate failed.
    #[error("generating {what}: {source}")]
    Pki {
        what: &'static str,
        #[source]
        source: rcgen::Error,
    },
    /// A child exited while the control plane was starting.
    #[error("{name} exited during start ({status}); last lines of {log}:\n{tail}")]
    Exited {
        name: &'static str,
        status: std::process::ExitStatus,
        log: PathBuf,
        tail: String,
    },
    /// A child did not become ready in time.
    #[error("{name} not ready after {after:?} ({last_error}); last lines of {log}:\n{tail}")]
    NotReady {
        name: &'static str,
        after: Duration,
        /// Boxed: a `kube::Error` inside would make every `DevClusterError` large.
        last_error: Box<ProbeError>,
        log: PathBuf,
        tail: String,
    },
    /// Building a client for the apiserver failed.
    #[error("building a client for {url}: {message}")]
    Client { url: String, message: String },
    /// A request to the apiserver failed.
    #[error("{context}: {source}")]
    Kube {
        context: String,
        #[source]
        source: kube::Error,
    },
}

impl DevClusterError {
    /// A child exited because its port was taken (by another process, after
    /// [`free_loopback_ports`] probed it).
    pub fn is_port_taken(&self) -> bool {
        matches!(self, DevClusterError::Exited { tail, .. } if tail.contains("address already in use"))
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> DevClusterError {
    let context = context.into();
    move |source| DevClusterError::Io { context, source }
}

fn pki_err(what: &'static str) -> impl FnOnce(rcgen::Error) -> DevClusterError {
    move |source| DevClusterError::Pki { what, source }
}

/// Where a [`ControlPlane`] keeps its state and logs.
#[derive(Debug, Clone, Default)]
pub struct ControlPlaneOptions {
    /// State directory (etcd data, certificates, token file). `None`: a fresh temporary directory,
    /// removed when the control plane stops or is dropped. An existing directory is reused: etcd
    /// data persists across starts, certificates and tokens are generated anew each start.
    pub dir: Option<PathBuf>,
    /// Where `etcd.log` and `kube-apiserver.log` go. `None`: `<dir>/logs`.
    pub log_dir: Option<PathBuf>,
    /// Extra kube-apiserver flags, after the defaults (a repeated flag's last value wins), e.g.
    /// `--etcd-compaction-interval=1m`.
    pub apiserver_args: Vec<String>,
    /// Also run kube-controller-manager (`--controllers=*`, no leader election, no cloud
    /// provider, admin credentials) and wait until it created the `default` ServiceAccount of
    /// namespace `default`.
    pub controller_manager: bool,
}

/// A user of the apiserver's static token file (`--token-auth-file`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StaticUser {
    pub name: String,
    pub uid: String,
    /// Groups besides `system:authenticated`, which the apiserver adds itself.
    pub groups: Vec<String>,
    /// Bearer token that authenticates as this user.
    pub token: String,
}

/// A running etcd + kube-apiserver pair on loopback.
pub struct ControlPlane {
    /// `https://127.0.0.1:PORT` of kube-apiserver.
    pub url: String,
    /// PEM of the CA that signed the apiserver's serving certificate.
    pub ca_pem: String,
    /// Static-token users: `admin`, `alice`, `bob` (see the module docs).
    pub users: Vec<StaticUser>,
    /// Directory holding `kube-apiserver`, `kubectl` and `etcd`.
    pub bin_dir: PathBuf,
    /// `http://127.0.0.1:PORT` of etcd's client endpoint.
    pub etcd_url: String,
    /// `http://127.0.0.1:PORT` of etcd's metrics endpoint (`/metrics`), for etcd load signals.
    pub etcd_metrics_url: String,
    /// State directory (see [`ControlPlaneOptions::dir`]).
    pub dir: PathBuf,
    /// Directory of `etcd.log` and `kube-apiserver.log`.
    pub log_dir: PathBuf,
    client_ca_cert_pem: String,
    client_ca_key_pem: String,
    client_ca: Issuer<'static, KeyPair>,
    /// Started children, in start order (etcd first).
    children: Vec<(&'static str, Child)>,
    /// kube-apiserver's arguments, for [`ControlPlane::kill_and_restart_apiserver`].
    api_args: Vec<String>,
    /// Whether `dir` is ours to remove.
    remove_dir: bool,
}

impl std::fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlPlane")
            .field("url", &self.url)
            .field("etcd_url", &self.etcd_url)
            .field("dir", &self.dir)
            .field("pids", &self.pids())
            .finish_non_exhaustive()
    }
}

impl ControlPlane {
    /// Builds the binaries if needed, starts etcd and kube-apiserver and waits until both are
    /// ready.
    ///
    /// # Errors
    /// Build failures, file system errors, a child that exits or does not become ready in time
    /// (with the tail of its log). Children started so far are killed.
    pub async fn start(opts: ControlPlaneOptions) -> Result<ControlPlane, DevClusterError> {
        let mut attempt = 1;
        loop {
            match Self::start_once(opts.clone()).await {
                // Another process bound a port between the probe and the child's bind: the
                // children were killed with their state; start again on new ports.
                Err(e) if e.is_port_taken() && attempt < START_ATTEMPTS => {
                    tracing::warn!(attempt, error = %e, "a control-plane port was taken; starting again");
                    attempt += 1;
                }
                r => return r,
            }
        }
    }

    async fn start_once(opts: ControlPlaneOptions) -> Result<ControlPlane, DevClusterError> {
        let bin_dir = tokio::task::spawn_blocking(ensure_binaries)
            .await
            .map_err(|e| DevClusterError::Build {
                script: PathBuf::from(BUILD_SCRIPT),
                message: e.to_string(),
            })??;
        let (dir, remove_dir) = match opts.dir {
            Some(dir) => (dir, false),
            None => (unique_temp_dir()?, true),
        };
        std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
        let log_dir = opts.log_dir.unwrap_or_else(|| dir.join("logs"));
        std::fs::create_dir_all(&log_dir)
            .map_err(io_err(format!("creating {}", log_dir.display())))?;

        let pki = Pki::generate()?;
        let users = default_users()?;
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir)
            .map_err(io_err(format!("creating {}", pki_dir.display())))?;
        let files = [
            ("serving-ca.crt", &pki.serving_ca_pem),
            ("serving.crt", &pki.serving_cert_pem),
            ("serving.key", &pki.serving_key_pem),
            ("client-ca.crt", &pki.client_ca_cert_pem),
            ("sa.key", &pki.sa_private_pem),
            ("sa.pub", &pki.sa_public_pem),
        ];
        for (name, content) in files {
            write_private(&pki_dir.join(name), content)?;
        }
        let token_file = pki_dir.join("tokens.csv");
        write_private(&token_file, &token_auth_file(&users))?;

        let [etcd_port, peer_port, metrics_port, api_port] =
            free_loopback_ports::<4>().map_err(io_err("binding free loopback ports"))?;
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let etcd_metrics_url = format!("http://127.0.0.1:{metrics_port}");
        let url = format!("https://127.0.0.1:{api_port}");

        let mut cp = ControlPlane {
            url,
            ca_pem: pki.serving_ca_pem.clone(),
            users,
            bin_dir,
            etcd_url,
            etcd_metrics_url,
            dir,
            log_dir,
            client_ca_cert_pem: pki.client_ca_cert_pem.clone(),
            client_ca_key_pem: pki.client_ca_key.serialize_pem(),
            client_ca: pki.client_ca,
            children: Vec::new(),
            api_args: Vec::new(),
            remove_dir,
        };
        // From here on `cp`'s Drop kills whatever was started if a step fails.
        let started = Instant::now();
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let etcd_args: Vec<String> = vec![
            "--name=default".into(),
            format!("--data-dir={}", cp.dir.join("etcd").display()),
            format!("--listen-client-urls={}", cp.etcd_url),
            format!("--advertise-client-urls={}", cp.etcd_url),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=default={peer_url}"),
            format!("--listen-metrics-urls={}", cp.etcd_metrics_url),
            // Tests and dev mode only: skips fsync of the WAL and backend, which makes writes
            // an order of magnitude faster on CI disks and loses data on a machine crash.
            "--unsafe-no-fsync".into(),
            "--log-level=warn".into(),
        ];
        cp.spawn("etcd", &etcd_args).await?;
        let health = format!("127.0.0.1:{etcd_port}");
        cp.wait_ready("etcd", ETCD_READY_TIMEOUT, || etcd_healthy(&health))
            .await?;
        let etcd_ready = started.elapsed();

        let p = |name: &str| pki_dir.join(name).display().to_string();
        let api_args: Vec<String> = vec![
            format!("--etcd-servers={}", cp.etcd_url),
            "--bind-address=127.0.0.1".into(),
            "--advertise-address=127.0.0.1".into(),
            format!("--secure-port={api_port}"),
            format!("--cert-dir={}", pki_dir.display()),
            format!("--tls-cert-file={}", p("serving.crt")),
            format!("--tls-private-key-file={}", p("serving.key")),
            format!("--client-ca-file={}", p("client-ca.crt")),
            format!("--token-auth-file={}", token_file.display()),
            "--authorization-mode=Node,RBAC".into(),
            format!("--service-account-issuer={SERVICE_ACCOUNT_ISSUER}"),
            format!("--service-account-key-file={}", p("sa.pub")),
            format!("--service-account-signing-key-file={}", p("sa.key")),
            format!("--api-audiences={SERVICE_ACCOUNT_ISSUER}"),
            "--service-cluster-ip-range=10.96.0.0/24".into(),
            "--allow-privileged=true".into(),
            "--enable-priority-and-fairness=true".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        let api_args: Vec<String> = api_args
            .into_iter()
            .chain(opts.apiserver_args.iter().cloned())
            .collect();
        cp.spawn("kube-apiserver", &api_args).await?;
        cp.api_args = api_args;
        let client = cp.client_for_token(cp.admin_token()).await?;
        cp.wait_apiserver_ready(&client).await?;
        if opts.controller_manager {
            cp.start_controller_manager(&pki_dir, &client).await?;
        }
        tracing::info!(
            url = %cp.url,
            etcd = %cp.etcd_url,
            dir = %cp.dir.display(),
            etcd_ready_ms = etcd_ready.as_millis() as u64,
            ready_ms = started.elapsed().as_millis() as u64,
            "local control plane ready"
        );
        Ok(cp)
    }

    async fn wait_apiserver_ready(&mut self, client: &kube::Client) -> Result<(), DevClusterError> {
        self.wait_ready("kube-apiserver", APISERVER_READY_TIMEOUT, || {
            let client = client.clone();
            async move {
                let req = http::Request::get("/readyz").body(Vec::new())?;
                client
                    .request_text(req)
                    .await
                    .map(|_| ())
                    .map_err(ProbeError::Apiserver)
            }
        })
        .await
    }

    /// Stops kube-apiserver with SIGSTOP, as a hung or descheduled process: connections are
    /// still accepted by the kernel, nothing is answered, open watches go silent. It runs
    /// again when the returned guard is dropped (also when a test fails) or
    /// [`FrozenApiserver::thaw`] is called. Fault tests use it.
    ///
    /// # Errors
    /// kube-apiserver is not running, or `kill -STOP` failed.
    pub fn freeze_apiserver(&self) -> Result<FrozenApiserver, DevClusterError> {
        let pid = self
            .children
            .iter()
            .find(|(n, _)| *n == "kube-apiserver")
            .and_then(|(_, c)| c.id())
            .ok_or_else(|| DevClusterError::Io {
                context: "freezing kube-apiserver: it is not running".into(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            })?;
        signal(pid, "STOP")?;
        Ok(FrozenApiserver { pid, thawed: false })
    }

    /// Kills kube-apiserver (SIGKILL: no graceful shutdown, its watches break mid-stream),
    /// starts it again with the same arguments, port and certificates, and waits until it is
    /// ready. etcd keeps running, so the data and the resourceVersions go on; the new
    /// apiserver's watch cache starts empty. Fault tests use it.
    ///
    /// # Errors
    /// The new process does not start or become ready in time.
    pub async fn kill_and_restart_apiserver(&mut self) -> Result<(), DevClusterError> {
        let Some(i) = self
            .children
            .iter()
            .position(|(n, _)| *n == "kube-apiserver")
        else {
            return Err(DevClusterError::Io {
                context: "restarting kube-apiserver: it is not running".into(),
                source: std::io::Error::from(std::io::ErrorKind::NotFound),
            });
        };
        let old = &mut self.children[i].1;
        let _ = old.start_kill();
        let _ = old.wait().await;
        let args = self.api_args.clone();
        self.spawn("kube-apiserver", &args).await?;
        // In place, so `pids()` keeps its order (etcd, kube-apiserver, ...).
        let new = self.children.pop().expect("just started");
        self.children[i] = new;
        let client = self.client_for_token(self.admin_token()).await?;
        self.wait_apiserver_ready(&client).await
    }

    /// Starts kube-controller-manager with the admin's credentials and waits for the
    /// ServiceAccount controller's first `default` ServiceAccount.
    async fn start_controller_manager(
        &mut self,
        pki_dir: &Path,
        client: &kube::Client,
    ) -> Result<(), DevClusterError> {
        let bin_dir = tokio::task::spawn_blocking(ensure_conformance_binaries)
            .await
            .map_err(|e| DevClusterError::Build {
                script: PathBuf::from(BUILD_SCRIPT),
                message: e.to_string(),
            })??;
        let kubeconfig = pki_dir.join("controller-manager.kubeconfig");
        write_private(&kubeconfig, &self.admin_kubeconfig_yaml())?;
        let p = |name: &str| pki_dir.join(name).display().to_string();
        let args: Vec<String> = vec![
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--authentication-kubeconfig={}", kubeconfig.display()),
            format!("--authorization-kubeconfig={}", kubeconfig.display()),
            // No serving endpoint: nothing scrapes it, and it needs no port.
            "--secure-port=0".into(),
            "--leader-elect=false".into(),
            "--controllers=*".into(),
            format!("--service-account-private-key-file={}", p("sa.key")),
            format!("--root-ca-file={}", p("serving-ca.crt")),
            "--service-cluster-ip-range=10.96.0.0/24".into(),
            "--profiling=false".into(),
            "--v=1".into(),
        ];
        self.spawn_from(&bin_dir, "kube-controller-manager", &args)
            .await?;
        cp_wait_default_sa(self, client).await
    }

    async fn spawn(&mut self, name: &'static str, args: &[String]) -> Result<(), DevClusterError> {
        let bin_dir = self.bin_dir.clone();
        self.spawn_from(&bin_dir, name, args).await
    }

    async fn spawn_from(
        &mut self,
        bin_dir: &Path,
        name: &'static str,
        args: &[String],
    ) -> Result<(), DevClusterError> {
        let log = self.log_path(name);
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .map_err(io_err(format!("opening {}", log.display())))?;
        let err = out
            .try_clone()
            .map_err(io_err(format!("opening {}", log.display())))?;
        let child = Command::new(bin_dir.join(name))
            .args(args)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .kill_on_drop(true)
            .spawn()
            .map_err(io_err(format!("starting {name}")))?;
        tracing::debug!(name, pid = child.id(), log = %log.display(), "started");
        self.children.push((name, child));
        Ok(())
    }

    /// Polls `probe` until it succeeds, the child named `name` exits, or `timeout` passes.
    async fn wait_ready<F, Fut>(
        &mut self,
        name: &'static str,
        timeout: Duration,
        mut probe: F,
    ) -> Result<(), DevClusterError>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<(), ProbeError>>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some((_, child)) = self.children.iter_mut().find(|(n, _)| *n == name)
                && let Ok(Some(status)) = child.try_wait()
            {
                let log = self.log_path(name);
                return Err(DevClusterError::Exited {
                    name,
                    status,
                    tail: log_tail(&log),
                    log,
                });
            }
            let last_error = match tokio::time::timeout(Duration::from_secs(5), probe()).await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => e,
                Err(_) => ProbeError::TimedOut,
            };
            if Instant::now() >= deadline {
                let log = self.log_path(name);
                return Err(DevClusterError::NotReady {
                    name,
                    after: timeout,
                    last_error: Box::new(last_error),
                    tail: log_tail(&log),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn log_path(&self, name: &str) -> PathBuf {
        self.log_dir.join(format!("{name}.log"))
    }

    /// The static-token user called `name`.
    ///
    /// # Panics
    /// If there is no such user (see [`ControlPlane::users`]).
    pub fn user(&self, name: &str) -> &StaticUser {
        self.users
            .iter()
            .find(|u| u.name == name)
            .unwrap_or_else(|| panic!("no static user {name:?}"))
    }

    /// The apiserver's `--token-auth-file`: every static user's token, name, uid and groups.
    pub fn token_file(&self) -> PathBuf {
        self.dir.join("pki").join("tokens.csv")
    }

    /// Bearer token of `admin` (group `system:masters`).
    pub fn admin_token(&self) -> &str {
        &self.user("admin").token
    }

    /// PEM certificate and PKCS#8 key of the client CA the apiserver trusts (`--client-ca-file`).
    pub fn client_ca(&self) -> (&str, &str) {
        (&self.client_ca_cert_pem, &self.client_ca_key_pem)
    }

    /// A client certificate (PEM cert, PEM PKCS#8 key) for user `cn` in `groups` (O=),
    /// signed by the client CA, valid for client authentication.
    ///
    /// # Panics
    /// If rcgen cannot generate a P-256 key or sign, which does not happen with valid input.
    pub fn mint_client_cert(&self, cn: &str, groups: &[&str]) -> (String, String) {
        let key = KeyPair::generate().expect("generating a P-256 key");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("empty SAN list");
        params.distinguished_name.push(DnType::CommonName, cn);
        for g in groups {
            params.distinguished_name.push(DnType::OrganizationName, *g);
        }
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        let cert = params
            .signed_by(&key, &self.client_ca)
            .expect("signing a client certificate");
        (cert.pem(), key.serialize_pem())
    }

    /// A complete kubeconfig (one cluster, user and context, all named `kube-cache-proxy`) with
    /// embedded data. `server` with `http://` gets `insecure-skip-tls-verify: true` and no CA
    /// (kubectl refuses both together).
    pub fn kubeconfig_yaml(
        server: &str,
        ca_pem: Option<&str>,
        token: Option<&str>,
        client_cert: Option<(&str, &str)>,
    ) -> String {
        kubeconfig_yaml(server, ca_pem, token, client_cert)
    }

    /// An admin kubeconfig for this apiserver.
    pub fn admin_kubeconfig_yaml(&self) -> String {
        kubeconfig_yaml(
            &self.url,
            Some(&self.ca_pem),
            Some(self.admin_token()),
            None,
        )
    }

    /// Path of the `kubectl` built alongside the apiserver.
    pub fn kubectl(&self) -> PathBuf {
        self.bin_dir.join("kubectl")
    }

    /// Process ids of the running children (etcd first).
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().filter_map(|(_, c)| c.id()).collect()
    }

    /// A kube client that talks to this apiserver directly with `token`.
    ///
    /// # Errors
    /// If the client cannot be built (TLS setup).
    pub async fn client_for_token(&self, token: &str) -> Result<kube::Client, DevClusterError> {
        let yaml = kubeconfig_yaml(&self.url, Some(&self.ca_pem), Some(token), None);
        client_from_kubeconfig(&yaml).await
    }

    /// A kube client authenticated as `admin`.
    ///
    /// # Errors
    /// If the client cannot be built (TLS setup).
    pub async fn admin_client(&self) -> Result<kube::Client, DevClusterError> {
        self.client_for_token(self.admin_token()).await
    }

    /// Creates namespace `ns` (if missing) and its ServiceAccount `default` (if missing), which
    /// the absent controller-manager would otherwise create. Pods need it: the ServiceAccount
    /// admission plugin rejects pods whose ServiceAccount does not exist.
    ///
    /// # Errors
    /// Requests that fail other than with 409 AlreadyExists.
    pub async fn create_default_service_account(&self, ns: &str) -> Result<(), DevClusterError> {
        let client = self.admin_client().await?;
        create_namespace_and_sa(&client, ns).await
    }

    /// Seeds demo data for dev mode: namespaces `demo-a` and `demo-b`, each with its `default`
    /// ServiceAccount, three ConfigMaps (`demo-config-1..3`, label `app=demo`) and two Pods
    /// (`demo-pod-1..2`, Pending forever as there are no nodes). Idempotent.
    ///
    /// # Errors
    /// Requests that fail other than with 409 AlreadyExists.
    pub async fn seed(&self) -> Result<(), DevClusterError> {
        let client = self.admin_client().await?;
        for ns in ["demo-a", "demo-b"] {
            create_namespace_and_sa(&client, ns).await?;
            let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
            for i in 1..=3 {
                let cm: ConfigMap = serde_json::from_value(serde_json::json!({
                    "metadata": {
                        "name": format!("demo-config-{i}"),
                        "labels": {"app": "demo", "index": i.to_string()},
                    },
                    "data": {"greeting": format!("hello from {ns} #{i}")},
                }))
                .expect("static ConfigMap JSON");
                ignore_exists(cms.create(&PostParams::default(), &cm).await)
                    .map_err(kube_err(format!("creating configmap {ns}/demo-config-{i}")))?;
            }
            let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
            for i in 1..=2 {
                let pod: Pod = serde_json::from_value(serde_json::json!({
                    "metadata": {"name": format!("demo-pod-{i}"), "labels": {"app": "demo"}},
                    "spec": {"containers": [{"name": "pause", "image": "registry.k8s.io/pause:3.10"}]},
                }))
                .expect("static Pod JSON");
                ignore_exists(pods.create(&PostParams::default(), &pod).await)
                    .map_err(kube_err(format!("creating pod {ns}/demo-pod-{i}")))?;
            }
        }
        Ok(())
    }

    /// Stops the control plane: SIGTERM to each child, last started first, up to 15 s each, then
    /// SIGKILL; removes the state directory if it was a temporary one.
    pub async fn stop(mut self) {
        let children = std::mem::take(&mut self.children);
        for (name, mut child) in children.into_iter().rev() {
            if let Some(pid) = child.id() {
                // std has no SIGTERM and the crate forbids unsafe code; kill(1) sends it.
                let _ = Command::new("kill")
                    .arg("-TERM")
                    .arg(pid.to_string())
                    .status()
                    .await;
            }
            match tokio::time::timeout(STOP_GRACE, child.wait()).await {
                Ok(Ok(status)) => tracing::debug!(name, %status, "stopped"),
                _ => {
                    tracing::warn!(name, "did not stop after SIGTERM; killing");
                    let _ = child.kill().await;
                }
            }
        }
        if self.remove_dir {
            let _ = tokio::fs::remove_dir_all(&self.dir).await;
            self.remove_dir = false;
        }
    }
}

/// kube-apiserver stopped by [`ControlPlane::freeze_apiserver`]; it runs again (SIGCONT) when
/// this is dropped or thawed.
#[derive(Debug)]
pub struct FrozenApiserver {
    pid: u32,
    thawed: bool,
}

impl FrozenApiserver {
    /// Lets kube-apiserver run again (SIGCONT).
    ///
    /// # Errors
    /// `kill -CONT` failed.
    pub fn thaw(mut self) -> Result<(), DevClusterError> {
        self.thawed = true;
        signal(self.pid, "CONT")
    }
}

impl Drop for FrozenApiserver {
    fn drop(&mut self) {
        if !self.thawed {
            let _ = signal(self.pid, "CONT");
        }
    }
}

/// Sends `SIG<sig>` to `pid` with kill(1) (the crate has no `unsafe`, so no libc).
fn signal(pid: u32, sig: &str) -> Result<(), DevClusterError> {
    let context = || format!("kill -{sig} {pid}");
    let status = std::process::Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status()
        .map_err(|source| DevClusterError::Io {
            context: context(),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(DevClusterError::Io {
            context: context(),
            source: std::io::Error::other(format!("exited with {status}")),
        })
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        for (_, child) in &mut self.children {
            // SIGKILL now, synchronously; tokio reaps the zombies.
            let _ = child.start_kill();
        }
        if self.remove_dir {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// Builds (or finds cached) kube-apiserver, kubectl and etcd; returns their directory.
///
/// Runs the embedded `tests/e2e/build-control-plane.sh` (see [`write_build_sources`]); its
/// progress (stderr) goes straight to this process's stderr. A first build takes several
/// minutes; later calls return at once.
///
/// # Errors
/// If the sources cannot be written, or the script cannot be run or fails.
pub fn ensure_binaries() -> Result<PathBuf, DevClusterError> {
    run_build_script(None)
}

/// Builds (or finds cached) kube-controller-manager and the upstream e2e test binary
/// `e2e.test` (the `conformance` set); returns their directory.
///
/// # Errors
/// If the sources cannot be written, or the script cannot be run or fails.
pub fn ensure_conformance_binaries() -> Result<PathBuf, DevClusterError> {
    run_build_script(Some("conformance"))
}

/// Builds (or finds cached) the client programs (`informer-check`); returns their directory.
///
/// # Errors
/// If the sources cannot be written, or the script cannot be run or fails.
pub fn ensure_client_binaries() -> Result<PathBuf, DevClusterError> {
    run_build_script(Some("clients"))
}

/// The build script's name among [`BUILD_SOURCES`].
const BUILD_SCRIPT: &str = "build-control-plane.sh";

/// The build script and the Go module it builds from (`tests/e2e/` in the repository), by path
/// relative to the directory they are written to: the script finds the module in `go/` beside
/// itself. The script keys its binaries on a hash of the module's files, so these bytes, being
/// the repository's, find binaries built from the checkout and the other way round.
const BUILD_SOURCES: &[(&str, &str)] = &[
    (
        BUILD_SCRIPT,
        include_str!("../../tests/e2e/build-control-plane.sh"),
    ),
    ("go/go.mod", include_str!("../../tests/e2e/go/go.mod")),
    ("go/go.sum", include_str!("../../tests/e2e/go/go.sum")),
    ("go/tools.go", include_str!("../../tests/e2e/go/tools.go")),
    (
        "go/cmd/etcd/main.go",
        include_str!("../../tests/e2e/go/cmd/etcd/main.go"),
    ),
    (
        "go/cmd/proto-schema/main.go",
        include_str!("../../tests/e2e/go/cmd/proto-schema/main.go"),
    ),
    (
        "go/cmd/informer-check/main.go",
        include_str!("../../tests/e2e/go/cmd/informer-check/main.go"),
    ),
    (
        "go/conformance/e2e_test.go",
        include_str!("../../tests/e2e/go/conformance/e2e_test.go"),
    ),
];

/// The cache directory the build script also uses: `$KCP_CACHE_DIR`, else
/// `$HOME/.cache/kube-cache-proxy`.
fn cache_root() -> Option<PathBuf> {
    match std::env::var_os("KCP_CACHE_DIR") {
        Some(d) if !d.is_empty() => Some(PathBuf::from(d)),
        _ => std::env::var_os("HOME")
            .filter(|h| !h.is_empty())
            .map(|h| Path::new(&h).join(".cache").join("kube-cache-proxy")),
    }
}

/// Writes `BUILD_SOURCES` to `<cache>/src/<hash of the sources>/` (files already there with
/// the same content are left alone; others are replaced atomically, so concurrent callers do
/// not see half-written files) and returns the script's path.
///
/// # Errors
/// If neither `KCP_CACHE_DIR` nor `HOME` is set, or a file cannot be written.
pub fn write_build_sources() -> Result<PathBuf, DevClusterError> {
    let root = cache_root().ok_or_else(|| DevClusterError::Build {
        script: PathBuf::from(BUILD_SCRIPT),
        message: "neither KCP_CACHE_DIR nor HOME is set, so there is no cache directory to \
                  build the control plane in"
            .into(),
    })?;
    write_build_sources_in(&root)
}

fn write_build_sources_in(root: &Path) -> Result<PathBuf, DevClusterError> {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    for (path, content) in BUILD_SOURCES {
        h.update(path.as_bytes());
        h.update([0]);
        h.update(content.as_bytes());
        h.update([0]);
    }
    let dir = root.join("src").join(hex::encode(&h.finalize()[..6]));
    for (path, content) in BUILD_SOURCES {
        let file = dir.join(path);
        if std::fs::read(&file).is_ok_and(|have| have == content.as_bytes()) {
            continue;
        }
        let parent = file.parent().unwrap_or(&dir);
        std::fs::create_dir_all(parent)
            .map_err(io_err(format!("creating {}", parent.display())))?;
        let tmp = parent.join(format!(
            ".{}.{}-{}.tmp",
            file.file_name().unwrap_or_default().to_string_lossy(),
            std::process::id(),
            random_hex(4)?
        ));
        std::fs::write(&tmp, content).map_err(io_err(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, &file).map_err(io_err(format!("writing {}", file.display())))?;
    }
    Ok(dir.join(BUILD_SCRIPT))
}

fn run_build_script(set: Option<&str>) -> Result<PathBuf, DevClusterError> {
    let script = write_build_sources()?;
    let fail = |message: String| DevClusterError::Build {
        script: script.clone(),
        message,
    };
    let mut cmd = std::process::Command::new("bash");
    cmd.arg(&script)
        .args(set)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let out = cmd.output().map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        return Err(fail(format!("exited with {}", out.status)));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let dir = stdout
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .map(|l| PathBuf::from(l.trim()))
        .ok_or_else(|| fail("printed no bin directory".into()))?;
    if !dir.is_dir() {
        return Err(fail(format!("printed {}, not a directory", dir.display())));
    }
    Ok(dir)
}

/// Generated keys and certificates of one control plane.
struct Pki {
    serving_ca_pem: String,
    serving_cert_pem: String,
    serving_key_pem: String,
    client_ca_cert_pem: String,
    client_ca_key: KeyPair,
    client_ca: Issuer<'static, KeyPair>,
    sa_private_pem: String,
    sa_public_pem: String,
}

impl Pki {
    fn generate() -> Result<Pki, DevClusterError> {
        let ca = |cn: &str| -> Result<(CertificateParams, KeyPair, String), DevClusterError> {
            let key = KeyPair::generate().map_err(pki_err("a CA key"))?;
            let mut params =
                CertificateParams::new(Vec::<String>::new()).map_err(pki_err("CA params"))?;
            params.distinguished_name.push(DnType::CommonName, cn);
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            let pem = params.self_signed(&key).map_err(pki_err("a CA"))?.pem();
            Ok((params, key, pem))
        };
        let (serving_ca_params, serving_ca_key, serving_ca_pem) =
            ca("kube-cache-proxy dev serving CA")?;
        let serving_ca = Issuer::new(serving_ca_params, serving_ca_key);
        let serving_key = KeyPair::generate().map_err(pki_err("the serving key"))?;
        let mut params = CertificateParams::new(
            [
                "127.0.0.1",
                "localhost",
                "10.96.0.1",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ]
            .map(String::from)
            .to_vec(),
        )
        .map_err(pki_err("serving cert params"))?;
        params
            .distinguished_name
            .push(DnType::CommonName, "kube-apiserver");
        params.key_usages = vec![
            KeyUsagePurpose::DigitalSignature,
            KeyUsagePurpose::KeyEncipherment,
        ];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let serving_cert_pem = params
            .signed_by(&serving_key, &serving_ca)
            .map_err(pki_err("the serving cert"))?
            .pem();

        let (client_ca_params, client_ca_key, client_ca_cert_pem) =
            ca("kube-cache-proxy dev client CA")?;
        // The issuer owns its key, and the same key is also handed out as PEM.
        let client_ca_key_copy =
            KeyPair::from_pem(&client_ca_key.serialize_pem()).map_err(pki_err("client CA key"))?;
        let client_ca = Issuer::new(client_ca_params, client_ca_key);

        // P-256 in PKCS#8: accepted by --service-account-signing-key-file (ES256 tokens).
        let sa = KeyPair::generate().map_err(pki_err("the service-account key"))?;
        Ok(Pki {
            serving_ca_pem,
            serving_cert_pem,
            serving_key_pem: serving_key.serialize_pem(),
            client_ca_cert_pem,
            client_ca_key: client_ca_key_copy,
            client_ca,
            sa_private_pem: sa.serialize_pem(),
            sa_public_pem: sa.public_key_pem(),
        })
    }
}

fn default_users() -> Result<Vec<StaticUser>, DevClusterError> {
    let user = |name: &str, groups: &[&str]| -> Result<StaticUser, DevClusterError> {
        Ok(StaticUser {
            name: name.into(),
            uid: format!("uid-{name}"),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            token: format!("{name}-{}", random_hex(16)?),
        })
    };
    Ok(vec![
        user("admin", &["system:masters"])?,
        user("alice", &[])?,
        user("bob", &["viewers"])?,
    ])
}

/// The `--token-auth-file` CSV: `token,user,uid,"group1,group2"`, the groups column only when
/// there are groups. See
/// <https://kubernetes.io/docs/reference/access-authn-authz/authentication/#static-token-file>.
pub fn token_auth_file(users: &[StaticUser]) -> String {
    let mut out = String::new();
    for u in users {
        let _ = write!(out, "{},{},{}", u.token, u.name, u.uid);
        if !u.groups.is_empty() {
            let _ = write!(out, ",\"{}\"", u.groups.join(","));
        }
        out.push('\n');
    }
    out
}

fn kubeconfig_yaml(
    server: &str,
    ca_pem: Option<&str>,
    token: Option<&str>,
    client_cert: Option<(&str, &str)>,
) -> String {
    // JSON strings are valid YAML scalars and take care of quoting.
    let q = |s: &str| serde_json::Value::from(s).to_string();
    let mut y = String::from(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: kube-cache-proxy\n  cluster:\n",
    );
    let _ = writeln!(y, "    server: {}", q(server));
    if server.starts_with("http://") {
        y.push_str("    insecure-skip-tls-verify: true\n");
    } else if let Some(ca) = ca_pem {
        let _ = writeln!(y, "    certificate-authority-data: {}", BASE64.encode(ca));
    }
    y.push_str("users:\n- name: kube-cache-proxy\n  user:");
    if token.is_none() && client_cert.is_none() {
        y.push_str(" {}");
    }
    y.push('\n');
    if let Some(token) = token {
        let _ = writeln!(y, "    token: {}", q(token));
    }
    if let Some((cert, key)) = client_cert {
        let _ = writeln!(y, "    client-certificate-data: {}", BASE64.encode(cert));
        let _ = writeln!(y, "    client-key-data: {}", BASE64.encode(key));
    }
    y.push_str(
        "contexts:\n- name: kube-cache-proxy\n  context:\n    cluster: kube-cache-proxy\n    user: kube-cache-proxy\n    namespace: default\ncurrent-context: kube-cache-proxy\npreferences: {}\n",
    );
    y
}

/// Builds a kube client from kubeconfig YAML, with rustls' aws-lc-rs provider installed.
///
/// # Errors
/// If the YAML does not parse or TLS cannot be set up.
pub async fn client_from_kubeconfig(yaml: &str) -> Result<kube::Client, DevClusterError> {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let fail = |message: String| DevClusterError::Client {
        url: String::new(),
        message,
    };
    let kc = kube::config::Kubeconfig::from_yaml(yaml).map_err(|e| fail(e.to_string()))?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .map_err(|e| fail(e.to_string()))?;
    let url = config.cluster_url.to_string();
    kube::Client::try_from(config).map_err(|e| DevClusterError::Client {
        url,
        message: e.to_string(),
    })
}

async fn create_namespace_and_sa(client: &kube::Client, ns: &str) -> Result<(), DevClusterError> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let namespace: Namespace =
        serde_json::from_value(serde_json::json!({"metadata": {"name": ns}}))
            .expect("static Namespace JSON");
    ignore_exists(namespaces.create(&PostParams::default(), &namespace).await)
        .map_err(kube_err(format!("creating namespace {ns}")))?;
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), ns);
    let sa: ServiceAccount =
        serde_json::from_value(serde_json::json!({"metadata": {"name": "default"}}))
            .expect("static ServiceAccount JSON");
    ignore_exists(sas.create(&PostParams::default(), &sa).await)
        .map_err(kube_err(format!("creating serviceaccount {ns}/default")))?;
    Ok(())
}

/// Waits until kube-controller-manager's ServiceAccount controller created `default/default`.
async fn cp_wait_default_sa(
    cp: &mut ControlPlane,
    client: &kube::Client,
) -> Result<(), DevClusterError> {
    let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
    cp.wait_ready(
        "kube-controller-manager",
        CONTROLLER_MANAGER_READY_TIMEOUT,
        || {
            let sas = sas.clone();
            async move {
                sas.get("default")
                    .await
                    .map(|_| ())
                    .map_err(ProbeError::DefaultServiceAccount)
            }
        },
    )
    .await
}

fn ignore_exists<T>(r: Result<T, kube::Error>) -> Result<(), kube::Error> {
    match r {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

fn kube_err(context: String) -> impl FnOnce(kube::Error) -> DevClusterError {
    move |source| DevClusterError::Kube { context, source }
}

/// Why a child's readiness probe failed; the last one is in [`DevClusterError::NotReady`].
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("probe timed out after 5s")]
    TimedOut,
    #[error(transparent)]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Request(#[from] http::Error),
    /// The apiserver's `/readyz` did not answer ok.
    #[error(transparent)]
    Apiserver(kube::Error),
    /// kube-controller-manager has not created the default ServiceAccount yet.
    #[error("ServiceAccount default/default: {0}")]
    DefaultServiceAccount(#[source] kube::Error),
    /// It answered, but not healthy: the last line of its answer.
    #[error("unhealthy: {0}")]
    Unhealthy(String),
}

/// One plain HTTP/1.0 `GET /health` against etcd; healthy when it answers `"health":"true"`.
async fn etcd_healthy(addr: &str) -> Result<(), ProbeError> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let text = String::from_utf8_lossy(&buf);
    let ok_status = text.starts_with("HTTP/1.0 200") || text.starts_with("HTTP/1.1 200");
    if ok_status && text.contains("\"health\":\"true\"") {
        return Ok(());
    }
    Err(ProbeError::Unhealthy(
        text.lines().last().unwrap_or_default().to_string(),
    ))
}

/// `N` distinct loopback ports that are free when probed, for children that must be told their
/// port (etcd, kube-apiserver, a proxy under test).
///
/// They are drawn at random from outside the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`): a port from that range, released after the probe, can be
/// taken by any outgoing connection on the machine before the child binds it (a busy test run
/// opens thousands), and again while a child is restarted on the same port. Outside it only
/// another explicit bind can collide, which [`ControlPlane::start`] answers with a new start.
///
/// # Errors
/// No free port could be bound.
pub fn free_loopback_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    let (lo, hi) = fixed_port_range(
        &std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default(),
    );
    let mut listeners = Vec::with_capacity(N);
    if hi > lo {
        let span = u32::from(hi - lo);
        let mut seed = [0u8; 4];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut seed)
            .map_err(|_| std::io::Error::other("the system's random source failed"))?;
        let start = u32::from_le_bytes(seed) % span;
        for i in 0..span {
            if listeners.len() == N {
                break;
            }
            let port = lo + ((start + i) % span) as u16;
            if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
                listeners.push(l);
            }
        }
    }
    // No usable fixed range (or all of it taken): the kernel's choice.
    while listeners.len() < N {
        listeners.push(std::net::TcpListener::bind("127.0.0.1:0")?);
    }
    let mut ports = [0u16; N];
    for (p, l) in ports.iter_mut().zip(&listeners) {
        *p = l.local_addr()?.port();
    }
    Ok(ports)
}

/// The range `[lo, hi)` that [`free_loopback_ports`] draws from, given the contents of
/// `ip_local_port_range` ("32768\t60999"; empty when it cannot be read): the larger of the
/// unprivileged ports below and above the ephemeral range, skipping the crowded ports below
/// 10000 when there is room. `lo == hi` when neither side has 1,000 ports.
fn fixed_port_range(ephemeral: &str) -> (u16, u16) {
    let mut it = ephemeral.split_whitespace().map(|v| v.parse::<u16>().ok());
    let (e_lo, e_hi) = match (it.next().flatten(), it.next().flatten()) {
        (Some(a), Some(b)) if a <= b => (a, b),
        // Linux's default when the file cannot be read.
        _ => (32768, 60999),
    };
    let below = if e_lo >= 11_000 {
        (10_000, e_lo)
    } else {
        (1024, e_lo.max(1024))
    };
    let above = (e_hi.saturating_add(1).max(1024), u16::MAX);
    let len = |(a, b): (u16, u16)| b.saturating_sub(a);
    let best = if len(below) >= len(above) {
        below
    } else {
        above
    };
    if len(best) >= 1000 { best } else { (0, 0) }
}

/// `bytes` random bytes from the system's cryptographic source, hex-encoded (tokens are
/// credentials).
fn random_hex(bytes: usize) -> Result<String, DevClusterError> {
    let mut buf = vec![0u8; bytes];
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut buf)
        .map_err(|_| std::io::Error::other("the system's random source failed"))
        .map_err(io_err("generating a random token"))?;
    Ok(hex::encode(buf))
}

fn unique_temp_dir() -> Result<PathBuf, DevClusterError> {
    let dir = std::env::temp_dir().join(format!(
        "kube-cache-proxy-devcluster-{}-{}",
        std::process::id(),
        random_hex(6)?
    ));
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    Ok(dir)
}

/// Writes a file readable by the owner only (keys and tokens live here).
fn write_private(path: &Path, content: &str) -> Result<(), DevClusterError> {
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(io_err(format!("writing {}", path.display())))?;
    f.write_all(content.as_bytes())
        .map_err(io_err(format!("writing {}", path.display())))
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(LOG_TAIL_LINES)..].join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_ports_come_from_outside_the_ephemeral_range() {
        assert_eq!(fixed_port_range("32768\t60999\n"), (10_000, 32768));
        // Unreadable or garbled: Linux's default range is assumed.
        assert_eq!(fixed_port_range(""), (10_000, 32768));
        assert_eq!(fixed_port_range("60999 32768"), (10_000, 32768));
        // The ephemeral range starts low: the ports above it.
        assert_eq!(fixed_port_range("1024 50000"), (50001, u16::MAX));
        assert_eq!(fixed_port_range("5000 40000"), (40001, u16::MAX));
        // No room on either side: the kernel chooses.
        assert_eq!(fixed_port_range("1024 65000"), (0, 0));
    }

    #[test]
    fn only_a_child_that_could_not_bind_its_port_is_a_taken_port() {
        use std::os::unix::process::ExitStatusExt as _;
        let exited = |tail: &str| DevClusterError::Exited {
            name: "kube-apiserver",
            status: std::process::ExitStatus::from_raw(256),
            log: PathBuf::from("kube-apiserver.log"),
            tail: tail.into(),
        };
        assert!(exited("listen tcp 127.0.0.1:41629: bind: address already in use").is_port_taken());
        assert!(!exited("etcdserver: mvcc: database space exceeded").is_port_taken());
        let io = DevClusterError::Io {
            context: "starting etcd".into(),
            source: std::io::Error::from(std::io::ErrorKind::AddrInUse),
        };
        assert!(!io.is_port_taken(), "only an exited child is started again");
    }

    #[test]
    fn free_loopback_ports_are_distinct_bindable_and_not_ephemeral() {
        let (lo, hi) = fixed_port_range(
            &std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default(),
        );
        let ports = free_loopback_ports::<8>().unwrap();
        let distinct: std::collections::BTreeSet<_> = ports.iter().collect();
        assert_eq!(distinct.len(), 8, "{ports:?}");
        for p in ports {
            if hi > lo {
                assert!((lo..hi).contains(&p), "{p} outside [{lo}, {hi})");
            }
            // Released when returned: the child can bind it.
            std::net::TcpListener::bind(("127.0.0.1", p)).unwrap();
        }
    }

    fn user(name: &str, groups: &[&str]) -> StaticUser {
        StaticUser {
            name: name.into(),
            uid: format!("uid-{name}"),
            groups: groups.iter().map(|g| g.to_string()).collect(),
            token: format!("tok-{name}"),
        }
    }

    #[test]
    fn token_file_quotes_groups_and_omits_empty_group_column() {
        let csv = token_auth_file(&[
            user("admin", &["system:masters"]),
            user("alice", &[]),
            user("bob", &["viewers", "editors"]),
        ]);
        assert_eq!(
            csv,
            "tok-admin,admin,uid-admin,\"system:masters\"\n\
             tok-alice,alice,uid-alice\n\
             tok-bob,bob,uid-bob,\"viewers,editors\"\n"
        );
    }

    #[test]
    fn default_users_have_distinct_random_tokens_and_expected_groups() {
        let users = default_users().unwrap();
        let names: Vec<_> = users.iter().map(|u| u.name.as_str()).collect();
        assert_eq!(names, ["admin", "alice", "bob"]);
        assert_eq!(users[0].groups, ["system:masters"]);
        assert!(users[1].groups.is_empty());
        assert_eq!(users[2].groups, ["viewers"]);
        assert_ne!(users[0].token, default_users().unwrap()[0].token);
        assert!(users.iter().all(|u| !u.token.contains(',')));
    }

    fn parse(yaml: &str) -> serde_json::Value {
        serde_saphyr::from_str(yaml).unwrap()
    }

    #[test]
    fn https_kubeconfig_embeds_ca_token_and_client_cert() {
        let yaml = kubeconfig_yaml(
            "https://127.0.0.1:6443",
            Some("CA PEM"),
            Some("tok\"en"),
            Some(("CERT", "KEY")),
        );
        let v = parse(&yaml);
        let cluster = &v["clusters"][0]["cluster"];
        assert_eq!(cluster["server"], "https://127.0.0.1:6443");
        assert_eq!(
            cluster["certificate-authority-data"],
            BASE64.encode("CA PEM")
        );
        assert!(cluster.get("insecure-skip-tls-verify").is_none());
        let user = &v["users"][0]["user"];
        assert_eq!(user["token"], "tok\"en");
        assert_eq!(user["client-certificate-data"], BASE64.encode("CERT"));
        assert_eq!(user["client-key-data"], BASE64.encode("KEY"));
        assert_eq!(v["current-context"], "kube-cache-proxy");
        assert_eq!(v["contexts"][0]["context"]["user"], "kube-cache-proxy");
        kube::config::Kubeconfig::from_yaml(&yaml).expect("kube-rs reads it");
    }

    #[test]
    fn http_kubeconfig_skips_tls_verify_and_drops_the_ca() {
        let yaml = kubeconfig_yaml("http://127.0.0.1:8080", Some("CA PEM"), None, None);
        let v = parse(&yaml);
        let cluster = &v["clusters"][0]["cluster"];
        assert_eq!(cluster["insecure-skip-tls-verify"], true);
        assert!(cluster.get("certificate-authority-data").is_none());
        assert_eq!(v["users"][0]["user"], serde_json::json!({}));
        kube::config::Kubeconfig::from_yaml(&yaml).expect("kube-rs reads it");
    }

    /// Every file of `tests/e2e/go` is embedded, byte for byte, with the build script.
    #[test]
    fn the_embedded_build_sources_are_the_repositorys() {
        let e2e = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/e2e");
        fn files(dir: &Path, out: &mut Vec<PathBuf>) {
            for e in std::fs::read_dir(dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    files(&p, out);
                } else {
                    out.push(p);
                }
            }
        }
        let mut want = vec![e2e.join(BUILD_SCRIPT)];
        files(&e2e.join("go"), &mut want);
        want.sort();
        let mut have: Vec<PathBuf> = BUILD_SOURCES.iter().map(|(p, _)| e2e.join(p)).collect();
        have.sort();
        assert_eq!(have, want, "BUILD_SOURCES lists every file of tests/e2e/go");
        for (path, content) in BUILD_SOURCES {
            assert_eq!(std::fs::read_to_string(e2e.join(path)).unwrap(), *content);
        }
    }

    #[test]
    fn build_sources_are_written_once_under_the_cache_directory() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("cache");
        let script = write_build_sources_in(&root).unwrap();
        assert!(script.starts_with(root.join("src")), "{}", script.display());
        assert_eq!(
            std::fs::read_to_string(&script).unwrap(),
            BUILD_SOURCES[0].1
        );
        let go_mod = script.parent().unwrap().join("go/go.mod");
        assert_eq!(
            std::fs::read_to_string(&go_mod).unwrap(),
            BUILD_SOURCES[1].1
        );
        let again = write_build_sources_in(&root).unwrap();
        assert_eq!(again, script);
    }

    #[test]
    fn pki_generates_parseable_pems_and_client_certs() {
        let pki = Pki::generate().unwrap();
        for pem in [
            &pki.serving_ca_pem,
            &pki.serving_cert_pem,
            &pki.client_ca_cert_pem,
        ] {
            assert!(pem.starts_with("-----BEGIN CERTIFICATE-----"), "{pem}");
        }
        assert!(
            pki.sa_private_pem
                .starts_with("-----BEGIN PRIVATE KEY-----")
        );
        assert!(pki.sa_public_pem.starts_with("-----BEGIN PUBLIC KEY-----"));
    }
}
