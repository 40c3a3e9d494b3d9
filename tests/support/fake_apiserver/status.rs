//! `Status` errors with the apiserver's codes, reasons and messages.

use super::*;

#[derive(Debug, Default)]
pub(super) struct Cause {
    pub(super) reason: String,
    pub(super) message: String,
    pub(super) field: Option<String>,
}

#[derive(Debug, Default)]
pub(super) struct Details {
    pub(super) name: Option<String>,
    pub(super) group: Option<String>,
    pub(super) kind: Option<String>,
    pub(super) causes: Vec<Cause>,
    pub(super) retry_after: Option<u32>,
}

/// A `metav1.Status` failure.
#[derive(Debug)]
pub(super) struct Status {
    pub(super) code: u16,
    pub(super) reason: &'static str,
    pub(super) message: String,
    /// Boxed to keep `Result<_, Status>` small.
    pub(super) details: Option<Box<Details>>,
    /// `metadata.continue` of an expired continue (the inconsistent-continuation token).
    pub(super) cont: Option<String>,
}

impl Status {
    pub(super) fn new(code: u16, reason: &'static str, message: String) -> Status {
        Status {
            code,
            reason,
            message,
            details: None,
            cont: None,
        }
    }

    pub(super) fn with_details(mut self, d: Details) -> Status {
        self.details = Some(Box::new(d));
        self
    }

    pub(super) fn named(kind: Kind, name: &str) -> Details {
        Details {
            name: Some(name.to_string()),
            kind: Some(kind.resource().to_string()),
            ..Details::default()
        }
    }

