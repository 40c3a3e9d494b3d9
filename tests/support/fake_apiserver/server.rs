//! Server plumbing: accepting connections, request handling and routing.

use super::*;

pub(super) async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let stream = tokio::select! {
            _ = shared.shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(_) => continue,
            },
        };
        if shared.refuse.load(Ordering::SeqCst) {
            drop(stream);
            continue;
        }
        let _ = stream.set_nodelay(true);
        let shared = shared.clone();
        tokio::spawn(async move {
            let service_shared = shared.clone();
            let service = service_fn(move |req| handle(service_shared.clone(), req));
            let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            // Like Go's server (kube-apiserver): heads up to 1 MiB, any number of headers.
            builder
                .http1()
                .max_headers(4096)
                .max_buf_size(2 * 1024 * 1024);
            builder.http2().max_header_list_size(2 * 1024 * 1024);
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
            tokio::select! {
                _ = shared.shutdown.cancelled() => {}
                _ = conn => {}
            }
        });
    }
}

pub(super) async fn handle(
    shared: Arc<Shared>,
    mut req: Request<Incoming>,
) -> Result<Response<Body>, BoxError> {
    let upgrade_requested = req.headers().contains_key(UPGRADE);
    let on_upgrade = upgrade_requested.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let body = if upgrade_requested {
        Bytes::new()
    } else {
        body.collect().await?.to_bytes()
    };
    lock(&shared.log).push(LoggedRequest {
        method: parts.method.clone(),
        path: parts.uri.path().to_string(),
        query: parts.uri.query().map(str::to_string),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    shared.arrived();

    if shared.refuse.load(Ordering::SeqCst) {
        return Err("connection refused by fault injection".into());
    }
    // Frozen (`Faults::set_freeze`): no answer until thawed.
    let _ = shared.frozen.subscribe().wait_for(|frozen| !*frozen).await;
    let injected = {
        let mut fail = lock(&shared.fail_next);
        if fail.0 > 0 {
            fail.0 -= 1;
            Some(fail.1)
        } else {
            None
        }
    };
    let delay = *lock(&shared.delay);
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if let Some(code) = injected {
        return Ok(Status::injected(code).into_response());
    }
    if shared.watches_429.load(Ordering::SeqCst)
        && parts.method == Method::GET
        && Query::parse(parts.uri.query().unwrap_or("")).flag("watch")
    {
        return Ok(Status::injected(429).into_response());
    }

    let req = ReadRequest {
        method: parts.method,
        path: parts.uri.path().to_string(),
        query: Query::parse(parts.uri.query().unwrap_or("")),
        headers: parts.headers,
        body,
    };
    let write = matches!(
        req.method,
        Method::POST | Method::PUT | Method::PATCH | Method::DELETE
    );
    let accept = req
        .headers
        .get(http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let resp = match route(&shared, req, on_upgrade).await {
        Ok(resp) => resp,
        Err(status) => status.into_response(),
    };
    if write && resp.status().is_success() {
        return encode_write_response(&accept, resp).await;
    }
    Ok(resp)
}

/// A write's response object in the encoding the client asked for first, as the apiserver
/// negotiates it: protobuf (the `k8s\0` envelope around `runtime.Unknown`, holding the
/// object's TypeMeta and ObjectMeta name, namespace and resourceVersion: enough for a client
/// that reads those) or YAML; JSON otherwise.
async fn encode_write_response(
    accept: &str,
    resp: Response<Body>,
) -> Result<Response<Body>, BoxError> {
    let first = accept.split(',').next().unwrap_or("").trim();
    let media = first.split(';').next().unwrap_or("").trim();
    if !matches!(
        media,
        "application/vnd.kubernetes.protobuf" | "application/yaml"
    ) {
        return Ok(resp);
    }
    let (mut parts, body) = resp.into_parts();
    let json: Value = serde_json::from_slice(&body.collect().await?.to_bytes())?;
    let bytes = if media == "application/yaml" {
        Bytes::from(serde_saphyr::to_string(&json)?)
    } else {
        Bytes::from(protobuf_envelope(&json))
    };
    parts.headers.insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static(if media == "application/yaml" {
            "application/yaml"
        } else {
            "application/vnd.kubernetes.protobuf"
        }),
    );
    parts.headers.insert(
        http::header::CONTENT_LENGTH,
        http::HeaderValue::from(bytes.len()),
    );
    Ok(Response::from_parts(parts, full_body(bytes)))
}

fn protobuf_envelope(obj: &Value) -> Vec<u8> {
    fn field(out: &mut Vec<u8>, n: u64, bytes: &[u8]) {
        let mut put = |mut v: u64| loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                break;
            }
            out.push(b | 0x80);
        };
        put((n << 3) | 2);
        put(bytes.len() as u64);
        out.extend_from_slice(bytes);
    }
    let s = |v: &Value| v.as_str().unwrap_or("").as_bytes().to_vec();
    let mut type_meta = Vec::new();
    field(&mut type_meta, 1, &s(&obj["apiVersion"]));
    field(&mut type_meta, 2, &s(&obj["kind"]));
    let mut meta = Vec::new();
    field(&mut meta, 1, &s(&obj["metadata"]["name"]));
    field(&mut meta, 3, &s(&obj["metadata"]["namespace"]));
    field(&mut meta, 6, &s(&obj["metadata"]["resourceVersion"]));
    let mut raw = Vec::new();
    field(&mut raw, 1, &meta);
    let mut out = b"k8s\0".to_vec();
    field(&mut out, 1, &type_meta);
    field(&mut out, 2, &raw);
    out
}

