// Shared helpers for the k6 scripts: where the apiserver (or the proxy) is, how to authenticate,
// and the request shapes the load driver (loadtest/src/scenarios.rs) uses.
//
// Configuration, from the environment (k6 run -e NAME=value, or exported variables):
//   KUBE_API            server URL, e.g. https://kube-cache-proxy.kube-cache-proxy.svc:443
//   KUBE_TOKEN          bearer token, or
//   KUBE_TOKEN_FILE     a file holding it (e.g. /var/run/secrets/kubernetes.io/serviceaccount/token)
//   KUBECONFIG          kubeconfig file: server and token of the current context are used when
//                       KUBE_API / KUBE_TOKEN are unset (embedded `token:` or `tokenFile:` only;
//                       exec plugins and client certificates need KUBE_TOKEN or the variables below)
//   KUBE_CLIENT_CERT, KUBE_CLIENT_KEY   PEM files for a client certificate instead of a token
//   SSL_CERT_FILE       (read by k6 itself, a Go program) the CA bundle to trust instead of the
//                       system roots: the cluster's CA, the proxy's CA, or both in one file
//   KUBE_INSECURE=1     skip TLS verification (not for published measurements: use SSL_CERT_FILE)
//   NAMESPACE           namespace of the objects (default: loadtest)
//   P99_MS              p99 threshold in milliseconds for the script's main request (per script default)

function readFile(path) {
  // open() is only available in k6's init context, which is where this module is evaluated.
  return open(path);
}

// A minimal reader for the kubeconfig fields used here (current-context, its cluster's server
// and its user's token/tokenFile). Kubeconfigs are YAML; this handles the usual block style.
function fromKubeconfig(path) {
  const text = readFile(path);
  const lines = text.split('\n');
  const current = (text.match(/^current-context:\s*"?([^"\n]+)"?/m) || [])[1];
  const sections = {};
  let section = null;
  let entry = null;
  for (const raw of lines) {
    const top = raw.match(/^([a-z-]+):\s*$/);
    if (top) {
      section = top[1];
      sections[section] = [];
      entry = null;
      continue;
    }
    if (!section) continue;
    const item = raw.match(/^- (.*)$/) || raw.match(/^ {2}- (.*)$/);
    if (item) {
      entry = {};
      sections[section].push(entry);
    }
    const kv = raw.replace(/^[\s-]+/, '').match(/^([A-Za-z-]+):\s*"?([^"]*)"?\s*$/);
    if (entry && kv) {
      if (kv[1] === 'name' && entry.name === undefined) entry.name = kv[2];
      else if (kv[2] !== '') entry[kv[1]] = kv[2];
    }
  }
  const find = (s, name) => (sections[s] || []).find((e) => e.name === name) || (sections[s] || [])[0] || {};
  const ctx = find('contexts', current);
  const cluster = find('clusters', ctx.cluster);
  const user = find('users', ctx.user);
  let token = user.token;
  if (!token && user.tokenFile) token = readFile(user.tokenFile).trim();
  return { server: cluster.server, token };
}

const fromFile = __ENV.KUBECONFIG && (!__ENV.KUBE_API || !(__ENV.KUBE_TOKEN || __ENV.KUBE_TOKEN_FILE))
  ? fromKubeconfig(__ENV.KUBECONFIG)
  : {};

export const API = (__ENV.KUBE_API || fromFile.server || 'https://127.0.0.1:8443').replace(/\/$/, '');
const TOKEN = __ENV.KUBE_TOKEN
  || (__ENV.KUBE_TOKEN_FILE ? readFile(__ENV.KUBE_TOKEN_FILE).trim() : fromFile.token);
const CLIENT_CERT = __ENV.KUBE_CLIENT_CERT ? readFile(__ENV.KUBE_CLIENT_CERT) : null;
const CLIENT_KEY = __ENV.KUBE_CLIENT_KEY ? readFile(__ENV.KUBE_CLIENT_KEY) : null;

export const NAMESPACE = __ENV.NAMESPACE || 'loadtest';

/// Options every script merges into its own `options`.
export function baseOptions() {
  const o = { insecureSkipTLSVerify: __ENV.KUBE_INSECURE === '1' };
  if (CLIENT_CERT && CLIENT_KEY) {
    const domain = API.replace(/^https?:\/\//, '').replace(/[:/].*$/, '');
    o.tlsAuth = [{ domains: [domain], cert: CLIENT_CERT, key: CLIENT_KEY }];
  }
  return o;
}

/// Request parameters: credentials, JSON, a `name` tag so thresholds can target one request kind.
export function params(name, extra) {
  const headers = { Accept: 'application/json' };
  if (TOKEN) headers.Authorization = `Bearer ${TOKEN}`;
  return Object.assign({ headers, tags: { name } }, extra || {});
}

export function envInt(name, dflt) {
  const v = parseInt(__ENV[name] || '', 10);
  return Number.isFinite(v) ? v : dflt;
}

export function p99(dfltMs) {
  return `p(99)<${envInt('P99_MS', dfltMs)}`;
}

export function collection(ns) {
  return `${API}/api/v1/namespaces/${ns || NAMESPACE}/configmaps`;
}

/// Unix time in nanoseconds as a decimal string (what the driver writes into `data.ts`).
export function nowNanos() {
  return `${Date.now()}000000`;
}

/// The continue token of a list response, URL-encoded, or null at the end.
export function continueOf(body) {
  const c = body && body.metadata && body.metadata.continue;
  return c ? encodeURIComponent(c) : null;
}
