// Scenario a of the load driver, write side: merge patches at a fixed rate (open loop) to
// ConfigMaps `w-0` .. `w-(OBJECTS-1)` of NAMESPACE, each carrying its send time in `data.ts`
// (unix nanoseconds) like the driver's churn. setup() creates the objects if they are missing.
// Point it at the apiserver (writes pass through the proxy unchanged anyway).
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... -e NAMESPACE=lt-a loadtest/k6/churn.js
//
// Env: RATE (50 per second), DURATION (60s), OBJECTS (50), P99_MS (200).
import http from 'k6/http';
import { check } from 'k6';
import { baseOptions, collection, envInt, nowNanos, p99, params } from './lib/kube.js';

const OBJECTS = envInt('OBJECTS', 50);

export const options = Object.assign(baseOptions(), {
  scenarios: {
    churn: {
      executor: 'constant-arrival-rate',
      rate: envInt('RATE', 50),
      timeUnit: '1s',
      duration: __ENV.DURATION || '60s',
      preAllocatedVUs: 20,
      maxVUs: 256,
    },
  },
  thresholds: {
    'http_req_duration{name:patch}': [p99(200)],
    checks: ['rate==1'],
  },
});

export function setup() {
  const p = params('create');
  p.headers['Content-Type'] = 'application/json';
  for (let i = 0; i < OBJECTS; i++) {
    const body = JSON.stringify({
      metadata: { name: `w-${i}`, labels: { loadtest: 'w' } },
      data: { payload: 'x'.repeat(512), ts: '0' },
    });
    const res = http.post(collection(), body, p);
    if (res.status !== 201 && res.status !== 409) {
      throw new Error(`creating w-${i}: ${res.status} ${res.body}`);
    }
  }
}

let seq = 0;

export default function () {
  const i = Math.floor(Math.random() * OBJECTS);
  const p = params('patch');
  p.headers['Content-Type'] = 'application/merge-patch+json';
  seq += 1;
  const body = JSON.stringify({ data: { ts: nowNanos(), seq: `${__VU}-${seq}` } });
  const res = http.patch(`${collection()}/w-${i}`, body, p);
  check(res, { 'patch 200': (r) => r.status === 200 });
}
