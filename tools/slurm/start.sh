#!/usr/bin/env bash
# Starts a one-node SLURM cluster on this machine for ddcnn's SLURM tests (tests/parallel/test_slurm.py) and the
# `hydra/launcher=local_slurm` configuration: partition `debug`, this machine's cores, 90% of its memory.
#
#   sudo bash tools/slurm/start.sh        # then: pytest -m slurm;  stop with: sudo bash tools/slurm/stop.sh
#
# For Debian 12 (slurm 22.05) without systemd, e.g. a CI container; run as root. It installs
# `slurmctld slurmd slurm-client munge` with apt-get when they are missing, writes /etc/slurm/slurm.conf, starts
# munged, slurmctld and slurmd as daemons (their pid files in /run), waits until the node takes jobs, installs the
# sacct stand-in (tools/slurm/sacct) and runs one job through srun. Idempotent: run again on a running cluster, it
# changes nothing and only checks (a changed configuration restarts the daemons; a drained node is resumed).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tools/slurm/lib.sh
. "$here/lib.sh"

[ "$(id -u)" = 0 ] || { echo "tools/slurm/start.sh must run as root (sudo bash $0)" >&2; exit 1; }

# --- packages -------------------------------------------------------------------------------------------------------
export PATH=$PATH:/usr/sbin
missing=()
for pair in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  # Without the recommends: the daemons and clients only, no plugins for GPUs, HDF5 profiling, IPMI or RRD.
  apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
fi

# --- munge: the authentication every slurm message carries ---------------------------------------------------------
# munged starts only with its key and folders owned by user munge and closed to others; /run/munge is normally made
# by systemd.
install -d -o munge -g munge -m 0700 /etc/munge /var/log/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0755 /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  say "creating the munge key"
  runuser -u munge -- mungekey --create --force
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key
if ! pid_of "$MUNGED_PIDFILE" munged >/dev/null; then
  say "starting munged"
  # --force: start even where a munged killed earlier left its socket behind
  runuser -u munge -- munged --force
  wait_until 'munge -n </dev/null >/dev/null 2>&1' 100 || true
fi
munge -n </dev/null | unmunge >/dev/null || { echo "munge does not work (log: /var/log/munge/munged.log)" >&2; exit 1; }

# --- slurm.conf -----------------------------------------------------------------------------------------------------
host=$(hostname -s)
# `slurmd -C` prints this machine as slurmd will see it ("NodeName=vm CPUs=2 Boards=1 SocketsPerBoard=1
# CoresPerSocket=2 ThreadsPerCore=1 RealMemory=24105"): taken as it is, slurmd never disagrees with the
# configuration. Its memory less 10%: a node that claims more than slurmd measures is drained ("Low RealMemory").
hardware=$(slurmd -C | grep '^NodeName=')
memory=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$hardware")
node=$(sed -e "s/^NodeName=[^ ]*/NodeName=$host/" -e "s/RealMemory=[0-9]*/RealMemory=$((memory * 9 / 10))/" \
  <<<"$hardware")

install -d -m 0755 /etc/slurm "$SLURM_STATE/ctld" "$SLURM_STATE/d" "$SLURM_LOGS"
wanted=$(mktemp)
trap 'rm -f "$wanted"' EXIT
cat >"$wanted" <<EOF
# Written by ddcnn's tools/slurm/start.sh: one node, no accounting database, no cgroups.
ClusterName=ddcnn-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
MailProg=/bin/true
# Processes tracked through /proc and no task binding: the cgroup plugins fail in a container ("cgroup namespace
# 'freezer' not mounted"), every job then fails and the node is drained.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1000
# A node that went down comes back by itself when its slurmd registers again.
ReturnToService=2
# Finished jobs stay in slurmctld's table for an hour: the sacct stand-in answers from it.
MinJobAge=3600
# Seconds between SIGTERM and SIGKILL when a job is cancelled or requeued (the tests train past it).
KillWait=10
SlurmctldPidFile=$CTLD_PIDFILE
SlurmdPidFile=$SLURMD_PIDFILE
StateSaveLocation=$SLURM_STATE/ctld
SlurmdSpoolDir=$SLURM_STATE/d
SlurmctldLogFile=$SLURM_LOGS/slurmctld.log
SlurmdLogFile=$SLURM_LOGS/slurmd.log
$node NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
if ! cmp -s "$wanted" "$SLURM_CONF"; then
  for daemon in slurmd:"$SLURMD_PIDFILE" slurmctld:"$CTLD_PIDFILE"; do
    if pid=$(pid_of "${daemon#*:}" "${daemon%%:*}"); then
      say "the configuration changed: stopping ${daemon%%:*} (pid $pid) to restart it"
      kill -TERM "$pid"
      wait_until "! pid_of ${daemon#*:} ${daemon%%:*} >/dev/null" 150 || { echo "${daemon%%:*} did not stop" >&2; exit 1; }
    fi
  done
  say "writing $SLURM_CONF"
  install -m 0644 "$wanted" "$SLURM_CONF"
