#!/usr/bin/env bash
# make test-slurm: a one-node SLURM cluster (munged, slurmctld, slurmd on this machine) in a temporary
# folder, the tests in tests/slurm run against it, and every daemon it started stopped by its PID, also
# when a test fails or this script is interrupted. Installs slurm-wlm's daemons and munge with apt where
# they are missing (as root); where that cannot be done it says why and skips (exit 0).
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}

need=()
for tool in munged slurmctld slurmd sbatch; do command -v "$tool" >/dev/null || need+=("$tool"); done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "make test-slurm skipped: ${need[*]} missing, and apt-get as root is not available here to install slurm-wlm and munge"
    exit 0
  fi
  echo "make test-slurm: installing slurmctld, slurmd, slurm-client and munge (apt)"
  if ! (DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1 ||
        (apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null 2>&1)); then
    echo "make test-slurm skipped: apt-get could not install slurm-wlm and munge here"
    exit 0
  fi
fi
if [ "$(id -u)" != 0 ]; then
  echo "make test-slurm skipped: slurmd runs jobs as their users and must start as root; this is uid $(id -u)"
  exit 0
fi

ROOT_DIR=$(mktemp -d /tmp/nnx-shard-slurm.XXXXXX)
chmod 755 "$ROOT_DIR"  # munged runs as munge and must reach its folder
PIDS=()
stop() {
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
  for _ in $(seq 50); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
  rm -rf "$ROOT_DIR"
}
trap stop EXIT
trap 'exit 130' INT TERM

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
mkdir -p "$ROOT_DIR"/{munge,state,spool,log}
chown munge:munge "$ROOT_DIR/munge" && chmod 700 "$ROOT_DIR/munge"
dd if=/dev/urandom bs=1 count=1024 of="$ROOT_DIR/munge/munge.key" status=none
chown munge:munge "$ROOT_DIR/munge/munge.key" && chmod 400 "$ROOT_DIR/munge/munge.key"
SOCKET="$ROOT_DIR/munge/munge.socket"
runuser -u munge -- munged --force --key-file="$ROOT_DIR/munge/munge.key" --socket="$SOCKET" \
  --pid-file="$ROOT_DIR/munge/munged.pid" --log-file="$ROOT_DIR/munge/munged.log" --seed-file="$ROOT_DIR/munge/seed" \
  || { echo "make test-slurm: munged did not start"; cat "$ROOT_DIR/munge/munged.log"; exit 1; }
PIDS+=("$(cat "$ROOT_DIR/munge/munged.pid")")

NODE=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
cat > "$ROOT_DIR/slurm.conf" <<CONF
ClusterName=nnxshard
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: how long a requeued job waits before it starts again (SLURM: 120 s by default)
AuthInfo=socket=$SOCKET,cred_expire=10
StateSaveLocation=$ROOT_DIR/state
SlurmdSpoolDir=$ROOT_DIR/spool
SlurmctldPidFile=$ROOT_DIR/slurmctld.pid
SlurmdPidFile=$ROOT_DIR/slurmd.pid
SlurmctldLogFile=$ROOT_DIR/log/slurmctld.log
SlurmdLogFile=$ROOT_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
export SLURM_CONF="$ROOT_DIR/slurm.conf"
slurmctld -f "$SLURM_CONF" -i || { echo "make test-slurm: slurmctld did not start"; cat "$ROOT_DIR/log/slurmctld.log"; exit 1; }
for _ in $(seq 50); do [ -s "$ROOT_DIR/slurmctld.pid" ] && break; sleep 0.1; done
PIDS+=("$(cat "$ROOT_DIR/slurmctld.pid")")
slurmd -f "$SLURM_CONF" || { echo "make test-slurm: slurmd did not start"; cat "$ROOT_DIR/log/slurmd.log"; exit 1; }
for _ in $(seq 50); do [ -s "$ROOT_DIR/slurmd.pid" ] && break; sleep 0.1; done
PIDS+=("$(cat "$ROOT_DIR/slurmd.pid")")
for _ in $(seq 100); do sinfo -h -o %T 2>/dev/null | grep -q '^idle' && break; sleep 0.2; done
echo "make test-slurm: $(sinfo -h -o '%P %D %T %c' | head -1) cpus on node $NODE (slurm $(sinfo -V | cut -d' ' -f2)); daemons ${PIDS[*]}"

JAX_PLATFORMS=cpu "$PY" -m pytest -q -p no:cacheprovider --durations=0 -rA tests/slurm "$@"
