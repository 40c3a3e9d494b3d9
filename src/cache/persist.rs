//! Warm restart: each cache's state (its objects, resourceVersion and event history) written
//! to a local directory when the proxy stops and read back when it starts, so the restarted
//! proxy resumes its upstream watches from where it stopped (no upstream LIST while etcd has
//! not compacted that far) and its clients resume their watches from it (no 410 Expired, no
//! relist). The Deployment mounts an `emptyDir` there, which survives container restarts.
//!
//! One file per resource, `<group|core>_<version>_<resource>.state`, written under a
//! temporary name, synced and renamed, so a reader sees a whole file or none:
//!
//! ```text
//! "KCPSTATE" | u32 format | u32 header length | header (JSON) | chunks
//!   | SHA-256 of everything before (32 bytes)
//! chunk:    u8 last (0 or 1) | u32 length | bytes (sealed: ciphertext and tag)
//! payload (the chunks' bytes, opened, in order):
//!           u64 objects | per object of the state at the history's start: object
//!           u64 events  | per event: u8 kind, u64 age in ms, object
//! object:   u32 length | body (JSON) | u32 length | protobuf envelope (length 0: none)
//! ```
//!
//! The checksum is written but not read: every file is sealed and its chunks are
//! authenticated (below).
//!
//! All integers are little endian. The header names where the state came from (the
//! upstream's URL, the resource, a custom resource's CRD uid), its resourceVersions and when
//! it was written, and what the protobuf side needs to resume (see [`ProtoImage`]). A file
//! that is partial or corrupt (checksum), of another format, from
//! another upstream, resource or CRD, or older than `cache.stateMaxAge` is ignored with a log
//! line and never served; the cache then lists as on a cold start.
//!
//! Sealing: every file is sealed. The payload is encrypted and authenticated with
//! ChaCha20-Poly1305, chunk by chunk (the header, the chunk's index and whether it is the
//! last are the associated data), so no byte can be changed and no chunk dropped, moved or
//! cut off without the file being refused. The key:
//! - with the continue-token key file (`tokens.keyFile`, shared by the replicas and kept in
//!   a Secret), one derived from it: the node's disk never holds the objects in clear;
//! - without it, a local key ([`LOCAL_KEY`]: 32 random bytes in `<stateDir>/.state-key`,
//!   created 0600 by the first save, exclusively, and reused by later starts; refused unless
//!   it is a regular file of the proxy's own user that nobody else may read or write). It
//!   authenticates the files but lies beside them, so it hides nothing from whoever can read
//!   the directory: Secrets are still saved only with `tokens.keyFile` (without it their
//!   cache lists again after a restart).
//!
//! A file that is not sealed (written by an earlier version without a key file, or edited
//! and its SHA-256 recomputed: a checksum proves nothing against whoever can write the
//! directory) is refused with a warning and never served; that cache starts cold. Without a
//! usable key (the local key file missing, another user's, or readable by others) files are
//! neither written nor read.
//!
//! On disk, whatever the umask: the directory 0700 (an existing one is changed to 0700; if
//! the proxy may not, e.g. a volume owned by root, that is logged once), every file 0600
//! (state, temporaries, the local key). Temporaries have unpredictable names
//! (`<file>.tmp-<random hex>`) and are created exclusively (`O_CREAT|O_EXCL`, which fails on
//! any existing name, a symlink included: nothing planted there is followed or truncated);
//! the rename then replaces the state file itself, never what a symlink there points to.
//! Temporaries left by a crash are removed by a later save of the same resource once they
//! are an hour old.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::{CachedObject, EventKind, Resource};

const MAGIC: &[u8; 8] = b"KCPSTATE";
/// The file layout's version; a file of another is ignored. 2: objects carry their
/// protobuf envelopes.
pub const FORMAT: u32 = 2;
/// A header longer than this is not one of ours.
const MAX_HEADER: usize = 1 << 20;

/// A cache's state as a warm restart needs it ([`super::ResourceCache::image`],
/// [`super::ResourceCache::restore`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// The cache's resourceVersion.
    pub rv: u64,
    /// The history holds every event after this.
    pub oldest_rv: u64,
    /// The last relist after the first sync, if the history starts there.
    pub relist_rv: Option<u64>,
    /// Absorbed relists: (resourceVersion before, the new list's).
    pub absorbed: Vec<(u64, u64)>,
    /// The objects at `oldest_rv`.
    pub base: Vec<Arc<CachedObject>>,
    /// The history after `oldest_rv`, oldest first, with each event's age.
    pub events: Vec<(EventKind, Duration, Arc<CachedObject>)>,
    /// The protobuf side's part; the envelopes themselves travel on the objects
    /// ([`CachedObject::proto`]).
    pub protobuf: ProtoImage,
}

