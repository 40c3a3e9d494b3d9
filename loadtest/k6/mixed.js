// Scenario e of the load driver: everything at once. Bounded watchers (as watch.js), churn
// (as churn.js, against the same KUBE_API), paged list walkers (as list.js) and quorum GETs
// (as get.js), each its own k6 scenario, with per-request-kind p99 thresholds.
//
//   SSL_CERT_FILE=ca.crt k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... \
//     -e NAMESPACE=loadtest loadtest/k6/mixed.js
//
// Env: NAMESPACE (loadtest; must exist), DURATION (60s), WATCHERS (250), CHURN_RATE (25),
// GET_RATE (100), LISTERS (2), LIST_LIMIT (100), OBJECTS (50: watched and read objects),
// LIST_OBJECTS (300: listed objects), WATCH_SECONDS (10). WATCH_NS, LIST_NS, GET_NS override
// NAMESPACE per part. setup() creates what it needs if missing, with the load driver's naming:
// w-* (watched, patched), b-* (listed), d-* (read).
import http from 'k6/http';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import { NAMESPACE, baseOptions, collection, continueOf, envInt, nowNanos, params } from './lib/kube.js';

const DURATION = __ENV.DURATION || '60s';
const WATCH_SECONDS = envInt('WATCH_SECONDS', 10);
const OBJECTS = envInt('OBJECTS', 50);
const LIST_OBJECTS = envInt('LIST_OBJECTS', 300);
const LIST_LIMIT = envInt('LIST_LIMIT', 100);
const WATCH_NS = __ENV.WATCH_NS || NAMESPACE;
const LIST_NS = __ENV.LIST_NS || NAMESPACE;
const GET_NS = __ENV.GET_NS || NAMESPACE;
const events = new Counter('watch_events');
const errors = new Counter('watch_error_events');

export const options = Object.assign(baseOptions(), {
  scenarios: {
    watchers: { executor: 'constant-vus', vus: envInt('WATCHERS', 250), duration: DURATION, exec: 'watcher' },
    churn: {
      executor: 'constant-arrival-rate', rate: envInt('CHURN_RATE', 25), timeUnit: '1s',
      duration: DURATION, preAllocatedVUs: 10, maxVUs: 200, exec: 'churn',
    },
    lists: { executor: 'constant-vus', vus: envInt('LISTERS', 2), duration: DURATION, exec: 'lister' },
    gets: {
      executor: 'constant-arrival-rate', rate: envInt('GET_RATE', 100), timeUnit: '1s',
      duration: DURATION, preAllocatedVUs: 20, maxVUs: 500, exec: 'getter',
    },
  },
  thresholds: {
    'http_req_waiting{name:watch}': [`p(99)<${envInt('WATCH_P99_MS', 2000)}`],
    'http_req_duration{name:patch}': [`p(99)<${envInt('PATCH_P99_MS', 300)}`],
    'http_req_duration{name:list-page}': [`p(99)<${envInt('LIST_P99_MS', 1000)}`],
    'http_req_duration{name:get}': [`p(99)<${envInt('GET_P99_MS', 200)}`],
    watch_error_events: ['count==0'],
    checks: ['rate==1'],
  },
});

/// Creates `prefix-0` .. `prefix-(n-1)` in `ns` unless they exist (201 or 409).
function ensure(ns, prefix, n, data) {
  const p = params('create');
  p.headers['Content-Type'] = 'application/json';
  for (let i = 0; i < n; i++) {
    const body = JSON.stringify({ metadata: { name: `${prefix}-${i}`, labels: { loadtest: prefix } }, data });
    const res = http.post(collection(ns), body, p);
    if (res.status !== 201 && res.status !== 409) {
      throw new Error(`creating ${ns}/${prefix}-${i}: ${res.status} ${res.body}`);
    }
  }
}

export function setup() {
  const payload = 'x'.repeat(512);
  ensure(WATCH_NS, 'w', OBJECTS, { payload, ts: '0' });
  ensure(LIST_NS, 'b', LIST_OBJECTS, { payload });
  ensure(GET_NS, 'd', OBJECTS, { payload });
}

let rv = '';

export function watcher() {
  if (!rv) {
    const res = http.get(`${collection(WATCH_NS)}?limit=1`, params('watch-start'));
    rv = res.status === 200 ? res.json().metadata.resourceVersion : '';
  }
  const res = http.get(
    `${collection(WATCH_NS)}?watch=1&allowWatchBookmarks=true&timeoutSeconds=${WATCH_SECONDS}&resourceVersion=${rv}`,
    params('watch', { timeout: `${WATCH_SECONDS + 30}s` }),
  );
  if (!check(res, { 'watch 200': (r) => r.status === 200 })) {
    rv = '';
    return;
  }
  for (const line of (res.body || '').split('\n')) {
    if (!line) continue;
    const ev = JSON.parse(line);
    if (ev.type === 'ERROR') {
      errors.add(1);
      rv = '';
      return;
    }
    rv = ev.object.metadata.resourceVersion;
    if (ev.type !== 'BOOKMARK') events.add(1);
  }
}

export function churn() {
  const p = params('patch');
  p.headers['Content-Type'] = 'application/merge-patch+json';
  const i = Math.floor(Math.random() * OBJECTS);
  const res = http.patch(`${collection(WATCH_NS)}/w-${i}`, JSON.stringify({ data: { ts: nowNanos() } }), p);
  check(res, { 'patch 200': (r) => r.status === 200 });
}

export function lister() {
  let cont = null;
  do {
    const url = `${collection(LIST_NS)}?limit=${LIST_LIMIT}${cont ? `&continue=${cont}` : ''}`;
    const res = http.get(url, params('list-page'));
    if (!check(res, { 'list page 200': (r) => r.status === 200 })) return;
    cont = continueOf(res.json());
  } while (cont);
}

export function getter() {
  const i = Math.floor(Math.random() * OBJECTS);
  const res = http.get(`${collection(GET_NS)}/d-${i}`, params('get'));
  check(res, { 'get 200': (r) => r.status === 200 });
}
