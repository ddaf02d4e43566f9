#!/usr/bin/env bash
# Start a real single-node SLURM on this machine (munged + slurmctld + slurmd), so
# `stapoctl submit cluster=slurm` and the SLURM tests run against real sbatch/squeue/scontrol.
#
# Debian's slurm-wlm 22.05 + munge, installed with apt only when missing. Runs as root without
# systemd or cgroups: proctrack/linuxproc, task/none, select/cons_tres with CR_Core_Memory, no
# accounting daemon; state, spool, logs and pid files live in $STAPOCTL_SLURM_STATE
# (default /tmp/stapoctl-local-slurm). The config goes to /etc/slurm/slurm.conf, where every
# SLURM client looks, and carries a marker line: a site's own slurm.conf is never overwritten.
#
# Idempotent: a second call finds the daemons it started alive and only prints how to use them.
# cluster/local-slurm/stop.sh stops exactly what this script started (its pid files).
set -euo pipefail

STATE=${STAPOCTL_SLURM_STATE:-/tmp/stapoctl-local-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by stapoctl cluster/local-slurm/start.sh"
PARTITION=${STAPOCTL_SLURM_PARTITION:-debug}
t0=$(date +%s)

die() { echo "local-slurm: $*" >&2; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

usage() {
    local node
    node=$(sinfo -h -N -o '%N %c CPUs %m MB %t' 2>/dev/null | head -1)
    cat <<EOF
local-slurm: up ($(($(date +%s) - t0)) s) — partition '$PARTITION', node: $node
  state, logs: $STATE        config: $CONF
  try:   sinfo; squeue
         stapoctl submit cluster=slurm cluster.preset=local --follow
         stapoctl jobs list
  stop:  bash cluster/local-slurm/stop.sh
EOF
}

[ "$(id -u)" = 0 ] || die "needs root (slurmd starts jobs as their user; no systemd here to do it for us)"

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    echo "local-slurm: installing slurm-wlm and munge with apt-get (once, ~30 s)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; } ||
        die "apt-get install slurm-wlm munge failed"
fi

mkdir -p "$STATE"
if alive "$STATE/slurmctld.pid" && alive "$STATE/slurmd.pid" && sinfo -h >/dev/null 2>&1; then
    usage
    exit 0
fi
if [ -f "$CONF" ] && ! grep -qF "$MARK" "$CONF"; then
    die "$CONF exists and was not written by this script: this machine has its own SLURM; use it"
fi

# -- munge: the key must be owned by munge and private, or munged refuses to start
if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown -R munge:munge /etc/munge && chmod 700 /etc/munge && chmod 400 /etc/munge/munge.key
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid ||
        die "munged did not start (see /var/log/munge/munged.log)"
    cp /run/munge/munged.pid "$STATE/munged.pid"  # ours: stop.sh stops it
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
fi
munge -n | unmunge >/dev/null || die "munge does not answer"

# -- slurm.conf for this one node, with its real CPUs and memory (slurmd -C)
node=$(slurmd -C | head -1)
host=$(hostname -s)
rm -rf "$STATE/ctld" "$STATE/spool"  # a fresh cluster: no jobs recovered from a previous start
mkdir -p "$STATE/ctld" "$STATE/spool" /etc/slurm
cat >"$CONF" <<EOF
$MARK ($(date -Is)); stop.sh removes it
ClusterName=stapoctl-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
# finished jobs stay visible to scontrol for an hour (there is no accounting database)
MinJobAge=3600
KillWait=10
JobRequeue=1
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
$node State=UNKNOWN
PartitionName=$PARTITION Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

alive "$STATE/slurmctld.pid" || slurmctld || die "slurmctld did not start (see $STATE/slurmctld.log)"
alive "$STATE/slurmd.pid" || slurmd || die "slurmd did not start (see $STATE/slurmd.log)"
for _ in $(seq 120); do
    case "$(sinfo -h -N -o %t 2>/dev/null | head -1)" in
        idle | mix | alloc) usage; exit 0 ;;
    esac
    sleep 0.25
done
die "the node did not come up within 30 s: $(sinfo -h -N -o '%N %t %E' 2>&1 | head -1) (see $STATE/*.log)"