/// What a restarted proxy needs to serve protobuf readers at once, as before it stopped:
/// without it every protobuf watch resuming after a restart would wait for envelopes the new
/// protobuf side never brings (those of history events) and go to the apiserver.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ProtoImage {
    /// The protobuf side had synced and every object of the state at the image's
    /// resourceVersion had its envelope: the side resumes its watch from there (no second
    /// copy of the whole state from the apiserver) and protobuf reads are served at once.
    pub complete: bool,
    /// The side had started (a protobuf reader came): the restarted proxy starts it too.
    pub started: bool,
    /// The kind's protobuf bookmark template, (kind, the bytes after its metadata), as
    /// learnt from the apiserver's bookmarks (`read::watch`).
    pub bookmark: Option<(String, Bytes)>,
}

/// Where and how caches are saved (`cache.stateDir`).
#[derive(Clone)]
pub struct Persist {
    pub dir: PathBuf,
    /// The upstream the state comes from (its URL): a file from another is foreign.
    pub upstream: String,
    /// A file written longer ago than this is ignored.
    pub max_age: Duration,
    /// Sealing keys from `tokens.keyFile`, (id, key): the first seals, any opens. Empty:
    /// files are sealed with the local key ([`LOCAL_KEY`]) and Secrets are not saved.
    pub keys: Vec<(String, [u8; 32])>,
    /// Besides at shutdown, states that changed are saved this often (a crash then loses at
    /// most this much; the restarted proxy catches up with its upstream watch). Zero: only
    /// at shutdown.
    pub save_interval: Duration,
}

/// Saves never overlap (a periodic save still writing when the final one starts must not
/// rename its older state over the final one).
static SAVING: parking_lot::Mutex<()> = parking_lot::Mutex::new(());

impl std::fmt::Debug for Persist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Persist")
            .field("dir", &self.dir)
            .field("upstream", &self.upstream)
            .field("max_age", &self.max_age)
            .field(
                "key",
                &if self.keys.is_empty() {
                    LOCAL_KEY
                } else {
                    "tokens.keyFile"
                },
            )
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("not a saved state of this resource and upstream: {0}")]
    Foreign(String),
    #[error("corrupt or partial: {0}")]
    Corrupt(&'static str),
    #[error("written {age:?} ago, more than cache.stateMaxAge")]
    Stale { age: Duration },
    #[error(
        "not sealed (written by an earlier version without tokens.keyFile, or edited): not trusted"
    )]
    Unsealed,
}

/// What one save wrote.
#[derive(Debug, Clone, Copy)]
pub struct Saved {
    pub bytes: u64,
    pub objects: usize,
    pub events: usize,
}

#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Identity {
    upstream: String,
    group: String,
    version: String,
    resource: String,
    kind: String,
    /// A custom resource's CRD uid (a re-created CRD is another resource), else empty.
    uid: String,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Header {
    identity: Identity,
    rv: u64,
    oldest_rv: u64,
    relist_rv: Option<u64>,
    absorbed: Vec<(u64, u64)>,
    saved_at_unix_ms: u64,
    /// The proxy version that wrote it (for diagnostics; the format decides).
    writer: String,
    /// The sealing key's id and the nonce (hex), when sealed.
    sealed: Option<(String, String)>,
    /// [`ProtoImage::complete`].
    #[serde(default)]
    protobuf_complete: bool,
    /// [`ProtoImage::started`].
    #[serde(default)]
    protobuf_started: bool,
    /// [`ProtoImage::bookmark`]: (kind, base64 of the bytes).
    #[serde(default)]
    protobuf_bookmark: Option<(String, String)>,
}

