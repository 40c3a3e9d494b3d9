#!/usr/bin/env bash
# Builds promtool (Prometheus' CLI, Apache-2.0) from the Go module proxy, once, into
# ~/.cache/kube-cache-proxy/promtool/<key>/bin, and prints that bin directory on the last line
# of stdout, like build-helm.sh. The end-to-end tier runs `promtool check metrics` on a scrape
# of the proxy's /metrics.
#
# The key holds the pinned Prometheus module version (v0.316.0 is Prometheus 3.16) and the
# Go version. `go install pkg@version` builds it with its own go.mod and go.sum.
set -euo pipefail

prometheus_version=v0.316.0
root=${KCP_CACHE_DIR:-$HOME/.cache/kube-cache-proxy}
gov=$(go env GOVERSION)
key="promtool-${prometheus_version}_${gov}"
bin="$root/promtool/$key/bin"

if [ -x "$bin/promtool" ]; then echo "$bin"; exit 0; fi

mkdir -p "$bin"
# Serialise concurrent builders (parallel test binaries and CI) on one lock.
exec 9>"$root/promtool/$key.lock"
flock 9
if [ ! -x "$bin/promtool" ]; then
  echo ">> building promtool $prometheus_version into $bin (a first build takes a few minutes)" >&2
  start=$(date +%s)
  tmp=$(mktemp -d "$root/promtool/$key.tmp.XXXXXX")
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags '-s -w' \
    "github.com/prometheus/prometheus/cmd/promtool@${prometheus_version}" >&2
  mv "$tmp/promtool" "$bin/promtool"
  rmdir "$tmp"
  echo ">> built promtool in $(( $(date +%s) - start ))s" >&2
fi
echo "$bin"
