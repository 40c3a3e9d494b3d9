// Scenario e of the load driver: everything at once. Bounded watchers (as watch.js), churn
// (as churn.js, against the same KUBE_API), paged list walkers (as list.js) and quorum GETs
// (as get.js), each its own k6 scenario, with per-request-kind p99 thresholds.
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... loadtest/k6/mixed.js
//
// Env: DURATION (60s), WATCHERS (250), CHURN_RATE (25), GET_RATE (100), LISTERS (2),
// LIST_LIMIT (100), WATCH_NS (lt-a), LIST_NS (lt-b), GET_NS (lt-d), OBJECTS (50),
// WATCH_SECONDS (10). Objects: create them with churn.js / get.js setups or the load driver's
// naming (w-*, b-*, d-*).
import http from 'k6/http';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import { baseOptions, collection, continueOf, envInt, nowNanos, params } from './lib/kube.js';

const DURATION = __ENV.DURATION || '60s';
const WATCH_SECONDS = envInt('WATCH_SECONDS', 10);
const OBJECTS = envInt('OBJECTS', 50);
const LIST_LIMIT = envInt('LIST_LIMIT', 100);
const WATCH_NS = __ENV.WATCH_NS || 'lt-a';
const LIST_NS = __ENV.LIST_NS || 'lt-b';
const GET_NS = __ENV.GET_NS || 'lt-d';
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
