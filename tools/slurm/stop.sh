#!/usr/bin/env bash
# Stops the test cluster of tools/slurm/start.sh: cancels its jobs, then stops slurmd, slurmctld and munged, each
# only through its pid file (and only when that pid is still the named program; never by name). Run as root.
# Idempotent: nothing running is not an error. The packages, configuration and sacct stand-in stay, so that the next
# start.sh is quick.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=tools/slurm/lib.sh
. "$here/lib.sh"
export PATH=$PATH:/usr/sbin

[ "$(id -u)" = 0 ] || { echo "tools/slurm/stop.sh must run as root (sudo bash $0)" >&2; exit 1; }

# Jobs first, while slurmctld can still end them: no job step is left running without its daemons.
if pid_of "$CTLD_PIDFILE" slurmctld >/dev/null; then
  jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
  if [ -n "${jobs// /}" ]; then
    say "cancelling jobs $jobs"
    scancel $jobs 2>/dev/null
    wait_until '[ -z "$(squeue -h 2>/dev/null)" ]' 150 || say "jobs still listed: $(squeue -h -o '%A %T' | tr '\n' ' ')"
  fi
fi

stop() { # $1 pid file, $2 program name
  local pid
  if ! pid=$(pid_of "$1" "$2"); then
    [ -e "$1" ] && say "$2 is not running (removing the stale $1)" && rm -f "$1"
    return 0
  fi
  say "stopping $2 (pid $pid)"
  kill -TERM "$pid"
  if wait_until "! pid_of $1 $2 >/dev/null" 150; then
    rm -f "$1"
  else
    # The pid file stays: start.sh then knows slurmctld was killed and cancels the jobs its stale state brings back.
    say "$2 (pid $pid) still runs 15 s after SIGTERM: SIGKILL"
    kill -KILL "$pid"
    wait_until "! pid_of $1 $2 >/dev/null" 50
  fi
}
stop "$SLURMD_PIDFILE" slurmd
stop "$CTLD_PIDFILE" slurmctld
stop "$MUNGED_PIDFILE" munged
exit 0