/// A request with its body read.
pub(super) struct ReadRequest {
    pub(super) method: Method,
    pub(super) path: String,
    pub(super) query: Query,
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
}

#[derive(Debug, PartialEq)]
pub(super) enum Route {
    Collection {
        kind: Kind,
        namespace: Option<String>,
    },
    Item {
        kind: Kind,
        namespace: Option<String>,
        name: String,
        subresource: Option<String>,
    },
}

/// Parses `/api/v1/...`, `/apis/apiextensions.k8s.io/v1/...` and `/apis/example.com/v1/...`
/// resource paths. `/api/v1/watch/...` paths are handled by the caller.
pub(super) fn parse_route(path: &str) -> Option<Route> {
    let (rest, kinds): (&str, &[Kind]) = if let Some(r) = path.strip_prefix("/api/v1/") {
        (r, &Kind::CORE)
    } else if let Some(r) = path.strip_prefix("/apis/apiextensions.k8s.io/v1/") {
        (r, &[Kind::Crd])
    } else if let Some(r) = path.strip_prefix("/apis/example.com/v1/") {
        (r, &[Kind::Widget])
    } else {
        return None;
    };
    let from_resource = |res: &str| kinds.iter().copied().find(|k| k.resource() == res);
    let core = kinds.contains(&Kind::Namespace);
    let segs: Vec<&str> = rest.trim_end_matches('/').split('/').collect();
    if segs.iter().any(|s| s.is_empty()) {
        return None;
    }
    match segs.as_slice() {
        [res] => Some(Route::Collection {
            kind: from_resource(res)?,
            namespace: None,
        }),
        [res, name] if !core => Some(Route::Item {
            kind: from_resource(res).filter(|k| !k.namespaced())?,
            namespace: None,
            name: name.to_string(),
            subresource: None,
        }),
        ["namespaces", name] if core => Some(Route::Item {
            kind: Kind::Namespace,
            namespace: None,
            name: name.to_string(),
            subresource: None,
        }),
        ["namespaces", name, "status"] if core => Some(Route::Item {
            kind: Kind::Namespace,
            namespace: None,
            name: name.to_string(),
            subresource: Some("status".into()),
        }),
        ["namespaces", ns, res] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            Some(Route::Collection {
                kind,
                namespace: Some(ns.to_string()),
            })
        }
        ["namespaces", ns, res, name] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            Some(Route::Item {
                kind,
                namespace: Some(ns.to_string()),
                name: name.to_string(),
                subresource: None,
            })
        }
        ["namespaces", ns, res, name, sub] => {
            let kind = from_resource(res).filter(|k| k.namespaced())?;
            let known = match kind {
                Kind::Pod => ["status", "exec", "attach", "portforward"].contains(sub),
                _ => false,
            };
            known.then(|| Route::Item {
                kind,
                namespace: Some(ns.to_string()),
                name: name.to_string(),
                subresource: Some(sub.to_string()),
            })
        }
        _ => None,
    }
}

