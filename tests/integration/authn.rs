//! Authentication and authorization of cache-served requests against the fake apiserver:
//! concurrent identical reviews share one upstream request (single flight), refusals are
//! counted by the method that refused, and the ServiceAccount issuer's keys are refreshed in
//! the background, keeping the previous keys when a refresh fails.

use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::support::eventually::{eventually, ok_if};
use crate::support::fake_apiserver::FakeApiServer;
use crate::support::proxy::TestProxy;
use jsonwebtoken::{Algorithm, EncodingKey, Header, jwk};
use kube_cache_proxy::auth::authn::AuthnMethod;
use kube_cache_proxy::metrics::KindLabels;
use serde_json::json;

const GUARD: Duration = Duration::from_secs(20);
const ISS: &str = "https://kubernetes.default.svc.cluster.local";

/// The fake (serving `jwks` as the issuer's keys from the start) and the proxy caching
/// configmaps, synced.
async fn setup(
    jwks: Option<&str>,
    tweak: impl FnOnce(&mut kube_cache_proxy::config::Config),
) -> (FakeApiServer, TestProxy) {
    let fake = FakeApiServer::start().await;
    fake.faults().set_jwks(jwks.map(|j| (ISS, j)));
    fake.create("/api/v1/namespaces", json!({"metadata": {"name": "ns1"}}))
        .await;
    fake.create(
        "/api/v1/namespaces/ns1/configmaps",
        json!({"metadata": {"name": "cm-1"}}),
    )
    .await;
    let proxy = TestProxy::start(&fake.url(), |c| {
        c.cache.resources = vec!["configmaps".into()];
        c.authentication.service_account_jwt = true;
        tweak(c);
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    eventually("the configmaps cache to sync", GUARD, async || {
        let ready = state
            .caches
            .get("", "v1", "configmaps")
            .is_some_and(|c| c.is_ready());
        ok_if(ready, "not ready")
    })
    .await;
    (fake, proxy)
}

fn count(fake: &FakeApiServer, suffix: &str) -> usize {
    fake.requests()
        .iter()
        .filter(|r| r.path.ends_with(suffix))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_requests_share_one_token_review_and_one_access_review() {
    let (fake, proxy) = setup(None, |_| {}).await;
    // Reviews take a while, so all the requests below are waiting for the same ones.
    fake.faults().set_review_delay(Duration::from_millis(500));
    fake.clear_requests();
    let client = proxy.client(None, true);
    let url = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");
    const N: usize = 50;
    let all = futures_util::future::join_all((0..N).map(|_| client.get(&url, Some("alice"))));
    let statuses: Vec<u16> = all.await.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses, vec![200; N]);
    assert_eq!(
        count(&fake, "/tokenreviews"),
        1,
        "one TokenReview for {N} requests"
    );
    assert_eq!(
        count(&fake, "/subjectaccessreviews"),
        1,
        "one SubjectAccessReview for {N} requests"
    );
    let state = &proxy.running.as_ref().unwrap().state;
    assert_eq!(state.authz.stats.cache_misses.load(Relaxed), 1);
    assert_eq!(state.authz.stats.allowed.load(Relaxed), N as u64);
    // Another identity is another question.
    let other = client.get(&url, Some("bob")).await;
    assert_eq!(other.status(), 200);
    assert_eq!(count(&fake, "/subjectaccessreviews"), 2);

    // A review the apiserver cannot answer is never cached: its leader fails closed (503);
    // the four that waited for it ask once more, together (one more review), and fail
    // closed too while the apiserver still cannot answer; the next request asks again. The
    // review is held until all five requests are in the proxy (its in-flight gauge, raised
    // before authentication with no wait between) and the one TokenReview has reached the
    // apiserver: a request joining only after the failure would start a flight of its own.
    let inflight = read_requests_in_flight_once_none(&proxy).await;
    fake.faults().fail_reviews(true);
    fake.faults().hold_reviews(true);
    let all = futures_util::future::join_all((0..5).map(|_| client.get(&url, Some("carol"))));
    let release = async {
        eventually(
            "the five requests in the proxy and their TokenReview held",
            GUARD,
            async || {
                let (requests, reviews) = (inflight.get(), count(&fake, "/tokenreviews"));
                ok_if(requests == 5 && reviews >= 3, (requests, reviews))
            },
        )
        .await;
        fake.faults().hold_reviews(false);
    };
    let (all, ()) = tokio::join!(all, release);
    let statuses: Vec<u16> = all.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(statuses, vec![503; 5]);
    assert_eq!(
        count(&fake, "/tokenreviews"),
        4,
        "alice, bob, carol's flight and its waiters' second asking"
    );
    fake.faults().fail_reviews(false);
    assert_eq!(client.get(&url, Some("carol")).await.status(), 200);
    assert_eq!(
        count(&fake, "/tokenreviews"),
        5,
        "the failure was not cached"
    );
    proxy.shutdown().await;
}

/// Requests that waited for a review the apiserver answered with an error ask once more,
/// in one flight of their own: only the review's leader fails for it. (In the fault tier a
/// watch sent just after the apiserver's 500s had stopped joined a TokenReview sent before,
/// and failed for that earlier answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_that_waited_for_a_failed_review_ask_again_once_together() {
    let (fake, proxy) = setup(None, |_| {}).await;
    let client = proxy.client(None, true);
    let url = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");
    let all_namespaces = proxy.https("/api/v1/configmaps?resourceVersion=0");
    let inflight = read_requests_in_flight_once_none(&proxy).await;
    let statuses =
        five_behind_a_failing_review(&fake, &client, &url, &inflight, "/tokenreviews").await;
    assert_eq!(
        statuses,
        vec![200, 200, 200, 200, 503],
        "only the leader fails"
    );
    // The failed flight and one more: whoever asked after the failure shares the second one
    // or its cached success.
    assert_eq!(count(&fake, "/tokenreviews"), 2);

    // The same for an access review: dave's token is known now; listing across namespaces
    // is a new question.
    let statuses = five_behind_a_failing_review(
        &fake,
        &client,
        &all_namespaces,
        &inflight,
        "/subjectaccessreviews",
    )
    .await;
    assert_eq!(
        statuses,
        vec![200, 200, 200, 200, 503],
        "only the leader fails"
    );
    assert_eq!(count(&fake, "/subjectaccessreviews"), 2);
    assert_eq!(count(&fake, "/tokenreviews"), 0);
    proxy.shutdown().await;
}

/// The proxy's gauge of read-only requests in flight (raised before authentication), once
/// it reads 0.
async fn read_requests_in_flight_once_none(
    proxy: &TestProxy,
) -> prometheus_client::metrics::gauge::Gauge {
    let state = &proxy.running.as_ref().unwrap().state;
    let inflight = state
        .metrics
        .inflight
        .get_or_create(&KindLabels {
            kind: "readOnly".into(),
        })
        .clone();
    eventually("the earlier requests to be done", GUARD, async || {
        ok_if(inflight.get() == 0, inflight.get())
    })
    .await;
    inflight
}

/// Five GETs of `url` as dave while the first review of kind `review` (its path's end) is
/// held until all five are in the proxy (`inflight`); then it answers 500. Their statuses,
/// sorted. The fake's request log is cleared first.
async fn five_behind_a_failing_review(
    fake: &FakeApiServer,
    client: &crate::support::proxy::TestClient,
    url: &str,
    inflight: &prometheus_client::metrics::gauge::Gauge,
    review: &str,
) -> Vec<u16> {
    fake.clear_requests();
    fake.faults().hold_reviews(true);
    fake.faults().fail_next_reviews(1);
    let all = futures_util::future::join_all((0..5).map(|_| client.get(url, Some("dave"))));
    let release = async {
        eventually(
            "the five requests in the proxy and their review held",
            GUARD,
            async || {
                let (requests, reviews) = (inflight.get(), count(fake, review));
                ok_if(requests == 5 && reviews == 1, (requests, reviews))
            },
        )
        .await;
        fake.faults().hold_reviews(false);
    };
    let (all, ()) = tokio::join!(all, release);
    let mut statuses: Vec<u16> = all.iter().map(|r| r.status().as_u16()).collect();
    statuses.sort();
    statuses
}

struct Signer {
    enc: EncodingKey,
    jwks: String,
}

fn signer(kid: &str) -> Signer {
    let kp = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).unwrap();
    let enc = EncodingKey::from_ec_der(&kp.serialize_der());
    let jwk = jwk::Jwk::from_encoding_key(&enc, Algorithm::ES256).unwrap();
    let mut v = serde_json::to_value(&jwk).unwrap();
    v["kid"] = json!(kid);
    v["use"] = json!("sig");
    Signer {
        enc,
        jwks: json!({ "keys": [v] }).to_string(),
    }
}

