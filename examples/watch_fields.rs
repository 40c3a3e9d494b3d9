//! A kube-rs watcher that opts into kube-cache-proxy's field-level change filter: it is woken
//! for a ConfigMap's `data` changes (and creations and deletions), not for annotation or
//! `managedFields` churn. See docs/watch-fields.md.
//!
//! ```text
//! cargo run --example watch_fields -- [NAMESPACE] [FIELDS]
//! ```
//! with `KUBECONFIG` pointing at the proxy (e.g. the kubeconfig `kube-cache-proxy dev`
//! prints). `FIELDS` defaults to `data`; `-metadata.annotations,-metadata.managedFields` is
//! the ignore form. Only watches the proxy serves from its cache are filtered: with the
//! JSON content type (kube-rs's default) they are.

use futures_util::StreamExt;
use http::{HeaderName, HeaderValue};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Config};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let namespace = args.next().unwrap_or_else(|| "default".into());
    let fields = args.next().unwrap_or_else(|| "data".into());

    let mut config = Config::infer().await?;
    // The whole opt-in: one header on every request (lists ignore it).
    config.headers.push((
        HeaderName::from_static("x-kube-cache-proxy-watch-fields"),
        HeaderValue::from_str(&fields)?,
    ));
    let client = Client::try_from(config)?;
    let api: Api<ConfigMap> = Api::namespaced(client, &namespace);

    let mut events = watcher(api, watcher::Config::default())
        .touched_objects()
        .boxed();
    while let Some(cm) = events.next().await {
        let cm = cm?;
        println!(
            "{} at resourceVersion {}: data {:?}",
            cm.metadata.name.as_deref().unwrap_or(""),
            cm.metadata.resource_version.as_deref().unwrap_or(""),
            cm.data.unwrap_or_default()
        );
    }
    Ok(())
}
