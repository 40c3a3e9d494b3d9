//! Writes: create, update, patch, delete.

use super::*;

/// Decodes a request body as an object of `kind`.
///
/// # Errors
/// 400 BadRequest for malformed JSON, a non-object, or another kind/apiVersion.
pub(super) fn parse_body(kind: Kind, body: &[u8]) -> Result<Value, Status> {
    let unrecognized = |detail: String| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {detail}",
            kind.kind()
        ))
    };
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| unrecognized(format!("couldn't get version/kind; json parse error: {e}")))?;
    if !v.is_object() {
        return Err(unrecognized(
            "couldn't get version/kind; json parse error: expected an object".into(),
        ));
    }
    check_type_meta(kind, &v)?;
    Ok(v)
}

pub(super) fn check_type_meta(kind: Kind, v: &Value) -> Result<(), Status> {
    if let Some(k) = v
        .get("kind")
        .and_then(Value::as_str)
        .filter(|k| !k.is_empty())
        && k != kind.kind()
    {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): {k} (not {})",
            kind.kind(),
            kind.kind()
        )));
    }
    if let Some(av) = v
        .get("apiVersion")
        .and_then(Value::as_str)
        .filter(|a| !a.is_empty())
        && av != kind.api_version()
    {
        return Err(Status::bad_request(format!(
            "the API version in the data ({av}) does not match the expected API version ({})",
            kind.api_version()
        )));
    }
    Ok(())
}

pub(super) fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

pub(super) fn metadata_mut(obj: &mut Value) -> &mut Map<String, Value> {
    let o = obj.as_object_mut().expect("object checked by parse_body");
    let meta = o
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !meta.is_object() {
        *meta = Value::Object(Map::new());
    }
    meta.as_object_mut().expect("just made an object")
}

pub(super) fn create_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    mut obj: Value,
) -> Result<Value, Status> {
    if !obj.is_object() {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {})",
            kind.kind()
        )));
    }
    check_type_meta(kind, &obj)?;
    let meta = obj.get("metadata");
    if meta.is_some_and(|m| !m.is_object() && !m.is_null()) {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): metadata must be an object",
            kind.kind()
        )));
    }
    if kind.namespaced()
        && let Some(body_ns) = meta_str(&obj, "namespace").filter(|n| !n.is_empty())
        && Some(body_ns) != ns
    {
        return Err(Status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        ));
    }
    let mut store = shared.store();
    let mut name = meta_str(&obj, "name").unwrap_or("").to_string();
    if name.is_empty() {
        let generate = meta_str(&obj, "generateName").unwrap_or("").to_string();
        if generate.is_empty() {
            return Err(Status::invalid_object(
                kind,
                "",
                "metadata.name",
                "Required value: name or generateName is required",
                "FieldValueRequired",
            ));
        }
        // Like the apiserver: five characters from a consonant-and-digit alphabet.
        const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
        let mut n = store.rv.wrapping_mul(2_654_435_761) ^ store.next_uid;
        let mut suffix = String::new();
        for _ in 0..5 {
            suffix.push(ALPHABET[(n % ALPHABET.len() as u64) as usize] as char);
            n /= ALPHABET.len() as u64;
        }
        name = format!("{generate}{suffix}");
    }
    let valid_name = if kind == Kind::Namespace {
        is_dns_label(&name)
    } else {
        is_dns_subdomain(&name)
    };
    if !valid_name {
        return Err(Status::invalid_object(
            kind,
            &name,
            "metadata.name",
            &format!(
                "Invalid value: {name:?}: a lowercase RFC 1123 {} must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                if kind == Kind::Namespace {
                    "label"
                } else {
                    "subdomain"
                }
            ),
            "FieldValueInvalid",
        ));
    }
    if let Some(ns) = ns
        && !store.objects(Kind::Namespace).contains_key(ns)
    {
        return Err(Status::not_found(Kind::Namespace, ns));
    }
    let key = object_key(kind, ns, &name);
    if store.objects(kind).contains_key(&key) {
        return Err(Status::already_exists(kind, &name));
    }
    let uid = store.new_uid();
    {
        let o = obj.as_object_mut().expect("checked above");
        o.insert("kind".into(), kind.kind().into());
        o.insert("apiVersion".into(), kind.api_version().into());
    }
    let meta = metadata_mut(&mut obj);
    meta.insert("name".into(), name.clone().into());
    if let Some(ns) = ns {
        meta.insert("namespace".into(), ns.into());
    } else {
        meta.remove("namespace");
    }
    meta.insert("uid".into(), uid.into());
    meta.insert("creationTimestamp".into(), now_rfc3339().into());
    for system in [
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "selfLink",
        "generation",
    ] {
        meta.remove(system);
    }
    match kind {
        Kind::Namespace => {
            let labels = meta
                .entry("labels")
                .or_insert_with(|| Value::Object(Map::new()));
            if !labels.is_object() {
                *labels = Value::Object(Map::new());
            }
            labels
                .as_object_mut()
                .expect("object")
                .insert("kubernetes.io/metadata.name".into(), name.clone().into());
            let o = obj.as_object_mut().expect("object");
            o.insert("spec".into(), json!({"finalizers": ["kubernetes"]}));
            o.insert("status".into(), json!({"phase": "Active"}));
        }
        Kind::Pod => {
            obj.as_object_mut()
                .expect("object")
                .insert("status".into(), json!({"phase": "Pending"}));
        }
        // Established at once (the apiserver's establishing controller takes a moment).
        Kind::Crd => {
            obj.as_object_mut().expect("object").insert(
                "status".into(),
                json!({"conditions": [
                    {"type": "NamesAccepted", "status": "True"},
                    {"type": "Established", "status": "True"},
                ]}),
            );
        }
        Kind::ConfigMap | Kind::Widget => {}
    }
    let created = store.write_locked(kind, &key, Some(obj));
    let rv = store.rv;
    drop(store);
    // After the lock is released: waiters re-check the store.
    shared.rv_tx.send_replace(rv);
    Ok(created)
}

