#!/usr/bin/env bash
# Builds Go programs the end-to-end tests and `kube-cache-proxy dev` run, from the Go module
# in tests/e2e/go, once, into ~/.cache/kube-cache-proxy/<set>/<key>/bin, and prints that bin
# directory on the last line of stdout. Later runs find the binaries and return at once.
#
#   build-control-plane.sh            kube-apiserver, kubectl, etcd (the real control plane)
#   build-control-plane.sh clients    informer-check (client-go informers pointed at the proxy)
#
# The key holds the pinned versions (k8s.io/kubernetes, etcd server), the Go version and a hash
# of the sources of that set, so changing a pin builds a new set beside the old one.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")/go" && pwd)
root=${KCP_CACHE_DIR:-$HOME/.cache/kube-cache-proxy}
set_name=${1:-control-plane}

k8s=$(awk '$1=="k8s.io/kubernetes"{print $2; exit}' "$here/go.mod")
etcd=$(awk '$1=="go.etcd.io/etcd/server/v3"{print $2; exit}' "$here/go.mod")
gov=$(go env GOVERSION)
case "$set_name" in
  control-plane) wanted=(kube-apiserver kubectl etcd); srcdirs=(cmd/etcd) ;;
  clients) wanted=(informer-check); srcdirs=(cmd/informer-check) ;;
  *) echo "unknown set $set_name" >&2; exit 2 ;;
esac
src_hash=$(cd "$here" && cat go.mod go.sum $(find "${srcdirs[@]}" -name '*.go' | sort) | sha256sum | cut -c1-12)
key="k8s-${k8s}_etcd-${etcd}_${gov}_${src_hash}"
bin="$root/$set_name/$key/bin"

have_all() { for b in "${wanted[@]}"; do [ -x "$bin/$b" ] || return 1; done; }
if have_all; then echo "$bin"; exit 0; fi

mkdir -p "$bin"
# Serialise concurrent builders (parallel test binaries, CI and dev mode) on one lock.
exec 9>"$root/$set_name/$key.lock"
flock 9
cd "$here"
for b in "${wanted[@]}"; do
  [ -x "$bin/$b" ] && continue
  case "$b" in
    kube-apiserver|kubectl) pkg=k8s.io/kubernetes/cmd/$b ;;
    *) pkg=./cmd/$b ;;
  esac
  echo ">> building $b ($pkg) into $bin; a first build of kube-apiserver takes several minutes" >&2
  start=$(date +%s)
  CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$bin/$b.tmp" "$pkg" >&2
  mv "$bin/$b.tmp" "$bin/$b"
  echo ">> built $b in $(( $(date +%s) - start ))s" >&2
done
echo "$bin"