/// A ServiceAccount token of `team-a:builder` (not bound to a pod: no revocation review).
fn sa_token(s: &Signer, kid: &str) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({
        "iss": ISS, "aud": [ISS], "sub": "system:serviceaccount:team-a:builder",
        "iat": now, "nbf": now, "exp": now + 3600,
        "kubernetes.io": {"namespace": "team-a", "serviceaccount": {"name": "builder", "uid": "sa-1"}},
    });
    let mut h = Header::new(Algorithm::ES256);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, &claims, &s.enc).unwrap()
}

fn metric(text: &str, line_prefix: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(line_prefix))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{line_prefix} missing:\n{text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_issuers_keys_are_refreshed_in_the_background_and_kept_when_a_refresh_fails() {
    let k1 = signer("k1");
    let (fake, proxy) = setup(Some(&k1.jwks), |c| {
        c.authentication.jwks_refresh_interval = Duration::from_secs(1);
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    // No token arrives, yet the keys are fetched again and again.
    eventually(
        "a background refresh (two JWKS fetches)",
        GUARD,
        async || {
            let fetches = count(&fake, "/openid/v1/jwks");
            ok_if(fetches >= 2, fetches)
        },
    )
    .await;
    // The apiserver stops answering: refreshes fail, are counted, and the keys stay.
    fake.faults().set_jwks(None);
    fake.clear_requests();
    // Two refreshes reached the apiserver and were answered 503, and the proxy has handled
    // both answers (the fake logs a request before the proxy reads its answer).
    let failures = &state.authn.stats.jwks_fetch_failures;
    eventually("two failed refreshes", GUARD, async || {
        let fetches = count(&fake, "/.well-known/openid-configuration");
        let failed = failures.load(Relaxed);
        ok_if(fetches >= 2 && failed >= 2, (fetches, failed))
    })
    .await;
    fake.clear_requests();
    let client = proxy.client(None, true);
    let url = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");
    let r = client.get(&url, Some(&sa_token(&k1, "k1"))).await;
    assert_eq!(r.status(), 200);
    assert_eq!(
        count(&fake, "/tokenreviews"),
        0,
        "verified offline with the kept keys"
    );
    let ok = &state.authn.stats.ok;
    let jwt = kube_cache_proxy::auth::authn::METHODS
        .iter()
        .position(|m| *m == AuthnMethod::ServiceAccountJwt)
        .unwrap();
    assert_eq!(ok[jwt].load(Relaxed), 1);
    let text = state.metrics.encode();
    assert!(
        metric(
            &text,
            "kube_cache_proxy_jwks_fetches_total{result=\"failure\"}"
        ) >= 2
    );
    assert!(
        metric(
            &text,
            "kube_cache_proxy_jwks_fetches_total{result=\"success\"}"
        ) >= 2
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_counted_by_the_method_that_refused() {
    let k1 = signer("k1");
    let forger = signer("k1");
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.csv");
    std::fs::write(&tokens, "tok-a,alice,u1\n").unwrap();
    let (fake, proxy) = setup(Some(&k1.jwks), |c| {
        c.authentication.token_auth_file = Some(tokens.clone());
    })
    .await;
    let state = proxy.running.as_ref().unwrap().state.clone();
    // The keys are fetched in the background at start; no request may fall back to a
    // TokenReview meanwhile (the fake's would accept any token).
    // (The refresher holds its lock from the request to storing the keys: a token arriving
    // after the request was seen waits for the keys.)
    eventually("the issuer's keys to load", GUARD, async || {
        let fetches = count(&fake, "/openid/v1/jwks");
        ok_if(fetches > 0, fetches)
    })
    .await;
    let client = proxy.client(None, true);
    let url = proxy.https("/api/v1/namespaces/ns1/configmaps?resourceVersion=0");
    let send = |token: Option<String>| {
        let client = &client;
        let url = url.clone();
        async move { client.get(&url, token.as_deref()).await.status().as_u16() }
    };
    assert_eq!(send(Some(sa_token(&k1, "k1"))).await, 200);
    assert_eq!(send(Some("tok-a".into())).await, 200);
    // Signed by another key under a known kid: the offline verifier refuses it.
    assert_eq!(send(Some(sa_token(&forger, "k1"))).await, 401);
    // The fake's TokenReview refuses tokens starting with "invalid".
    assert_eq!(send(Some("invalid-1".into())).await, 401);
    assert_eq!(send(Some("invalid-2".into())).await, 401);
    // No credentials at all.
    assert_eq!(send(None).await, 401);
    let text = state.metrics.encode();
    let line = |method: &str| {
        format!(
            "kube_cache_proxy_authentications_total{{method=\"{method}\",result=\"unauthorized\"}}"
        )
    };
    assert_eq!(metric(&text, &line("serviceaccount_jwt")), 1);
    assert_eq!(metric(&text, &line("token_review")), 2);
    assert_eq!(metric(&text, &line("none")), 1);
    assert_eq!(metric(&text, &line("token_file")), 0);
    assert!(!text.contains("method=\"any\""), "{text}");
    proxy.shutdown().await;
}