fn kind_byte(k: EventKind) -> u8 {
    match k {
        EventKind::Added => 1,
        EventKind::Modified => 2,
        EventKind::Deleted => 3,
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

impl Persist {
    /// The state file of `r`.
    pub fn path(&self, r: &Resource) -> PathBuf {
        let group = if r.group.is_empty() { "core" } else { &r.group };
        self.dir
            .join(format!("{group}_{}_{}.state", r.version, r.resource))
    }

    /// Whether `r`'s state may be written: everything when files are sealed; not Secrets in
    /// clear.
    pub fn may_save(&self, r: &Resource) -> bool {
        !(self.keys.is_empty() && r.group.is_empty() && r.resource == "secrets")
    }

    fn identity(&self, r: &Resource, uid: &str) -> Identity {
        Identity {
            upstream: self.upstream.clone(),
            group: r.group.clone(),
            version: r.version.clone(),
            resource: r.resource.clone(),
            kind: r.kind.clone(),
            uid: uid.to_string(),
        }
    }

    /// Makes the state directory 0700 whatever the umask: created so (with `create`, its
    /// missing parents too), an existing one changed. One the proxy may not change (a volume
    /// owned by another user) is logged once and used as it is: its files are 0600 and
    /// sealed, and a local key there must be the proxy's own.
    fn private_dir(&self, create: bool) -> std::io::Result<()> {
        use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
        if create {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.dir)?;
        }
        let mode = match std::fs::metadata(&self.dir) {
            Ok(m) => m.permissions().mode() & 0o7777,
            Err(e) if !create && e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        if mode != 0o700
            && let Err(e) =
                std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
        {
            static WARNED: std::sync::atomic::AtomicBool =
                std::sync::atomic::AtomicBool::new(false);
            if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(dir = %self.dir.display(), mode = %format!("{mode:04o}"), error = %e, "cache.stateDir: cannot make the directory private (0700); its files are 0600 and sealed");
            }
        }
        Ok(())
    }

    /// The local sealing key, (id, key), used when `tokens.keyFile` is not set: read from
    /// [`LOCAL_KEY`] in the state directory; `None` when there is none, unless `create`,
    /// which makes one (32 random bytes, 0600, written whole under a temporary name and
    /// linked to its name, which fails if it exists: a reader sees a whole key or none, and
    /// of two proxies making one at once, one key wins and both use it).
    fn local_key(&self, create: bool) -> Result<Option<(String, [u8; 32])>, PersistError> {
        use std::io::Write as _;
        let path = self.dir.join(LOCAL_KEY);
        let io = |source| PersistError::Io {
            path: path.clone(),
            source,
        };
        match read_local_key(&path, &self.dir) {
            Ok(key) => return Ok(Some(local_key_id(key))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && create => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io(e)),
        }
        let mut key = [0u8; 32];
        random(&mut key)?;
        let (tmp, mut file) = create_temporary(&path).map_err(io)?;
        let made = file
            .write_all(&key)
            .and_then(|()| file.sync_all())
            .and_then(|()| std::fs::hard_link(&tmp, &path));
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        match made {
            Ok(()) => {
                sync_dir(&self.dir);
                tracing::info!(path = %path.display(), "cache state: made a local sealing key (no tokens.keyFile)");
                Ok(Some(local_key_id(key)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                read_local_key(&path, &self.dir)
                    .map(|k| Some(local_key_id(k)))
                    .map_err(io)
            }
            Err(e) => Err(io(e)),
        }
    }

    /// Writes `image` as `r`'s state file (atomically: a temporary file, synced, renamed),
    /// streamed in chunks of about `CHUNK` bytes, so saving holds one chunk beyond the
    /// cache itself. Always sealed: with the first of [`Persist::keys`], else with the
    /// local key (made by the first save).
    pub fn save(&self, r: &Resource, uid: &str, image: &Image) -> Result<Saved, PersistError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| PersistError::Io { path, source }
        };
        self.private_dir(true).map_err(io(&self.dir))?;
        let mut header = Header {
            identity: self.identity(r, uid),
            rv: image.rv,
            oldest_rv: image.oldest_rv,
            relist_rv: image.relist_rv,
            absorbed: image.absorbed.clone(),
            saved_at_unix_ms: unix_ms(SystemTime::now()),
            writer: env!("CARGO_PKG_VERSION").to_string(),
            sealed: None,
            protobuf_complete: image.protobuf.complete,
            protobuf_started: image.protobuf.started,
            protobuf_bookmark: image.protobuf.bookmark.as_ref().map(|(kind, rest)| {
                use base64::Engine as _;
                (
                    kind.clone(),
                    base64::engine::general_purpose::STANDARD.encode(rest),
                )
            }),
        };
        let _one_at_a_time = SAVING.lock();
        let (id, key) = match self.keys.first() {
            Some(k) => k.clone(),
            None => self.local_key(true)?.expect("made when there is none"),
        };
        let mut n = [0u8; ring::aead::NONCE_LEN];
        random(&mut n)?;
        header.sealed = Some((id, hex(&n)));
        let header_json = serde_json::to_vec(&header).expect("the header serializes");

        let path = self.path(r);
        remove_stale_temporaries(&path);
        let (tmp, file) = create_temporary(&path).map_err(io(&path))?;
        let bytes = match write_file(file, &header_json, Some((seal_key(&key), n)), image) {
            Ok(b) => b,
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                return Err(io(&tmp)(e));
            }
        };
        if let Err(e) = std::fs::rename(&tmp, &path) {
            let _ = std::fs::remove_file(&tmp);
            return Err(io(&path)(e));
        }
        sync_dir(&self.dir);
        Ok(Saved {
            bytes,
            objects: image.base.len(),
            events: image.events.len(),
        })
    }

    /// Reads `r`'s state file: `Ok(None)` when there is none; an error (to be logged, the
    /// file ignored) when it is not a whole, current, matching state of `r` from this
    /// upstream.
    pub fn load(&self, r: &Resource, uid: &str) -> Result<Option<Image>, PersistError> {
        let path = self.path(r);
        self.private_dir(false).map_err(|source| PersistError::Io {
            path: self.dir.clone(),
            source,
        })?;
        let file = match std::fs::read(&path) {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(PersistError::Io { path, source }),
        };
        self.decode(r, uid, file, SystemTime::now()).map(Some)
    }

    /// Decodes a whole file. The payload is assembled in the file's own buffer (each chunk,
    /// opened in place, moved down over the chunk headers before it): with 100,000 objects,
    /// fresh memory the kernel must zero was most of a warm start's time (`perf`:
    /// `clear_page_erms` 58% of the samples), and this spares one copy of the file. A file
    /// that is not sealed is refused ([`PersistError::Unsealed`]); a sealed one is not
    /// hashed: every chunk is authenticated, with the header, its index and whether it is
    /// the last, which the checksum would only repeat (`perf`: SHA-256 was 42% of a sealed
    /// load). Chunks are opened, and objects parsed, on every core
    /// ([`par_map`]): a warm start waits for its largest file.
    fn decode(
        &self,
        r: &Resource,
        uid: &str,
        mut file: Vec<u8>,
        now: SystemTime,
    ) -> Result<Image, PersistError> {
        if file.len() < MAGIC.len() + 4 || &file[..MAGIC.len()] != MAGIC {
            return Err(PersistError::Foreign("not a state file".into()));
        }
        let mut rd = Reader(&file[MAGIC.len()..]);
        let format = rd.u32()?;
        if format != FORMAT {
            return Err(PersistError::Foreign(format!(
                "format {format}, this proxy reads {FORMAT}"
            )));
        }
        if file.len() < 32 + MAGIC.len() + 8 {
            return Err(PersistError::Corrupt("too short"));
        }
        let content_len = file.len() - 32;
        let mut rd = Reader(&file[MAGIC.len() + 4..content_len]);
        let hlen = rd.u32()? as usize;
        if hlen > MAX_HEADER {
            return Err(PersistError::Corrupt("header too long"));
        }
        let header_json = rd.take(hlen)?.to_vec();
        let chunks_at = content_len - rd.0.len();
        // Nothing in the header is trusted before the chunks are opened (they authenticate
        // it); until then it only decides to refuse the file. A file that is not sealed is
        // refused whatever its checksum: anyone who can write the directory can recompute it.
        let header: Header =
            serde_json::from_slice(&header_json).map_err(|_| PersistError::Corrupt("header"))?;
        let Some((key_id, nonce)) = header.sealed.clone() else {
            return Err(PersistError::Unsealed);
        };
        file.truncate(content_len);
        let want = self.identity(r, uid);
        if header.identity != want {
            return Err(PersistError::Foreign(format!(
                "saved from {:?}, this cache is {want:?}",
                header.identity
            )));
        }
        let saved_at = UNIX_EPOCH + Duration::from_millis(header.saved_at_unix_ms);
        let age = now.duration_since(saved_at).unwrap_or_default();
        if age > self.max_age {
            return Err(PersistError::Stale { age });
        }
        let key = if self.keys.is_empty() {
            match self.local_key(false)? {
                Some((id, key)) if id == key_id => key,
                found => {
                    return Err(PersistError::Foreign(format!(
                        "sealed with key {key_id:?}; no tokens.keyFile, and the local key ({}) is {}",
                        self.dir.join(LOCAL_KEY).display(),
                        found.map_or("missing".to_string(), |(id, _)| format!("{id:?}"))
                    )));
                }
            }
        } else {
            match self.keys.iter().find(|(k, _)| *k == key_id) {
                Some((_, key)) => *key,
                None => {
                    return Err(PersistError::Foreign(format!(
                        "sealed with key {key_id:?}, not in tokens.keyFile"
                    )));
                }
            }
        };
        let n: [u8; ring::aead::NONCE_LEN] = unhex(&nonce)
            .and_then(|v| v.try_into().ok())
            .ok_or(PersistError::Corrupt("nonce"))?;
        let (key, base) = (seal_key(&key), n);
        // Where the chunks are: (start, stop) of each one's bytes.
        let mut chunks = Vec::new();
        let mut at = chunks_at;
        loop {
            let head = file
                .get(at..at + 5)
                .ok_or(PersistError::Corrupt("truncated"))?;
            let last = match head[0] {
                0 => false,
                1 => true,
                _ => return Err(PersistError::Corrupt("chunk flag")),
            };
            let len = u32::from_le_bytes(head[1..5].try_into().expect("4 bytes")) as usize;
            let start = at + 5;
            let stop = start
                .checked_add(len)
                .filter(|e| *e <= file.len())
                .ok_or(PersistError::Corrupt("truncated"))?;
            chunks.push((start, stop));
            at = stop;
            if last {
                break;
            }
        }
        if at != file.len() {
            return Err(PersistError::Corrupt("trailing bytes"));
        }
        // Each chunk opened in place, under its own nonce, with its index and whether it is
        // the last in the associated data (so none can be dropped, reordered or cut off). The
        // plain bytes of each: (start, length).
        let plain: Vec<(usize, usize)> = {
            let (key, base) = (&key, &base);
            let count = chunks.len() as u64;
            let mut rest = &mut file[chunks_at..];
            let mut offset = chunks_at;
            let mut work = Vec::with_capacity(chunks.len());
            for (index, &(start, stop)) in (0u64..).zip(&chunks) {
                let (before, tail) = std::mem::take(&mut rest).split_at_mut(stop - offset);
                work.push((index, start, &mut before[start - offset..]));
                rest = tail;
                offset = stop;
            }
            let header_json = &header_json;
            par_map(work, 1, |(index, start, bytes)| {
                let aad = chunk_aad(header_json, index, index + 1 == count);
                key.open_in_place(chunk_nonce(base, index), ring::aead::Aad::from(aad), bytes)
                    .map(|p| (start, p.len()))
                    .map_err(|_| PersistError::Corrupt("does not open with its key"))
            })
            .into_iter()
            .collect::<Result<_, _>>()?
        };
        // The payload goes to `chunks_at..end`, each chunk's bytes moved down over the
        // headers (and, sealed, tags) before them: it never overtakes what it reads.
        let mut end = chunks_at;
        for (start, len) in plain {
            file.copy_within(start..start + len, end);
            end += len;
        }
        let payload = &file[chunks_at..end];
        // The records, in one pass over the lengths; then the objects, parsed on every core.
        let mut rd = Reader(payload);
        let n = rd.u64()?;
        let mut records = Vec::with_capacity(usize::try_from(n.min(1 << 20)).unwrap_or(0));
        for _ in 0..n {
            records.push(Record::read(&mut rd, payload)?);
        }
        let n = rd.u64()?;
        let mut events = Vec::with_capacity(usize::try_from(n.min(1 << 20)).unwrap_or(0));
        for _ in 0..n {
            let kind = match rd.take(1)?[0] {
                1 => EventKind::Added,
                2 => EventKind::Modified,
                3 => EventKind::Deleted,
                _ => return Err(PersistError::Corrupt("event kind")),
            };
            let age = Duration::from_millis(rd.u64()?) + age;
            events.push((kind, age));
            records.push(Record::read(&mut rd, payload)?);
        }
        if !rd.0.is_empty() {
            return Err(PersistError::Corrupt("trailing payload"));
        }
        let api_version = r.api_version();
        let mut objects = par_map(records, 4096, |rec| {
            let o = CachedObject::parse(Bytes::copy_from_slice(&payload[rec.body]), r)
                .map_err(|_| PersistError::Corrupt("an object does not parse"))?;
            if !rec.envelope.is_empty() {
                // Served to protobuf readers as it is: it must be one of this resource's.
                let envelope = Bytes::copy_from_slice(&payload[rec.envelope]);
                match crate::k8s::protobuf::envelope(&envelope) {
                    Some(e) if e.kind == r.kind && e.api_version == api_version => {}
                    _ => return Err(PersistError::Corrupt("a protobuf envelope")),
                }
                o.proto.set(envelope);
            }
            Ok(Arc::new(o))
        })
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        let first_event = objects.len() - events.len();
        let events = events
            .into_iter()
            .zip(objects.drain(first_event..))
            .map(|((kind, age), o)| (kind, age, o))
            .collect();
        let bookmark = match header.protobuf_bookmark {
            None => None,
            Some((kind, rest)) => {
                use base64::Engine as _;
                let rest = base64::engine::general_purpose::STANDARD
                    .decode(rest)
                    .map_err(|_| PersistError::Corrupt("the protobuf bookmark"))?;
                Some((kind, Bytes::from(rest)))
            }
        };
        Ok(Image {
            rv: header.rv,
            oldest_rv: header.oldest_rv,
            relist_rv: header.relist_rv,
            absorbed: header.absorbed,
            base: objects,
            events,
            protobuf: ProtoImage {
                complete: header.protobuf_complete,
                started: header.protobuf_started,
                bookmark,
            },
        })
    }
}

