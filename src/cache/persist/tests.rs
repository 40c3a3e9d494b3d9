//! Tests of warm-restart state files: round trips, sealing, permissions, temporaries.

use super::*;

fn cm(name: &str, rv: u64) -> Arc<CachedObject> {
    let raw = format!(
        r#"{{"metadata":{{"name":"{name}","namespace":"ns","resourceVersion":"{rv}","uid":"u-{name}"}},"data":{{"k":"v"}}}}"#
    );
    Arc::new(CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap())
}

fn configmaps() -> Resource {
    Resource::core("configmaps", "ConfigMap", true)
}

fn image() -> Image {
    Image {
        rv: 20,
        oldest_rv: 10,
        relist_rv: Some(10),
        absorbed: vec![(3, 7)],
        base: vec![cm("a", 5), cm("b", 9)],
        events: vec![
            (EventKind::Modified, Duration::from_secs(3), cm("a", 12)),
            (EventKind::Deleted, Duration::from_secs(2), cm("b", 15)),
            (EventKind::Added, Duration::from_secs(1), cm("c", 18)),
        ],
        protobuf: ProtoImage::default(),
        table: None,
    }
}

/// A ConfigMap's protobuf envelope whose message is `raw` (the bytes are opaque to the
/// state file; only the type meta is checked when loading).
fn envelope(raw: &[u8]) -> Bytes {
    Bytes::from(crate::k8s::protobuf_write::object_envelope(
        "v1",
        "ConfigMap",
        raw,
    ))
}

/// The image of a cache whose protobuf side ran: envelopes on some objects, the
/// bookmark template, complete or not.
fn image_with_protobuf(complete: bool) -> Image {
    let i = image();
    i.base[0].proto.set(envelope(b"a5"));
    i.events[0].2.proto.set(envelope(b"a12"));
    i.events[2].2.proto.set(envelope(b"c18"));
    Image {
        protobuf: ProtoImage {
            complete,
            started: true,
            bookmark: Some(("ConfigMap".into(), Bytes::from_static(b"\x0a\x00"))),
        },
        ..i
    }
}

/// Each object's envelope (or none), in the image's order.
fn envelopes(i: &Image) -> Vec<Option<Bytes>> {
    let objects = i.base.iter().chain(i.events.iter().map(|e| &e.2));
    objects.map(|o| o.proto.get().cloned()).collect()
}

fn persist(dir: &Path, keys: Vec<(String, [u8; 32])>) -> Persist {
    Persist {
        dir: dir.to_path_buf(),
        upstream: "https://10.0.0.1:6443".into(),
        max_age: Duration::from_secs(3600),
        keys,
        save_interval: Duration::ZERO,
    }
}

/// 9,000 objects of about 500 bytes and 100 events: two chunks, enough objects to be
/// parsed on two threads.
fn a_large_image() -> Image {
    let data = "y".repeat(400);
    let obj = |i: u64, rv: u64| {
        let raw = format!(
            r#"{{"metadata":{{"name":"c{i}","namespace":"ns","resourceVersion":"{rv}"}},"data":{{"k":"{data}"}}}}"#
        );
        Arc::new(CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap())
    };
    let events = (0..100)
        .map(|i| {
            let kind = [EventKind::Added, EventKind::Modified, EventKind::Deleted][i % 3];
            let i = i as u64;
            (kind, Duration::from_millis(i), obj(20_000 + i, 9_001 + i))
        })
        .collect();
    Image {
        rv: 10_100,
        oldest_rv: 9_000,
        relist_rv: None,
        absorbed: vec![],
        base: (0..9_000).map(|i| obj(i, i + 1)).collect(),
        events,
        protobuf: ProtoImage::default(),
        table: None,
    }
}

/// Objects come back in their order whatever the number of threads.
#[test]
fn par_map_keeps_the_order() {
    for n in [0usize, 1, 2, 3, 7, 1000, 4099] {
        let want: Vec<usize> = (0..n).map(|x| x * 2).collect();
        for min in [1, 2, 1000] {
            assert_eq!(
                par_map((0..n).collect(), min, |x| x * 2),
                want,
                "{n} by {min}"
            );
        }
    }
}

