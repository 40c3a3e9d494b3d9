//! The guard of a watch served through a filtered cluster view: it re-derives the view every
//! `viewRecheckInterval` and, once it differs from the one the watch started with, ends the
//! stream with a 410 Expired ERROR event (client-go relists into the new view).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;

use super::Tenancy;
use crate::auth::authn::Identity;
use crate::auth::authz::{Attributes, Authorizer};
use crate::k8s::status::{Reason, Status};

/// An open watch through a filtered cluster view, and what it needs to re-derive that view.
pub struct ViewWatch {
    pub tenancy: Arc<Tenancy>,
    pub authz: Arc<Authorizer>,
    pub caches: Arc<crate::cache::registry::Caches>,
    pub id: Arc<Identity>,
    pub attrs: Attributes,
    /// The namespace set the watch started with.
    pub view: Arc<BTreeSet<String>>,
    /// The stream is in protobuf (its ERROR event too).
    pub protobuf: bool,
}

impl ViewWatch {
    /// Resolves once the caller's view is no longer the one the watch started with.
    async fn changed(self) {
        let Some(every) = self.tenancy.get(&self.id.tenant).map(|t| {
            t.config
                .view_recheck_interval
                .max(Duration::from_millis(100))
        }) else {
            return std::future::pending().await;
        };
        loop {
            tokio::time::sleep(every).await;
            let ns = self.caches.get("", "v1", "namespaces");
            // Boxed while it runs (once per interval): this future lives as long as the
            // watch, and with the view's derivation (its access reviews) inlined it held
            // their size for the whole stream.
            let now = Box::pin(self.tenancy.filtered_view(
                &self.authz,
                ns.as_deref(),
                &self.id,
                &self.attrs,
                true,
            ))
            .await;
            if now.as_deref() != Some(&*self.view) {
                tracing::debug!(tenant = %self.id.tenant, user = %self.id.user, resource = %self.attrs.resource, "filtered cluster view changed; ending the watch with 410");
                return;
            }
        }
    }

    /// Passes the watch body's frames (whole events) through until the view changes, then
    /// ends the stream with an ERROR event carrying 410 Expired (client-go relists on it).
    pub fn guard(self, watch: crate::http::body::Body) -> crate::http::body::Body {
        use futures_util::StreamExt;
        use http_body_util::BodyStream;
        type Changed = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;
        let protobuf = self.protobuf;
        let changed: Changed = Box::pin(self.changed());
        let s = futures_util::stream::unfold(
            Some((BodyStream::new(watch), changed)),
            move |st| async move {
                let (mut inner, mut changed) = st?;
                tokio::select! {
                    biased;
                    f = inner.next() => f.map(|f| (f, Some((inner, changed)))),
                    () = &mut changed => {
                        let status = Status::failure(
                            StatusCode::GONE,
                            Reason::Expired,
                            "the namespaces of this caller's filtered cluster view changed; list again",
                        );
                        let frame = status.watch_error_frame(protobuf);
                        Some((Ok(hyper::body::Frame::data(frame)), None))
                    }
                }
            },
        );
        crate::http::body::boxed(http_body_util::StreamBody::new(s))
    }
}
