//! Authorization: bearer tokens, the deny list, access and token reviews.

use super::*;

/// The bearer token of a request, if any.
pub(super) fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// The caller's user name (the impersonated user, else the token) when it is on the deny list.
pub(super) fn denied_caller(shared: &Shared, headers: &HeaderMap) -> Option<String> {
    if let Some(t) = bearer_token(headers)
        && lock(&shared.deny_resources).contains(t)
    {
        return Some(t.to_string());
    }
    let deny = lock(&shared.deny);
    if deny.is_empty() {
        return None;
    }
    let impersonated = headers
        .get("impersonate-user")
        .and_then(|v| v.to_str().ok());
    [impersonated, bearer_token(headers)]
        .into_iter()
        .flatten()
        .find(|u| deny.contains(*u))
        .map(str::to_string)
}

/// RBAC's 403 for a resource request, in the apiserver's words.
pub(super) fn forbidden(user: &str, method: &Method, watch: bool, route: &Route) -> Status {
    let (kind, namespace, name, collection) = match route {
        Route::Collection { kind, namespace } => (*kind, namespace.clone(), None, true),
        Route::Item {
            kind,
            namespace,
            name,
            ..
        } => (*kind, namespace.clone(), Some(name.clone()), false),
    };
    let verb = match *method {
        Method::GET if watch => "watch",
        Method::GET if collection => "list",
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "unknown",
    };
    let subject = match &name {
        Some(n) => format!("{} {n:?}", kind.resource()),
        None => kind.resource().to_string(),
    };
    let scope = match &namespace {
        Some(ns) => format!(" in the namespace {ns:?}"),
        None => " at the cluster scope".to_string(),
    };
    Status::new(
        403,
        "Forbidden",
        format!(
            "{subject} is forbidden: User {user:?} cannot {verb} resource {:?} in API group \"\"{scope}",
            kind.resource()
        ),
    )
    .with_details(Details {
        name,
        kind: Some(kind.resource().to_string()),
        ..Details::default()
    })
}

/// `POST .../selfsubjectaccessreviews` (about the bearer token's user) and
/// `.../subjectaccessreviews` (about `spec.user` and `spec.groups`): the review back with
/// `status.allowed`, true unless a subject is on the deny list. 201 Created, like the apiserver.
pub(super) fn access_review(
    shared: &Shared,
    req: &ReadRequest,
    self_review: bool,
) -> Result<Response<Body>, Status> {
    if req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    let kind = if self_review {
        "SelfSubjectAccessReview"
    } else {
        "SubjectAccessReview"
    };
    let mut review: Value = serde_json::from_slice(&req.body).map_err(|e| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {kind}): {e}"
        ))
    })?;
    if !review.is_object() || review.get("kind").is_some_and(|k| k != kind) {
        return Err(Status::bad_request(format!(
            "the object provided is unrecognized (must be of type {kind})"
        )));
    }
    let token = bearer_token(&req.headers).map(str::to_string);
    let deny = lock(&shared.deny).clone();
    let spec = review.get("spec").cloned().unwrap_or(Value::Null);
    let allowed = if self_review {
        let Some(token) = token else {
            return Err(Status::new(401, "Unauthorized", "Unauthorized".into()));
        };
        !deny.contains(&token)
    } else {
        if let Some(caller) = token.filter(|t| deny.contains(t)) {
            return Err(Status::new(
                403,
                "Forbidden",
                format!(
                    "subjectaccessreviews.authorization.k8s.io is forbidden: User {caller:?} cannot create resource \"subjectaccessreviews\" in API group \"authorization.k8s.io\" at the cluster scope"
                ),
            ));
        }
        let user = spec.get("user").and_then(Value::as_str).unwrap_or("");
        let groups = spec
            .get("groups")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let impersonate = spec.pointer("/resourceAttributes/verb") == Some(&json!("impersonate"));
        let ns = spec
            .pointer("/resourceAttributes/namespace")
            .and_then(Value::as_str)
            .unwrap_or("");
        let in_scope = lock(&shared.only_in)
            .get(user)
            .is_none_or(|set| set.contains(ns));
        in_scope
            && (!impersonate || lock(&shared.impersonators).contains(user))
            && !deny.contains(user)
            && !groups
                .iter()
                .filter_map(Value::as_str)
                .any(|g| deny.contains(g))
    };
    let mut status = json!({ "allowed": allowed });
    if !allowed {
        status["reason"] = Value::from("denied by the fake apiserver's deny list");
    }
    let o = review.as_object_mut().expect("checked above");
    o.insert("kind".into(), kind.into());
    o.insert("apiVersion".into(), "authorization.k8s.io/v1".into());
    o.insert("metadata".into(), json!({ "creationTimestamp": null }));
    o.insert("status".into(), status);
    Ok(json_response(StatusCode::CREATED, to_json(&review)))
}

/// `POST .../tokenreviews`: every token authenticates as the user named like the token
/// itself (so the deny list applies to it in access reviews), in `system:authenticated`,
/// except tokens starting with `invalid`. 201 Created, like the apiserver.
pub(super) fn token_review(req: &ReadRequest) -> Result<Response<Body>, Status> {
    if req.method != Method::POST {
        return Err(Status::method_not_allowed());
    }
    let mut review: Value = serde_json::from_slice(&req.body).map_err(|e| {
        Status::bad_request(format!(
            "the object provided is unrecognized (must be of type TokenReview): {e}"
        ))
    })?;
    let token = review
        .pointer("/spec/token")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let status = if token.is_empty() || token.starts_with("invalid") {
        json!({ "authenticated": false, "user": {}, "error": "invalid bearer token" })
    } else {
        json!({
            "authenticated": true,
            "user": { "username": token, "uid": format!("uid-{token}"), "groups": ["system:authenticated"] },
            "audiences": ["https://kubernetes.default.svc.cluster.local"],
        })
    };
    let Some(o) = review.as_object_mut() else {
        return Err(Status::bad_request(
            "the object provided is unrecognized (must be of type TokenReview)".into(),
        ));
    };
    o.insert("kind".into(), "TokenReview".into());
    o.insert("apiVersion".into(), "authentication.k8s.io/v1".into());
    o.insert("metadata".into(), json!({ "creationTimestamp": null }));
    o.insert("status".into(), status);
    Ok(json_response(StatusCode::CREATED, to_json(&review)))
}

pub(super) fn check_ns_segment(ns: &str) -> Result<(), Status> {
    if is_dns_label(ns) {
        Ok(())
    } else {
        Err(Status::not_found(Kind::Namespace, ns))
    }
}