fn without_ages(mut i: Image) -> Image {
    for e in &mut i.events {
        e.1 = Duration::ZERO;
    }
    i
}

/// What is saved loads back the same, with and without `tokens.keyFile` (sealed either
/// way); the ages grow by the time the file lay on disk (at least, never less).
#[test]
fn an_image_round_trips_with_and_without_a_key_file() {
    for keys in [vec![], vec![("k1".to_string(), [7u8; 32])]] {
        let dir = tempfile::tempdir().unwrap();
        let p = persist(dir.path(), keys.clone());
        let saved = p.save(&configmaps(), "", &image()).unwrap();
        assert_eq!((saved.objects, saved.events), (2, 3));
        let got = p.load(&configmaps(), "").unwrap().expect("a file");
        for (a, b) in got.events.iter().zip(&image().events) {
            assert!(a.1 >= b.1);
        }
        assert_eq!(without_ages(got), without_ages(image()));
        let file = std::fs::read(p.path(&configmaps())).unwrap();
        let clear = file.windows(5).any(|w| w == b"\"u-a\"");
        assert!(!clear, "sealed files hold no object in clear");
    }
}

/// A state larger than a chunk goes in several, sealed one by one, and loads back whole.
#[test]
fn a_large_image_spans_chunks() {
    let big = "x".repeat(5000);
    let base: Vec<_> = (0..2000)
        .map(|i| {
            let raw = format!(
                r#"{{"metadata":{{"name":"c{i}","namespace":"ns","resourceVersion":"{}"}},"data":{{"k":"{big}"}}}}"#,
                i + 1
            );
            Arc::new(CachedObject::parse(Bytes::from(raw), &configmaps()).unwrap())
        })
        .collect();
    let img = Image {
        rv: 3000,
        oldest_rv: 2000,
        relist_rv: None,
        absorbed: vec![],
        base,
        events: vec![],
        protobuf: ProtoImage::default(),
        table: None,
    };
    for keys in [vec![], vec![("k1".to_string(), [7u8; 32])]] {
        let dir = tempfile::tempdir().unwrap();
        let p = persist(dir.path(), keys);
        let saved = p.save(&configmaps(), "", &img).unwrap();
        assert!(saved.bytes > 2 * CHUNK as u64);
        assert_eq!(p.load(&configmaps(), "").unwrap().unwrap(), img);
        let many = a_large_image();
        let saved = p.save(&configmaps(), "", &many).unwrap();
        assert!(saved.bytes > CHUNK as u64);
        let got = p.load(&configmaps(), "").unwrap().unwrap();
        assert_eq!(without_ages(got), without_ages(many));
    }
}

/// The protobuf side's part comes back as saved, plain and sealed: each object's
/// envelope (objects without one stay without), whether the side can resume, and the
/// bookmark template.
#[test]
fn envelopes_and_the_protobuf_sides_state_round_trip() {
    for complete in [false, true] {
        for keys in [vec![], vec![("k1".to_string(), [7u8; 32])]] {
            let dir = tempfile::tempdir().unwrap();
            let p = persist(dir.path(), keys);
            let img = image_with_protobuf(complete);
            p.save(&configmaps(), "", &img).unwrap();
            let got = p.load(&configmaps(), "").unwrap().unwrap();
            assert_eq!(got.protobuf, img.protobuf);
            assert_eq!(envelopes(&got), envelopes(&img));
            assert_eq!(
                envelopes(&got).iter().filter(|e| e.is_some()).count(),
                3,
                "three of the five objects had an envelope"
            );
        }
    }
}