    pub(super) fn not_found(kind: Kind, name: &str) -> Status {
        Status::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", kind.resource()),
        )
        .with_details(Status::named(kind, name))
    }

    pub(super) fn not_found_path() -> Status {
        Status::new(
            404,
            "NotFound",
            "the server could not find the requested resource".into(),
        )
        .with_details(Details::default())
    }

    pub(super) fn already_exists(kind: Kind, name: &str) -> Status {
        Status::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", kind.resource()),
        )
        .with_details(Status::named(kind, name))
    }

    pub(super) fn conflict(kind: Kind, name: &str, why: &str) -> Status {
        Status::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                kind.resource()
            ),
        )
        .with_details(Status::named(kind, name))
    }

    pub(super) fn bad_request(message: String) -> Status {
        Status::new(400, "BadRequest", message)
    }

    pub(super) fn method_not_allowed() -> Status {
        Status::new(
            405,
            "MethodNotAllowed",
            "the server does not allow this method on the requested resource".into(),
        )
        .with_details(Details::default())
    }

    pub(super) fn expired(message: &str) -> Status {
        Status::new(410, "Expired", message.to_string())
    }

    pub(super) fn continue_expired(new_token: &str) -> Status {
        let mut s = Status::expired(
            "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
        );
        s.cont = Some(new_token.to_string());
        s
    }

    pub(super) fn too_large_rv(wanted: u64, current: u64) -> Status {
        Status::new(
            504,
            "Timeout",
            format!("Timeout: Too large resource version: {wanted}, current: {current}"),
        )
        .with_details(Details {
            causes: vec![Cause {
                reason: "ResourceVersionTooLarge".into(),
                message: "Too large resource version".into(),
                field: None,
            }],
            retry_after: Some(1),
            ..Details::default()
        })
    }

    pub(super) fn invalid_object(
        kind: Kind,
        name: &str,
        field: &str,
        detail: &str,
        cause: &str,
    ) -> Status {
        Status::new(
            422,
            "Invalid",
            format!("{} {name:?} is invalid: {field}: {detail}", kind.kind()),
        )
        .with_details(Details {
            name: Some(name.to_string()),
            kind: Some(kind.kind().to_string()),
            causes: vec![Cause {
                reason: cause.to_string(),
                message: detail.to_string(),
                field: Some(field.to_string()),
            }],
            ..Details::default()
        })
    }

    pub(super) fn invalid_list_options(errs: &[(&str, String, &str)]) -> Status {
        let joined: Vec<String> = errs.iter().map(|(f, m, _)| format!("{f}: {m}")).collect();
        let message = if joined.len() == 1 {
            joined[0].clone()
        } else {
            format!("[{}]", joined.join(", "))
        };
        Status::new(
            422,
            "Invalid",
            format!("ListOptions.meta.k8s.io \"\" is invalid: {message}"),
        )
        .with_details(Details {
            group: Some("meta.k8s.io".into()),
            kind: Some("ListOptions".into()),
            causes: errs
                .iter()
                .map(|(f, m, r)| Cause {
                    reason: r.to_string(),
                    message: m.clone(),
                    field: Some(f.to_string()),
                })
                .collect(),
            ..Details::default()
        })
    }

    /// The error [`Faults::fail_next`] injects for `code`.
    pub(super) fn injected(code: u16) -> Status {
        const WHY: &str = "injected fault";
        match code {
            400 => Status::bad_request(WHY.into()),
            401 => Status::new(401, "Unauthorized", "Unauthorized".into()),
            403 => Status::new(403, "Forbidden", format!("forbidden: {WHY}")),
            404 => Status::not_found_path(),
            405 => Status::method_not_allowed(),
            409 => Status::new(409, "Conflict", format!("conflict: {WHY}")),
            410 => Status::expired("The resourceVersion for the provided list is too old."),
            422 => Status::new(422, "Invalid", format!("invalid: {WHY}")),
            429 => Status::new(
                429,
                "TooManyRequests",
                "Too many requests, please try again later.".into(),
            )
            .with_details(Details {
                retry_after: Some(1),
                ..Details::default()
            }),
            500 => Status::new(
                500,
                "InternalError",
                format!("Internal error occurred: {WHY}"),
            )
            .with_details(Details {
                causes: vec![Cause {
                    message: WHY.into(),
                    ..Cause::default()
                }],
                ..Details::default()
            }),
            503 => Status::new(
                503,
                "ServiceUnavailable",
                format!("service unavailable: {WHY}"),
            ),
            504 => Status::new(504, "Timeout", format!("Timeout: {WHY}")),
            other => Status::new(other, "", format!("{WHY} (code {other})")),
        }
    }

    pub(super) fn to_json(&self) -> String {
        let mut meta = JsonObj::new();
        if let Some(c) = &self.cont {
            meta = meta.str("continue", c);
        }
        let mut o = JsonObj::new()
            .str("kind", "Status")
            .str("apiVersion", "v1")
            .raw("metadata", &meta.finish())
            .str("status", "Failure")
            .str("message", &self.message);
        if !self.reason.is_empty() {
            o = o.str("reason", self.reason);
        }
        if let Some(d) = &self.details {
            let mut dj = JsonObj::new();
            if let Some(n) = &d.name {
                dj = dj.str("name", n);
            }
            if let Some(g) = &d.group {
                dj = dj.str("group", g);
            }
            if let Some(k) = &d.kind {
                dj = dj.str("kind", k);
            }
            if !d.causes.is_empty() {
                let causes: Vec<String> = d
                    .causes
                    .iter()
                    .map(|c| {
                        let mut cj = JsonObj::new();
                        if !c.reason.is_empty() {
                            cj = cj.str("reason", &c.reason);
                        }
                        cj = cj.str("message", &c.message);
                        if let Some(f) = &c.field {
                            cj = cj.str("field", f);
                        }
                        cj.finish()
                    })
                    .collect();
                dj = dj.raw("causes", &format!("[{}]", causes.join(",")));
            }
            if let Some(r) = d.retry_after {
                dj = dj.raw("retryAfterSeconds", &r.to_string());
            }
            o = o.raw("details", &dj.finish());
        }
        o.raw("code", &self.code.to_string()).finish()
    }

    pub(super) fn into_response(self) -> Response<Body> {
        let code = StatusCode::from_u16(self.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut resp = json_response(code, self.to_json());
        if let Some(r) = self.details.as_ref().and_then(|d| d.retry_after) {
            resp.headers_mut()
                .insert(http::header::RETRY_AFTER, HeaderValue::from(r));
        }
        resp
    }
}
