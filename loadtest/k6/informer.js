// Scenario b of the load driver: an informer start storm. VUS clients start at once, each
// doing what an informer does at start, once per iteration:
//   MODE=legacy     LIST resourceVersion=0&limit=500 (continue followed), then WATCH from the
//                   list's resourceVersion (bounded by WATCH_SECONDS);
//   MODE=watchlist  one WATCH with sendInitialEvents=true&resourceVersionMatch=NotOlderThan&
//                   allowWatchBookmarks=true; the initial state ends with the BOOKMARK
//                   annotated k8s.io/initial-events-end.
// Compare the apiserver's apiserver_request_total{resource="configmaps"} before and after a run
// with and without the proxy: K clients cost K LISTs and K WATCHes directly, one through it.
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... -e NAMESPACE=lt-b loadtest/k6/informer.js
//
// Env: VUS (200), MODE (legacy), WATCH_SECONDS (10), P99_MS (2000, LIST or WATCH head).
import http from 'k6/http';
import { check } from 'k6';
import { Trend } from 'k6/metrics';
import { baseOptions, collection, continueOf, envInt, p99, params } from './lib/kube.js';

const MODE = __ENV.MODE || 'legacy';
const WATCH_SECONDS = envInt('WATCH_SECONDS', 10);
const initialObjects = new Trend('informer_initial_objects');

export const options = Object.assign(baseOptions(), {
  scenarios: {
    storm: {
      executor: 'per-vu-iterations',
      vus: envInt('VUS', 200),
      iterations: 1,
      maxDuration: `${WATCH_SECONDS + 120}s`,
    },
  },
  thresholds: {
    'http_req_duration{name:informer-list}': [p99(2000)],
    'http_req_waiting{name:informer-watch}': [p99(2000)],
    checks: ['rate==1'],
  },
});

export default function () {
  const watchParams = params('informer-watch', { timeout: `${WATCH_SECONDS + 30}s` });
  if (MODE === 'watchlist') {
    const res = http.get(
      `${collection()}?watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan`
        + `&allowWatchBookmarks=true&timeoutSeconds=${WATCH_SECONDS}`,
      watchParams,
    );
    if (!check(res, { 'watchlist 200': (r) => r.status === 200 })) return;
    let added = 0;
    let ended = false;
    for (const line of (res.body || '').split('\n')) {
      if (!line || ended) continue;
      const ev = JSON.parse(line);
      const ann = ev.object.metadata.annotations || {};
      if (ev.type === 'ADDED') added += 1;
      if (ev.type === 'BOOKMARK' && ann['k8s.io/initial-events-end'] === 'true') ended = true;
    }
    check(ended, { 'initial-events-end bookmark': (e) => e });
    initialObjects.add(added);
    return;
  }
  let cont = null;
  let rv = '';
  let n = 0;
  do {
    const q = cont ? `limit=500&continue=${cont}` : 'limit=500&resourceVersion=0';
    const res = http.get(`${collection()}?${q}`, params('informer-list'));
    if (!check(res, { 'list 200': (r) => r.status === 200 })) return;
    const body = res.json();
    if (!rv) rv = body.metadata.resourceVersion;
    n += (body.items || []).length;
    cont = continueOf(body);
  } while (cont);
  initialObjects.add(n);
  const res = http.get(
    `${collection()}?watch=1&resourceVersion=${rv}&allowWatchBookmarks=true`
      + `&timeoutSeconds=${WATCH_SECONDS}`,
    watchParams,
  );
  check(res, { 'watch 200': (r) => r.status === 200 });
}