/// The table side's columns, rows and bookmark row come back as they were saved; a file
/// of the previous layout (no table side) is still read.
#[test]
fn the_table_side_round_trips_and_the_previous_layout_is_read() {
    use crate::cache::table::TableImage;
    let table: TableImage = serde_json::from_value(serde_json::json!({
        "columns": r#"[{"name":"Name","type":"string","format":"name","description":"n","priority":0}]"#,
        "progress": 20,
        "bookmark": {"cells": ["\"\""], "received_ms": 5},
        "rows": [
            {"namespace": "ns", "name": "a", "rv": 12, "row": {"cells": ["\"a\""], "created": 100, "received_ms": 7}},
            {"namespace": "ns", "name": "c", "rv": 18, "row": {"cells": ["\"c\""], "conditions": "[]", "received_ms": 8}}
        ]
    }))
    .unwrap();
    let img = Image {
        table: Some(table),
        ..image()
    };
    for keys in [vec![], vec![("k1".to_string(), [7u8; 32])]] {
        let dir = tempfile::tempdir().unwrap();
        let p = persist(dir.path(), keys);
        p.save(&configmaps(), "", &img).unwrap();
        let got = p.load(&configmaps(), "").unwrap().unwrap();
        assert_eq!(got.table, img.table);
        assert_eq!(without_ages(got), without_ages(img.clone()));
    }
    // Format 2: the payload ends with the events.
    let dir = tempfile::tempdir().unwrap();
    let p = persist(dir.path(), vec![]);
    let old = Image {
        table: None,
        ..image()
    };
    p.save_format(&configmaps(), "", &old, 2).unwrap();
    let got = p.load(&configmaps(), "").unwrap().unwrap();
    assert_eq!(got.table, None);
    assert_eq!(without_ages(got), without_ages(old));
}

/// Envelopes of a side that was not running (shed: some history events keep theirs)
/// are not written: nothing would charge them to the protobuf bound after a restart.
#[test]
fn envelopes_of_a_side_that_is_not_running_are_not_saved() {
    let dir = tempfile::tempdir().unwrap();
    let p = persist(dir.path(), vec![]);
    let mut img = image_with_protobuf(false);
    img.protobuf = ProtoImage::default();
    p.save(&configmaps(), "", &img).unwrap();
    let got = p.load(&configmaps(), "").unwrap().unwrap();
    assert!(envelopes(&got).iter().all(Option::is_none));
}

/// An envelope that is not one of this resource's (another kind, or not an envelope)
/// refuses the whole file, even when it opens with its key (a file written by a buggy
/// writer): it would be served to protobuf readers as it is.
#[test]
fn a_file_with_an_envelope_of_another_kind_is_refused() {
    let other = Bytes::from(crate::k8s::protobuf_write::object_envelope(
        "v1", "Secret", b"x",
    ));
    for bad in [other, Bytes::from_static(b"not an envelope")] {
        let dir = tempfile::tempdir().unwrap();
        let p = persist(dir.path(), vec![]);
        let img = image_with_protobuf(true);
        img.base[1].proto.set(bad);
        p.save(&configmaps(), "", &img).unwrap();
        assert!(matches!(
            p.load(&configmaps(), ""),
            Err(PersistError::Corrupt("a protobuf envelope"))
        ));
    }
}