/// Writes a state file to `file`: the header, the payload in chunks (sealed with `seal`;
/// `None` only in tests, for the files earlier versions wrote without a key), the
/// checksum, then syncs it. The bytes written.
fn write_file(
    file: std::fs::File,
    header_json: &[u8],
    seal: Option<(ring::aead::LessSafeKey, [u8; ring::aead::NONCE_LEN])>,
    image: &Image,
) -> std::io::Result<u64> {
    let mut w = Chunks {
        out: std::io::BufWriter::with_capacity(1 << 20, file),
        sha: Sha256::new(),
        written: 0,
        buf: Vec::with_capacity(CHUNK + (64 << 10)),
        seal,
        aad: header_json.to_vec(),
        index: 0,
    };
    let head = [
        &MAGIC[..],
        &FORMAT.to_le_bytes(),
        &(header_json.len() as u32).to_le_bytes(),
        header_json,
    ];
    for part in head {
        w.emit(part)?;
    }
    w.put(&(image.base.len() as u64).to_le_bytes())?;
    // Envelopes only of a side that runs (a shed one's history keeps some for a while).
    let with_protobuf = image.protobuf.started;
    let object = |w: &mut Chunks<_>, o: &CachedObject| {
        w.put(&body_len(o))?;
        w.put(&o.body)?;
        let envelope = match o.proto.get() {
            Some(b) if with_protobuf => &b[..],
            _ => &[][..],
        };
        w.put(&len_u32(envelope.len()))?;
        w.put(envelope)
    };
    for o in &image.base {
        object(&mut w, o)?;
    }
    w.put(&(image.events.len() as u64).to_le_bytes())?;
    for (kind, age, o) in &image.events {
        w.put(&[kind_byte(*kind)])?;
        let ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
        w.put(&ms.to_le_bytes())?;
        object(&mut w, o)?;
    }
    w.finish()
}

