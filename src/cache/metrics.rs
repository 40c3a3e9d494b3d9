//! Per-resource cache metrics, read from the caches, hubs and reflectors at scrape time.

use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

use super::registry::Caches;
use crate::cache::reflector::{ReflectorStatus, RelistReason};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BudgetStateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    resource: String,
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    resource: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    resource: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    resource: String,
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ServedByLabels {
    resource: String,
    served_by: String,
}

#[derive(Debug)]
pub struct CacheCollector(pub Arc<Caches>);

/// Adds `n` to the counter of `labels`, creating its series only once it counts something:
/// a per-resource counter appears with its first count, as kube-apiserver's own counter
/// vectors do. Written at zero, the reasons nothing happened for (5 relist reasons, 3
/// continue-token rejections, ... for each of 57 resources) were most of the cache
/// families' lines of a scrape.
fn count<L>(family: &Family<L, Counter>, labels: &L, n: u64)
where
    L: Clone + std::hash::Hash + Eq,
{
    if n > 0 {
        family.get_or_create(labels).inc_by(n);
    }
}

use crate::metrics::emit;

impl Collector for CacheCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let upstream_watches = Family::<ResourceLabels, Gauge>::default();
        let watchers = Family::<ResourceLabels, Gauge>::default();
        let objects = Family::<ResourceLabels, Gauge>::default();
        let bytes = Family::<ResourceLabels, Gauge>::default();
        let expired = Family::<ReasonLabels, Counter>::default();
        let events_sent = Family::<ResourceLabels, Counter>::default();
        let relists = Family::<ReasonLabels, Counter>::default();
        let received = Family::<PhaseLabels, Counter>::default();
        let upstream_events = Family::<ResourceLabels, Counter>::default();
        let proto_resyncs = Family::<ResourceLabels, Counter>::default();
        let transcoded = Family::<ResourceLabels, Counter>::default();
        let absorbed = Family::<ResourceLabels, Counter>::default();
        let absorbed_events = Family::<ResourceLabels, Counter>::default();
        let warm = Family::<ResourceLabels, Gauge>::default();
        let terminated = Family::<ReasonLabels, Counter>::default();
        let lists = Family::<ServedByLabels, Counter>::default();
        let pages = Family::<ResourceLabels, Counter>::default();
        let rejections = Family::<ReasonLabels, Counter>::default();
        let snapshots = Family::<ResourceLabels, Gauge>::default();
        let snapshot_bytes = Family::<ResourceLabels, Gauge>::default();
        let field_filtered = Family::<ResultLabels, Counter>::default();
        let filtered_watchers = Family::<ResourceLabels, Gauge>::default();
        let field_filters = Family::<ResourceLabels, Gauge>::default();
        let field_evaluations = Family::<ResourceLabels, Counter>::default();
        let field_seconds = Family::<ResourceLabels, Counter<f64>>::default();
        let field_refused = Family::<ReasonLabels, Counter>::default();
        let proto_objects = Family::<StateLabels, Gauge>::default();
        let proto_bytes = Family::<ResourceLabels, Gauge>::default();
        let proto_watchers = Family::<ResourceLabels, Gauge>::default();
        let proto_waits_expired = Family::<ResourceLabels, Counter>::default();
        let proto_shed = Family::<ResourceLabels, Gauge>::default();
        let proto_budget_bytes = Family::<BudgetStateLabels, Gauge>::default();
        let table_rows = Family::<ResourceLabels, Gauge>::default();
        let table_bytes = Family::<ResourceLabels, Gauge>::default();
        let table_responses = Family::<ServedByLabels, Counter>::default();
        let table_age_mismatches = Family::<ResourceLabels, Counter>::default();
        let table_shed = Family::<ResourceLabels, Gauge>::default();
        let table_budget_bytes = Family::<BudgetStateLabels, Gauge>::default();
        for e in self.0.entries() {
            let resource = e.cache.resource.label();
            let l = ResourceLabels {
                resource: resource.clone(),
            };
            let watching = matches!(
                *e.reflector.status().borrow(),
                ReflectorStatus::Watching { .. }
            );
            upstream_watches.get_or_create(&l).set(i64::from(watching));
            watchers
                .get_or_create(&l)
                .set((e.cache.hub.len() + e.cache.proto_hub.len()) as i64);
            objects.get_or_create(&l).set(e.cache.len() as i64);
            if e.cache.protobuf_started() {
                let (with, without, b) = e.cache.protobuf_coverage();
                for (state, n) in [("with", with), ("without", without)] {
                    proto_objects
                        .get_or_create(&StateLabels {
                            resource: resource.clone(),
                            state: state.into(),
                        })
                        .set(n as i64);
                }
                proto_bytes.get_or_create(&l).set(b as i64);
                proto_watchers
                    .get_or_create(&l)
                    .set(e.cache.proto_hub.len() as i64);
                count(
                    &proto_waits_expired,
                    &l,
                    e.cache.proto_waits_expired.load(Relaxed),
                );
                proto_shed
                    .get_or_create(&l)
                    .set(i64::from(e.cache.proto_shed.is_cancelled()));
            }
            // One budget for the process: every cache holds the same one.
            let b = e.cache.protobuf_budget();
            for (state, n) in [("used", b.used()), ("max", b.max())] {
                proto_budget_bytes
                    .get_or_create(&BudgetStateLabels {
                        state: state.into(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            let t = &e.cache.table;
            if t.started() {
                let (rows, b) = t.size();
                table_rows.get_or_create(&l).set(rows as i64);
                table_bytes.get_or_create(&l).set(b as i64);
                table_shed
                    .get_or_create(&l)
                    .set(i64::from(t.shed.is_cancelled()));
                table_age_mismatches
                    .get_or_create(&l)
                    .inc_by(t.stats.age_mismatches.load(Relaxed));
            }
            let (served, passed) = (
                t.stats.served.load(Relaxed),
                t.stats.passed_through.load(Relaxed),
            );
            if served + passed > 0 {
                for (by, n) in [("cache", served), ("apiserver", passed)] {
                    table_responses
                        .get_or_create(&ServedByLabels {
                            resource: resource.clone(),
                            served_by: by.into(),
                        })
                        .inc_by(n);
                }
            }
            let b = t.budget();
            for (state, n) in [("used", b.used()), ("max", b.max())] {
                table_budget_bytes
                    .get_or_create(&BudgetStateLabels {
                        state: state.into(),
                    })
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
            }
            bytes.get_or_create(&l).set(e.cache.object_bytes() as i64);
            let ws = &e.cache.watch_stats;
            for (reason, n) in [
                ("too_old", ws.expired_too_old.load(Relaxed)),
                ("relist", ws.expired_relist.load(Relaxed)),
            ] {
                count(
                    &expired,
                    &ReasonLabels {
                        resource: resource.clone(),
                        reason: reason.into(),
                    },
                    n,
                );
            }
            count(
                &events_sent,
                &l,
                e.cache.hub.stats.events_sent.load(Relaxed)
                    + e.cache.proto_hub.stats.events_sent.load(Relaxed),
            );
            let snap = e.reflector.stats().snapshot();
            let proto = e.proto_stats().map(|s| s.snapshot());
            let phases = [
                ("list", Some(snap.list_bytes)),
                ("watch", Some(snap.watch_bytes)),
                ("protobuf", proto.as_ref().map(|p| p.bytes)),
            ];
            for (phase, n) in phases {
                if let Some(n) = n {
                    count(
                        &received,
                        &PhaseLabels {
                            resource: resource.clone(),
                            phase: phase.into(),
                        },
                        n,
                    );
                }
            }
            if let Some(p) = &proto {
                count(&proto_resyncs, &l, p.restarts);
            }
            count(
                &transcoded,
                &l,
                e.cache
                    .transcoded
                    .load(std::sync::atomic::Ordering::Relaxed),
            );
            count(&upstream_events, &l, snap.events);
            for reason in RelistReason::ALL {
                count(
                    &relists,
                    &ReasonLabels {
                        resource: resource.clone(),
                        reason: reason.as_str().into(),
                    },
                    snap.lists(reason),
                );
            }
            count(&absorbed, &l, e.cache.absorbed_total.load(Relaxed));
            count(&absorbed_events, &l, e.cache.absorbed_events.load(Relaxed));
            warm.get_or_create(&l)
                .set(i64::from(e.cache.restored_from.load(Relaxed) > 0));
            let ls = &e.cache.list_stats;
            for (by, n) in [
                ("cache", ls.from_cache.load(Relaxed)),
                ("apiserver", ls.passed_through.load(Relaxed)),
            ] {
                count(
                    &lists,
                    &ServedByLabels {
                        resource: resource.clone(),
                        served_by: by.into(),
                    },
                    n,
                );
            }
            count(&pages, &l, ls.continued.load(Relaxed));
            for (reason, n) in [
                ("invalid", ls.token_invalid.load(Relaxed)),
                ("expired", ls.token_expired.load(Relaxed)),
                ("snapshot_gone", ls.snapshot_gone.load(Relaxed)),
            ] {
                count(
                    &rejections,
                    &ReasonLabels {
                        resource: resource.clone(),
                        reason: reason.into(),
                    },
                    n,
                );
            }
            let hs = &e.cache.hub.stats;
            for (result, n) in [
                ("delivered", hs.changes_delivered.load(Relaxed)),
                ("suppressed", hs.changes_suppressed.load(Relaxed)),
            ] {
                count(
                    &field_filtered,
                    &ResultLabels {
                        resource: resource.clone(),
                        result: result.into(),
                    },
                    n,
                );
            }
            // The filter gauges and work, only for resources that have or had a filtered
            // watch (the scrape stays proportionate to what is used).
            let reg = &e.cache.hub.change_filters;
            let refused = [
                ("resource_limit", reg.refused_resource.load(Relaxed)),
                ("identity_limit", reg.refused_identity.load(Relaxed)),
            ];
            let evaluations = hs.change_evaluations.load(Relaxed);
            let distinct = reg.distinct();
            let filtered = e.cache.hub.filtered();
            if filtered > 0
                || evaluations > 0
                || distinct > 0
                || refused.iter().any(|(_, n)| *n > 0)
            {
                filtered_watchers.get_or_create(&l).set(filtered as i64);
                field_filters.get_or_create(&l).set(distinct as i64);
                field_evaluations.get_or_create(&l).inc_by(evaluations);
                field_seconds
                    .get_or_create(&l)
                    .inc_by(hs.change_nanos.load(Relaxed) as f64 / 1e9);
                for (reason, n) in refused {
                    field_refused
                        .get_or_create(&ReasonLabels {
                            resource: resource.clone(),
                            reason: reason.into(),
                        })
                        .inc_by(n);
                }
            }
            snapshots
                .get_or_create(&l)
                .set(e.cache.retained_snapshots().0 as i64);
            snapshot_bytes
                .get_or_create(&l)
                .set(e.cache.retained_bytes() as i64);
            let (hs, ps) = (&e.cache.hub.stats, &e.cache.proto_hub.stats);
            for (reason, n) in [
                (
                    "slow_consumer",
                    hs.closed_slow.load(Relaxed) + ps.closed_slow.load(Relaxed),
                ),
                (
                    "relist",
                    hs.closed_relist.load(Relaxed) + ps.closed_relist.load(Relaxed),
                ),
            ] {
                count(
                    &terminated,
                    &ReasonLabels {
                        resource: resource.clone(),
                        reason: reason.into(),
                    },
                    n,
                );
            }
        }
        emit(
            &mut enc,
            "kube_cache_proxy_upstream_watches",
            "Open upstream watches per cached resource (1 while synced and watching)",
            &upstream_watches,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watchers",
            "Downstream watchers served from the cache",
            &watchers,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_objects",
            "Objects held in the cache",
            &objects,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_bytes",
            "Bytes of the cached objects' bodies (their JSON as received; the process holds more: parsed metadata, history, snapshots)",
            &bytes,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_protobuf_objects",
            "Cached objects with and without their protobuf envelope, for resources whose protobuf side runs (started by the first protobuf reader)",
            &proto_objects,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_protobuf_bytes",
            "Bytes of the current objects' protobuf envelopes",
            &proto_bytes,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_protobuf_watchers",
            "Downstream watchers served in protobuf from the cache (also counted in kube_cache_proxy_cache_watchers)",
            &proto_watchers,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_protobuf_shed",
            "1 when the resource's protobuf representation was shed for cache.protobufMaxBytes (its protobuf requests go to the apiserver until restart)",
            &proto_shed,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_protobuf_budget_bytes",
            "The protobuf representation's bytes charged over all resources (used) and its bound, cache.protobufMaxBytes (max)",
            &proto_budget_bytes,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_table_rows",
            "Table rows held by the resource's table side (the apiserver's printer rows of cached object versions; started by the first Table reader)",
            &table_rows,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_table_bytes",
            "Bytes of the table side's rows, as charged to cache.tableMaxBytes",
            &table_bytes,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_table_shed",
            "1 when the resource's table side was shed for cache.tableMaxBytes (its Tables go to the apiserver until restart)",
            &table_shed,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_table_budget_bytes",
            "The table side's bytes charged over all resources (used) and its bound, cache.tableMaxBytes (max)",
            &table_budget_bytes,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_table_responses",
            "Table GETs, LISTs and WATCHes (as=Table, kubectl get) of cached resources by who answered them (cache or apiserver)",
            &table_responses,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_table_age_mismatches",
            "Table rows received whose age cell was not the age the proxy prints for that moment (those rows are not served)",
            &table_age_mismatches,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_protobuf_envelope_waits_expired",
            "Events whose protobuf envelope did not come within 10 s: the resource's protobuf watchers were closed (they resume, passed to the apiserver while envelopes are missing)",
            &proto_waits_expired,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watches_expired",
            "Downstream watches answered 410 Expired, by reason: too_old (before the history window or the first list), relist (before the cache's last relist)",
            &expired,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_events_sent",
            "Events queued to downstream watchers",
            &events_sent,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filter_events",
            "MODIFIED events offered to watchers with a field-level change filter: delivered, or suppressed (none of their fields changed)",
            &field_filtered,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filter_watchers",
            "Downstream watchers with a field-level change filter",
            &filtered_watchers,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filters",
            "Distinct field-level change filters of the open watches (bounded by cache.watchFields)",
            &field_filters,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filter_evaluations",
            "Field-level change filter decisions computed, per MODIFIED event reaching filtered watchers: one walk deciding every select filter at once, and one per distinct ignore filter",
            &field_evaluations,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filter_seconds",
            "Time the event dispatch spent on field-level change filters: parsing the two objects, their changed paths, the decisions",
            &field_seconds,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watch_field_filter_refused",
            "Filtered watches refused (429) beyond cache.watchFields: resource_limit, identity_limit",
            &field_refused,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_upstream_relists",
            "Upstream LISTs by reason (initial, expired, ...)",
            &relists,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_upstream_received_bytes",
            "Bytes of upstream response bodies the cache took in, by phase: list (the reflector's LIST pages), watch (its watch stream), protobuf (the protobuf side's watch, once started)",
            &received,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_protobuf_side_resyncs",
            "Times the protobuf side started over with the apiserver's whole protobuf state (a watch with initial events after it had delivered some)",
            &proto_resyncs,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_protobuf_transcoded",
            "Object versions whose protobuf was written from their JSON (cache.protobufTranscode) rather than read from a protobuf side's watch",
            &transcoded,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_upstream_watch_events",
            "ADDED/MODIFIED/DELETED events the cache's reflector took in from its upstream watch",
            &upstream_events,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_relists_absorbed",
            "Relists told to open downstream watchers as the difference from the old state (cache.absorbRelists): the watchers stayed open",
            &absorbed,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_cache_warm_start",
            "1 when the cache started from its saved state (cache.stateDir) and resumed its upstream watch without a LIST, 0 after a cold start",
            &warm,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_relist_difference_events",
            "Events of those differences (ADDED, MODIFIED, DELETED), before per-watcher selection",
            &absorbed_events,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_watchers_terminated",
            "Downstream watchers closed by the proxy, by reason",
            &terminated,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_list_requests",
            "LIST requests for cached resources by who answered them (cache or apiserver)",
            &lists,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_list_continued_pages",
            "List pages after the first served from a retained or rebuilt snapshot",
            &pages,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_continue_token_rejections",
            "Continue tokens refused: invalid (forged, tampered, another caller or query), expired, snapshot gone",
            &rejections,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_list_snapshots",
            "Snapshots retained for paginated lists",
            &snapshots,
        )?;
        emit(
            &mut enc,
            "kube_cache_proxy_list_snapshot_bytes",
            "Object bytes kept alive only by retained snapshots (estimate)",
            &snapshot_bytes,
        )?;
        Ok(())
    }
}