/// Every flipped byte, every truncation and every foreign origin is refused; no file is
/// "none". The checksum is not read (the chunks are authenticated): a flipped byte there
/// changes nothing the file holds.
#[test]
fn damaged_foreign_or_stale_files_are_refused() {
    let now = SystemTime::now();
    let r = configmaps();
    // Small files byte by byte; a large one (several chunks, opened and parsed on several
    // threads) at a few dozen places, among them each chunk's header.
    for (img, step) in [(image(), 7), (a_large_image(), 500_000)] {
        for keys in [vec![], vec![("k1".to_string(), [7u8; 32])]] {
            let dir = tempfile::tempdir().unwrap();
            let p = persist(dir.path(), keys.clone());
            p.save(&r, "", &img).unwrap();
            let file = std::fs::read(p.path(&r)).unwrap();
            let content = file.len() - 32;
            let tail = content.saturating_sub(16)..content;
            // Each chunk's flag and length.
            let hlen = u32::from_le_bytes(file[12..16].try_into().unwrap()) as usize;
            let mut heads = vec![];
            let mut at = 16 + hlen;
            loop {
                heads.extend([at, at + 1, at + 4]);
                let len = u32::from_le_bytes(file[at + 1..at + 5].try_into().unwrap());
                if file[at] == 1 {
                    break;
                }
                at += 5 + len as usize;
            }
            assert!(step == 7 || heads.len() >= 6, "{heads:?}");
            for i in (0..content).step_by(step).chain(tail).chain(heads) {
                let mut bad = file.clone();
                bad[i] ^= 0x40;
                assert!(p.decode(&r, "", bad, now).is_err(), "flipped byte {i}");
            }
            for i in (content..file.len()).step_by(if step == 7 { 1 } else { 31 }) {
                let mut bad = file.clone();
                bad[i] ^= 0x40;
                let got = p
                    .decode(&r, "", bad, now)
                    .expect("the checksum is not read");
                assert_eq!(without_ages(got), without_ages(img.clone()));
            }
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let key = vec![("k1".to_string(), [7u8; 32])];
    let p = persist(dir.path(), key.clone());
    assert!(p.load(&r, "").unwrap().is_none());
    p.save(&r, "", &image()).unwrap();
    let file = std::fs::read(p.path(&r)).unwrap();
    for cut in [0, 5, 12, file.len() / 2, file.len() - 1] {
        assert!(
            p.decode(&r, "", file[..cut].to_vec(), now).is_err(),
            "cut at {cut}"
        );
    }
    let other = |f: &dyn Fn(&mut Persist)| {
        let mut q = persist(dir.path(), key.clone());
        f(&mut q);
        q
    };
    let cases: [(&str, Persist, &str); 4] = [
        (
            "another upstream",
            other(&|q| q.upstream = "https://x".into()),
            "",
        ),
        ("another CRD uid", other(&|_| ()), "uid-2"),
        (
            "an unknown key",
            other(&|q| q.keys = vec![("k2".into(), [7u8; 32])]),
            "",
        ),
        (
            "a wrong key",
            other(&|q| q.keys = vec![("k1".into(), [8u8; 32])]),
            "",
        ),
    ];
    for (what, q, uid) in cases {
        assert!(q.decode(&r, uid, file.clone(), now).is_err(), "{what}");
    }
    let pods = Resource::core("pods", "Pod", true);
    assert!(
        p.decode(&pods, "", file.clone(), now).is_err(),
        "another resource"
    );
    let later = now + Duration::from_secs(7200);
    assert!(matches!(
        p.decode(&r, "", file.clone(), later),
        Err(PersistError::Stale { .. })
    ));
    // A rotated key file still opens it while the old key is listed.
    let rotated = other(&|q| q.keys.insert(0, ("k2".into(), [9u8; 32])));
    assert!(rotated.decode(&r, "", file.clone(), now).is_ok());
}

/// Secrets are written only with `tokens.keyFile`: the local key lies beside the files,
/// so it hides nothing from whoever can read the directory.
#[test]
fn secrets_are_saved_only_with_a_key_file() {
    let dir = tempfile::tempdir().unwrap();
    let secrets = Resource::core("secrets", "Secret", true);
    assert!(!persist(dir.path(), vec![]).may_save(&secrets));
    assert!(persist(dir.path(), vec![("k".into(), [1; 32])]).may_save(&secrets));
    assert!(persist(dir.path(), vec![]).may_save(&configmaps()));
}

fn mode(path: &Path) -> u32 {
    use std::os::unix::fs::PermissionsExt;
    std::fs::symlink_metadata(path)
        .unwrap()
        .permissions()
        .mode()
        & 0o7777
}

fn key() -> Vec<(String, [u8; 32])> {
    vec![("k1".to_string(), [7u8; 32])]
}

/// Set in the child the umask test runs itself in: the umask it was given.
const UMASK_CHILD: &str = "KUBE_CACHE_PROXY_PERSIST_TEST_UMASK";

/// With umask 022 (and 000) the state directory is 0700 and every file in it 0600: a
/// directory made by the save, its parents, an existing 0755 one (as earlier versions
/// left it), a state file left 0644, with and without `tokens.keyFile` (the local key
/// included). The umask is the process's, so the test runs itself again in a child
/// started by `sh -c 'umask …; exec …'` (this crate forbids `unsafe`, so no `umask(2)`).
#[test]
fn the_state_directory_and_files_are_private_whatever_the_umask() {
    if let Ok(umask) = std::env::var(UMASK_CHILD) {
        return private_whatever_the_umask(&umask);
    }
    let exe = std::env::current_exe().unwrap();
    let name = format!(
        "{}::the_state_directory_and_files_are_private_whatever_the_umask",
        module_path!().split_once("::").unwrap().1
    );
    for umask in ["022", "000"] {
        let out = std::process::Command::new("/bin/sh")
            .arg("-c")
            .arg(format!("umask {umask} && exec \"$0\" \"$@\""))
            .arg(&exe)
            .args([&name, "--exact", "--nocapture", "--test-threads=1"])
            .env(UMASK_CHILD, umask)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "umask {umask}:\n{text}");
        assert!(text.contains("1 passed"), "umask {umask}: ran\n{text}");
    }
}

fn private_whatever_the_umask(umask: &str) {
    use std::os::unix::fs::PermissionsExt;
    // The child runs under the umask it was given (Linux shows it).
    if let Ok(status) = std::fs::read_to_string("/proc/self/status")
        && let Some(line) = status.lines().find(|l| l.starts_with("Umask:"))
    {
        assert_eq!(line.split_whitespace().nth(1), Some(&*format!("0{umask}")));
    }
    let root = tempfile::tempdir().unwrap();
    let existing = root.path().join("existing");
    std::fs::create_dir(&existing).unwrap();
    std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o755)).unwrap();
    let old = existing.join("core_v1_configmaps.state");
    std::fs::write(&old, b"an earlier version's file").unwrap();
    std::fs::set_permissions(&old, std::fs::Permissions::from_mode(0o644)).unwrap();
    let fresh = root.path().join("parent/state");
    for dir in [existing, fresh] {
        for keys in [vec![], key()] {
            let p = persist(&dir, keys);
            p.save(&configmaps(), "", &image()).unwrap();
            assert!(p.load(&configmaps(), "").unwrap().is_some());
            assert_eq!(mode(&dir), 0o700, "{}", dir.display());
            let files: Vec<_> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .collect();
            let names: Vec<_> = files.iter().map(|f| f.file_name().unwrap()).collect();
            assert!(
                names.contains(&std::ffi::OsStr::new(LOCAL_KEY)),
                "{names:?}"
            );
            assert_eq!(files.len(), 2, "no temporary left: {names:?}");
            for f in files {
                assert_eq!(mode(&f), 0o600, "{}", f.display());
            }
        }
    }
    assert_eq!(mode(&root.path().join("parent")), 0o700);
    // An existing directory is made private at load too, before any save.
    let loose = root.path().join("loose");
    std::fs::create_dir(&loose).unwrap();
    std::fs::set_permissions(&loose, std::fs::Permissions::from_mode(0o777)).unwrap();
    assert!(
        persist(&loose, vec![])
            .load(&configmaps(), "")
            .unwrap()
            .is_none()
    );
    assert_eq!(mode(&loose), 0o700);
}

