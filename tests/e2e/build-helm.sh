#!/usr/bin/env bash
# Builds helm (the Helm 3 CLI, Apache-2.0) from the Go module proxy, once, into
# ~/.cache/kube-cache-proxy/helm/<key>/bin, and prints that bin directory on the last line of
# stdout, like build-control-plane.sh. The end-to-end tests render deploy/helm with it
# (`helm template`) and check the output against a real kube-apiserver.
#
# The key holds the pinned helm version and the Go version, so changing the pin builds a new
# binary beside the old one. `go install pkg@version` builds helm with its own go.mod and
# go.sum (checked against the checksum database), independent of any module here.
set -euo pipefail

helm_version=v3.22.0
root=${KCP_CACHE_DIR:-$HOME/.cache/kube-cache-proxy}
gov=$(go env GOVERSION)
key="helm-${helm_version}_${gov}"
bin="$root/helm/$key/bin"

if [ -x "$bin/helm" ]; then echo "$bin"; exit 0; fi

mkdir -p "$bin"
# Serialise concurrent builders (parallel test binaries and CI) on one lock.
exec 9>"$root/helm/$key.lock"
flock 9
if [ ! -x "$bin/helm" ]; then
  echo ">> building helm $helm_version into $bin (a first build takes a few minutes)" >&2
  start=$(date +%s)
  tmp=$(mktemp -d "$root/helm/$key.tmp.XXXXXX")
  CGO_ENABLED=0 GOBIN="$tmp" go install -trimpath -ldflags '-s -w' \
    "helm.sh/helm/v3/cmd/helm@${helm_version}" >&2
  mv "$tmp/helm" "$bin/helm"
  rmdir "$tmp"
  echo ">> built helm in $(( $(date +%s) - start ))s" >&2
fi
echo "$bin"
