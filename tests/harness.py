"""Launches multi-rank test scripts with horovodrun (Gloo) and checks every rank's result.

A rank script calls `tests.multirank.rank.run(main)`: each rank writes its result (or its
traceback) to $HVDX_RESULT_DIR/rank-<r>.json, then meets the others at a final barrier.
`launch()` runs the job under a timeout, kills every process of it on expiry, and
`Launch.check()` fails with the ranks that failed or wrote nothing, and why.

On one machine, horovodrun treats `localhost`, `127.0.0.1` and this machine's host name
as three nodes: `hosts(2, 2)` gives a real 2-node x 2-rank topology. `launch_on_cluster()`
runs the same scripts on the emulated cluster of hvdx/runner/cluster.py instead (one network
namespace per node, shaped links between them).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

ROOT = Path(__file__).resolve().parents[1]
MULTIRANK = Path(__file__).resolve().parent / "multirank"
NODE_NAMES = ("localhost", "127.0.0.1", socket.gethostname())


def hosts(nodes: int, ranks_per_node: int) -> str:
    """A horovodrun -H value for `nodes` emulated nodes of `ranks_per_node` ranks each."""
    return host_list([ranks_per_node] * nodes)


def host_list(ranks_per_node: Sequence[int]) -> str:
    """A horovodrun -H value with the given number of ranks on each emulated node."""
    if len(ranks_per_node) > len(NODE_NAMES):
        raise ValueError(f"at most {len(NODE_NAMES)} emulated nodes on one machine")
    return ",".join(f"{name}:{n}" for name, n in zip(NODE_NAMES, ranks_per_node))


@dataclass
class Launch:
    """The outcome of one horovodrun job."""

    command: List[str]
    script: str
    np: int
    returncode: Optional[int]
    timed_out: bool
    output: str
    results: Dict[int, dict] = field(default_factory=dict)

    def rank_output(self, rank: int, lines: int = 25) -> str:
        """The last lines horovodrun printed for `rank` (it prefixes them with [rank])."""
        mine = [l for l in self.output.splitlines() if l.startswith(f"[{rank}]")]
        return "\n".join(mine[-lines:])

    def failures(self) -> List[str]:
        """One explanation per failed rank; empty when every rank succeeded."""
        problems = []
        for rank in range(self.np):
            result = self.results.get(rank)
            if result is None:
                why = "timed out" if self.timed_out else "wrote no result (crashed, or killed)"
                problems.append(f"rank {rank} {why}; its last output:\n{self.rank_output(rank)}")
            elif not result["ok"]:
                problems.append(f"rank {rank} failed:\n{result['error']}")
        if not problems and self.returncode != 0:
            problems.append(f"horovodrun exited with {self.returncode} although every rank succeeded:\n"
                            + "\n".join(self.output.splitlines()[-20:]))
        return problems

    def check(self) -> Dict[int, dict]:
        """Every rank's returned data, or AssertionError naming the ranks that failed."""
        problems = self.failures()
        if problems:
            head = f"{len(problems)} problem(s) in {' '.join(self.command)}"
            raise AssertionError(head + "\n\n" + "\n\n".join(problems))
        return {rank: result["data"] for rank, result in self.results.items()}


def leftover_processes(job: "Launch") -> List[psutil.Process]:
    """Processes still running the job's rank script (there should be none)."""
    return [proc for proc in psutil.process_iter(["cmdline"])
            if job.script in (proc.info["cmdline"] or ()) and proc.pid != os.getpid()]


def _kill_tree(pid: int) -> None:
    try:
        parent = psutil.Process(pid)
        procs = parent.children(recursive=True) + [parent]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def test_env(result_dir: str = ".") -> Dict[str, str]:
    """The environment of a rank script: results to `result_dir`, hvdx's tests importable."""
    return dict(os.environ, HVDX_RESULT_DIR=result_dir, PYTHONUNBUFFERED="1",
                TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))


def launch(script: str, *args: str, np: int, hosts: str, timeout: float = 180,
           env: Optional[Dict[str, str]] = None) -> Launch:
    """Runs tests/multirank/<script> on `np` ranks placed on `hosts`, under `timeout`."""
    horovodrun = Path(sys.executable).parent / "horovodrun"
    script_path = str(MULTIRANK / script)
    command = [str(horovodrun), "-np", str(np), "-H", hosts, "--gloo", sys.executable, script_path, *args]
    return _run(command, script_path, np, timeout, env)


def launch_on_cluster(script: str, *args: str, nodes: int, ranks_per_node: int, rate: str = "1gbit",
                      timeout: float = 180, env: Optional[Dict[str, str]] = None) -> Launch:
    """Runs tests/multirank/<script> on the emulated cluster (hvdx/runner/cluster.py): one
    network namespace per node, links shaped to `rate`. Needs root; see `cluster_unavailable`."""
    script_path = str(MULTIRANK / script)
    command = [sys.executable, str(ROOT / "hvdx" / "runner" / "cluster.py"), "--nodes", str(nodes),
               "--ranks-per-node", str(ranks_per_node), "--rate", rate, "--timeout", str(timeout),
               "--", sys.executable, script_path, *args]
    return _run(command, script_path, nodes * ranks_per_node, timeout + 30, env)


def cluster_unavailable() -> Optional[str]:
    """Why the emulated cluster cannot be built here (None when it can)."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network namespaces and tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the emulated cluster needs iproute2's ip and tc"
    probe = f"hvdx-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(command: List[str], script_path: str, np: int, timeout: float, env: Optional[Dict[str, str]]) -> Launch:
    with tempfile.TemporaryDirectory(prefix="hvdx-ranks-") as result_dir:
        full_env = test_env(result_dir)
        full_env.update(env or {})
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, env=full_env, cwd=ROOT,
                                start_new_session=True)
        timed_out = False
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_tree(proc.pid)
            output, _ = proc.communicate()
        results = {}
        for path in Path(result_dir).glob("rank-*.json"):
            result = json.loads(path.read_text())
            results[result["rank"]] = result
    return Launch(command=command, script=script_path, np=np, returncode=proc.returncode, timed_out=timed_out,
                  output=output, results=results)
