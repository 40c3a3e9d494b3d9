// Scenario c of the load driver: paginated list storm. VUS clients walk the ConfigMaps of
// NAMESPACE with limit=LIMIT and continue tokens, over and over, for DURATION.
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... -e NAMESPACE=lt-c loadtest/k6/list.js
//
// Env: VUS (4), DURATION (60s), LIMIT (500), P99_MS (1000, per page). See lib/kube.js for the
// connection settings.
import http from 'k6/http';
import { check } from 'k6';
import { Counter, Trend } from 'k6/metrics';
import { baseOptions, collection, continueOf, envInt, p99, params } from './lib/kube.js';

const LIMIT = envInt('LIMIT', 500);
const walkTime = new Trend('list_walk_duration', true);
const items = new Counter('list_items');

export const options = Object.assign(baseOptions(), {
  scenarios: {
    list: {
      executor: 'constant-vus',
      vus: envInt('VUS', 4),
      duration: __ENV.DURATION || '60s',
    },
  },
  thresholds: {
    'http_req_duration{name:list-page}': [p99(1000)],
    checks: ['rate==1'],
  },
});

export default function () {
  const started = Date.now();
  let cont = null;
  do {
    const url = `${collection()}?limit=${LIMIT}${cont ? `&continue=${cont}` : ''}`;
    const res = http.get(url, params('list-page', { timeout: '120s' }));
    if (!check(res, { 'list page 200': (r) => r.status === 200 })) return;
    const body = res.json();
    items.add((body.items || []).length);
    cont = continueOf(body);
  } while (cont);
  walkTime.add(Date.now() - started);
}