fi

# --- daemons --------------------------------------------------------------------------------------------------------
if ! pid_of "$CTLD_PIDFILE" slurmctld >/dev/null; then
  # slurmctld removes its pid file when it stops normally. One left behind means it was killed (SIGKILL, OOM): the
  # state it saved is then up to a minute old, and jobs that ended since come back as running forever, holding the
  # cores (new jobs would only queue). Those are cancelled below.
  killed=0
  [ -s "$CTLD_PIDFILE" ] && killed=1 && say "slurmctld was killed last time; its recovered jobs will be cancelled"
  say "starting slurmctld"
  slurmctld
  wait_until 'scontrol ping 2>/dev/null | grep -q "is UP"' 200 ||
    { tail -20 "$SLURM_LOGS/slurmctld.log" >&2; echo "slurmctld does not answer" >&2; exit 1; }
  if [ "$killed" = 1 ]; then
    stale=$(squeue -h -o %A | sort -u | tr '\n' ' ')
    if [ -n "${stale// /}" ]; then say "cancelling recovered jobs $stale"; scancel $stale || true; fi
  fi
fi
scontrol ping | grep -q 'is UP' || { echo "slurmctld does not answer" >&2; exit 1; }
if ! pid_of "$SLURMD_PIDFILE" slurmd >/dev/null; then
  say "starting slurmd"
  slurmd
fi

# --- the node must take jobs ----------------------------------------------------------------------------------------
# The node's state survives restarts: one drained once (a failed launch, too little memory) stays drained until
# resumed. INVAL means slurm.conf does not match the machine, which no resume fixes.
ready=0
for _ in $(seq 120); do
  state=$(sinfo -h -N -n "$host" -o %t 2>/dev/null | head -1)
  case $state in
    idle | mix | alloc | comp) ready=1; break ;;
    *'*') ;; # not responding yet: slurmd is still registering
    inval) echo "node $host is INVAL: $(sinfo -h -N -n "$host" -o %E)" >&2; exit 1 ;;
    drain | drng | down | fail | failg)
      say "node $host is $state ($(sinfo -h -N -n "$host" -o %E)): resuming it"
      scontrol update NodeName="$host" State=RESUME || true ;;
  esac
  sleep 0.5
done
[ "$ready" = 1 ] || { sinfo -N -l >&2; tail -20 "$SLURM_LOGS/slurmd.log" >&2; echo "node $host never became ready" >&2; exit 1; }

# --- sacct stand-in -------------------------------------------------------------------------------------------------
if ! cmp -s "$here/sacct" "$SACCT_STANDIN"; then
  say "installing the sacct stand-in as $SACCT_STANDIN"
  install -m 0755 "$here/sacct" "$SACCT_STANDIN.new"
  mv -f "$SACCT_STANDIN.new" "$SACCT_STANDIN"
fi

# --- smoke test: one job through srun, then its state as submitit reads it ------------------------------------------
job=$(timeout 120 srun -N1 -n1 -t1 -J ddcnn-smoke bash -c 'echo $SLURM_JOB_ID') ||
  { echo "srun smoke test failed" >&2; exit 1; }
sacct_says() { "$SACCT_STANDIN" -o JobID,State,NodeList --parsable2 -j "$job" | tail -n +2; }
wait_until '[ "$(sacct_says)" = "$job|COMPLETED|$host" ]' 100 ||
  { echo "sacct answers '$(sacct_says)' for the smoke test's job $job, not '$job|COMPLETED|$host'" >&2; exit 1; }
say "up: $(sinfo -h -o '%P %D %t %N %c CPUs %m MB') (munged $(pid_of "$MUNGED_PIDFILE" munged)," \
  "slurmctld $(pid_of "$CTLD_PIDFILE" slurmctld), slurmd $(pid_of "$SLURMD_PIDFILE" slurmd))"
