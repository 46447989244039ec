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
# Without ROOT_DIR the Debian goes into a fresh directory under /tmp, removed at the end; a
# ROOT_DIR given is kept, and a later run with the same one skips debootstrap.
set -eu

build=$(cd "${1:?usage: $0 BUILD_DIR [ROOT_DIR]}" && pwd)
if [ $# -ge 2 ]; then
  root=$2 made_root=0  # kept afterwards: a later run reuses its Debian
  mkdir -p "$root"
else
  root=$(mktemp -d /tmp/pathways-debian12-XXXXXX) made_root=1
fi
chmod 755 "$root"  # apt inside reads its lists as user _apt
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
examples=$(cd "$(dirname "$0")/../examples/cpp" && pwd)

if [ "$(id -u)" != 0 ]; then echo "$0: needs root (debootstrap, chroot, mounts)" >&2; exit 2; fi
for deb in pathways_0.1.0_amd64.deb pathways-dev_0.1.0_amd64.deb; do
  if [ ! -f "$build/$deb" ]; then echo "$0: $build/$deb is missing: run make package first" >&2; exit 2; fi
done
command -v debootstrap > /dev/null || { echo "$0: debootstrap is missing (apt-get install debootstrap)" >&2; exit 2; }

mounted=""
cleanup() {
  # Processes started inside the root (a controller and a worker) end with it.
  for pidfile in "$root"/tmp/controller.pid "$root"/tmp/worker.pid; do
    if [ -f "$pidfile" ]; then kill "$(cat "$pidfile")" 2> /dev/null || true; fi
  done
  for m in $mounted; do umount "$m" 2> /dev/null || umount -l "$m" || true; done
  if [ "$made_root" = 1 ]; then rm -rf --one-file-system "$root"; fi
}
trap cleanup EXIT INT TERM

step() { printf '\n== %s\n' "$*"; }
in_root() { chroot "$root" /bin/sh -c "$1"; }

step "a minimal Debian 12 in $root"
if [ ! -x "$root/usr/bin/apt-get" ]; then debootstrap --variant=minbase bookworm "$root" "$mirror" > "$root.debootstrap.log" 2>&1 || {
  tail -20 "$root.debootstrap.log" >&2; exit 1; }; fi
rm -f "$root.debootstrap.log"
mount -t proc proc "$root/proc" && mounted="$root/proc $mounted"
mount --bind /dev "$root/dev" && mounted="$root/dev $mounted"
mount --bind /dev/shm "$root/dev/shm" && mounted="$root/dev/shm $mounted"
cp "$build/pathways_0.1.0_amd64.deb" "$build/pathways-dev_0.1.0_amd64.deb" "$root/tmp/"
mkdir -p "$root/tmp/example_src" && cp "$examples"/* "$root/tmp/example_src/"

step "apt-get install the two packages (their dependencies come from the mirror)"
in_root "apt-get update -q > /dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
  /tmp/pathways_0.1.0_amd64.deb /tmp/pathways-dev_0.1.0_amd64.deb > /tmp/install.log 2>&1 || { tail -30 /tmp/install.log; exit 1; }"

step "pathways help, demo and a short train"
in_root "pathways help | head -1"
in_root "cd /tmp && timeout 300 pathways demo 2>&1 | tail -2"
in_root "cd /tmp && timeout 300 pathways train --model tiny --steps 20 2>&1 | tail -1"

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
in_root "cd /tmp && timeout 300 python3 py_check.py 2> /tmp/py.log || { tail -20 /tmp/py.log; exit 1; }"

step "examples/cpp built against /usr (find_package(pathways)) and run against a real controller and worker"
in_root "DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++ > /tmp/gxx.log 2>&1 || { tail -20 /tmp/gxx.log; exit 1; }"
in_root "cd /tmp && cmake -S example_src -B example_build -DCMAKE_BUILD_TYPE=Release > /tmp/cmake.log 2>&1 && \
  cmake --build example_build > /tmp/cmake_build.log 2>&1 || { tail -30 /tmp/cmake.log /tmp/cmake_build.log; exit 1; }"
# The controller writes its address to a file once it listens; the worker says "serving" once registered.
in_root "cd /tmp && rm -f address && { pathways controller --listen 127.0.0.1:0 --port-file /tmp/address > ctl.log 2>&1 & echo \$! > controller.pid; }"
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
in_root "cd /tmp && timeout 120 ./example_build/matmul_allreduce $address 2"

step "apt-get remove takes them away"
in_root "kill \$(cat /tmp/worker.pid) \$(cat /tmp/controller.pid); rm -f /tmp/worker.pid /tmp/controller.pid; \
  DEBIAN_FRONTEND=noninteractive apt-get remove -y -q pathways-dev pathways > /tmp/remove.log 2>&1 && \
  ! command -v pathways && ! python3 -c 'import pathways' 2> /dev/null && echo 'removed: no pathways binary, no Python package'"

printf '\nCLEAN DEBIAN 12 CHECK PASSED\n'
