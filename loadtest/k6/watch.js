// Scenario a of the load driver, read side: VUS bounded watches (timeoutSeconds) on the
// ConfigMaps of NAMESPACE, each re-opened from the last resourceVersion it saw, as informers do.
// Run churn.js at the same time for the write side. k6 reads a response only when it ends, so a
// watch is bounded by WATCH_SECONDS and its events are counted when it ends; per-event delivery
// latency needs a streaming reader, which is what the load driver's scenario a measures.
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... -e NAMESPACE=lt-a loadtest/k6/watch.js
//
// Env: VUS (100), DURATION (60s), WATCH_SECONDS (10), P99_MS (2000, time to the response head).
import http from 'k6/http';
import { check } from 'k6';
import { Counter } from 'k6/metrics';
import { baseOptions, collection, envInt, p99, params } from './lib/kube.js';

const WATCH_SECONDS = envInt('WATCH_SECONDS', 10);
const events = new Counter('watch_events');
const errors = new Counter('watch_error_events');

export const options = Object.assign(baseOptions(), {
  scenarios: {
    watch: {
      executor: 'constant-vus',
      vus: envInt('VUS', 100),
      duration: __ENV.DURATION || '60s',
    },
  },
  thresholds: {
    // Time to the response head: a watch is established when its headers arrive.
    'http_req_waiting{name:watch}': [p99(2000)],
    watch_error_events: ['count==0'],
    checks: ['rate==1'],
  },
});

let rv = '';

/// The resourceVersion to start from: the collection's current one (a cheap limit=1 list).
function currentRv() {
  const res = http.get(`${collection()}?limit=1`, params('watch-start'));
  return res.status === 200 ? res.json().metadata.resourceVersion : '';
}

export default function () {
  if (!rv) rv = currentRv();
  const url = `${collection()}?watch=1&allowWatchBookmarks=true&timeoutSeconds=${WATCH_SECONDS}`
    + `&resourceVersion=${rv}`;
  const res = http.get(url, params('watch', { timeout: `${WATCH_SECONDS + 30}s` }));
  if (!check(res, { 'watch 200': (r) => r.status === 200 })) {
    rv = '';
    return;
  }
  for (const line of (res.body || '').split('\n')) {
    if (!line) continue;
    const ev = JSON.parse(line);
    if (ev.type === 'ERROR') {
      // 410 Expired: start again from the current state, as an informer would after a relist.
      errors.add(1);
      rv = '';
      return;
    }
    rv = ev.object.metadata.resourceVersion;
    if (ev.type !== 'BOOKMARK') events.add(1);
  }
}
