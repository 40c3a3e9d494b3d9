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
//!           u64 length | the table side (JSON, `table::TableImage`; length 0: none)
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

use super::table::TableImage;
use super::{CachedObject, EventKind, Resource};

const MAGIC: &[u8; 8] = b"KCPSTATE";
/// The file layout's version; a file of another is ignored. 2: objects carry their
/// protobuf envelopes; 3: the table side follows the events (a file of 2 is read, without
/// one).
pub const FORMAT: u32 = 3;
/// The oldest layout still read.
const FORMAT_READ: u32 = 2;
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
    /// The table side's columns and rows, when it had synced.
    pub table: Option<TableImage>,
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
        self.save_format(r, uid, image, FORMAT)
    }

    /// [`Persist::save`] in the layout of `format` (tests write the previous one).
    fn save_format(
        &self,
        r: &Resource,
        uid: &str,
        image: &Image,
        format: u32,
    ) -> Result<Saved, PersistError> {
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
        let seal = Some((seal_key(&key), n));
        let bytes = match write_file(file, &header_json, seal, image, format) {
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
        if !(FORMAT_READ..=FORMAT).contains(&format) {
            return Err(PersistError::Foreign(format!(
                "format {format}, this proxy reads {FORMAT_READ} to {FORMAT}"
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
        let table = if format >= 3 {
            let n = usize::try_from(rd.u64()?).map_err(|_| PersistError::Corrupt("table"))?;
            match rd.take(n)? {
                [] => None,
                t => Some(
                    serde_json::from_slice::<TableImage>(t)
                        .map_err(|_| PersistError::Corrupt("the table side"))?,
                ),
            }
        } else {
            None
        };
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
            table,
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
    format: u32,
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
        &format.to_le_bytes(),
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
    if format >= 3 {
        let table = match &image.table {
            Some(t) => serde_json::to_vec(t).map_err(std::io::Error::other)?,
            None => Vec::new(),
        };
        w.put(&(table.len() as u64).to_le_bytes())?;
        for part in table.chunks(CHUNK) {
            w.put(part)?;
        }
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
mod tests;
