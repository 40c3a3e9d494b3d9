#!/usr/bin/env bash
# Builds the simulated-cluster components the load driver's `cluster` scenario runs beside the
# control plane (see loadtest/README.md), once, into
# ~/.cache/kube-cache-proxy/cluster/<key>/bin, and prints that bin directory on the last line of
# stdout. Later runs find the binaries and return at once.
#
#   kwok                 sigs.k8s.io/kwok/cmd/kwok (simulated nodes and pods)
#   kwok-stages.yaml     kwok's own default stages from the same module (node-initialize,
#                        node-heartbeat-with-lease, pod-ready, pod-complete, pod-delete): the
#                        kwok binary runs no stage unless its --config names some
#   kube-state-metrics   k8s.io/kube-state-metrics/v2
#
# kube-controller-manager and kube-scheduler come from `build-control-plane.sh conformance`
# (the pinned k8s.io/kubernetes module).
#
# Each is installed with `go install <pkg>@<version>` (neither module has replace directives, so
# its own go.mod and go.sum pin every dependency). The key holds both versions, the Go version
# and RECIPE (raise it when the way of building changes), so changing a pin builds a new set
# beside the old one.
set -euo pipefail

KWOK_VERSION=${KWOK_VERSION:-v0.8.0}
KSM_VERSION=${KSM_VERSION:-v2.20.0}

root=${KCP_CACHE_DIR:-$HOME/.cache/kube-cache-proxy}
gov=$(go env GOVERSION)
RECIPE=1
key="kwok-${KWOK_VERSION}_ksm-${KSM_VERSION}_${gov}_r${RECIPE}"
bin="$root/cluster/$key/bin"
wanted=(kwok kwok-stages.yaml kube-state-metrics)

have_all() { for b in "${wanted[@]}"; do [ -s "$bin/$b" ] || return 1; done; }
if have_all; then echo "$bin"; exit 0; fi

mkdir -p "$bin"
# Serialise concurrent builders (parallel test binaries, the load driver) on one lock.
exec 9>"$root/cluster/$key.lock"
flock 9
for b in "${wanted[@]}"; do
  [ -s "$bin/$b" ] && continue
  if [ "$b" = kwok-stages.yaml ]; then
    # The module `go install` just fetched (the module cache is read-only: read, never write).
    dir=$(go env GOMODCACHE)/sigs.k8s.io/kwok@$KWOK_VERSION/kustomize/stage
    # A module cache cleaned since kwok was built: fetch the module again (outside any module).
    [ -d "$dir" ] || (cd "$root" && go mod download "sigs.k8s.io/kwok@$KWOK_VERSION" >&2)
    {
      for f in node/fast/node-initialize.yaml node/heartbeat-with-lease/node-heartbeat-with-lease.yaml \
               pod/fast/pod-ready.yaml pod/fast/pod-complete.yaml pod/fast/pod-delete.yaml; do
        echo "---"
        cat "$dir/$f"
      done
    } > "$bin/$b.tmp"
    mv "$bin/$b.tmp" "$bin/$b"
    continue
  fi
  case "$b" in
    kwok) pkg=sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION ;;
    kube-state-metrics) pkg=k8s.io/kube-state-metrics/v2@$KSM_VERSION ;;
  esac
  echo ">> building $b ($pkg) into $bin; a first build takes a few minutes" >&2
  start=$(date +%s)
  tmp=$(mktemp -d "$root/cluster/$key.gobin.XXXXXX")
  # Outside any module, so the workspace's go.mod plays no part.
  (cd "$tmp" && GOFLAGS=-trimpath GOBIN="$tmp" CGO_ENABLED=0 go install -ldflags "-s -w" "$pkg" >&2)
  built=$(find "$tmp" -maxdepth 1 -type f -perm -u+x | head -n1)
  [ -n "$built" ] || { echo "no binary from $pkg" >&2; exit 1; }
  mv "$built" "$bin/$b"
  rm -rf "$tmp"
  echo ">> built $b in $(( $(date +%s) - start ))s" >&2
done
echo "$bin"