/// PUT semantics. `status_only` is the `/status` subresource: only `.status` changes.
pub(super) fn update_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    obj: Value,
    status_only: bool,
) -> Result<Value, Status> {
    let mut store = shared.store();
    let updated = update_locked(&mut store, kind, ns, name, obj, status_only)?;
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(updated)
}

pub(super) fn update_locked(
    store: &mut Store,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    mut obj: Value,
    status_only: bool,
) -> Result<Value, Status> {
    if !obj.is_object() {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {})",
            kind.kind()
        )));
    }
    check_type_meta(kind, &obj)?;
    let body_name = meta_str(&obj, "name").unwrap_or("");
    if body_name != name {
        return Err(Status::bad_request(format!(
            "the name of the object ({body_name}) does not match the name on the URL ({name})"
        )));
    }
    if kind.namespaced()
        && let Some(body_ns) = meta_str(&obj, "namespace").filter(|n| !n.is_empty())
        && Some(body_ns) != ns
    {
        return Err(Status::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
                .into(),
        ));
    }
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let old_rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
    if let Some(rv) = meta_str(&obj, "resourceVersion").filter(|rv| !rv.is_empty())
        && rv != old_rv
    {
        return Err(Status::conflict(
            kind,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        ));
    }
    let mut new = if status_only {
        let mut new = old.clone();
        let status = obj.get("status").cloned().unwrap_or(Value::Null);
        new.as_object_mut()
            .expect("stored objects are objects")
            .insert("status".into(), status);
        new
    } else {
        {
            let o = obj.as_object_mut().expect("checked above");
            o.insert("kind".into(), kind.kind().into());
            o.insert("apiVersion".into(), kind.api_version().into());
            // The main resource cannot change status (pod and namespace strategies keep it).
            if kind.has_status() {
                match old.get("status") {
                    Some(s) => o.insert("status".into(), s.clone()),
                    None => o.remove("status"),
                };
            }
        }
        let meta = metadata_mut(&mut obj);
        for system in ["uid", "creationTimestamp", "deletionTimestamp", "namespace"] {
            match old.get("metadata").and_then(|m| m.get(system)) {
                Some(v) => meta.insert(system.into(), v.clone()),
                None => meta.remove(system),
            };
        }
        obj
    };
    set_rv(&mut new, old_rv.parse().unwrap_or(0));
    if new == old {
        // The apiserver skips writes that change nothing: same resourceVersion, no event.
        return Ok(old);
    }
    Ok(store.write_locked(kind, &key, Some(new)))
}

pub(super) fn patch(
    shared: &Shared,
    req: &ReadRequest,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    status_only: bool,
) -> Result<Response<Body>, Status> {
    let ct = req
        .headers
        .get(CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    if ct != "application/merge-patch+json" && ct != "application/strategic-merge-patch+json" {
        return Err(Status::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/merge-patch+json, application/strategic-merge-patch+json (this fake does not implement {ct:?})"
            ),
        ));
    }
    let patch: Value = serde_json::from_slice(&req.body)
        .map_err(|e| Status::bad_request(format!("error decoding patch: {e}")))?;
    if !patch.is_object() {
        return Err(Status::bad_request(
            "error decoding patch: a merge patch must be a JSON object".into(),
        ));
    }
    let mut store = shared.store();
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let mut merged = old.clone();
    merge_patch(&mut merged, &patch);
    if !merged.is_object() {
        return Err(Status::bad_request(
            "the patch produced something that is not an object".into(),
        ));
    }
    // A resourceVersion in the patch is a precondition; without one the patch always applies.
    if meta_str(&patch, "resourceVersion").is_none() {
        let old_rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
        if let Some(meta) = merged.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.insert("resourceVersion".into(), old_rv.into());
        }
    }
    if meta_str(&merged, "name") != Some(name) {
        return Err(Status::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            meta_str(&merged, "name").unwrap_or("")
        )));
    }
    let updated = update_locked(&mut store, kind, ns, name, merged, status_only)?;
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(json_response(StatusCode::OK, to_json(&updated)))
}

