#!/bin/sh
# Open MPI's rsh agent for nodes emulated on one machine (hvdx/runner/mpi.py; root only).
#
#   mpirun --mca plm_rsh_agent /path/to/uts_agent.sh --hostfile HOSTS ...
#
# Open MPI calls it as it would call ssh: `uts_agent.sh [ssh options] HOST COMMAND...`. Instead
# of logging in, it starts COMMAND (Open MPI's daemon, orted) in a new UTS namespace whose host
# name is HOST, so the daemon and the ranks it starts see a machine of that name: Open MPI and
# Horovod group ranks into nodes by host name, and each node keeps its own session directory and
# shared-memory segments. Like ssh, the command words are joined and run by a shell.
#
# On the emulated cluster (hvdx/runner/cluster.py) HVDX_NETNS_MAP="node0:ns0 node1:ns1" names
# each host's network namespace: the daemon then starts in it (`ip netns exec`), so its ranks
# reach the other nodes only over that node's shaped link. HVDX_CPU_MAP="node0:0 node1:1" pins each
# host's command to its cores (taskset), as a node's processes have only that node's cores.
#
# Named `ssh` on PATH it is also horovodrun's ssh for an elastic job on the emulated cluster
# (hvdx.runner.cluster.run_elastic_job): horovodrun starts a remote host's workers with
# `ssh -o ... HOST 'cd DIR ; ENV... COMMAND'`, and of a fixed-size horovodrun job on it
# (hvdx.runner.cluster.run_horovodrun_job), which first checks each host with
# `ssh -o ... HOST -o ConnectTimeout=N true`.
# The host is the first word that is not an ssh option; options may follow it too (horovodrun's
# `ssh ... HOST -o ConnectTimeout=N true`), skipped while more than the command remains.
host=""
while [ $# -gt 0 ] && { [ -z "$host" ] || [ $# -gt 1 ]; }; do
    case "$1" in
        -p|-i|-l|-o|-F) shift 2 ;;   # ssh options that take a value
        -*) shift ;;                 # other ssh flags (-x, -q, -T, ...)
        *) [ -n "$host" ] && break
           host="$1"
           shift ;;
    esac
done
if [ -z "$host" ] || [ $# -lt 1 ]; then
    echo "uts_agent.sh: usage: uts_agent.sh HOST COMMAND..." >&2
    exit 2
fi
pin=""
for pair in ${HVDX_CPU_MAP:-}; do
    if [ "${pair%%:*}" = "$host" ]; then
        pin="taskset -c ${pair#*:}"   # inherited by everything the command starts
    fi
done
for pair in ${HVDX_NETNS_MAP:-}; do
    if [ "${pair%%:*}" = "$host" ]; then
        exec $pin ip netns exec "${pair#*:}" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
    fi
done
exec $pin unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
