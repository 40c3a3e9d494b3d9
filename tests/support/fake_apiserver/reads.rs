//! Reads: GET and LIST (resourceVersion semantics, paging).

use super::*;

pub(super) fn get_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
) -> Result<Response<Body>, Status> {
    let store = shared.store();
    match store.objects(kind).get(&object_key(kind, ns, name)) {
        Some(obj) => Ok(json_response(StatusCode::OK, to_json(obj))),
        None => Err(Status::not_found(kind, name)),
    }
}

/// Parsed list/watch query parameters.
pub(super) struct ListParams {
    pub(super) rv: Option<u64>,
    /// `resourceVersion` was given and non-empty, but it is `"0"`.
    pub(super) rv_zero: bool,
    pub(super) rv_match: Option<String>,
    pub(super) limit: Option<usize>,
    pub(super) cont: Option<String>,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
    pub(super) allow_bookmarks: bool,
    pub(super) send_initial: Option<bool>,
    pub(super) timeout: Option<Duration>,
}

impl ListParams {
    /// `selectable`: the kind's fields beyond [`supported_fields`] (a CRD's `selectableFields`).
    pub(super) fn parse(
        q: &Query,
        kind: Kind,
        watch: bool,
        selectable: &[String],
    ) -> Result<ListParams, Status> {
        let rv_raw = q.get("resourceVersion").unwrap_or("");
        let rv = if rv_raw.is_empty() {
            None
        } else {
            Some(rv_raw.parse::<u64>().map_err(|_| {
                Status::bad_request(format!(
                    "resourceVersion: Invalid value: {rv_raw:?}: invalid resource version: strconv.ParseUint: parsing {rv_raw:?}: invalid syntax"
                ))
            })?)
        };
        let rv_match = q
            .get("resourceVersionMatch")
            .filter(|m| !m.is_empty())
            .map(str::to_string);
        let limit = match q.get("limit").filter(|l| !l.is_empty()) {
            None => None,
            Some(l) => {
                let n = l.parse::<i64>().map_err(|_| {
                    Status::bad_request(format!("strconv.ParseInt: parsing {l:?}: invalid syntax"))
                })?;
                // The apiserver treats limit <= 0 as "no limit".
                (n > 0).then(|| usize::try_from(n).unwrap_or(usize::MAX))
            }
        };
        let timeout = match q.get("timeoutSeconds").filter(|t| !t.is_empty()) {
            None => None,
            Some(t) => {
                let n = t.parse::<i64>().map_err(|_| {
                    Status::bad_request(format!("strconv.ParseInt: parsing {t:?}: invalid syntax"))
                })?;
                (n > 0).then(|| Duration::from_secs(n.unsigned_abs()))
            }
        };
        let send_initial = q.get("sendInitialEvents").map(parse_bool);
        let params = ListParams {
            rv,
            rv_zero: rv == Some(0),
            rv_match,
            limit,
            cont: q
                .get("continue")
                .filter(|c| !c.is_empty())
                .map(str::to_string),
            labels: LabelSelector::parse(q.get("labelSelector").unwrap_or(""))?,
            fields: FieldSelector::parse(q.get("fieldSelector").unwrap_or(""), kind, selectable)?,
            allow_bookmarks: q.flag("allowWatchBookmarks"),
            send_initial,
            timeout,
        };
        params.validate(watch, rv_raw)?;
        Ok(params)
    }

    /// Mirrors `ValidateListOptions` in k8s.io/apimachinery `internalversion/validation`.
    pub(super) fn validate(&self, watch: bool, rv_raw: &str) -> Result<(), Status> {
        let mut errs: Vec<(&str, String, &str)> = Vec::new();
        let m = self.rv_match.as_deref();
        if watch {
            if let Some(_send) = self.send_initial
                && m != Some("NotOlderThan")
            {
                errs.push((
                    "resourceVersionMatch",
                    "Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan".into(),
                    "FieldValueForbidden",
                ));
            }
            if let Some(m) = m {
                if self.send_initial.is_none() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided".into(),
                        "FieldValueForbidden",
                    ));
                }
                if m != "NotOlderThan" {
                    errs.push((
                        "resourceVersionMatch",
                        format!("Unsupported value: {m:?}: supported values: \"NotOlderThan\""),
                        "FieldValueNotSupported",
                    ));
                }
            }
        } else {
            if self.send_initial.is_some() {
                errs.push((
                    "sendInitialEvents",
                    "Forbidden: sendInitialEvents is forbidden for list".into(),
                    "FieldValueForbidden",
                ));
            }
            if let Some(m) = m {
                if rv_raw.is_empty() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided".into(),
                        "FieldValueForbidden",
                    ));
                }
                if self.cont.is_some() {
                    errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch is forbidden when continue is provided"
                            .into(),
                        "FieldValueForbidden",
                    ));
                }
                match m {
                    "Exact" if self.rv_zero => errs.push((
                        "resourceVersionMatch",
                        "Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"".into(),
                        "FieldValueForbidden",
                    )),
                    "Exact" | "NotOlderThan" => {}
                    other => errs.push((
                        "resourceVersionMatch",
                        format!(
                            "Unsupported value: {other:?}: supported values: \"Exact\", \"NotOlderThan\", \"\""
                        ),
                        "FieldValueNotSupported",
                    )),
                }
            }
        }
        if errs.is_empty() {
            Ok(())
        } else {
            Err(Status::invalid_list_options(&errs))
        }
    }
}