pub(super) async fn route(
    shared: &Arc<Shared>,
    req: ReadRequest,
    on_upgrade: Option<hyper::upgrade::OnUpgrade>,
) -> Result<Response<Body>, Status> {
    let path = req.path.as_str();
    // Health in the apiserver's format, with checks only this fake has (`fake-apiserver`):
    // a test tells its answers from the proxy's own.
    if let Some(ep) = ["livez", "readyz", "healthz"].into_iter().find(|ep| {
        path.strip_prefix('/')
            .and_then(|p| p.strip_prefix(ep))
            .is_some_and(|rest| rest.is_empty() || rest == "/etcd" || rest == "/fake-apiserver")
    }) {
        if path.len() == ep.len() + 1 && req.query.get("verbose").is_some() {
            return Ok(text_response(
                StatusCode::OK,
                match ep {
                    "livez" => "[+]ping ok\n[+]etcd ok\n[+]fake-apiserver ok\nlivez check passed\n",
                    "readyz" => {
                        "[+]ping ok\n[+]etcd ok\n[+]fake-apiserver ok\nreadyz check passed\n"
                    }
                    _ => "[+]ping ok\n[+]etcd ok\n[+]fake-apiserver ok\nhealthz check passed\n",
                },
            ));
        }
        return Ok(text_response(StatusCode::OK, "ok"));
    }
    if path.starts_with("/debug/") {
        return Ok(text_response(
            StatusCode::OK,
            "fake apiserver debug endpoint\n",
        ));
    }
    match path {
        "/openapi/v2" => {
            return Ok(json_response(
                StatusCode::OK,
                r#"{"swagger":"2.0","info":{"title":"Kubernetes (fake apiserver)","version":"v1.36.3"},"paths":{}}"#.to_string(),
            ));
        }
        "/version" => return Ok(json_response(StatusCode::OK, version_json())),
        "/metrics" => {
            let (text, n) = {
                let mut m = lock(&shared.metrics);
                m.1 += 1;
                (m.0.clone(), m.1)
            };
            let mut resp = Response::new(full_body(text(n)));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            return Ok(resp);
        }
        "/api" => {
            return Ok(json_response(
                StatusCode::OK,
                api_versions_json(shared.addr),
            ));
        }
        "/api/v1" => return Ok(json_response(StatusCode::OK, api_resource_list_json())),
        // The authorization group is not advertised in discovery: the proxy posts its
        // reviews directly, and clients that discover it would expect more of it.
        "/apis" => {
            let mut groups = vec![api_group_json("apiextensions.k8s.io")];
            if widgets_served(shared) {
                groups.push(api_group_json("example.com"));
            }
            return Ok(json_response(
                StatusCode::OK,
                format!(
                    r#"{{"kind":"APIGroupList","apiVersion":"v1","groups":[{}]}}"#,
                    groups.join(",")
                ),
            ));
        }
        "/apis/apiextensions.k8s.io" => {
            return Ok(json_response(
                StatusCode::OK,
                api_group_json("apiextensions.k8s.io"),
            ));
        }
        "/apis/apiextensions.k8s.io/v1" => {
            return Ok(json_response(
                StatusCode::OK,
                group_resource_list_json(Kind::Crd),
            ));
        }
        "/apis/example.com" if widgets_served(shared) => {
            return Ok(json_response(StatusCode::OK, api_group_json("example.com")));
        }
        "/apis/example.com/v1" if widgets_served(shared) => {
            return Ok(json_response(
                StatusCode::OK,
                group_resource_list_json(Kind::Widget),
            ));
        }
        "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews" => {
            return access_review(shared, &req, true);
        }
        "/apis/authorization.k8s.io/v1/subjectaccessreviews"
        | "/apis/authentication.k8s.io/v1/tokenreviews" => {
            let _ = shared
                .reviews_held
                .subscribe()
                .wait_for(|held| !*held)
                .await;
            let d = *lock(&shared.review_delay);
            tokio::time::sleep(d).await;
            let failed = shared
                .fail_reviews
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| match n {
                    0 => None,
                    usize::MAX => Some(n),
                    n => Some(n - 1),
                })
                .is_ok();
            if failed {
                return Ok(Status::injected(500).into_response());
            }
            return if path.ends_with("/tokenreviews") {
                token_review(&req)
            } else {
                access_review(shared, &req, false)
            };
        }
        "/.well-known/openid-configuration" | "/openid/v1/jwks" => {
            let served = lock(&shared.jwks).clone();
            let Some((issuer, jwks)) = served else {
                return Ok(json_response(
                    StatusCode::SERVICE_UNAVAILABLE,
                    r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":503}"#
                        .to_string(),
                ));
            };
            let doc = if path == "/openid/v1/jwks" {
                jwks
            } else {
                json!({"issuer": issuer, "jwks_uri": format!("{issuer}/openid/v1/jwks")})
                    .to_string()
            };
            return Ok(json_response(StatusCode::OK, doc));
        }
        _ => {}
    }

    // Legacy watch paths: /api/v1/watch/<collection or item>.
    let (path, legacy_watch) = match path.strip_prefix("/api/v1/watch/") {
        Some(rest) => (format!("/api/v1/{rest}"), true),
        None => (path.to_string(), false),
    };
    let Some(route) = parse_route(&path) else {
        return Err(Status::not_found_path());
    };
    let kind = match &route {
        Route::Collection { kind, .. } | Route::Item { kind, .. } => *kind,
    };
    if kind == Kind::Widget && !widgets_served(shared) {
        return Err(Status::not_found_path());
    }
    let method = req.method.clone();
    if let Some(user) = denied_caller(shared, &req.headers) {
        return Err(forbidden(
            &user,
            &method,
            legacy_watch || req.query.flag("watch"),
            &route,
        ));
    }
    match route {
        Route::Collection { kind, namespace } => {
            if let Some(ns) = &namespace {
                check_ns_segment(ns)?;
            }
            match method {
                Method::GET if legacy_watch || req.query.flag("watch") => {
                    let params = ListParams::parse(
                        &req.query,
                        kind,
                        true,
                        &selectable_fields(shared, kind),
                    )?;
                    watch(shared, kind, namespace, params, caller_token(&req.headers)).await
                }
                Method::GET => {
                    let params = ListParams::parse(
                        &req.query,
                        kind,
                        false,
                        &selectable_fields(shared, kind),
                    )?;
                    list(shared, kind, namespace.as_deref(), params).await
                }
                Method::POST if namespace.is_some() || !kind.namespaced() => {
                    let obj = parse_body(kind, &req.body)?;
                    let created = create_object(shared, kind, namespace.as_deref(), obj)?;
                    Ok(json_response(StatusCode::CREATED, to_json(&created)))
                }
                _ => Err(Status::method_not_allowed()),
            }
        }
        Route::Item {
            kind,
            namespace,
            name,
            subresource,
        } => {
            if let Some(ns) = &namespace {
                check_ns_segment(ns)?;
            }
            let ns = namespace.as_deref();
            if legacy_watch {
                if subresource.is_some() || method != Method::GET {
                    return Err(Status::not_found_path());
                }
                let mut params =
                    ListParams::parse(&req.query, kind, true, &selectable_fields(shared, kind))?;
                params.fields.reqs.push(FieldReq {
                    field: "metadata.name".into(),
                    value: name,
                    equal: true,
                });
                return watch(shared, kind, namespace, params, caller_token(&req.headers)).await;
            }
            match subresource.as_deref() {
                Some("exec" | "attach" | "portforward") => {
                    upgrade(shared, &req, ns, &name, on_upgrade)
                }
                Some(_status) => match method {
                    Method::GET => get_object(shared, kind, ns, &name),
                    Method::PUT => {
                        let obj = parse_body(kind, &req.body)?;
                        let updated = update_object(shared, kind, ns, &name, obj, true)?;
                        Ok(json_response(StatusCode::OK, to_json(&updated)))
                    }
                    Method::PATCH => patch(shared, &req, kind, ns, &name, true),
                    _ => Err(Status::method_not_allowed()),
                },
                None => match method {
                    Method::GET => get_object(shared, kind, ns, &name),
                    Method::PUT => {
                        let obj = parse_body(kind, &req.body)?;
                        let updated = update_object(shared, kind, ns, &name, obj, false)?;
                        Ok(json_response(StatusCode::OK, to_json(&updated)))
                    }
                    Method::PATCH => patch(shared, &req, kind, ns, &name, false),
                    Method::DELETE => {
                        let options = if req.body.is_empty() {
                            Value::Null
                        } else {
                            serde_json::from_slice(&req.body).map_err(|e| {
                                Status::bad_request(format!(
                                    "the object provided is unrecognized (must be of type DeleteOptions): {e}"
                                ))
                            })?
                        };
                        let out = delete_object(shared, kind, ns, &name, &options)?;
                        Ok(json_response(StatusCode::OK, to_json(&out)))
                    }
                    _ => Err(Status::method_not_allowed()),
                },
            }
        }
    }
}

/// The bearer token of a request's caller, `None` when it acts for an impersonated user (the
/// proxy passing through a client-certificate caller's request) or sends no token.
fn caller_token(headers: &HeaderMap) -> Option<String> {
    if headers.contains_key("impersonate-user") {
        return None;
    }
    headers
        .get(http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::to_string)
}