/// A state file as an earlier version wrote it without a key (or as anyone who can write
/// the directory can): plain, one ConfigMap with `body`, its SHA-256 recomputed. Built
/// byte by byte, as an attacker would.
fn forged_plain_file(p: &Persist, r: &Resource, body: &str) -> Vec<u8> {
    let header = Header {
        identity: p.identity(r, ""),
        rv: 20,
        oldest_rv: 20,
        relist_rv: None,
        absorbed: vec![],
        saved_at_unix_ms: unix_ms(SystemTime::now()),
        writer: "0.1.0".into(),
        sealed: None,
        protobuf_complete: false,
        protobuf_started: false,
        protobuf_bookmark: None,
    };
    let header = serde_json::to_vec(&header).unwrap();
    let mut payload = 1u64.to_le_bytes().to_vec();
    payload.extend((body.len() as u32).to_le_bytes());
    payload.extend(body.as_bytes());
    payload.extend(0u32.to_le_bytes());
    payload.extend(0u64.to_le_bytes());
    let mut f = MAGIC.to_vec();
    f.extend(FORMAT.to_le_bytes());
    f.extend((header.len() as u32).to_le_bytes());
    f.extend(&header);
    f.push(1);
    f.extend((payload.len() as u32).to_le_bytes());
    f.extend(&payload);
    let sum = Sha256::digest(&f);
    f.extend(sum);
    f
}

