#!/bin/sh
# Installs the Debian packages that `make package` built into a clean Debian 12 (a minimal
# bookworm root made by debootstrap from Debian's mirror, nothing else in it) and uses them as a
# new user would: `pathways help`, `pathways demo`, a short `pathways train`, a Python job through
# `import pathways`, and examples/cpp built against /usr with cmake and run against a controller
# and a worker started from the installed binary. Whatever dpkg-shlibdeps could not see (Python's
# torch, a header the -dev package needs) shows up here as a failed step.
#
#   make check-package          (root, Debian's mirror reachable; about 5 minutes)
#   deploy/clean_debian_check.sh BUILD_DIR [ROOT_DIR]
#
# Without ROOT_DIR the Debian goes into a fresh directory under /tmp, removed at the end. A
# ROOT_DIR given must be empty or one an earlier run made (it then skips debootstrap), and is
# kept. The script runs in a mount namespace of its own, so the root's /proc and /dev mounts go
# with it however it ends.
set -eu

if [ "$(id -u)" != 0 ]; then echo "$0: needs root (debootstrap, chroot, mounts)" >&2; exit 2; fi
if [ -z "${PATHWAYS_CHECK_NAMESPACE:-}" ]; then
  PATHWAYS_CHECK_NAMESPACE=1 exec unshare --mount --propagation private "$0" "$@"
fi

