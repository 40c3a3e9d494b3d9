//! A loopback TCP balancer in front of several proxies (the HA tests' Service): each
//! accepted connection goes, round robin, to the next backend that accepts a connection,
//! and bytes are copied both ways until either side closes. TLS passes through untouched,
//! so the backends must share a serving certificate.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};

pub struct Balancer {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    /// Connections handed to each backend, in the order given.
    pub handed: Arc<Vec<AtomicUsize>>,
}

impl Balancer {
    pub async fn start(backends: Vec<SocketAddr>) -> Balancer {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handed: Arc<Vec<AtomicUsize>> =
            Arc::new(backends.iter().map(|_| AtomicUsize::new(0)).collect());
        let next = Arc::new(AtomicUsize::new(0));
        let counts = handed.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let (backends, next, counts) = (backends.clone(), next.clone(), counts.clone());
                tokio::spawn(async move {
                    for _ in 0..backends.len() {
                        let i = next.fetch_add(1, Ordering::Relaxed) % backends.len();
                        if let Ok(mut up) = TcpStream::connect(backends[i]).await {
                            counts[i].fetch_add(1, Ordering::Relaxed);
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut up).await;
                            return;
                        }
                    }
                });
            }
        });
        Balancer { addr, task, handed }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