/// An edited state file whose SHA-256 is recomputed is never loaded, with or without
/// `tokens.keyFile`: neither a plain file (an earlier version's, or forged with another
/// value than the apiserver has), nor the saved file with a byte changed.
#[test]
fn an_edited_state_file_with_a_recomputed_checksum_is_refused() {
    let r = configmaps();
    let forged = r#"{"metadata":{"name":"a","namespace":"ns","resourceVersion":"20","uid":"u-a"},"data":{"k":"FFFFFFFF"}}"#;
    for keys in [vec![], key()] {
        let dir = tempfile::tempdir().unwrap();
        let p = persist(dir.path(), keys.clone());
        p.save(&r, "", &image()).unwrap();
        let path = p.path(&r);

        // The saved file, edited: the value in clear if it were there, else a byte of
        // its payload; the checksum recomputed.
        let mut file = std::fs::read(&path).unwrap();
        let content = file.len() - 32;
        match file.windows(7).position(|w| w == br#""k":"v""#) {
            Some(at) => file[at + 5] = b'F',
            None => file[content - 20] ^= 0x01,
        }
        let sum = Sha256::digest(&file[..content]);
        file[content..].copy_from_slice(&sum);
        std::fs::write(&path, &file).unwrap();
        let got = p.load(&r, "");
        assert!(got.is_err(), "an edited file was loaded: {got:?}");

        // A plain file with another value and a valid checksum.
        std::fs::write(&path, forged_plain_file(&p, &r, forged)).unwrap();
        let got = p.load(&r, "");
        assert!(got.is_err(), "a forged plain file was loaded: {got:?}");
        let err = got.unwrap_err().to_string();
        assert!(err.contains("not sealed"), "{err}");
    }
}

/// A symlink to a victim file planted at every name earlier versions wrote their
/// temporary under (`<file>.tmp`, one per resource), and at the state file's own name, is
/// not followed: the victim is untouched after saves (with and without
/// `tokens.keyFile`), the state is written and loads; the planted temporaries are left
/// alone. Temporary names are unpredictable.
#[test]
fn a_symlink_planted_at_the_temporary_name_is_not_followed() {
    let root = tempfile::tempdir().unwrap();
    let victim = root.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let deployments = Resource {
        group: "apps".into(),
        resource: "deployments".into(),
        kind: "Deployment".into(),
        ..configmaps()
    };
    let resources = [
        configmaps(),
        Resource::core("secrets", "Secret", true),
        deployments,
    ];
    for (i, keys) in [vec![], key()].into_iter().enumerate() {
        let dir = root.path().join(format!("state-{i}"));
        std::fs::create_dir(&dir).unwrap();
        let p = persist(&dir, keys);
        let mut planted = vec![];
        for r in &resources {
            let old_tmp = p.path(r).with_extension("state.tmp");
            std::os::unix::fs::symlink(&victim, &old_tmp).unwrap();
            planted.push(old_tmp);
        }
        std::os::unix::fs::symlink(&victim, p.path(&configmaps())).unwrap();
        for round in 0..2 {
            for r in &resources {
                p.save(r, "", &image()).unwrap();
            }
            assert_eq!(
                std::fs::read(&victim).unwrap(),
                b"precious",
                "round {round}"
            );
        }
        for l in &planted {
            assert!(std::fs::symlink_metadata(l).unwrap().is_symlink());
        }
        let state = std::fs::symlink_metadata(p.path(&configmaps())).unwrap();
        assert!(
            state.file_type().is_file(),
            "the state file replaced the symlink"
        );
        let got = p.load(&configmaps(), "").unwrap().unwrap();
        assert_eq!(without_ages(got), without_ages(image()));
    }
    let target = root.path().join("x.state");
    let (a, _) = create_temporary(&target).unwrap();
    let (b, _) = create_temporary(&target).unwrap();
    assert_ne!(a, b);
    for t in [a, b] {
        let name = t.file_name().unwrap().to_str().unwrap().to_string();
        let suffix = name.strip_prefix("x.state.tmp-").unwrap();
        assert_eq!(suffix.len(), 24, "{name}");
        assert!(suffix.bytes().all(|c| c.is_ascii_hexdigit()), "{name}");
        assert_eq!(mode(&t), 0o600);
    }
}