/// The local sealing key's file in the state directory, used when `tokens.keyFile` is not
/// set (see the module's documentation).
pub const LOCAL_KEY: &str = ".state-key";

/// How old a save's leftover temporary must be to be removed: no save takes that long.
const STALE_TEMPORARY: Duration = Duration::from_secs(3600);

fn random(buf: &mut [u8]) -> Result<(), PersistError> {
    ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), buf)
        .map_err(|_| PersistError::Corrupt("the system random source failed"))
}

/// A new file `<path>.tmp-<random hex>`, 0600 whatever the umask, created exclusively
/// (`O_CREAT|O_EXCL`): an existing name, a symlink included (dangling or not), fails
/// instead of being followed or truncated, and the name cannot be guessed beforehand.
fn create_temporary(path: &Path) -> std::io::Result<(PathBuf, std::fs::File)> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut suffix = [0u8; 12];
    random(&mut suffix).map_err(std::io::Error::other)?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}", hex(&suffix)));
    let tmp = path.with_file_name(name);
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    // The umask can only have removed bits; this makes it exactly 0600.
    if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(0o600)) {
        drop(file);
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok((tmp, file))
}

/// Removes what crashed saves of `path` left: its temporaries older than
/// [`STALE_TEMPORARY`], and the fixed-name one of earlier versions (`<path>.tmp`). Regular
/// files only: anything else there (a symlink) is left alone, never followed.
fn remove_stale_temporaries(path: &Path) {
    let (Some(dir), Some(name)) = (path.parent(), path.file_name().and_then(|n| n.to_str())) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let old = format!("{name}.tmp");
    let ours = format!("{name}.tmp-");
    for e in entries.flatten() {
        let n = e.file_name();
        let Some(n) = n.to_str() else {
            continue;
        };
        if n != old && !n.starts_with(&ours) {
            continue;
        }
        // Not followed: the entry's own type.
        let Ok(m) = e.metadata() else {
            continue;
        };
        let aged = m
            .modified()
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > STALE_TEMPORARY);
        if m.file_type().is_file() && (n == old || aged) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The local key's id (in the files' headers): a hash of the key, so a file sealed with
