"""The emulated cluster's command line: `python -m hvdx.runner ...`, the same as
`python hvdx/runner/cluster.py ...` (which starts without importing TensorFlow).

    python -m hvdx.runner [--nodes N] [--ranks-per-node M] [--rate R] [--delay D | --no-delay]
                          [--loss L] [--mtu B] [--timeout S] [--pin-cores]
                          [--mpi | --elastic --host-discovery-script S [--min-np K] [--max-np L]]
                          (-- command ... | --probe | --cleanup)

Exit status: the job's (the first failing rank's, 124 on timeout), 2 when the cluster cannot
be built or the options are wrong (the reason on stderr, after `hvdx-cluster: `), 130 on Ctrl-C.
"""
from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from .cluster import DESCRIPTION, Cluster, run_elastic_job, run_job, run_mpi_job
from .netns import ClusterError, cleanup_stale
from .probe import client, endpoint, probe_links
from .shaping import LinkSpec


def _raise_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def parser() -> argparse.ArgumentParser:
    """The options; a command to run goes after `--` and is split off before parsing."""
    prog = "python -m hvdx.runner" if Path(sys.argv[0]).name == "__main__.py" else None
    out = argparse.ArgumentParser(prog=prog, description=DESCRIPTION,
                                  usage="%(prog)s [options] [--probe | --cleanup | -- command ...]")
    out.add_argument("--nodes", type=int, default=2)
    out.add_argument("--ranks-per-node", type=int, default=2)
    out.add_argument("--rate", default="1gbit", help="per-node link rate, tc syntax (default 1gbit)")
    out.add_argument("--delay", default="0.1ms", help="one-way delay per link end (netem; default 0.1ms)")
    out.add_argument("--no-delay", action="store_true", help="no netem at all")
    out.add_argument("--loss", default=None, help="loss per link end, e.g. 0.1%% (netem)")
    out.add_argument("--mtu", type=int, default=1500)
    out.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    out.add_argument("--mpi", action="store_true",
                     help="start the ranks with mpirun (Open MPI) instead of Horovod's Gloo launcher")
    out.add_argument("--pin-cores", action="store_true",
                     help="run each node's processes on its own share of this machine's cores")
    out.add_argument("--elastic", action="store_true",
                     help="an elastic job: horovodrun --gloo with --host-discovery-script, in the switch namespace")
    out.add_argument("--host-discovery-script", help="with --elastic: prints the nodes up, e.g. 'node0:2'")
    out.add_argument("--min-np", type=int, default=None, help="with --elastic (default: --ranks-per-node)")
    out.add_argument("--max-np", type=int, default=None, help="with --elastic (default: every node's ranks)")
    out.add_argument("--probe", action="store_true", help="measure the links and exit")
    out.add_argument("--cleanup", action="store_true", help="remove namespaces of dead launchers")
    for hidden in ("--endpoint", "--client"):  # the two ends of a probe (hvdx/runner/probe.py)
        out.add_argument(hidden, choices=("recv", "echo"), help=argparse.SUPPRESS)
    out.add_argument("--host", help=argparse.SUPPRESS)
    out.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    out.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    return out


def _print_probe(result: dict) -> None:
    print(json.dumps(result))
    print(f"inter-node {result['inter_bps'] / 1e6:.0f} Mbit/s (configured "
          f"{result['configured_bps'] / 1e6:.0f}), intra-node {result['intra_bps'] / 1e6:.0f} Mbit/s; "
          f"round trip {result['inter_rtt_s'] * 1e6:.0f} us between nodes, "
          f"{result['intra_rtt_s'] * 1e6:.0f} us inside one")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Builds the cluster, runs the command (or probes the links), removes the cluster;
    returns the exit status (see the module's docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    options = parser()
    args = options.parse_args(argv)
    if args.endpoint or args.client:
        run_end = endpoint if args.endpoint else client
        run_end(args.endpoint or args.client, args.host, args.nbytes, args.rounds)
        return 0
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespace(s){': ' + ' '.join(removed) if removed else ''}")
        return 0
    if not command and not args.probe:
        options.error("give a command after --, or --probe")
    if args.elastic and (args.mpi or not args.host_discovery_script):
        options.error("--elastic needs --host-discovery-script and Horovod's Gloo launcher (not --mpi)")
    previous = {sig: signal.signal(sig, _raise_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        return _on_cluster(args, command)
    finally:  # main() may run in a process that goes on (python -m hvdx.runner is one that does not)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _on_cluster(args: argparse.Namespace, command: List[str]) -> int:
    try:
        link = LinkSpec(rate=args.rate, delay=None if args.no_delay else args.delay, loss=args.loss, mtu=args.mtu)
        with Cluster(args.nodes, link, pin_cores=args.pin_cores) as built:
            print(f"hvdx-cluster: {args.nodes} node(s) x {args.ranks_per_node} rank(s), "
                  f"links {json.dumps(built.describe())}", flush=True)
            if args.probe:
                _print_probe(probe_links(built))
                return 0
            print(f"hvdx-cluster: running {shlex.join(command)}", flush=True)
            if args.elastic:
                return run_elastic_job(built, args.ranks_per_node, command, timeout=args.timeout,
                                       discovery_script=args.host_discovery_script,
                                       min_np=args.min_np or args.ranks_per_node, max_np=args.max_np)
            job = run_mpi_job if args.mpi else run_job
            return job(built, args.ranks_per_node, command, timeout=args.timeout)
    except ClusterError as exc:
        print(f"hvdx-cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hvdx-cluster: interrupted; cleaned up", file=sys.stderr)
        return 130
