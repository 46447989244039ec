#!/bin/bash
# Builds deploy/Dockerfile with podman and runs a cluster from the image: a controller, a worker
# and a tenant's job, each a container of the image on the host's network. The base image
# (debian:12) is made here by debootstrap from Debian's mirror and imported, since no registry is
# reachable from the development machine; with one, podman would pull it instead.
#
#   make check-container          (root; Debian's mirror reachable; about 10 minutes, most of
#                                  it the image's own build of the runtime)
#
# The image build runs `make deps` and `make package` inside the first stage, as anyone's build
# of the Dockerfile would. Everything this makes (the root, the images and the containers) is
# removed at the end, also when a signal ends it.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
SOURCE=$(cd "$HERE/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "container_check.sh: needs root (debootstrap, podman)" >&2; exit 2; }
for tool in podman debootstrap runc; do
  command -v "$tool" >/dev/null || { echo "container_check.sh: $tool is missing (make deps-container)" >&2; exit 2; }
done
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
image=localhost/pathways-check:$$
base=docker.io/library/debian:12
# runc with cgroupfs: crun refuses the hybrid cgroup layout of machines like this one. Limits are
# given explicitly, within this shell's own (a container may not raise them).
podman_() { podman --runtime runc --cgroup-manager cgroupfs "$@"; }
limits=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")

root=$(mktemp -d /tmp/pathways-container-root.XXXXXX)
had_base=0
podman image exists "$base" && had_base=1
# Images there before: every other one is this check's (its base, its stages, the image), and
# goes at the end (another build running meanwhile would lose its images too).
images_before=$(podman_ images -aq --no-trunc | sort -u)
names=()
cleanup() {
  for n in "${names[@]}"; do podman_ rm -f "$n" >/dev/null 2>&1 || true; done
  comm -13 <(echo "$images_before") <(podman_ images -aq --no-trunc | sort -u) | xargs -r podman --runtime runc --cgroup-manager cgroupfs rmi -f >/dev/null 2>&1 || true
  rm -rf "$root" "$root.log"
}
trap cleanup EXIT
# A signal ends the check through the EXIT trap (the long steps run under `wait`, which a signal
# interrupts; a foreground command would defer the trap until it ended).
trap 'exit 143' TERM
trap 'exit 130' INT

if [ "$had_base" = 0 ]; then
  echo "container_check.sh: debian:12 from $mirror (debootstrap)"
  debootstrap --variant=minbase bookworm "$root" "$mirror" >"$root.log" 2>&1 &
  wait $! || { tail "$root.log" >&2; exit 1; }
  rm -f "$root.log"
  tar -C "$root" -c . | podman_ import - "$base" >/dev/null
fi

echo "container_check.sh: building the image (make deps and make package inside)"
podman_ build --network host "${limits[@]}" -f "$HERE/Dockerfile" -t "$image" "$SOURCE" &
wait $!

run() {  # NAME ARGS...: a container of the image, in the background, on the host's network
  local name=$1; shift
  names+=("$name")
  podman_ run -d --name "$name" --network host "${limits[@]}" "$image" "$@" >/dev/null
}
port=$(( 20000 + $$ % 20000 ))
suffix=$$
run "pw-controller-$suffix" controller --listen "127.0.0.1:$port"
run "pw-worker-$suffix" worker --controller "127.0.0.1:$port" --listen "127.0.0.1:$((port + 1))" --devices 4
# Until the worker has registered (status lists it alive), at most 60 s.
names+=("pw-status-$suffix" "pw-tenant-$suffix")
live=""
for _ in $(seq 60); do
  live=$(podman_ run --rm --name "pw-status-$suffix" --network host "${limits[@]}" "$image" \
           status --controller "127.0.0.1:$port" 2>/dev/null || true)
  grep -qE '^  host .* alive' <<<"$live" && break
  sleep 1
done
if ! grep -qE '^  host .* alive' <<<"$live"; then
  echo "container_check.sh: the worker did not register in 60 s" >&2
  podman_ logs "pw-worker-$suffix" >&2 || true
  exit 1
fi
status=0
podman_ run --rm --name "pw-tenant-$suffix" --network host "${limits[@]}" "$image" \
  tenant --controller "127.0.0.1:$port" --devices 4 --runs 100 --value 1 || status=$?
echo "--- controller ---"; podman_ logs "pw-controller-$suffix" 2>&1 | tail -n 5
echo "--- worker ---"; podman_ logs "pw-worker-$suffix" 2>&1 | tail -n 5
echo "container_check.sh: the tenant's job in the image exited $status"
exit "$status"