/// another local key is told apart from a damaged one.
fn local_key_id(key: [u8; 32]) -> (String, [u8; 32]) {
    let h = Sha256::new()
        .chain_update(b"kube-cache-proxy/cache-state/local-key-id\0")
        .chain_update(key)
        .finalize();
    (format!("local:{}", hex(&h[..8])), key)
}

/// Reads the local key file, refusing anything but a regular file (not a symlink) of 32
/// bytes, owned by the proxy's user, that nobody else may read or write: a key someone else
/// could have planted or read would let them forge a state that is then served.
fn read_local_key(path: &Path, dir: &Path) -> std::io::Result<[u8; 32]> {
    use std::io::Read as _;
    use std::os::unix::fs::MetadataExt;
    let bad = |why: String| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{why}; the local key must be a regular file of 32 bytes, mode 0600, owned by \
                 the proxy's user (removing it makes the next save create a new one; the \
                 states sealed with it are then refused)"
            ),
        )
    };
    let link = std::fs::symlink_metadata(path)?;
    if !link.file_type().is_file() {
        return Err(bad("not a regular file".into()));
    }
    let mut file = std::fs::File::open(path)?;
    let meta = file.metadata()?;
    if (meta.dev(), meta.ino()) != (link.dev(), link.ino()) {
        return Err(bad("replaced while being opened".into()));
    }
    let own = own_uid(dir)?;
    if meta.uid() != own {
        return Err(bad(format!("owned by uid {}, not {own}", meta.uid())));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(bad(format!("mode {:04o}", meta.mode() & 0o7777)));
    }
    if meta.len() != 32 {
        return Err(bad(format!("{} bytes", meta.len())));
    }
    let mut key = [0u8; 32];
    file.read_exact(&mut key)?;
    Ok(key)
}

