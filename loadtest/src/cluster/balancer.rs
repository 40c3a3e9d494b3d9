//! A loopback TCP balancer in front of the proxy's replicas (a Service's part in the
//! rolling-restart phase), as `tests/support/balancer.rs` is for the HA tests: each accepted
//! connection goes, round robin, to the next backend that accepts a connection, and bytes are
//! copied both ways until either side closes. TLS passes through untouched (the replicas share
//! one serving certificate). Backends are replaced while it runs: a replica restarted on a new
//! port is put back in its slot; an empty slot (`None`) is skipped.
//!
//! It runs in the driver's process, so on the proxy's sides the driver's CPU includes copying
//! every byte the components and agents exchange with the proxy.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::net::{TcpListener, TcpStream};

pub struct Balancer {
    pub addr: SocketAddr,
    backends: Arc<Mutex<Vec<Option<SocketAddr>>>>,
    /// Connections handed to each slot.
    pub handed: Arc<Vec<AtomicUsize>>,
    task: tokio::task::JoinHandle<()>,
}

impl Balancer {
    /// A balancer with `slots` backend slots, the first holding `first`.
    pub async fn start(slots: usize, first: SocketAddr) -> anyhow::Result<Balancer> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let mut v = vec![None; slots.max(1)];
        v[0] = Some(first);
        let backends = Arc::new(Mutex::new(v));
        let handed: Arc<Vec<AtomicUsize>> =
            Arc::new((0..slots.max(1)).map(|_| AtomicUsize::new(0)).collect());
        let next = Arc::new(AtomicUsize::new(0));
        let (b, counts) = (backends.clone(), handed.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                let (b, next, counts) = (b.clone(), next.clone(), counts.clone());
                tokio::spawn(async move {
                    let list = b.lock().clone();
                    for _ in 0..list.len() {
                        let i = next.fetch_add(1, Ordering::Relaxed) % list.len();
                        let Some(backend) = list[i] else { continue };
                        if let Ok(mut up) = TcpStream::connect(backend).await {
                            let _ = up.set_nodelay(true);
                            counts[i].fetch_add(1, Ordering::Relaxed);
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                            return;
                        }
                    }
                });
            }
        });
        Ok(Balancer {
            addr,
            backends,
            handed,
            task,
        })
    }

    /// Puts `backend` in slot `i` (`None`: out of rotation).
    pub fn set(&self, i: usize, backend: Option<SocketAddr>) {
        if let Some(s) = self.backends.lock().get_mut(i) {
            *s = backend;
        }
    }

    /// Connections handed to each slot so far.
    pub fn handed(&self) -> Vec<usize> {
        self.handed
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .collect()
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
