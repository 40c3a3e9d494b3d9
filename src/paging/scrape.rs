//! What the load score reads from one `/metrics` text: the apiserver's etcd request latency
//! histogram, APF queueing and rejections, object counts ([`ApiserverScrape`]), and etcd's
//! commit latency and pending proposals ([`EtcdScrape`]). Summaries of one scrape only: the
//! rates and windowed quantiles between scrapes are the load tracker's.

use super::promtext::{Sample, parse_samples, parse_value};
use crate::metrics::window::histogram_quantile;

/// Cumulative histogram buckets `(le, count)`, sorted, summed over series.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Buckets(Vec<(f64, f64)>);

impl Buckets {
    fn add(&mut self, le: f64, count: f64) {
        match self.0.iter_mut().find(|(l, _)| *l == le) {
            Some((_, c)) => *c += count,
            None => {
                self.0.push((le, count));
                self.0.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
        }
    }

    /// The change since `prev`; `None` after a reset (a count went down) or a changed layout.
    pub(super) fn since(&self, prev: &Buckets) -> Option<Buckets> {
        if self.0.len() != prev.0.len() {
            return None;
        }
        let mut out = Vec::with_capacity(self.0.len());
        for (&(le, c), &(ple, pc)) in self.0.iter().zip(&prev.0) {
            if le != ple || c < pc {
                return None;
            }
            out.push((le, c - pc));
        }
        Some(Buckets(out))
    }

    pub(super) fn quantile(&self, q: f64) -> Option<f64> {
        histogram_quantile(q, &self.0)
    }
}

fn bucket_le(s: &Sample<'_>) -> Option<f64> {
    s.label("le").and_then(parse_value)
}

/// What the load score needs from one apiserver `/metrics` text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ApiserverScrape {
    /// `etcd_request_duration_seconds` buckets by operation.
    pub etcd_request: Vec<(String, Buckets)>,
    /// `apiserver_flowcontrol_current_inqueue_requests`, summed.
    pub inqueue: Option<f64>,
    /// `apiserver_flowcontrol_rejected_requests_total`, summed.
    pub rejected_total: Option<f64>,
    /// `apiserver_storage_objects` (or its successor `apiserver_resource_objects`), summed.
    pub storage_objects: Option<f64>,
}

const ETCD_REQUEST_BUCKET: &str = "etcd_request_duration_seconds_bucket";
const INQUEUE: &str = "apiserver_flowcontrol_current_inqueue_requests";
const REJECTED: &str = "apiserver_flowcontrol_rejected_requests_total";
/// `apiserver_resource_objects` replaced `apiserver_storage_objects` (deprecated in 1.34;
/// 1.36 still declares it but exports no samples). Both are refreshed about once a minute
/// (`--etcd-count-metric-poll-period`), read 0 until the first check and -1 for a resource
/// whose count failed.
const STORAGE_OBJECTS: &[&str] = &["apiserver_resource_objects", "apiserver_storage_objects"];
const ETCD_COMMIT_BUCKET: &str = "etcd_disk_backend_commit_duration_seconds_bucket";
const ETCD_PENDING: &str = "etcd_server_proposals_pending";

fn sum(acc: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *acc = Some(acc.unwrap_or(0.0) + v);
    }
}

impl ApiserverScrape {
    pub fn parse(text: &str) -> ApiserverScrape {
        let mut out = ApiserverScrape::default();
        let samples = parse_samples(text, |n| {
            n == ETCD_REQUEST_BUCKET
                || n == INQUEUE
                || n == REJECTED
                || STORAGE_OBJECTS.contains(&n)
        });
        // The first storage-objects name present wins, so an apiserver exporting both (during
        // the rename) is not counted twice.
        let storage_name = STORAGE_OBJECTS
            .iter()
            .find(|n| samples.iter().any(|s| s.name == **n));
        for s in &samples {
            match s.name {
                ETCD_REQUEST_BUCKET => {
                    let (Some(op), Some(le)) = (s.label("operation"), bucket_le(s)) else {
                        continue;
                    };
                    let i = match out.etcd_request.iter().position(|(o, _)| o == op) {
                        Some(i) => i,
                        None => {
                            out.etcd_request.push((op.to_string(), Buckets::default()));
                            out.etcd_request.len() - 1
                        }
                    };
                    out.etcd_request[i].1.add(le, s.value);
                }
                INQUEUE => sum(&mut out.inqueue, s.value),
                REJECTED => sum(&mut out.rejected_total, s.value),
                n if Some(&n) == storage_name && s.value >= 0.0 => {
                    sum(&mut out.storage_objects, s.value)
                }
                _ => {}
            }
        }
        out
    }
}

