#!/bin/bash
# A one-node Slurm on this machine, for the tests that submit real jobs (tests/test_parts.py
# -k slurm, tests/test_elastic.py -k slurm; they skip where no Slurm answers). As root, after
# `apt-get install slurm-wlm munge` (Debian/Ubuntu):
#
#   scripts/local_slurm.sh          # writes /etc/slurm/slurm.conf for this host, starts munged, slurmctld, slurmd
#   sinfo                           # the node is "idle"
#
# It overwrites /etc/slurm/slurm.conf: use it on a development machine, not on a cluster's node.
set -euo pipefail
[ "$(id -u)" = 0 ] || { echo "local_slurm.sh: run as root (it writes /etc/slurm and starts daemons)" >&2; exit 2; }
for b in munged slurmctld slurmd sinfo; do
  command -v $b >/dev/null || [ -x /usr/sbin/$b ] || { echo "local_slurm.sh: $b not found: apt-get install slurm-wlm munge" >&2; exit 2; }
done
host=$(hostname -s)
cpus=$(nproc)
mem_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 * 8 / 10 ))
mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
SlurmUser=root
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$cpus RealMemory=$mem_mb State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
pgrep -x munged >/dev/null || runuser -u munge -- /usr/sbin/munged
pgrep -x slurmctld >/dev/null || /usr/sbin/slurmctld
pgrep -x slurmd >/dev/null || /usr/sbin/slurmd
for _ in $(seq 30); do sinfo -h -o %t 2>/dev/null | grep -q idle && { sinfo; exit 0; }; sleep 1; done
echo "local_slurm.sh: the node did not come up idle; see /var/log/slurm/" >&2; exit 1
