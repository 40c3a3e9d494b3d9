//! The configuration's tests (parsing, defaults, validation).

use super::*;

#[test]
fn empty_file_gives_defaults() {
    assert_eq!(Config::from_yaml("").unwrap(), Config::default());
    assert_eq!(
        Config::from_yaml("# only a comment\n").unwrap(),
        Config::default()
    );
}

/// Caching Secrets lets the proxy's ServiceAccount read every Secret of the cluster:
/// an operator's choice, not a default.
#[test]
fn secrets_are_not_cached_unless_listed() {
    let c = Config::default();
    assert!(!c.cache.resources.iter().any(|r| r == "secrets"));
    assert!(c.cache.resources.iter().any(|r| r == "configmaps"));
}

#[test]
fn tracing_is_off_by_default_and_its_fields_are_validated() {
    let c = Config::default();
    assert_eq!(c.tracing.endpoint(|_| None), None);
    // The standard variable turns it on when the file names no endpoint...
    let env = |k: &str| (k == "OTEL_EXPORTER_OTLP_ENDPOINT").then(|| "http://c:4318".into());
    assert_eq!(c.tracing.endpoint(env).as_deref(), Some("http://c:4318"));
    // ...and the file wins over it.
    let c = Config::from_yaml(
        "tracing:\n  otlp:\n    endpoint: https://otel:4318\n    protocol: http/protobuf\n  \
         samplingRatio: 0.25\n  serviceName: kcp\n",
    )
    .unwrap();
    assert_eq!(
        c.tracing.endpoint(env).as_deref(),
        Some("https://otel:4318")
    );
    assert_eq!(c.tracing.sampling_ratio, 0.25);
    assert_eq!(c.tracing.service_name, "kcp");
    // gRPC is not built in: refused when the file is read, with the field's path.
    let e = Config::from_yaml("tracing:\n  otlp:\n    protocol: grpc\n").unwrap_err();
    assert!(e.to_string().contains("tracing.otlp.protocol"), "{e}");

    let mut c = Config::default();
    c.tracing.sampling_ratio = 1.5;
    c.tracing.service_name = " ".into();
    c.tracing.otlp.endpoint = "otel-collector:4318".into();
    let ConfigError::Invalid(errs) = c.validate().unwrap_err() else {
        panic!()
    };
    let paths: Vec<&str> = errs
        .iter()
        .map(|e| e.path.as_str())
        .filter(|p| p.starts_with("tracing."))
        .collect();
    assert_eq!(
        paths,
        [
            "tracing.samplingRatio",
            "tracing.serviceName",
            "tracing.otlp.endpoint"
        ]
    );
    for bad in [
        "http://",
        "ftp://otel:21",
        "http://otel:4318/?x=1",
        "http://a b",
    ] {
        assert!(check_endpoint(bad).is_err(), "{bad}");
    }
    for good in ["http://otel:4318", "https://10.0.0.1:4318/prefix/"] {
        check_endpoint(good).unwrap();
    }
    c.tracing.sampling_ratio = f64::NAN;
    assert!(c.validate().is_err());
}

#[test]
fn the_access_log_switch_reads_on_and_off_and_sampling_is_a_fraction() {
    for (text, want) in [
        ("on", true),
        ("off", false),
        ("true", true),
        ("false", false),
    ] {
        let c = Config::from_yaml(&format!("log:\n  access: {text}\n")).unwrap();
        assert_eq!(c.log.access, want, "{text}");
    }
    assert!(Config::from_yaml("log:\n  access: maybe\n").is_err());
    let mut c = Config::from_yaml("log:\n  accessSampling: 0.1\n").unwrap();
    assert_eq!(c.log.access_sampling, 0.1);
    c.insecure_listen = Some("127.0.0.1:1".parse().unwrap());
    c.validate().unwrap();
    c.log.access_sampling = 1.5;
    let ConfigError::Invalid(errs) = c.validate().unwrap_err() else {
        panic!()
    };
    assert_eq!(errs[0].path, "log.accessSampling");
}

