#!/usr/bin/env bash
# Creates (once) a virtualenv with tests/e2e/python/requirements.txt installed and prints the path
# of its python on the last line of stdout. The venv lives in
# ~/.cache/kube-cache-proxy/python-venv-<hash of requirements.txt>, so changing a pin makes a new
# one; later runs return at once.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=${KCP_CACHE_DIR:-$HOME/.cache/kube-cache-proxy}
hash=$(sha256sum "$here/requirements.txt" | cut -c1-12)
venv="$root/python-venv-$hash"
python="$venv/bin/python"

# The marker is written last, so an interrupted install is redone rather than half used.
if [ -f "$venv/.complete" ]; then echo "$python"; exit 0; fi

mkdir -p "$root"
exec 9>"$venv.lock"
flock 9
if [ ! -f "$venv/.complete" ]; then
  echo ">> creating $venv" >&2
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$python" -m pip install --quiet --disable-pip-version-check -r "$here/requirements.txt" >&2
  touch "$venv/.complete"
fi
echo "$python"