/// What the load score needs from one etcd `/metrics` text.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EtcdScrape {
    pub commit: Option<Buckets>,
    pub pending: Option<f64>,
}

impl EtcdScrape {
    pub fn parse(text: &str) -> EtcdScrape {
        let mut out = EtcdScrape::default();
        for s in parse_samples(text, |n| n == ETCD_COMMIT_BUCKET || n == ETCD_PENDING) {
            match s.name {
                ETCD_COMMIT_BUCKET => {
                    if let Some(le) = bucket_le(&s) {
                        out.commit
                            .get_or_insert_with(Buckets::default)
                            .add(le, s.value);
                    }
                }
                _ => sum(&mut out.pending, s.value),
            }
        }
        out
    }
}

/// A trimmed apiserver exposition: histogram buckets over two label sets, APF gauges and
/// counters, both object-count names, and an unrelated counter.
#[cfg(test)]
pub(crate) const APISERVER_TEXT: &str = r#"# HELP etcd_request_duration_seconds [ALPHA] Etcd request latency in seconds for each operation and object type.
# TYPE etcd_request_duration_seconds histogram
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="0.005"} 90
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="0.1"} 100
etcd_request_duration_seconds_bucket{operation="get",type="/registry/pods",le="+Inf"} 100
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="0.005"} 10
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="0.1"} 10
etcd_request_duration_seconds_bucket{operation="get",type="/registry/configmaps",le="+Inf"} 10
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="0.005"} 0
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="0.1"} 4
etcd_request_duration_seconds_bucket{operation="listWithCount",type="/registry/pods",le="+Inf"} 4
etcd_request_duration_seconds_sum{operation="get",type="/registry/pods"} 0.3
etcd_request_duration_seconds_count{operation="get",type="/registry/pods"} 100
# TYPE apiserver_flowcontrol_current_inqueue_requests gauge
apiserver_flowcontrol_current_inqueue_requests{flow_schema="a",priority_level="workload-low"} 3
apiserver_flowcontrol_current_inqueue_requests{flow_schema="b",priority_level="global-default"} 2
apiserver_flowcontrol_rejected_requests_total{flow_schema="a",priority_level="workload-low",reason="queue-full"} 7
apiserver_storage_objects{resource="pods"} 1500
apiserver_storage_objects{resource="configmaps"} 500
apiserver_resource_objects{group="",resource="pods"} 1500
apiserver_request_total{code="200",verb="GET"} 12345
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apiserver_scrape_sums_series_by_operation_and_prefers_one_objects_name() {
        let s = ApiserverScrape::parse(APISERVER_TEXT);
        assert_eq!(s.inqueue, Some(5.0));
        assert_eq!(s.rejected_total, Some(7.0));
        assert_eq!(
            s.storage_objects,
            Some(1500.0),
            "apiserver_resource_objects only"
        );
        let get = &s.etcd_request.iter().find(|(o, _)| o == "get").unwrap().1;
        assert_eq!(
            get.0,
            vec![(0.005, 100.0), (0.1, 110.0), (f64::INFINITY, 110.0)]
        );
        assert_eq!(s.etcd_request.len(), 2);
        let only_old = ApiserverScrape::parse(
            "apiserver_storage_objects{resource=\"pods\"} 42\n\
             apiserver_storage_objects{resource=\"nodes\"} -1\n",
        );
        assert_eq!(only_old.storage_objects, Some(42.0), "-1 is a failed count");
        assert_eq!(ApiserverScrape::parse(""), ApiserverScrape::default());
    }
}
