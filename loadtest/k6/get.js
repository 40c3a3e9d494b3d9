// Scenario d of the load driver: GETs at a fixed rate (open loop) of ConfigMaps
// `${PREFIX}-0` .. `${PREFIX}-(OBJECTS-1)`. RV0=1 asks for resourceVersion=0, which a cache
// may answer; without it the GET is a quorum read the apiserver answers (passthrough in the
// proxy).
//
//   k6 run -e KUBE_API=https://... -e KUBE_TOKEN=... -e NAMESPACE=lt-d loadtest/k6/get.js
//
// Env: RATE (200 per second), DURATION (60s), OBJECTS (50), PREFIX (d), RV0 (0), P99_MS (100).
import http from 'k6/http';
import { check } from 'k6';
import { baseOptions, collection, envInt, p99, params } from './lib/kube.js';

const OBJECTS = envInt('OBJECTS', 50);
const PREFIX = __ENV.PREFIX || 'd';
const QUERY = __ENV.RV0 === '1' ? '?resourceVersion=0' : '';

export const options = Object.assign(baseOptions(), {
  scenarios: {
    get: {
      executor: 'constant-arrival-rate',
      rate: envInt('RATE', 200),
      timeUnit: '1s',
      duration: __ENV.DURATION || '60s',
      preAllocatedVUs: 50,
      maxVUs: 1000,
    },
  },
  thresholds: {
    'http_req_duration{name:get}': [p99(100)],
    checks: ['rate==1'],
  },
});

export default function () {
  const i = Math.floor(Math.random() * OBJECTS);
  const res = http.get(`${collection()}/${PREFIX}-${i}${QUERY}`, params('get'));
  check(res, { 'get 200': (r) => r.status === 200 });
}