/// RFC 7386 JSON merge patch.
pub(super) fn merge_patch(target: &mut Value, patch: &Value) {
    let Some(patch_obj) = patch.as_object() else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    let t = target.as_object_mut().expect("made an object");
    for (k, v) in patch_obj {
        if v.is_null() {
            t.remove(k);
        } else {
            merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    }
}

/// DELETE semantics; returns the response body the apiserver gives for `kind`.
pub(super) fn delete_object(
    shared: &Shared,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    options: &Value,
) -> Result<Value, Status> {
    let mut store = shared.store();
    let key = object_key(kind, ns, name);
    let Some(old) = store.objects(kind).get(&key).cloned() else {
        return Err(Status::not_found(kind, name));
    };
    let pre = options.get("preconditions");
    let uid = meta_str(&old, "uid").unwrap_or("").to_string();
    let rv = meta_str(&old, "resourceVersion").unwrap_or("").to_string();
    if let Some(want) = pre.and_then(|p| p.get("uid")).and_then(Value::as_str)
        && want != uid
    {
        return Err(Status::conflict(
            kind,
            name,
            &format!("Precondition failed: UID in precondition: {want}, UID in object meta: {uid}"),
        ));
    }
    if let Some(want) = pre
        .and_then(|p| p.get("resourceVersion"))
        .and_then(Value::as_str)
        && want != rv
    {
        return Err(Status::conflict(
            kind,
            name,
            &format!(
                "Precondition failed: ResourceVersion in precondition: {want}, ResourceVersion in object meta: {rv}"
            ),
        ));
    }
    let out = match kind {
        Kind::ConfigMap | Kind::Widget => {
            store.write_locked(kind, &key, None);
            let details = JsonObj::new()
                .str("name", name)
                .str("kind", kind.resource())
                .str("uid", &uid)
                .finish();
            let status = JsonObj::new()
                .str("kind", "Status")
                .str("apiVersion", "v1")
                .raw("metadata", "{}")
                .str("status", "Success")
                .raw("details", &details)
                .finish();
            serde_json::from_str(&status).unwrap_or(Value::Null)
        }
        Kind::Pod => store.write_locked(kind, &key, None),
        Kind::Crd => {
            // The apiserver's CRD finalizer deletes every object first; then the resource
            // stops being served and its watches end.
            if name == WIDGETS_CRD {
                let keys: Vec<String> = store.objects(Kind::Widget).keys().cloned().collect();
                for k in keys {
                    store.write_locked(Kind::Widget, &k, None);
                }
            }
            let out = store.write_locked(kind, &key, None);
            if name == WIDGETS_CRD {
                store.watchers.retain(|w| {
                    if w.filter.kind == Kind::Widget {
                        let _ = w.tx.send(WatchMsg::End);
                        false
                    } else {
                        true
                    }
                });
            }
            out
        }
        Kind::Namespace => {
            // The apiserver answers with the Terminating namespace; its namespace controller
            // then empties it and removes it. Here that happens at once.
            let mut terminating = old.clone();
            if let Some(meta) = terminating
                .get_mut("metadata")
                .and_then(Value::as_object_mut)
            {
                meta.insert("deletionTimestamp".into(), now_rfc3339().into());
            }
            if let Some(o) = terminating.as_object_mut() {
                o.insert("status".into(), json!({"phase": "Terminating"}));
            }
            let out = store.write_locked(kind, &key, Some(terminating));
            let prefix = format!("{name}/");
            for content_kind in [Kind::ConfigMap, Kind::Pod] {
                let keys: Vec<String> = store
                    .objects(content_kind)
                    .keys()
                    .filter(|k| k.starts_with(&prefix))
                    .cloned()
                    .collect();
                for k in keys {
                    store.write_locked(content_kind, &k, None);
                }
            }
            store.write_locked(kind, &key, None);
            out
        }
    };
    let rv = store.rv;
    drop(store);
    shared.rv_tx.send_replace(rv);
    Ok(out)
}
