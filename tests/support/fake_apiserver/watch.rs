//! Watch: filters, event framing, bookmarks, the watch stream.

use super::*;

/// What a watcher receives: kind, namespace scope and selectors.
pub(super) struct Filter {
    pub(super) kind: Kind,
    /// Only events after this resourceVersion (a watch from a future resourceVersion waits).
    pub(super) after_rv: u64,
    pub(super) namespace: Option<String>,
    pub(super) labels: LabelSelector,
    pub(super) fields: FieldSelector,
}

impl Filter {
    pub(super) fn matches(&self, obj: &Value) -> bool {
        if let Some(ns) = &self.namespace
            && meta_str(obj, "namespace") != Some(ns.as_str())
        {
            return false;
        }
        self.labels.matches(obj) && self.fields.matches(obj)
    }

    /// The watch line this watcher sees for `e`, following the cacher's rules: an object that
    /// starts matching arrives as ADDED, one that stops matching as DELETED.
    pub(super) fn convert(&self, e: &HistEvent) -> Option<Bytes> {
        if e.kind != self.kind || e.rv <= self.after_rv {
            return None;
        }
        let cur = e.typ != EventType::Deleted && self.matches(&e.obj);
        let old = match e.typ {
            EventType::Added => false,
            EventType::Modified => e.prev.as_ref().is_some_and(|p| self.matches(p)),
            EventType::Deleted => self.matches(&e.obj),
        };
        match (old, cur) {
            (false, true) => Some(event_line(EventType::Added.as_str(), &e.obj)),
            (true, true) => Some(event_line(EventType::Modified.as_str(), &e.obj)),
            (true, false) if e.typ == EventType::Deleted => {
                Some(event_line(EventType::Deleted.as_str(), &e.obj))
            }
            (true, false) => {
                // The previous state, stamped with this event's resourceVersion.
                let mut prev = e.prev.clone().unwrap_or(Value::Null);
                set_rv(&mut prev, e.rv);
                Some(event_line(EventType::Deleted.as_str(), &prev))
            }
            (false, false) => None,
        }
    }
}

pub(super) fn event_line(typ: &str, obj: &Value) -> Bytes {
    let mut s = String::with_capacity(64);
    s.push_str("{\"type\":\"");
    s.push_str(typ);
    s.push_str("\",\"object\":");
    s.push_str(&to_json(obj));
    s.push_str("}\n");
    Bytes::from(s)
}

