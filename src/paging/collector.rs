//! The paging gauges: `kube_cache_proxy_page_size` and `kube_cache_proxy_paging_*`, read
//! from the latest sample at scrape time.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use super::service::Paging;

/// The `kube_cache_proxy_page_size` and `kube_cache_proxy_paging_*` gauges, read from the
/// latest sample at scrape time. An input unknown in the latest sample has no series.
#[derive(Debug)]
pub struct PagingCollector(pub Arc<Paging>);

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct TargetLabels {
    target: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct FactorLabels {
    factor: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct SignalLabels {
    signal: String,
}

type FloatGauge = prometheus_client::metrics::gauge::Gauge<f64, AtomicU64>;

impl prometheus_client::collector::Collector for PagingCollector {
    fn encode(&self, mut enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        use crate::metrics::emit;
        use prometheus_client::metrics::family::Family;
        use prometheus_client::metrics::gauge::Gauge;
        let p = &self.0;
        let sizes = Family::<TargetLabels, Gauge>::default();
        sizes
            .get_or_create(&TargetLabels {
                target: "upstream".into(),
            })
            .set(i64::from(p.upstream_page_size()));
        if let Some(cap) = p.downstream_cap() {
            sizes
                .get_or_create(&TargetLabels {
                    target: "downstream".into(),
                })
                .set(cap as i64);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_page_size",
            "Page size in use: of the proxy's own upstream LISTs, and the cap on downstream pages",
            &sizes,
        )?;
        let Some(r) = p.current() else {
            return Ok(());
        };
        let i = &r.inputs;
        let gauge = |v: f64| {
            let g = FloatGauge::default();
            g.set(v);
            g
        };
        emit(
            &mut enc,
            "kube_cache_proxy_paging_downstream_list_qps",
            "Downstream LISTs per second in the last paging interval",
            &gauge(i.downstream_list_qps),
        )?;
        for (name, help, v) in [
            (
                "kube_cache_proxy_paging_downstream_list_latency_p95_seconds",
                "p95 latency of downstream LISTs in the last paging interval",
                i.downstream_list_latency_p95_seconds,
            ),
            (
                "kube_cache_proxy_paging_upstream_latency_p95_seconds",
                "p95 latency (to response headers) of the proxy's own upstream requests in the last paging interval",
                i.upstream_latency_p95_seconds,
            ),
            (
                "kube_cache_proxy_paging_load_score",
                "apiserver/etcd load score (0..1) used by adaptive paging",
                i.load.score,
            ),
        ] {
            if let Some(v) = v {
                emit(&mut enc, name, help, &gauge(v))?;
            }
        }
        let values = Family::<SignalLabels, FloatGauge>::default();
        let scores = Family::<SignalLabels, FloatGauge>::default();
        for s in &i.load.signals {
            let l = SignalLabels {
                signal: s.name.into(),
            };
            values.get_or_create(&l).set(s.value);
            scores.get_or_create(&l).set(s.score);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_paging_load_signal",
            "Load signals read from the apiserver's and etcd's /metrics",
            &values,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_paging_load_signal_score",
            "Load signals normalised to 0..1 (value / saturation, at most 1)",
            &scores,
        )?;
        let factors = Family::<FactorLabels, FloatGauge>::default();
        let f = &r.decision.factors;
        for (name, v) in [
            ("qps", f.qps),
            ("load", f.load),
            ("upstream_latency", f.upstream_latency),
            ("downstream_latency", f.downstream_latency),
        ] {
            factors
                .get_or_create(&FactorLabels {
                    factor: name.into(),
                })
                .set(v);
        }
        emit(
            &mut enc,
            "kube_cache_proxy_paging_factor",
            "Factors of the adaptive page size in the last sample",
            &factors,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::window::LatencyWindow;
    use crate::paging::scrape::{APISERVER_TEXT, ApiserverScrape};

    use crate::paging::controller::tests::{MS, cfg};

    #[test]
    fn gauges_report_sizes_inputs_and_factors() {
        let p = Paging::new(cfg(), 500);
        let m = crate::metrics::Metrics::new();
        m.register_collector(Box::new(PagingCollector(p.clone())));
        let before = m.encode();
        assert!(
            before.contains("kube_cache_proxy_page_size{target=\"upstream\"} 100"),
            "{before}"
        );
        assert!(before.contains("kube_cache_proxy_page_size{target=\"downstream\"} 100"));
        assert!(
            !before.contains("kube_cache_proxy_paging_factor"),
            "no sample yet"
        );
        let up = LatencyWindow::default();
        up.observe(MS(20));
        p.sample(up.take(), Ok(ApiserverScrape::parse(APISERVER_TEXT)), None);
        let text = m.encode();
        for want in [
            "kube_cache_proxy_paging_factor{factor=\"qps\"} 0.5",
            "kube_cache_proxy_paging_factor{factor=\"load\"} 1.0",
            "kube_cache_proxy_paging_factor{factor=\"upstream_latency\"} 1.0",
            "kube_cache_proxy_paging_load_signal{signal=\"storageObjects\"} 1500.0",
            "kube_cache_proxy_paging_load_signal_score{signal=\"inqueueRequests\"} 0.05",
            "kube_cache_proxy_paging_load_score 0.05",
            "kube_cache_proxy_paging_downstream_list_qps 0.0",
            "kube_cache_proxy_paging_upstream_latency_p95_seconds 0.0",
        ] {
            assert!(text.contains(want), "{want} missing:\n{text}");
        }
        assert!(
            !text.contains("kube_cache_proxy_paging_downstream_list_latency_p95_seconds "),
            "no LIST, no p95"
        );
    }
}