/// The proxy's user as the file system records it: the owner of a file it creates in `dir`
/// (std has no `geteuid`, and this crate forbids `unsafe`). Found once.
fn own_uid(dir: &Path) -> std::io::Result<u32> {
    use std::os::unix::fs::MetadataExt;
    static UID: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    if let Some(uid) = UID.get() {
        return Ok(*uid);
    }
    let (probe, file) = create_temporary(&dir.join(".uid-probe"))?;
    let uid = file.metadata().map(|m| m.uid());
    drop(file);
    let _ = std::fs::remove_file(&probe);
    let uid = uid?;
    Ok(*UID.get_or_init(|| uid))
}

/// Where one object's body and protobuf envelope (empty: none) are in the payload.
struct Record {
    body: std::ops::Range<usize>,
    envelope: std::ops::Range<usize>,
}

impl Record {
    fn read(rd: &mut Reader<'_>, payload: &[u8]) -> Result<Record, PersistError> {
        let range = |rd: &mut Reader<'_>| -> Result<std::ops::Range<usize>, PersistError> {
            let len = rd.u32()? as usize;
            let start = payload.len() - rd.0.len();
            rd.take(len)?;
            Ok(start..start + len)
        };
        Ok(Record {
            body: range(rd)?,
            envelope: range(rd)?,
        })
    }
}

