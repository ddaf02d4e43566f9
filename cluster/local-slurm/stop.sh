#!/usr/bin/env bash
# Stop what cluster/local-slurm/start.sh started, by its pid files: cancel the jobs still in the
# queue (their processes would outlive slurmd), stop slurmd and slurmctld, and munged when
# start.sh started it; remove the slurm.conf it wrote. Logs stay in the state dir.
set -uo pipefail

STATE=${STAPOCTL_SLURM_STATE:-/tmp/stapoctl-local-slurm}
CONF=/etc/slurm/slurm.conf
MARK="# written by stapoctl cluster/local-slurm/start.sh"
t0=$(date +%s)

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop_pidfile() {  # stop_pidfile FILE NAME: TERM, then KILL after 10 s
    local f=$1 name=$2 pid
    alive "$f" || { rm -f "$f"; return 0; }
    pid=$(cat "$f")
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && { echo "local-slurm: $name ($pid) ignored TERM; killing"; kill -KILL "$pid"; }
    rm -f "$f"
    echo "local-slurm: stopped $name ($pid)"
}

if [ ! -d "$STATE" ]; then
    echo "local-slurm: nothing to stop (no $STATE)"
    exit 0
fi
if alive "$STATE/slurmctld.pid" && alive "$STATE/slurmd.pid"; then
    jobs=$(squeue -h -o %A 2>/dev/null | sort -u | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        echo "local-slurm: cancelling jobs $jobs"
        scancel $jobs 2>/dev/null
        for _ in $(seq 150); do [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break; sleep 0.2; done
    fi
fi
stop_pidfile "$STATE/slurmd.pid" slurmd
stop_pidfile "$STATE/slurmctld.pid" slurmctld
stop_pidfile "$STATE/munged.pid" munged
if [ -f "$CONF" ] && grep -qF "$MARK" "$CONF"; then
    rm -f "$CONF"
fi
rm -rf "$STATE/ctld" "$STATE/spool"
echo "local-slurm: stopped in $(($(date +%s) - t0)) s (logs kept in $STATE)"