build=$(cd "${1:?usage: $0 BUILD_DIR [ROOT_DIR]}" && pwd)
examples=$(cd "$(dirname "$0")/../examples/cpp" && pwd)
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
runtime_deb=$(ls "$build"/pathways_*_amd64.deb 2> /dev/null | head -1)
dev_deb=$(ls "$build"/pathways-dev_*_amd64.deb 2> /dev/null | head -1)
if [ -z "$runtime_deb" ] || [ -z "$dev_deb" ]; then echo "$0: no packages in $build: run make package first" >&2; exit 2; fi
command -v debootstrap > /dev/null || { echo "$0: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }

marker=.pathways-clean-debian-check  # written into a root this script made
if [ $# -ge 2 ]; then
  root=$(mkdir -p "$2" && cd "$2" && pwd) made_root=0
  if [ "$root" = / ] || { [ -n "$(ls -A "$root")" ] && [ ! -f "$root/$marker" ]; }; then
    echo "$0: $root is neither empty nor a root an earlier run made" >&2; exit 2
  fi
else
  root=$(mktemp -d /tmp/pathways-debian12-XXXXXX) made_root=1
fi

# The step running now (its process tree ends with the script: a signal to the script alone would
# otherwise wait for the step, apt-get say, to finish by itself).
child=""
kill_tree() {
  for c in $(ps -o pid= --ppid "$1" 2> /dev/null); do kill_tree "$c"; done
  kill "$1" 2> /dev/null || true
}
# Runs "$@" as the current step; a trapped signal interrupts the wait at once.
run() {
  "$@" &
  child=$!
  wait "$child"
  status=$?
  child=""
  return $status
}

cleanup() {
  if [ -n "$child" ]; then kill_tree "$child"; wait "$child" 2> /dev/null || true; fi
  # Processes started inside the root (a controller and a worker) end with it.
  for pidfile in "$root/tmp/controller.pid" "$root/tmp/worker.pid"; do
    if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2> /dev/null || true; rm -f "$pidfile"; fi
  done
  # Lazily when still busy (a step's processes may take a moment to go): the namespace is ours.
  umount -R "$root/dev" 2> /dev/null || umount -R -l "$root/dev" 2> /dev/null || true
  umount "$root/proc" 2> /dev/null || umount -l "$root/proc" 2> /dev/null || true
  if [ "$made_root" = 1 ]; then rm -rf --one-file-system "$root" "$root.debootstrap.log"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

step() { printf '\n== %s\n' "$*"; }
in_root() { run chroot "$root" /bin/sh -c "$1"; }
# Runs $1 in the root with its output in the root's /tmp/$2, shown (the last lines) on failure
# and, on success, the last $3 lines.
logged() {
  if ! in_root "cd /tmp && { $1; } > /tmp/$2 2>&1"; then
    echo "failed: $1" >&2; tail -30 "$root/tmp/$2" >&2; exit 1
  fi
  if [ "${3:-0}" -gt 0 ]; then tail -"$3" "$root/tmp/$2"; fi
}

step "a minimal Debian 12 in $root"
chmod 755 "$root"  # apt inside reads its lists as user _apt
if [ ! -f "$root/$marker" ]; then
  run debootstrap --variant=minbase bookworm "$root" "$mirror" > "$root.debootstrap.log" 2>&1 || {
    tail -20 "$root.debootstrap.log" >&2; exit 1; }
  rm -f "$root.debootstrap.log"
  touch "$root/$marker"
fi
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
rm -f "$root"/tmp/*.pid "$root"/tmp/*.log "$root/tmp/address"
cp "$runtime_deb" "$dev_deb" "$root/tmp/"
mkdir -p "$root/tmp/example_src" && cp "$examples"/* "$root/tmp/example_src/"

step "apt-get install the two packages (their dependencies come from the mirror)"
logged "apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q /tmp/$(basename "$runtime_deb") \
  /tmp/$(basename "$dev_deb")" install.log

step "pathways help, demo and a short train"
logged "pathways help" help.log 0
head -1 "$root/tmp/help.log"
logged "timeout 300 pathways demo" demo.log 2
logged "timeout 300 pathways train --model tiny --steps 20" train.log 1

step "import pathways: a job on an embedded cluster, torch tensors in and out"
cat > "$root/tmp/py_check.py" << 'EOF'
import torch
import pathways
P = pathways.P
with pathways.LocalCluster(islands=1, hosts_per_island=2, devices_per_host=2, device_memory="64MiB") as cluster:
    client = cluster.connect()
    devices = client.slice((4,), axes=("x",))

    @pathways.function(in_shardings=[P("x")], out_shardings=[P(None)])
    def doubled(x):
        return pathways.all_gather(x * 2.0, "x")

    got = doubled(client.put(torch.arange(8, dtype=torch.float32), devices, P("x"))).fetch()
    assert torch.equal(got, torch.arange(8, dtype=torch.float32) * 2), got
    print("python: all_gather over 4 devices of 2 hosts:", got.tolist())
EOF
logged "timeout 300 python3 py_check.py" py.log
grep "^python:" "$root/tmp/py.log"

step "examples/cpp built against /usr (find_package(pathways)) and run against a real controller and worker"
logged "DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++" gxx.log
logged "cmake -S example_src -B example_build -DCMAKE_BUILD_TYPE=Release && cmake --build example_build" cmake.log
# The controller writes its address to a file once it listens; the worker says "serving" once registered.
in_root "cd /tmp && { pathways controller --listen 127.0.0.1:0 --port-file /tmp/address > ctl.log 2>&1 & echo \$! > controller.pid; }"
tries=0
until [ -s "$root/tmp/address" ]; do
  tries=$((tries + 1)); if [ $tries -gt 300 ]; then echo "the controller did not start:" >&2; cat "$root/tmp/ctl.log" >&2; exit 1; fi
  sleep 0.1
done
address=$(cat "$root/tmp/address")
in_root "cd /tmp && { pathways worker --controller $address --devices 2 > worker.log 2>&1 & echo \$! > worker.pid; }"
tries=0
until grep -q serving "$root/tmp/worker.log" 2> /dev/null; do
  tries=$((tries + 1)); if [ $tries -gt 300 ]; then echo "the worker did not start:" >&2; cat "$root/tmp/worker.log" >&2; exit 1; fi
  sleep 0.1
done
logged "timeout 120 ./example_build/matmul_allreduce $address 2" example.log 1

step "apt-get remove takes them away"
for pidfile in "$root/tmp/worker.pid" "$root/tmp/controller.pid"; do kill "$(cat "$pidfile")"; rm -f "$pidfile"; done
logged "DEBIAN_FRONTEND=noninteractive apt-get remove -y -q pathways-dev pathways" remove.log
if in_root "command -v pathways > /dev/null || python3 -c 'import pathways' 2> /dev/null"; then
  echo "pathways is still installed after apt-get remove" >&2; exit 1
fi
echo "removed: no pathways binary, no Python package"

printf '\nCLEAN DEBIAN 12 CHECK PASSED\n'