pub(super) fn bookmark_line(kind: Kind, rv: u64, initial_events_end: bool) -> Bytes {
    let mut meta = JsonObj::new().str("resourceVersion", &rv.to_string());
    if initial_events_end {
        meta = meta.raw("annotations", r#"{"k8s.io/initial-events-end":"true"}"#);
    }
    let obj = JsonObj::new()
        .str("kind", kind.kind())
        .str("apiVersion", kind.api_version())
        .raw("metadata", &meta.finish())
        .finish();
    Bytes::from(format!("{{\"type\":\"BOOKMARK\",\"object\":{obj}}}\n"))
}

pub(super) async fn watch(
    shared: &Arc<Shared>,
    kind: Kind,
    namespace: Option<String>,
    p: ListParams,
    caller: Option<String>,
) -> Result<Response<Body>, Status> {
    if p.send_initial == Some(true)
        && let Some(n) = p.rv.filter(|n| *n > 0)
    {
        wait_for_rv(shared, n).await?;
    }
    let mut filter = Filter {
        kind,
        after_rv: 0,
        namespace,
        labels: p.labels,
        fields: p.fields,
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let id;
    let start_rv;
    {
        let mut store = shared.store();
        id = store.next_watcher_id;
        store.next_watcher_id += 1;
        let initial_events = match p.send_initial {
            Some(send) => send,
            None => p.rv.is_none_or(|n| n == 0),
        };
        let mut registered = true;
        filter.after_rv = store.rv;
        if initial_events {
            for obj in store.objects(kind).values().filter(|o| filter.matches(o)) {
                let _ = tx.send(WatchMsg::Line(event_line("ADDED", obj)));
            }
            // kube-apiserver 1.36 ends initial events with this bookmark whenever bookmarks
            // are allowed, also for RV unset / "0" watches without sendInitialEvents.
            if p.allow_bookmarks {
                // At the state's own resourceVersion: the initial events are the current
                // objects, also while events are held back from watchers.
                let _ = tx.send(WatchMsg::Line(bookmark_line(kind, store.rv, true)));
            }
        } else if let Some(n) = p.rv.filter(|n| *n > 0) {
            let floor = store.floor.max(store.watch_floor);
            if n < floor {
                let status = Status::expired(&format!("too old resource version: {n} ({floor})"));
                let obj: Value = serde_json::from_str(&status.to_json()).unwrap_or(Value::Null);
                let _ = tx.send(WatchMsg::Line(event_line("ERROR", &obj)));
                let _ = tx.send(WatchMsg::End);
                registered = false;
            } else {
                filter.after_rv = n;
                // Held events reach this watcher when they are released.
                let delivered = store.delivered_rv();
                for e in store
                    .history
                    .iter()
                    .filter(|e| e.rv > n && e.rv <= delivered)
                {
                    if let Some(line) = filter.convert(e) {
                        let _ = tx.send(WatchMsg::Line(line));
                    }
                }
            }
        }
        start_rv = filter.after_rv;
        // Refusing (an apiserver restart): a watch that passed the check at the request's
        // start but registers only now, after `drop_watches` ended the others under this
        // lock, is cut too, so no watch outlives the fault.
        if shared.refuse.load(Ordering::SeqCst) {
            let _ = tx.send(WatchMsg::Abort);
            registered = false;
        }
        if registered {
            store.watchers.push(Watcher {
                id,
                caller,
                filter,
                tx: tx.clone(),
            });
        }
    }
    let now = Instant::now();
    let state = WatchStream {
        rx,
        tx,
        shared: shared.clone(),
        id,
        kind,
        start_rv,
        bookmarks: p.allow_bookmarks,
        last_bookmark: now,
        interval: shared.bookmark_interval.subscribe(),
        pre_deadline_bookmark: p
            .timeout
            .filter(|t| *t > PRE_DEADLINE_BOOKMARK)
            .map(|t| after(now, t - PRE_DEADLINE_BOOKMARK)),
        deadline: p.timeout.map(|t| after(now, t)),
        done: false,
    };
    let stream = futures_util::stream::unfold(state, |mut ws| async move {
        let item = ws.next_item().await?;
        Some((item, ws))
    });
    let body = StreamBody::new(stream.boxed()).boxed_unsync();
    let mut resp = Response::new(body);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    add_common_headers(resp.headers_mut());
    Ok(resp)
}

/// Stands in for "never" in timers.
pub(super) const FAR_FUTURE: Duration = Duration::from_secs(86_400 * 365);

/// `t + d`, saturating far in the future instead of overflowing on absurd inputs.
pub(super) fn after(t: Instant, d: Duration) -> Instant {
    t.checked_add(d.min(FAR_FUTURE))
        .unwrap_or_else(|| t + Duration::from_secs(86_400))
}

/// The state of one open watch response body.
pub(super) struct WatchStream {
    pub(super) rx: mpsc::UnboundedReceiver<WatchMsg>,
    /// For bookmarks: they are queued under the store lock so they never overtake an event.
    pub(super) tx: mpsc::UnboundedSender<WatchMsg>,
    pub(super) shared: Arc<Shared>,
    pub(super) id: u64,
    pub(super) kind: Kind,
    /// The resourceVersion the watch starts after.
    pub(super) start_rv: u64,
    pub(super) bookmarks: bool,
    /// When the last periodic bookmark was sent (the watch's start before the first).
    pub(super) last_bookmark: Instant,
    /// The bookmark period ([`Shared::bookmark_interval`]): a change applies at once.
    pub(super) interval: tokio::sync::watch::Receiver<Duration>,
    pub(super) pre_deadline_bookmark: Option<Instant>,
    pub(super) deadline: Option<Instant>,
    pub(super) done: bool,
}

impl WatchStream {
    pub(super) async fn next_item(&mut self) -> Option<Result<Frame<Bytes>, BoxError>> {
        if self.done {
            return None;
        }
        loop {
            let far = after(Instant::now(), FAR_FUTURE);
            let next_bookmark = after(self.last_bookmark, *self.interval.borrow_and_update());
            let bookmark_at = match self.pre_deadline_bookmark {
                Some(pre) if pre < next_bookmark => pre,
                _ => next_bookmark,
            };
            tokio::select! {
                biased;
                msg = self.rx.recv() => match msg {
                    Some(WatchMsg::Line(line)) => return Some(Ok(Frame::data(line))),
                    Some(WatchMsg::End) | None => {
                        self.finish();
                        return None;
                    }
                    Some(WatchMsg::Abort) => {
                        self.finish();
                        return Some(Err("watch dropped by fault injection".into()));
                    }
                },
                _ = tokio::time::sleep_until(self.deadline.unwrap_or(far)) => {
                    self.finish();
                    return None;
                }
                // A new period: the next bookmark is due at another time. (The sender lives
                // in `shared`, which this stream holds: `changed` never fails.)
                _ = self.interval.changed(), if self.bookmarks => {}
                _ = tokio::time::sleep_until(bookmark_at), if self.bookmarks => {
                    let store = self.shared.store();
                    let now = Instant::now();
                    if self.pre_deadline_bookmark.is_some_and(|pre| pre <= now) {
                        self.pre_deadline_bookmark = None;
                    } else if after(self.last_bookmark, *self.shared.bookmark_interval.borrow())
                        <= now
                    {
                        self.last_bookmark = now;
                    } else {
                        // The period grew after this timer was set, and the new one is read
                        // under the store lock: a write made after `set_bookmark_interval`
                        // returned never reaches a bookmark the new period does not call for.
                        continue;
                    }
                    // Queued while holding the lock: every event up to store.rv is already
                    // in the queue ahead of it.
                    // Never below where the watch started (a watch from a future resourceVersion).
                    let rv = store.delivered_rv().max(self.start_rv);
                    let _ = self.tx.send(WatchMsg::Line(bookmark_line(self.kind, rv, false)));
                }
            }
        }
    }

    pub(super) fn finish(&mut self) {
        self.done = true;
        let id = self.id;
        self.shared.store().watchers.retain(|w| w.id != id);
    }
}

impl Drop for WatchStream {
    fn drop(&mut self) {
        if !self.done {
            self.finish();
        }
    }
}