/// Waits (bounded) until the store has reached `rv`.
///
/// # Errors
/// 504 "Too large resource version" with `Retry-After: 1`, like the apiserver's cacher.
pub(super) async fn wait_for_rv(shared: &Shared, rv: u64) -> Result<(), Status> {
    let mut rx = shared.rv_tx.subscribe();
    if shared.store().rv >= rv {
        return Ok(());
    }
    let reached = tokio::time::timeout(FRESHNESS_WAIT, rx.wait_for(|v| *v >= rv)).await;
    match reached {
        Ok(Ok(_)) => Ok(()),
        _ => Err(Status::too_large_rv(rv, shared.store().rv)),
    }
}

pub(super) async fn list(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    p: ListParams,
) -> Result<Response<Body>, Status> {
    let prefix = ns.map(|ns| format!("{ns}/")).unwrap_or_default();
    // (snapshot rv or None for latest, start key)
    let (at, start) = if let Some(token) = &p.cont {
        if p.rv.is_some() && !p.rv_zero {
            return Err(Status::bad_request(
                "specifying resource version is not allowed when using continue".into(),
            ));
        }
        let (start, token_rv) = decode_continue(token, &prefix)
            .map_err(|e| Status::bad_request(format!("invalid continue token: {e}")))?;
        (u64::try_from(token_rv).ok(), Some(start))
    } else {
        let exact = match (p.rv, p.rv_match.as_deref()) {
            (Some(n), Some("Exact")) => Some(n),
            // Legacy: a non-zero resourceVersion with a limit and no match means Exact.
            (Some(n), None) if n > 0 && p.limit.is_some() => Some(n),
            _ => None,
        };
        match (exact, p.rv) {
            (Some(n), _) => (Some(n), None),
            (None, Some(n)) if n > 0 => {
                wait_for_rv(shared, n).await?;
                (None, None)
            }
            _ => (None, None),
        }
    };
    if let Some(at) = at {
        wait_for_rv(shared, at).await?;
    }

    let store = shared.store();
    let snapshot_rv = at.unwrap_or(store.rv);
    if snapshot_rv < store.floor {
        return Err(match &start {
            Some(start) => Status::continue_expired(&encode_continue(&start[prefix.len()..], -1)),
            None => Status::expired("The resourceVersion for the provided list is too old."),
        });
    }
    let snapshot;
    let objects = if snapshot_rv == store.rv {
        store.objects(kind)
    } else {
        snapshot = store.state_at(kind, snapshot_rv);
        &snapshot
    };
    let from = start.unwrap_or_else(|| prefix.clone());
    let mut in_scope = objects
        .range(from..)
        .take_while(|(k, _)| k.starts_with(&prefix))
        .peekable();
    let mut items: Vec<&Value> = Vec::new();
    let mut last_key: Option<&String> = None;
    // resourceVersion "0" is served from the apiserver's watch cache, which ignores limit.
    let limit = match p.limit {
        Some(l) if !p.rv_zero => l,
        _ => usize::MAX,
    };
    while items.len() < limit {
        let Some((key, obj)) = in_scope.next() else {
            break;
        };
        if p.labels.matches(obj) && p.fields.matches(obj) {
            items.push(obj);
            last_key = Some(key);
        }
    }
    let has_more = items.len() >= limit && in_scope.peek().is_some();
    let mut meta = JsonObj::new().str("resourceVersion", &snapshot_rv.to_string());
    if has_more && let Some(last) = last_key {
        let token = encode_continue(
            &format!("{}\u{0}", &last[prefix.len()..]),
            snapshot_rv as i64,
        );
        meta = meta.str("continue", &token);
        // etcd counts the remaining keys; with selectors the count would be wrong, so the
        // apiserver leaves it out.
        if p.labels.is_empty() && p.fields.is_empty() {
            meta = meta.raw("remainingItemCount", &in_scope.count().to_string());
        }
    }
    let mut out = JsonObj::new()
        .str("kind", &format!("{}List", kind.kind()))
        .str("apiVersion", kind.api_version())
        .raw("metadata", &meta.finish())
        .finish();
    out.pop();
    out.push_str(",\"items\":[");
    for (i, item) in items.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        // Items of a typed list carry no kind/apiVersion; a custom resource's do.
        let mut item = (*item).clone();
        if let Some(o) = item.as_object_mut().filter(|_| !kind.custom()) {
            o.remove("kind");
            o.remove("apiVersion");
        }
        out.push_str(&to_json(&item));
    }
    out.push_str("]}");
    Ok(json_response(StatusCode::OK, out))
}
