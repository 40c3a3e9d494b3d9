//! Unit tests of the table side's store (`cache::table`).
use super::*;

const POD_COLUMNS: &str = r#"[{"name":"Name","type":"string","format":"name","description":"n","priority":0},{"name":"Restarts","type":"string","format":"","description":"r","priority":0},{"name":"Age","type":"string","format":"","description":"CREATION","priority":0}]"#;

fn pod_columns() -> String {
    let q = serde_json::to_string(CREATION_DOC).unwrap();
    POD_COLUMNS.replace("CREATION", &q[1..q.len() - 1])
}

fn store() -> TableStore {
    TableStore::new(false, "", "pods", Arc::new(ProtoBudget::new(u64::MAX)))
}

fn event(name: &str, rv: u64, cells: &str, created: &str) -> String {
    format!(
        r#"{{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{{"resourceVersion":"{rv}"}},"columnDefinitions":null,"rows":[{{"cells":{cells},"object":{{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}","creationTimestamp":"{created}"}}}}}}]}}"#
    )
}

#[test]
fn builtin_age_columns_are_found_and_clock_printers_are_refused() {
    let c = Columns::parse(&pod_columns(), false, "", "pods", 1).unwrap();
    assert_eq!(c.age, vec![2]);
    assert_eq!(c.unservable, None);
    assert!(!c.null_when_empty);
    let c = Columns::parse(&pod_columns(), false, "", "events", 1).unwrap();
    assert!(c.unservable.is_some());
    // Jobs' durations are re-rendered (`ClockKind`).
    let c = Columns::parse(&pod_columns(), false, "batch", "jobs", 1).unwrap();
    assert_eq!(c.unservable, None);
    let default = r#"[{"name":"Name","type":"string","format":"name","description":"x","priority":0},{"name":"Created At","type":"date","format":"","description":"y","priority":0}]"#;
    let c = Columns::parse(default, false, "", "things", 1).unwrap();
    assert!(c.null_when_empty);
    assert!(c.age.is_empty());
}

