#!/usr/bin/env bash
# Builds Go programs the end-to-end tests and `kube-cache-proxy dev` run, from the Go module
# in tests/e2e/go, once, into ~/.cache/kube-cache-proxy/<set>/<key>/bin, and prints that bin
# directory on the last line of stdout. Later runs find the binaries and return at once.
#
#   build-control-plane.sh            kube-apiserver, kubectl, etcd (the real control plane)
#   build-control-plane.sh clients    informer-check (client-go informers pointed at the proxy)
#   build-control-plane.sh conformance kube-controller-manager, kube-scheduler and e2e.test (the
#                                      upstream e2e tests of the conformance tier, see
#                                      go/conformance)
#
# Every binary is stamped with the version of k8s.io/kubernetes pinned in go.mod (gitVersion,
# gitMajor, gitMinor, gitTreeState and a buildDate fixed to that release's publication time, in
# both k8s.io/component-base/version and k8s.io/client-go/pkg/version, as hack/lib/version.sh
# does), so `kubectl version` and the e2e framework's server-version checks see v1.x.y.
#
# The key holds the pinned versions (k8s.io/kubernetes, etcd server), the Go version and a hash
# of the sources of that set and of the ldflags, so changing a pin, a source or a flag builds a
# new set beside the old one.
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
  conformance) wanted=(kube-controller-manager kube-scheduler e2e.test); srcdirs=(conformance) ;;
  *) echo "unknown set $set_name" >&2; exit 2 ;;
esac

# The version stamp, derived from the k8s.io/kubernetes pin (vMAJOR.MINOR.PATCH).
major=${k8s#v}; major=${major%%.*}
minor=${k8s#v*.}; minor=${minor%%.*}
# The release's publication time from the module's metadata: fixed, so builds are deterministic.
build_date=$(cd "$here" && go list -m -f '{{if .Time}}{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' k8s.io/kubernetes 2>/dev/null || true)
build_date=${build_date:-1970-01-01T00:00:00Z}
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags+=" -X $pkg.gitVersion=$k8s -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

src_hash=$( (cd "$here" && cat go.mod go.sum $(find "${srcdirs[@]}" -name '*.go' | sort); echo "$ldflags") | sha256sum | cut -c1-12)
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
    kube-apiserver|kubectl|kube-controller-manager|kube-scheduler) pkg=k8s.io/kubernetes/cmd/$b ;;
    e2e.test) pkg=./conformance ;;
    *) pkg=./cmd/$b ;;
  esac
  echo ">> building $b ($pkg) into $bin; a first build of kube-apiserver or e2e.test takes several minutes" >&2
  start=$(date +%s)
  if [ "$b" = e2e.test ]; then
    CGO_ENABLED=0 go test -c -trimpath -ldflags "$ldflags" -o "$bin/$b.tmp" "$pkg" >&2
  else
    CGO_ENABLED=0 go build -trimpath -ldflags "$ldflags" -o "$bin/$b.tmp" "$pkg" >&2
  fi
  mv "$bin/$b.tmp" "$bin/$b"
  echo ">> built $b in $(( $(date +%s) - start ))s" >&2
done
echo "$bin"