/// Temporaries a crash left (an hour old) and an earlier version's fixed-name one are
/// removed by the next save; a recent one (another save in progress) is not.
#[test]
fn a_save_removes_stale_temporaries() {
    let dir = tempfile::tempdir().unwrap();
    let p = persist(dir.path(), vec![]);
    let path = p.path(&configmaps());
    let name = |s: &str| dir.path().join(format!("core_v1_configmaps.state{s}"));
    let (aged, recent, old) = (name(".tmp-0a1b"), name(".tmp-2c3d"), name(".tmp"));
    for f in [&aged, &recent, &old] {
        std::fs::write(f, b"left over").unwrap();
    }
    std::fs::File::options()
        .write(true)
        .open(&aged)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(7200))
        .unwrap();
    p.save(&configmaps(), "", &image()).unwrap();
    assert!(!aged.exists() && !old.exists());
    assert!(recent.exists() && path.exists());
}

/// Without `tokens.keyFile` the local key is made once (of several saves at once, one
/// key wins), 0600, and reused by a restarted proxy; one that is a symlink, readable by
/// others or another user's is refused (nothing loaded, nothing saved); when it is gone
/// the files sealed with it are refused and the next save makes a new one.
#[test]
fn the_local_key_is_made_once_kept_private_and_reused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let r = configmaps();
    let keys: Vec<_> = std::thread::scope(|s| {
        let tasks: Vec<_> = (0..8)
            .map(|_| s.spawn(|| persist(dir.path(), vec![]).local_key(true).unwrap()))
            .collect();
        tasks.into_iter().map(|t| t.join().unwrap()).collect()
    });
    assert!(keys.iter().all(|k| *k == keys[0]), "one key");
    let key_path = dir.path().join(LOCAL_KEY);
    assert_eq!(mode(&key_path), 0o600);
    assert_eq!(
        std::fs::read(&key_path).unwrap(),
        keys[0].clone().unwrap().1
    );
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "only the key"
    );

    persist(dir.path(), vec![]).save(&r, "", &image()).unwrap();
    let restarted = persist(dir.path(), vec![]);
    assert!(restarted.load(&r, "").unwrap().is_some());
    // A file sealed with the local key is not opened with tokens.keyFile's, and back.
    assert!(persist(dir.path(), key()).load(&r, "").is_err());

    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(restarted.load(&r, "").is_err(), "a key others may read");
    assert!(restarted.save(&r, "", &image()).is_err());
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert!(restarted.load(&r, "").unwrap().is_some());

    // Another user's key (only where this test may give it away: as root).
    if std::os::unix::fs::chown(&key_path, Some(54321), None).is_ok() {
        assert!(restarted.load(&r, "").is_err(), "another user's key");
        assert!(restarted.save(&r, "", &image()).is_err());
        std::os::unix::fs::chown(&key_path, Some(own_uid(dir.path()).unwrap()), None).unwrap();
        assert!(restarted.load(&r, "").unwrap().is_some());
    }

    // A symlink to a key-like file is refused, not followed.
    let elsewhere = dir.path().join("elsewhere");
    std::fs::rename(&key_path, &elsewhere).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &key_path).unwrap();
    assert!(restarted.load(&r, "").is_err(), "a symlinked key");
    assert!(restarted.save(&r, "", &image()).is_err());
    std::fs::remove_file(&key_path).unwrap();

    // Gone: the file is refused (a cold start), the next save makes a new key.
    assert!(matches!(
        restarted.load(&r, ""),
        Err(PersistError::Foreign(_))
    ));
    restarted.save(&r, "", &image()).unwrap();
    assert_ne!(
        std::fs::read(&key_path).unwrap(),
        std::fs::read(&elsewhere).unwrap()
    );
    assert!(restarted.load(&r, "").unwrap().is_some());
}
