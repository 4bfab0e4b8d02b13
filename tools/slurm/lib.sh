# Shared by start.sh and stop.sh (sourced, not run): where the test cluster keeps its files, and how a pid file is
# checked. The daemons' pid files are the standard ones, so that stop.sh also stops a cluster started otherwise.

SLURM_CONF=/etc/slurm/slurm.conf                # where Debian's slurm binaries read their configuration
SLURM_STATE=/var/spool/ddcnn-slurm              # ctld/ (controller state) and d/ (slurmd spool)
SLURM_LOGS=/var/log/ddcnn-slurm                 # slurmctld.log, slurmd.log
CTLD_PIDFILE=/run/slurmctld.pid
SLURMD_PIDFILE=/run/slurmd.pid
MUNGED_PIDFILE=/run/munge/munged.pid            # munged's default
SACCT_STANDIN=/usr/local/bin/sacct              # ahead of /usr/bin/sacct on PATH

say() { echo "[slurm $(basename "$0" .sh) $(date +%T)] $*"; }

# The pid of the live process named $2 that pid file $1 names; fails when the file is missing or empty, the process
# is gone or a zombie (without a real init, a killed daemon stays a zombie until PID 1 reaps it, and `kill -0`
# still succeeds on it), or the pid now belongs to another program (a stale file after a reboot or SIGKILL).
pid_of() {
  local file=$1 name=$2 pid state
  [ -s "$file" ] || return 1
  pid=$({ tr -dc 0-9 <"$file"; } 2>/dev/null)
  [ -n "$pid" ] && [ -r "/proc/$pid/stat" ] || return 1
  state=$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)
  [ -n "$state" ] && [ "$state" != Z ] || return 1
  [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ] || return 1
  echo "$pid"
}

# Waits up to $2 tenths of a second for command $1 (a string, run by eval) to succeed.
wait_until() {
  local i
  for ((i = 0; i < $2; i++)); do eval "$1" && return 0; sleep 0.1; done
  eval "$1"
}
