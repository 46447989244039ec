#!/bin/bash
# Runs deploy/slurm/pathways.sbatch for real on a Slurm cluster made on this machine: slurmctld and
# one slurmd per node, each in a network namespace (and hostname) of its own on a shared bridge,
# so the controller and workers reach each other by the nodes' addresses, as on separate machines.
# Needs root and Slurm (`make deps-slurm`); everything it makes (namespaces, daemons, a munge
# daemon with a key of its own, files under a temporary directory) is removed when it ends.
#
#   deploy/slurm/check_local.sh [BUILD_DIR] [NODES]      (make check-slurm)
#
# Prints the job's output and exits 0 when the job (the script's default: a tenant's runs over
# every node's devices) succeeded.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "${1:-build}" && pwd)
NODES=${2:-2}
PATHWAYS_BIN="$BUILD/bin/pathways"
[ "$(id -u)" = 0 ] || { echo "check_local.sh: needs root (network namespaces, Slurm's daemons)" >&2; exit 2; }
for tool in slurmctld slurmd sbatch munged mungekey ip unshare nsenter; do
  command -v "$tool" >/dev/null || { echo "check_local.sh: $tool is missing (make deps-slurm)" >&2; exit 2; }
done
[ -x "$PATHWAYS_BIN" ] || { echo "check_local.sh: no $PATHWAYS_BIN (make build)" >&2; exit 2; }
[ "$NODES" -ge 1 ] && [ "$NODES" -le 8 ] || { echo "check_local.sh: NODES must be 1 to 8" >&2; exit 2; }

prefix="ps$(( $$ % 100000 ))"  # interface names are at most 15 characters
subnet=$(( $$ % 200 + 20 ))
dir=$(mktemp -d /tmp/pathways-slurm.XXXXXX)
chmod 755 "$dir"
pids=()
spaces=()
cleanup() {
  # The job's steps first (a check cut short leaves them running), then the daemons, given a few
  # seconds; then whatever is still in a namespace (a slurmd waiting for its steps, slurmstepd,
  # the job's own processes) is killed, and the namespaces go.
  [ -e "$dir/slurm.conf" ] && ip netns exec "${prefix}ctl" scancel --full --quiet --user root 2>/dev/null || true
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for ns in "${spaces[@]}"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true; done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  for ns in "${spaces[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  rm -rf "$dir"
}
trap cleanup EXIT
# A signal ends the check through the EXIT trap (long waits below are `wait`s, which a signal
# interrupts; a foreground command would defer the trap until it ended).
trap 'exit 143' TERM
trap 'exit 130' INT

# The bridge, then a namespace per member: ctl (slurmctld) at .1, node n<i> at .<i+1>.
ip netns add "${prefix}sw"; spaces+=("${prefix}sw")
ip -n "${prefix}sw" link add br0 type bridge
ip -n "${prefix}sw" link set br0 up
members=(ctl)
for i in $(seq "$NODES"); do members+=("n$i"); done
hosts="127.0.0.1 localhost"$'\n'
for i in "${!members[@]}"; do hosts+="10.$subnet.0.$((i + 1)) ${members[$i]}"$'\n'; done
for i in "${!members[@]}"; do
  m=${members[$i]}
  ns="${prefix}$m"
  ip netns add "$ns"; spaces+=("$ns")
  ip link add "e$m" netns "$ns" type veth peer name "${prefix}p$m" netns "${prefix}sw"
  ip -n "$ns" addr add "10.$subnet.0.$((i + 1))/24" dev "e$m"
  ip -n "$ns" link set "e$m" up
  ip -n "$ns" link set lo up
  ip -n "${prefix}sw" link set "${prefix}p$m" master br0
  ip -n "${prefix}sw" link set "${prefix}p$m" up
  # The members' names, for every process of the member (`ip netns exec` and in_member below
  # show this file as /etc/hosts).
  mkdir -p "/etc/netns/$ns"
  printf '%s' "$hosts" > "/etc/netns/$ns/hosts"
done

# A munge daemon of this check's own, with its own key and socket (Slurm's authentication).
mkdir -p "$dir/munge"
mungekey --create --keyfile "$dir/munge/munge.key" >/dev/null
chmod 700 "$dir/munge"
chmod 600 "$dir/munge/munge.key"
munged --force --key-file "$dir/munge/munge.key" --socket "$dir/munge/socket" --pid-file "$dir/munge/pid" \
  --log-file "$dir/munge/log" --seed-file "$dir/munge/seed" --foreground >"$dir/munge/out" 2>&1 &
pids+=($!)

cpus=$(nproc)
mkdir -p "$dir/state" "$dir/spool" "$dir/log"
cat > "$dir/slurm.conf" <<EOF
ClusterName=pathways-check
SlurmctldHost=ctl(10.$subnet.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=DEFAULT CPUs=$cpus RealMemory=1000 State=UNKNOWN
EOF
for i in $(seq "$NODES"); do echo "NodeName=n$i NodeAddr=10.$subnet.0.$((i + 1))" >> "$dir/slurm.conf"; done
echo "PartitionName=check Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$dir/slurm.conf"
export SLURM_CONF="$dir/slurm.conf"

# Each daemon in its member's network namespace, with the member's name as its hostname (a UTS
# namespace) and the members' names in its /etc/hosts (a private mount). Not `ip netns exec`: it
# mounts /sys afresh, which hides the cgroup file systems slurmd needs.
in_member() {  # in the background only: it execs
  local m=$1; shift
  exec nsenter --net="/run/netns/${prefix}$m" unshare --uts --mount /bin/sh -c \
    "mount --bind /etc/netns/${prefix}$m/hosts /etc/hosts && hostname $m && exec \"\$@\"" sh "$@"
}
in_member ctl slurmctld -D -i -f "$SLURM_CONF" >"$dir/log/slurmctld.out" 2>&1 &
pids+=($!)
for i in $(seq "$NODES"); do
  mkdir -p "$dir/spool/n$i"
  in_member "n$i" slurmd -D -f "$SLURM_CONF" >"$dir/log/slurmd-n$i.out" 2>&1 &
  pids+=($!)
done

# sbatch and sinfo talk to slurmctld from the controller's namespace (the root one has no route).
on_ctl() { ip netns exec "${prefix}ctl" "$@"; }
idle=0
for _ in $(seq 60); do
  idle=$(on_ctl sinfo -h -N -t idle -o '%N' 2>/dev/null | wc -l || true)
  [ "$idle" -ge "$NODES" ] && break
  sleep 1
done
if [ "$idle" -lt "$NODES" ]; then
  echo "check_local.sh: only $idle of $NODES Slurm nodes came up in 60 s" >&2
  on_ctl sinfo -N 2>&1 >&2 || true
  tail -n 20 "$dir"/log/*.log >&2 || true
  exit 1
fi
echo "Slurm: $NODES nodes idle ($(on_ctl sinfo -h -N -o '%N %T' | tr '\n' ' '))"

status=0
# At most 10 minutes: a job that hangs fails the check instead of holding it.
on_ctl timeout 660 sbatch --wait --time 10 --nodes "$NODES" --output "$dir/job.out" \
  --export "ALL,PATHWAYS=$PATHWAYS_BIN,DEVICES=2" "$HERE/pathways.sbatch" &
wait $! || status=$?
echo "--- job output (sbatch exit status $status) ---"
cat "$dir/job.out" 2>/dev/null || true
if [ "$status" -ne 0 ]; then
  echo "--- Slurm's logs ---" >&2
  tail -n 20 "$dir"/log/*.log >&2 || true
fi
exit "$status"