#[test]
fn the_example_file_documents_exactly_the_defaults() {
    let text = include_str!("../../config/kube-cache-proxy.yaml");
    // But for the loopback listener that lets it run as it is (its header says so).
    let want = Config {
        insecure_listen: Some("127.0.0.1:8001".parse().unwrap()),
        ..Config::default()
    };
    assert_eq!(Config::from_yaml(text).unwrap(), want);
}

#[test]
fn the_admin_listener_defaults_by_transport_and_refuses_clear_text_off_loopback() {
    let mut cfg = Config {
        insecure_listen: Some("127.0.0.1:8080".parse().unwrap()),
        ..Config::default()
    };
    // Without a serving certificate: plain HTTP, so loopback by default.
    assert_eq!(cfg.admin_addr(), "127.0.0.1:8444".parse().unwrap());
    cfg.validate().unwrap();
    cfg.server.admin_listen = Some("0.0.0.0:9000".parse().unwrap());
    let ConfigError::Invalid(errs) = cfg.validate().unwrap_err() else {
        panic!()
    };
    assert_eq!(errs[0].path, "server.adminListen");
    cfg.allow_insecure_non_loopback = true;
    cfg.validate().unwrap();
    // The same port as another listener.
    cfg.server.admin_listen = Some("127.0.0.1:8080".parse().unwrap());
    assert!(cfg.validate().is_err());
    // With TLS: all interfaces by default, another port than the API's.
    let mut tls = Config::default();
    tls.tls.cert_file = Some("/c".into());
    tls.tls.key_file = Some("/k".into());
    assert_eq!(tls.admin_addr(), "0.0.0.0:8444".parse().unwrap());
    tls.validate().unwrap();
    tls.server.admin_listen = Some("0.0.0.0:8443".parse().unwrap());
    assert!(tls.validate().is_err());
    // Port 0 (tests) never conflicts.
    tls.server.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    tls.validate().unwrap();
    let y =
        Config::from_yaml("server:\n  adminListen: 127.0.0.1:9444\n  adminAuth: none\n").unwrap();
    assert_eq!(y.server.admin_auth, AdminAuth::None);
    assert_eq!(y.admin_addr(), "127.0.0.1:9444".parse().unwrap());
    assert!(Config::from_yaml("server:\n  adminAuth: off\n").is_err());
}

#[test]
fn type_errors_name_the_field() {
    let e = Config::from_yaml("server:\n  http2MaxConcurrentStreams: lots\n").unwrap_err();
    let ConfigError::Invalid(errs) = e else {
        panic!()
    };
    assert_eq!(errs[0].path, "server.http2MaxConcurrentStreams");
}

#[test]
fn unknown_fields_are_errors_with_their_path() {
    let e = Config::from_yaml("shutdown:\n  dealy: 5s\n").unwrap_err();
    let ConfigError::Invalid(errs) = e else {
        panic!()
    };
    assert_eq!(errs[0].path, "shutdown.dealy");
    assert!(errs[0].message.contains("dealy"), "{}", errs[0].message);
}

#[test]
fn every_type_error_and_unknown_field_is_reported_with_its_path_as_written() {
    let text = "shutdown:\n  dealy: 5s\n  delay: soon\nserver:\n  maxConnections: many\n\
                cache:\n  resources: [pods, 7, {a: b}, configmaps]\n\
                tenants:\n- name: a\n  quotas: {maxWatches: -1}\n- nmae: b\n";
    let (cfg, errs) = Config::parse_all(text);
    let mut paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            "cache.resources[1]",
            "cache.resources[2]",
            "server.maxConnections",
            "shutdown.dealy",
            "shutdown.delay",
            "tenants[0].quotas.maxWatches",
            // The misspelt field, then the one missing because of it.
            "tenants[1]",
            "tenants[1].nmae",
        ],
        "{errs:?}"
    );
    // What parsed is kept; what failed has its default.
    let cfg = cfg.unwrap();
    assert_eq!(cfg.cache.resources, ["pods", "configmaps"]);
    assert_eq!(cfg.shutdown.delay, ShutdownConfig::default().delay);
    let ConfigError::Invalid(all) = Config::from_yaml(text).unwrap_err() else {
        panic!()
    };
    assert_eq!(all.len(), errs.len());
    // A YAML syntax error is one error without a config.
    let (cfg, errs) = Config::parse_all("a: [\n");
    assert!(cfg.is_none());
    assert_eq!(errs[0].path, "(document)");
}