/// `items.map(f)` in order, on up to four threads (this one and scoped helpers) when there
/// are at least `min_per_thread` items for each.
fn par_map<T: Send, U: Send>(
    mut items: Vec<T>,
    min_per_thread: usize,
    f: impl Fn(T) -> U + Sync,
) -> Vec<U> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = cores.min(4).min(items.len() / min_per_thread.max(1)).max(1);
    if threads == 1 {
        return items.into_iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut parts = Vec::with_capacity(threads - 1);
    while items.len() > per {
        parts.push(items.split_off(items.len() - per));
    }
    parts.reverse();
    std::thread::scope(|s| {
        let f = &f;
        let helpers: Vec<_> = parts
            .into_iter()
            .map(|part| s.spawn(move || part.into_iter().map(f).collect::<Vec<U>>()))
            .collect();
        let mut out: Vec<U> = items.into_iter().map(f).collect();
        for h in helpers {
            out.extend(h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
        }
        out
    })
}

/// Payload bytes per chunk (sealed and written one at a time).
const CHUNK: usize = 4 << 20;

fn body_len(o: &CachedObject) -> [u8; 4] {
    len_u32(o.body.len())
}

fn len_u32(n: usize) -> [u8; 4] {
    u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes()
}

/// The nonce of chunk `index`: the file's random nonce with the index in its last 8 bytes.
fn chunk_nonce(base: &[u8; ring::aead::NONCE_LEN], index: u64) -> ring::aead::Nonce {
    let mut n = *base;
    for (b, i) in n[4..].iter_mut().zip(index.to_le_bytes()) {
        *b ^= i;
    }
    ring::aead::Nonce::assume_unique_for_key(n)
}

fn chunk_aad(header: &[u8], index: u64, last: bool) -> Vec<u8> {
    let mut a = Vec::with_capacity(header.len() + 9);
    a.extend_from_slice(header);
    a.extend_from_slice(&index.to_le_bytes());
    a.push(u8::from(last));
    a
}

/// The file as it is written: everything hashed; the payload in chunks (`u8 last`, `u32
/// length`, bytes), each sealed when a key is set.
struct Chunks<W: std::io::Write> {
    out: W,
    sha: Sha256,
    written: u64,
    buf: Vec<u8>,
    seal: Option<(ring::aead::LessSafeKey, [u8; ring::aead::NONCE_LEN])>,
    aad: Vec<u8>,
    index: u64,
}

impl<W: std::io::Write> Chunks<W> {
    fn emit(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.sha.update(b);
        self.written += b.len() as u64;
        self.out.write_all(b)
    }

    fn put(&mut self, b: &[u8]) -> std::io::Result<()> {
        self.buf.extend_from_slice(b);
        if self.buf.len() >= CHUNK {
            self.chunk(false)?;
        }
        Ok(())
    }

    fn chunk(&mut self, last: bool) -> std::io::Result<()> {
        let mut data = std::mem::take(&mut self.buf);
        if let Some((key, base)) = &self.seal {
            key.seal_in_place_append_tag(
                chunk_nonce(base, self.index),
                ring::aead::Aad::from(chunk_aad(&self.aad, self.index, last)),
                &mut data,
            )
            .map_err(|_| std::io::Error::other("sealing failed"))?;
        }
        let len =
            u32::try_from(data.len()).map_err(|_| std::io::Error::other("chunk too large"))?;
        self.emit(&[u8::from(last)])?;
        self.emit(&len.to_le_bytes())?;
        self.emit(&data)?;
        data.clear();
        self.buf = data;
        self.index += 1;
        Ok(())
    }

    /// The last chunk, the checksum, then the file synced: the bytes written.
    fn finish(mut self) -> std::io::Result<u64>
    where
        W: IntoFile,
    {
        self.chunk(true)?;
        let sum = std::mem::take(&mut self.sha).finalize();
        self.out.write_all(&sum)?;
        self.out.into_file()?.sync_all()?;
        Ok(self.written + 32)
    }
}

/// The file under a buffered writer, flushed.
trait IntoFile {
    fn into_file(self) -> std::io::Result<std::fs::File>;
}

impl IntoFile for std::io::BufWriter<std::fs::File> {
    fn into_file(self) -> std::io::Result<std::fs::File> {
        self.into_inner()
            .map_err(std::io::IntoInnerError::into_error)
    }
}

/// The ChaCha20-Poly1305 key of a 32-byte secret.
fn seal_key(key: &[u8; 32]) -> ring::aead::LessSafeKey {
    ring::aead::LessSafeKey::new(
        ring::aead::UnboundKey::new(&ring::aead::CHACHA20_POLY1305, key)
            .expect("a 32-byte ChaCha20-Poly1305 key"),
    )
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Bounds-checked reads of the file's fields.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], PersistError> {
        if self.0.len() < n {
            return Err(PersistError::Corrupt("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32, PersistError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64, PersistError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
}

#[cfg(test)]
mod tests {
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
}
