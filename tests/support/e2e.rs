//! Helpers for the end-to-end tier (a real kube-apiserver).

/// The apiserver's own count of open WATCH requests for `resource`, from its `/metrics`:
/// (all scopes, cluster scope). The apiserver keeps a couple of internal namespace-scoped
/// watches of its own (configmaps in kube-system, for instance).
pub async fn apiserver_watches(admin: &kube::Client, resource: &str) -> (u64, u64) {
    let text = admin
        .request_text(http::Request::get("/metrics").body(Vec::new()).unwrap())
        .await
        .unwrap();
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