#[test]
fn bad_durations_are_explained() {
    let e = Config::from_yaml("shutdown:\n  delay: soon\n").unwrap_err();
    let ConfigError::Invalid(errs) = e else {
        panic!()
    };
    assert_eq!(errs[0].path, "shutdown.delay");
    assert!(errs[0].message.contains("invalid duration"));
}

#[test]
fn validation_reports_every_problem_with_a_path() {
    let cfg = Config::from_yaml(
        "insecureListen: 10.1.2.3:8080\ntls:\n  keyFile: /k\nserver:\n  http2MaxConcurrentStreams: 0\nlog:\n  level: 'a=b=c'\n",
    )
    .unwrap();
    let ConfigError::Invalid(errs) = cfg.validate().unwrap_err() else {
        panic!()
    };
    let paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
    assert!(paths.contains(&"tls.certFile"), "{paths:?}");
    assert!(paths.contains(&"insecureListen"), "{paths:?}");
    assert!(
        paths.contains(&"server.http2MaxConcurrentStreams"),
        "{paths:?}"
    );
    assert!(paths.contains(&"log.level"), "{paths:?}");
}

#[test]
fn downstream_buffer_budgets_are_validated_with_their_paths() {
    let cfg = Config::from_yaml(
        "insecureListen: 127.0.0.1:8080\nserver:\n  http2MaxSendBufferBytes: 1024\n  \
         connectionBufferBytes: 1000\n",
    )
    .unwrap();
    let ConfigError::Invalid(errs) = cfg.validate().unwrap_err() else {
        panic!()
    };
    let mut paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            "server.connectionBufferBytes",
            "server.http2MaxSendBufferBytes"
        ]
    );
    let cfg = Config::from_yaml(
        "insecureListen: 127.0.0.1:8080\nserver:\n  connectionBufferBytes: 8388608\n  \
         downstreamBufferBytes: 4194304\n",
    )
    .unwrap();
    let ConfigError::Invalid(errs) = cfg.validate().unwrap_err() else {
        panic!()
    };
    assert_eq!(errs.len(), 1, "{errs:?}");
    assert_eq!(errs[0].path, "server.downstreamBufferBytes");
}

#[test]
fn paging_fields_are_validated_with_their_paths() {
    let cfg = Config::from_yaml(
        "insecureListen: 127.0.0.1:8080\npaging:\n  minPageSize: 600\n  emaAlpha: 0\n  \
         latencyPenalty: -1\n  highLoad: 0.5\n  etcdMetricsUrl: https://etcd:2379\n  \
         load:\n    etcdRequestP99: 0s\n",
    )
    .unwrap();
    let ConfigError::Invalid(errs) = cfg.validate().unwrap_err() else {
        panic!()
    };
    let mut paths: Vec<_> = errs.iter().map(|e| e.path.as_str()).collect();
    paths.sort();
    assert_eq!(
        paths,
        [
            "paging.emaAlpha",
            "paging.etcdMetricsUrl",
            "paging.highLoad",
            "paging.latencyPenalty",
            "paging.load.etcdRequestP99",
            "paging.maxPageSize",
        ]
    );
    let ok = Config::from_yaml(
        "insecureListen: 127.0.0.1:8080\npaging:\n  etcdMetricsUrl: http://127.0.0.1:2381\n",
    )
    .unwrap();
    ok.validate().unwrap();
    let e = Config::from_yaml("paging:\n  emaAlfa: 0.5\n").unwrap_err();
    let ConfigError::Invalid(errs) = e else {
        panic!()
    };
    assert_eq!(errs[0].path, "paging.emaAlfa");
}

#[test]
fn non_loopback_insecure_listener_needs_the_explicit_override() {
    let mut cfg = Config {
        insecure_listen: Some("0.0.0.0:8080".parse().unwrap()),
        ..Config::default()
    };
    assert!(cfg.validate().is_err());
    cfg.allow_insecure_non_loopback = true;
    cfg.validate().unwrap();
}