#[test]
fn custom_date_columns_are_ages_only_of_the_creation_timestamp() {
    let cols = r#"[{"name":"Name","type":"string","format":"name","description":"x","priority":0},{"name":"Age","type":"date","format":"","description":"Custom resource definition column (in JSONPath format): .metadata.creationTimestamp","priority":0}]"#;
    let c = Columns::parse(cols, true, "example.com", "widgets", 1).unwrap();
    assert_eq!(c.age, vec![1]);
    assert_eq!(c.unservable, None);
    // A date of another field, by its JSONPath in the description apiextensions gives a
    // column without one: re-rendered from that field (`Row::cells_now`).
    let other = cols.replace(".metadata.creationTimestamp", ".status.lastSeen");
    let c = Columns::parse(&other, true, "example.com", "widgets", 1).unwrap();
    assert_eq!(c.unservable, None);
    assert_eq!(c.dates.len(), 1);
    assert_eq!(
        &*c.dates[0].1,
        &[Box::from("status"), Box::from("lastSeen")][..]
    );
    // Described by its author, or a JSONPath not read here: the apiserver's.
    for d in [
        "\"When it was seen\"",
        "\"Custom resource definition column (in JSONPath format): .status.items[0].at\"",
    ] {
        let authored = cols.replace(
            "\"Custom resource definition column (in JSONPath format): .metadata.creationTimestamp\"",
            d,
        );
        let c = Columns::parse(&authored, true, "example.com", "widgets", 1).unwrap();
        assert!(c.unservable.is_some(), "{d}");
    }
    // The row: the field's time printed on arrival, re-rendered now; another time, or
    // none, and the apiserver answers.
    let st = TableStore::new(
        true,
        "example.com",
        "widgets",
        Arc::new(ProtoBudget::new(u64::MAX)),
    );
    st.set_columns(&other).unwrap();
    let t0 = parse_time("2026-12-07T12:00:00Z").unwrap();
    let ev = r#"{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"3"},"rows":[{"cells":["w","7m"],"object":{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{"name":"w","namespace":"ns","resourceVersion":"3"}}}]}"#;
    for r in parse_table_event(ev).unwrap().rows {
        st.attach(r.key, r.rv, r.row, t0 * 1000);
    }
    let cols = st.columns().unwrap();
    let row = st
        .row(&ObjectKey::new("ns", "w"), 3, cols.generation)
        .expect("servable");
    let later = (t0 + 3600) * 1000;
    let seen = br#"{"status":{"lastSeen":"2026-12-07T11:53:00Z"}}"#;
    assert_eq!(
        row.cells_now(&cols, seen, later),
        Ok(vec![(1, r#""67m""#.to_string())])
    );
    assert!(
        row.cells_now(
            &cols,
            br#"{"status":{"lastSeen":"2026-12-07T10:00:00Z"}}"#,
            later
        )
        .is_err()
    );
    assert!(row.cells_now(&cols, b"{}", later).is_err());
    // A built-in "Age" that is not the creation timestamp's is not re-rendered.
    let c = Columns::parse(&other, false, "", "things", 1).unwrap();
    assert!(c.age.is_empty());
}

#[test]
fn rows_are_kept_by_version_and_served_with_their_age_at_the_moment_of_reading() {
    let st = store();
    st.set_columns(&pod_columns()).unwrap();
    let created = "2026-12-07T11:00:00Z";
    let t0 = parse_time(created).unwrap() * 1000;
    let ev = parse_table_event(&event("a", 7, r#"["a","0","5s"]"#, created)).unwrap();
    assert!(ev.columns.is_none());
    let r = ev.rows.into_iter().next().unwrap();
    assert_eq!((r.key.name.as_ref(), r.rv), ("a", 7));
    st.attach(r.key.clone(), r.rv, r.row, t0 + 5_300);
    let cols = st.columns().unwrap();
    let row = st.row(&r.key, 7, cols.generation).expect("served");
    assert!(
        st.row(&r.key, 8, cols.generation).is_none(),
        "another version"
    );
    let mut b = BytesMut::new();
    row.put(&mut b, &cols, t0 + 3 * 60_000 + 1_000, &[], |b| {
        b.put_slice(b"null")
    });
    assert_eq!(&b[..], br#"{"cells":["a","0","3m1s"],"object":null}"#);
    // Not the age the clock says when it arrived: never served.
    let ev = parse_table_event(&event("b", 8, r#"["b","0","1h"]"#, created)).unwrap();
    let r = ev.rows.into_iter().next().unwrap();
    st.attach(r.key.clone(), r.rv, r.row, t0 + 5_000);
    assert!(st.row(&r.key, 8, cols.generation).is_none());
    assert_eq!(st.stats.age_mismatches.load(Relaxed), 1);
    // A pod's restarts printed relative to the clock: re-rendered from the pod's
    // finishedAt that printed so when the row arrived (5 minutes before it).
    let ev = parse_table_event(&event("c", 9, r#"["c","2 (5m ago)","5s"]"#, created)).unwrap();
    let r = ev.rows.into_iter().next().unwrap();
    st.attach(r.key.clone(), r.rv, r.row, t0 + 5_000);
    let row = st.row(&r.key, 9, cols.generation).expect("served");
    // The test's moments are within the day of `created`.
    let at = |secs: i64| {
        let t = t0 / 1000 + secs;
        format!(
            "2026-12-07T{:02}:{:02}:{:02}Z",
            (t % 86_400) / 3600,
            (t % 3600) / 60,
            t % 60
        )
    };
    let pod = |finished: &[String]| {
        let cs: Vec<String> = finished
            .iter()
            .map(|f| {
                format!(r#"{{"name":"x","lastState":{{"terminated":{{"finishedAt":"{f}"}}}}}}"#)
            })
            .collect();
        format!(
            r#"{{"metadata":{{"name":"c"}},"status":{{"containerStatuses":[{}]}}}}"#,
            cs.join(",")
        )
    };
    let one = pod(&[at(-295), at(-3000)]);
    assert_eq!(
        row.clock_cell_now(one.as_bytes(), t0 + 65_000),
        Ok(Some(r#""2 (6m ago)""#.to_string()))
    );
    // No finishedAt that printed so, or none at all: not re-rendered.
    assert!(
        row.clock_cell_now(pod(&[at(-3000)]).as_bytes(), t0 + 65_000)
            .is_err()
    );
    assert!(row.clock_cell_now(b"{}", t0 + 65_000).is_err());
    // The same cell of another resource is the apiserver's.
    let other = TableStore::new(false, "", "nodes", Arc::new(ProtoBudget::new(u64::MAX)));
    other.set_columns(&pod_columns()).unwrap();
    let ev = parse_table_event(&event("c", 9, r#"["c","2 (5m ago)","5s"]"#, created)).unwrap();
    let r = ev.rows.into_iter().next().unwrap();
    other.attach(r.key.clone(), r.rv, r.row, t0 + 5_000);
    let g = other.columns().unwrap().generation;
    assert!(other.row(&r.key, 9, g).is_none());
    assert!(other.row_unservable(&r.key, 9, g));
}

#[test]
fn restarts_are_not_re_rendered_from_finish_times_that_would_print_differently_now() {
    let r = Row {
        cells: vec![Box::from(r#""2 (10d ago)""#)].into(),
        conditions: None,
        created: None,
        generation: 1,
        clock_bound: false,
        clock_cell: Some(ClockCell {
            index: 0,
            kind: ClockKind::PodRestarts,
            prefix: "2 (".into(),
            printed: "10d".into(),
        }),
        dates: Box::default(),
        received_ms: parse_time("2026-12-17T12:00:00Z").unwrap() * 1000,
    };
    // Both printed "10d" when the row arrived; five hours later one is 11 days old.
    let pod = r#"{"status":{"containerStatuses":[{"lastState":{"terminated":{"finishedAt":"2026-12-07T11:00:00Z"}}}],"initContainerStatuses":[{"lastState":{"terminated":{"finishedAt":"2026-12-06T16:00:00Z"}}}]}}"#;
    let later = r.received_ms + 5 * 3_600_000;
    assert!(r.clock_cell_now(pod.as_bytes(), later).is_err());
    let one = r#"{"status":{"containerStatuses":[{"lastState":{"terminated":{"finishedAt":"2026-12-07T11:00:00Z"}}}]}}"#;
    assert_eq!(
        r.clock_cell_now(one.as_bytes(), later),
        Ok(Some(r#""2 (10d ago)""#.to_string()))
    );
    assert_eq!(split_restarts(r#""12 (3m4s ago)""#), Some(("12 (", "3m4s")));
    for bad in [
        r#""x (3m ago)""#,
        r#""2 (ago)""#,
        r#"" (3m ago)""#,
        r#""2 3m ago)""#,
    ] {
        assert_eq!(split_restarts(bad), None, "{bad}");
    }
}

/// A running Job's duration and a CronJob's last schedule move with the clock: kept
/// with the time they were printed from, re-rendered now; a complete Job's duration and
/// a CronJob never scheduled do not move.
#[test]
fn job_durations_and_last_schedules_are_re_rendered_from_the_object() {
    const JOB_COLUMNS: &str = r#"[{"name":"Name","type":"string","format":"name","description":"n","priority":0},{"name":"Status","type":"string","format":"","description":"s","priority":0},{"name":"Completions","type":"string","format":"","description":"c","priority":0},{"name":"Duration","type":"string","format":"","description":"Time required to complete the job.","priority":0}]"#;
    let st = TableStore::new(false, "batch", "jobs", Arc::new(ProtoBudget::new(u64::MAX)));
    st.set_columns(JOB_COLUMNS).unwrap();
    let g = st.columns().unwrap().generation;
    let t0 = parse_time("2026-12-07T12:00:00Z").unwrap();
    let start = "2026-12-07T11:40:00Z";
    let row = |cell: &str| {
        format!(
            r#"{{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{{"resourceVersion":"5"}},"rows":[{{"cells":["j","Running","0/1","{cell}"],"object":{{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{{"name":"j","namespace":"ns","resourceVersion":"5"}}}}}}]}}"#
        )
    };
    for r in parse_table_event(&row("20m")).unwrap().rows {
        st.attach(r.key, r.rv, r.row, t0 * 1000);
    }
    let r = st.row(&ObjectKey::new("ns", "j"), 5, g).expect("servable");
    let running = format!(r#"{{"status":{{"startTime":"{start}"}}}}"#);
    let later = (t0 + 600) * 1000;
    assert_eq!(
        r.clock_cell_now(running.as_bytes(), later),
        Ok(Some(r#""30m""#.to_string()))
    );
    // Printed from another start than the object's: not re-rendered.
    let other = r#"{"status":{"startTime":"2026-12-07T10:00:00Z"}}"#;
    assert!(r.clock_cell_now(other.as_bytes(), later).is_err());
    // Complete, or not started: the cell as printed.
    let done = format!(
        r#"{{"status":{{"startTime":"{start}","completionTime":"2026-12-07T11:45:00Z"}}}}"#
    );
    assert_eq!(r.clock_cell_now(done.as_bytes(), later), Ok(None));
    assert_eq!(r.clock_cell_now(b"{}", later), Ok(None));
    assert!(r.clock_cell_now(b"[", later).is_err());

    const CRON_COLUMNS: &str = r#"[{"name":"Name","type":"string","format":"name","description":"n","priority":0},{"name":"Last Schedule","type":"string","format":"","description":"l","priority":0}]"#;
    let st = TableStore::new(
        false,
        "batch",
        "cronjobs",
        Arc::new(ProtoBudget::new(u64::MAX)),
    );
    st.set_columns(CRON_COLUMNS).unwrap();
    let g = st.columns().unwrap().generation;
    let cron = |cell: &str| {
        format!(
            r#"{{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{{"resourceVersion":"6"}},"rows":[{{"cells":["c","{cell}"],"object":{{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{{"name":"c","namespace":"ns","resourceVersion":"6"}}}}}}]}}"#
        )
    };
    for r in parse_table_event(&cron("7m")).unwrap().rows {
        st.attach(r.key, r.rv, r.row, t0 * 1000);
    }
    let r = st.row(&ObjectKey::new("ns", "c"), 6, g).expect("servable");
    let scheduled = r#"{"status":{"lastScheduleTime":"2026-12-07T11:53:00Z"}}"#;
    assert_eq!(
        r.clock_cell_now(scheduled.as_bytes(), later),
        Ok(Some(r#""17m""#.to_string()))
    );
    assert!(r.clock_cell_now(b"{}", later).is_ok());
    // No Last Schedule column: the row is not served.
    let st = TableStore::new(
        false,
        "batch",
        "cronjobs",
        Arc::new(ProtoBudget::new(u64::MAX)),
    );
    st.set_columns(JOB_COLUMNS).unwrap();
    for r in parse_table_event(&cron("7m")).unwrap().rows {
        st.attach(r.key, r.rv, r.row, t0 * 1000);
    }
    assert!(
        st.row(
            &ObjectKey::new("ns", "c"),
            6,
            st.columns().unwrap().generation
        )
        .is_none()
    );
}

#[test]
fn changed_columns_drop_every_row_and_ask_for_a_restart() {
    let st = store();
    st.set_columns(&pod_columns()).unwrap();
    let created = "2026-12-07T11:00:00Z";
    let t0 = parse_time(created).unwrap() * 1000;
    let r = parse_table_event(&event("a", 7, r#"["a","0","0s"]"#, created))
        .unwrap()
        .rows
        .remove(0);
    st.attach(r.key.clone(), 7, r.row, t0);
    st.set_synced(true);
    assert!(st.ready());
    st.set_columns(&pod_columns()).unwrap();
    assert!(st.ready(), "the same columns again change nothing");
    assert!(!st.restart.load(Relaxed));
    st.set_columns(&pod_columns().replace("Restarts", "Restarted"))
        .unwrap();
    assert!(!st.ready());
    assert!(st.restart.load(Relaxed));
    assert_eq!(st.size(), (0, 0));
    let g = st.columns().unwrap().generation;
    assert_eq!(g, 2);
    assert!(st.row(&r.key, 7, g).is_none());
}

#[test]
fn replaced_versions_are_kept_for_older_snapshots_then_released() {
    let budget = Arc::new(ProtoBudget::new(u64::MAX));
    let st = TableStore::new(false, "", "pods", budget.clone());
    st.set_columns(&pod_columns()).unwrap();
    let created = "2026-12-07T11:00:00Z";
    let t0 = parse_time(created).unwrap() * 1000;
    for rv in [7, 9] {
        let r = parse_table_event(&event("a", rv, r#"["a","0","0s"]"#, created))
            .unwrap()
            .rows
            .remove(0);
        st.attach(r.key, rv, r.row, t0);
    }
    assert_eq!(st.size().0, 2);
    assert!(budget.used() > 0);
    let key = ObjectKey::new("ns", "a");
    // The JSON side holds version 9: version 7 is marked, not dropped yet.
    st.reconcile(9, |k| (k == &key).then_some(9));
    assert_eq!(st.size().0, 2);
    let g = st.columns().unwrap().generation;
    assert!(st.row(&key, 7, g).is_some());
    // A row ahead of the JSON side is never marked.
    st.reconcile(8, |_| Some(7));
    assert!(st.row(&key, 9, g).is_some());
}

#[test]
fn the_bound_sheds_the_rows_and_gives_the_bytes_back() {
    let budget = Arc::new(ProtoBudget::new(100));
    let st = TableStore::new(false, "", "pods", budget.clone());
    st.set_columns(&pod_columns()).unwrap();
    st.set_synced(true);
    let created = "2026-12-07T11:00:00Z";
    let t0 = parse_time(created).unwrap() * 1000;
    let r = parse_table_event(&event("a", 7, r#"["a","0","0s"]"#, created))
        .unwrap()
        .rows
        .remove(0);
    st.attach(r.key, 7, r.row, t0);
    assert!(st.shed.is_cancelled());
    assert!(!st.ready());
    assert_eq!(budget.used(), 0);
    assert_eq!(st.size(), (0, 0));
}

#[test]
fn a_crds_declared_columns_are_described_as_the_apiserver_describes_them() {
    let declared: Vec<PrinterColumn> = serde_json::from_str(
        r#"[{"name":"Size","type":"integer","jsonPath":".spec.size"},
            {"name":"Color","type":"string","jsonPath":".spec.color","priority":1,"description":"The colour."}]"#,
    )
    .unwrap();
    let want = [
        (
            "Size".to_string(),
            "integer".to_string(),
            String::new(),
            "Custom resource definition column (in JSONPath format): .spec.size".to_string(),
            0,
        ),
        (
            "Color".to_string(),
            "string".to_string(),
            String::new(),
            "The colour.".to_string(),
            1,
        ),
    ];
    assert_eq!(crd_columns(&declared), want);
    assert_eq!(crd_columns(&[])[0].0, "Age");
    // The side's columns are compared after Name.
    let raw = r#"[{"name":"Name","type":"string","format":"name","description":"n","priority":0},{"name":"Size","type":"integer","format":"","description":"Custom resource definition column (in JSONPath format): .spec.size","priority":0},{"name":"Color","type":"string","format":"","description":"The colour.","priority":1}]"#;
    let st = TableStore::new(
        true,
        "example.com",
        "widgets",
        Arc::new(ProtoBudget::new(u64::MAX)),
    );
    st.set_columns(raw).unwrap();
    st.set_synced(true);
    assert!(st.ready(), "no CRD read yet");
    st.expect_columns(crd_columns(&declared));
    assert!(st.ready());
    st.expect_columns(crd_columns(&declared[..1]));
    assert!(!st.ready(), "the CRD dropped a column the side still has");
    assert!(st.not_ready_reason().is_some());
}

#[test]
fn bookmarks_and_rows_without_metadata_are_told_apart() {
    let bm = r#"{"kind":"Table","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"222"},"columnDefinitions":null,"rows":[{"cells":["",0,"\u003cunknown\u003e"],"object":{"kind":"PartialObjectMetadata","apiVersion":"meta.k8s.io/v1","metadata":{"resourceVersion":"222","annotations":{"k8s.io/initial-events-end":"true"}}}}]}"#;
    let ev = parse_table_event(bm).unwrap();
    assert!(ev.rows[0].initial_events_end, "{ev:?}");
    assert_eq!(ev.rows[0].rv, 222);
    let none = r#"{"kind":"Table","columnDefinitions":[],"rows":[{"cells":[],"object":null}]}"#;
    assert!(parse_table_event(none).is_err());
    assert!(parse_table_event("[]").is_err());
    assert!(parse_table_event(r#"["Table"]"#).is_err());
    assert!(parse_table_event(r#"{"kind":"Status","rows":[]}"#).is_err());
    let cols =
        parse_table_event(r#"{"kind":"Table","columnDefinitions":[{"name":"Name"}],"rows":[]}"#)
            .unwrap()
            .columns;
    assert_eq!(cols.as_deref(), Some(r#"[{"name":"Name"}]"#));
}
