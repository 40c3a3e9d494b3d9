//! The store: objects per kind, the event history for watch resume and Exact lists, open
//! watchers.

use super::*;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum EventType {
    Added,
    Modified,
    Deleted,
}

impl EventType {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One write as the store applied it, for [`FakeApiServer::writes`].
#[derive(Debug, Clone)]
pub struct Write {
    pub rv: u64,
    /// `configmaps`, `pods` or `namespaces`.
    pub resource: &'static str,
    /// `ADDED`, `MODIFIED` or `DELETED`.
    pub typ: &'static str,
    /// The object after the write; for a delete its last state stamped with the delete's
    /// resourceVersion (as a watch delivers it).
    pub object: Value,
}

/// One write. `obj` is the object after the write (for DELETED: the last state, stamped with
/// the deletion's resourceVersion, as etcd watch delivers it); `prev` the stored state before.
#[derive(Clone)]
pub(super) struct HistEvent {
    pub(super) rv: u64,
    pub(super) kind: Kind,
    pub(super) key: String,
    pub(super) typ: EventType,
    pub(super) obj: Value,
    pub(super) prev: Option<Value>,
}

#[derive(Clone)]
pub(super) enum WatchMsg {
    Line(Bytes),
    End,
    Abort,
}

pub(super) struct Watcher {
    pub(super) id: u64,
    /// The caller's bearer token (`None`: impersonating, or no token); see
    /// [`super::Faults::expire_watches_of`].
    pub(super) caller: Option<String>,
    pub(super) filter: Filter,
    pub(super) tx: mpsc::UnboundedSender<WatchMsg>,
}

pub(super) struct Store {
    pub(super) rv: u64,
    /// Oldest resourceVersion whose state can still be rebuilt: history holds every event with
    /// `rv > floor`.
    pub(super) floor: u64,
    /// Watches from a resourceVersion below this get 410 while Exact lists there still
    /// work: kube-apiserver's watch cache keeps a window of events, etcd every revision
    /// until compaction ([`super::FakeApiServer::set_watch_window_start`]).
    pub(super) watch_floor: u64,
    pub(super) objects: [BTreeMap<String, Value>; 5],
    pub(super) history: VecDeque<HistEvent>,
    /// Every write ever, for [`FakeApiServer::writes`]; never compacted.
    pub(super) journal: Vec<Write>,
    pub(super) watchers: Vec<Watcher>,
    /// While `Some`, events are kept here instead of reaching watchers (a watch that lags).
    pub(super) held: Option<Vec<HistEvent>>,
    pub(super) next_watcher_id: u64,
    pub(super) next_uid: u64,
}

impl Store {
    pub(super) fn new() -> Store {
        Store {
            rv: 0,
            floor: 0,
            watch_floor: 0,
            objects: Default::default(),
            history: VecDeque::new(),
            journal: Vec::new(),
            watchers: Vec::new(),
            held: None,
            next_watcher_id: 0,
            next_uid: 0,
        }
    }

    pub(super) fn objects(&self, kind: Kind) -> &BTreeMap<String, Value> {
        &self.objects[kind.index()]
    }

    pub(super) fn compact(&mut self, rv: u64) {
        let rv = rv.min(self.rv);
        if rv <= self.floor {
            return;
        }
        self.floor = rv;
        while self.history.front().is_some_and(|e| e.rv <= rv) {
            self.history.pop_front();
        }
    }

    pub(super) fn new_uid(&mut self) -> String {
        self.next_uid += 1;
        // Unique per server and stable in shape; the prefix keeps servers apart.
        static SERVER_NONCE: AtomicU64 = AtomicU64::new(0);
        let nonce = SERVER_NONCE.fetch_add(1, Ordering::Relaxed) & 0xffff;
        format!(
            "{:08x}-{:04x}-4000-8000-{:012x}",
            std::process::id(),
            nonce,
            self.next_uid
        )
    }

    /// Applies one write: bumps the resourceVersion, stamps it, records history and notifies
    /// watchers. `new` is the object to store (`None` deletes). Returns the event's object.
    pub(super) fn write_locked(&mut self, kind: Kind, key: &str, new: Option<Value>) -> Value {
        self.rv += 1;
        let rv = self.rv;
        let map = &mut self.objects[kind.index()];
        let prev = map.get(key).cloned();
        let (typ, obj) = match new {
            Some(mut obj) => {
                set_rv(&mut obj, rv);
                map.insert(key.to_string(), obj.clone());
                let typ = if prev.is_some() {
                    EventType::Modified
                } else {
                    EventType::Added
                };
                (typ, obj)
            }
            None => {
                map.remove(key);
                let mut obj = prev.clone().unwrap_or(Value::Null);
                set_rv(&mut obj, rv);
                (EventType::Deleted, obj)
            }
        };
        let event = HistEvent {
            rv,
            kind,
            key: key.to_string(),
            typ,
            obj: obj.clone(),
            prev,
        };
        match &mut self.held {
            Some(held) => held.push(event.clone()),
            None => self.notify(&event),
        }
        self.journal.push(Write {
            rv,
            resource: kind.resource(),
            typ: typ.as_str(),
            object: obj.clone(),
        });
        self.history.push_back(event);
        if self.history.len() > HISTORY_CAPACITY
            && let Some(old) = self.history.pop_front()
        {
            self.floor = old.rv;
        }
        obj
    }

    /// The objects of `kind` as they were at `rv` (`floor <= rv <= self.rv`).
    pub(super) fn state_at(&self, kind: Kind, rv: u64) -> BTreeMap<String, Value> {
        let mut map = self.objects(kind).clone();
        for e in self.history.iter().rev().take_while(|e| e.rv > rv) {
            if e.kind != kind {
                continue;
            }
            match &e.prev {
                Some(prev) => map.insert(e.key.clone(), prev.clone()),
                None => map.remove(&e.key),
            };
        }
        map
    }

    fn notify(&mut self, event: &HistEvent) {
        self.watchers.retain(|w| match w.filter.convert(event) {
            Some(line) => w.tx.send(WatchMsg::Line(line)).is_ok(),
            None => !w.tx.is_closed(),
        });
    }

    /// The newest resourceVersion whose events watchers have been sent: bookmarks never
    /// claim more (an apiserver's watch cache does not bookmark past what it delivered).
    pub(super) fn delivered_rv(&self) -> u64 {
        match self.held.as_deref() {
            Some([first, ..]) => first.rv - 1,
            _ => self.rv,
        }
    }

    /// Holds (`true`) or releases, in order, the events watchers are sent.
    pub(super) fn hold_events(&mut self, on: bool) {
        if on {
            self.held.get_or_insert_with(Vec::new);
        } else if let Some(held) = self.held.take() {
            for e in &held {
                self.notify(e);
            }
        }
    }

    pub(super) fn end_watchers(&mut self, msg: WatchMsg) {
        for w in self.watchers.drain(..) {
            let _ = w.tx.send(msg.clone());
        }
    }
}

pub(super) fn set_rv(obj: &mut Value, rv: u64) {
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
    }
}
