"""Launches multi-rank test scripts with horovodrun (Gloo) and checks every rank's result.

A rank script calls `tests.multirank.rank.run(main)`: each rank writes its result (or its
traceback) to $HVDX_RESULT_DIR/rank-<r>.json, then meets the others at a final barrier.
`launch()` runs the job under a timeout, kills every process of it on expiry, and
`Launch.check()` fails with the ranks that failed or wrote nothing, and why.

Host lists and launching are hvdx.runner's: `hosts(2, 2)` is a real 2-node x 2-rank
topology on this one machine (hvdx/runner/hosts.py), and `launch_on_cluster()` runs the same
scripts on the emulated cluster of hvdx/runner/cluster.py instead (one network namespace per
node, shaped links between them).
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import psutil
import pytest

from hvdx import legacy_keras
from hvdx.runner import NODE_NAMES, cluster_command, horovodrun_command, host_list, hosts, kill_tree, run  # noqa: F401
from hvdx.runner.netns import unavailable

ROOT = Path(__file__).resolve().parents[1]
MULTIRANK = Path(__file__).resolve().parent / "multirank"


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
    cpu_seconds: Optional[float] = None  # the launcher's and every rank's together (None: killed, not measured)

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


#: The keras package's version, and whether it is Keras 3 (`import keras` from TensorFlow 2.16
#: on, the tf2.21 stack; TensorFlow 2.15's is Keras 2): what the Keras 3 tests need.
KERAS_VERSION = importlib.metadata.version("keras")
HAS_KERAS3 = int(KERAS_VERSION.split(".")[0]) >= 3
NO_KERAS3 = f"no Keras 3: the keras package is {KERAS_VERSION} (Keras 3 is `import keras` from TensorFlow 2.16 on)"
#: Marks a test (or, as `pytestmark`, a module) that needs Keras 3.
KERAS3 = pytest.mark.skipif(not HAS_KERAS3, reason=NO_KERAS3)


def leftover_processes(job: "Launch") -> List[psutil.Process]:
    """Processes still running the job's rank script (there should be none)."""
    return [proc for proc in psutil.process_iter(["cmdline"])
            if job.script in (proc.info["cmdline"] or ()) and proc.pid != os.getpid()]


_kill_tree = kill_tree  # SIGKILL to a process and all its descendants (hvdx/runner/launch.py)


#: A prefix that starts a command as a terminal would, SIGINT at its default: a shell runs a
#: background job (`make test &`, nohup) with SIGINT ignored, its children inherit that, and
#: Python then installs no KeyboardInterrupt handler, so a test's Ctrl-C would not reach them.
FOREGROUND = ["env", "--default-signal=INT"]

#: Horovod's background thread wakes every HOROVOD_CYCLE_TIME ms (default 1) and, under Gloo,
#: negotiates with the other ranks even when no tensor is pending: 4 idle ranks on this 2-core
#: machine burn about one core between them (0.3 CPU s per rank per second, against 0.03 at
#: 5 ms), the cores the working ranks need. Busy ranks pay per cycle too (futex and epoll
#: system time): optimizer.training, training_path.horovod_options and .checkpoints in one
#: 2x2 launch took 210 CPU s at 5 ms, 192 at 10 and 166 at 20, while a collective waits for
#: the next cycle (half of one on average), which lengthens checks of many small sequential
#: steps (optimizer.training: 85 s at 5 ms, 109 s at 20). 10 ms: most of the saving, little
#: of the wait. Tests run many ranks on few cores; a user's job may set its own (the
#: environment wins).
TEST_CYCLE_TIME_MS = "10"


def test_env(result_dir: str = ".") -> Dict[str, str]:
    """The environment of a rank script: results to `result_dir`, hvdx's tests importable,
    Horovod's cycle time for many ranks on few cores (TEST_CYCLE_TIME_MS) unless set, tf.keras
    as Keras 2 (legacy_keras.keras2_env(): the rank scripts written with tf.keras are the Keras 2
    checks; a Keras 3 launch removes the variable, as the "keras3:" topologies do)."""
    env = dict(os.environ, HVDX_RESULT_DIR=result_dir, PYTHONUNBUFFERED="1",
               TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), **legacy_keras.keras2_env())
    env.setdefault("HOROVOD_CYCLE_TIME", TEST_CYCLE_TIME_MS)
    return env


def launch(script: str, *args: str, np: int, hosts: str, timeout: float = 180,
           env: Optional[Dict[str, Optional[str]]] = None) -> Launch:
    """Runs tests/multirank/<script> on `np` ranks placed on `hosts`, under `timeout`, with
    `env` over the test environment (a None value removes that variable)."""
    script_path = str(MULTIRANK / script)
    command = horovodrun_command([sys.executable, script_path, *args], np=np, hosts=hosts)
    return _run(command, script_path, np, timeout, env)


def launch_on_cluster(script: str, *args: str, nodes: int, ranks_per_node: int, rate: str = "1gbit",
                      timeout: float = 180, env: Optional[Dict[str, str]] = None) -> Launch:
    """Runs tests/multirank/<script> on the emulated cluster (hvdx/runner/cluster.py): one
    network namespace per node, links shaped to `rate`. Needs root; see `cluster_unavailable`."""
    script_path = str(MULTIRANK / script)
    command = cluster_command([sys.executable, script_path, *args], nodes=nodes, ranks_per_node=ranks_per_node,
                              rate=rate, timeout=timeout)
    with network_lock():
        return _run(command, script_path, nodes * ranks_per_node, timeout + 30, env)


#: Held while an emulated cluster of the test session exists, and by the tests that compare
#: the machine's network state (namespaces, links, qdiscs) before and after: the suite's
#: launches run beside the other tests in a thread of the same process (tests/suite.py),
#: and one's namespaces must not be taken for another's leftovers. Reentrant: a test that
#: holds it may launch a cluster itself.
NETWORK_LOCK = threading.RLock()


@contextlib.contextmanager
def network_lock() -> Iterator[None]:
    """Holds NETWORK_LOCK."""
    with NETWORK_LOCK:
        yield


def cluster_unavailable() -> Optional[str]:
    """Why the emulated cluster cannot be built here (None when it can)."""
    return unavailable()


#: Wraps every launch: the job's own CPU seconds, measured by its parent (tests/cpu_meter.py).
CPU_METER = Path(__file__).resolve().with_name("cpu_meter.py")


def _run(command: List[str], script_path: str, np: int, timeout: float, env: Optional[Dict[str, str]]) -> Launch:
    with tempfile.TemporaryDirectory(prefix="hvdx-ranks-") as result_dir:
        full_env = test_env(result_dir)
        for key, value in (env or {}).items():  # None: the variable removed
            full_env.pop(key, None) if value is None else full_env.__setitem__(key, value)
        meter = Path(result_dir) / "cpu.json"
        job = run([sys.executable, str(CPU_METER), str(meter), "--", *command], timeout=timeout, env=full_env,
                  cwd=ROOT)
        results = {}
        for path in Path(result_dir).glob("rank-*.json"):
            result = json.loads(path.read_text())
            results[result["rank"]] = result
        cpu = json.loads(meter.read_text())["cpu_seconds"] if meter.exists() else None
    return Launch(command=command, script=script_path, np=np, returncode=job.returncode, timed_out=job.timed_out,
                  output=job.output, results=results, cpu_seconds=cpu)


def thread_allgather(world: int, timeout: float = 60) -> Callable[[Any], List[Any]]:
    """allgather(obj) for `world` threads of this process standing in for ranks; obj[0] is
    the caller's rank. Two barriers per call, so it can be called again at once."""
    slots: list = [None] * world
    barrier = threading.Barrier(world, timeout=timeout)

    def allgather(obj):
        slots[obj[0]] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out
    return allgather


def on_threads(build: Callable[[int], Any], world: int, join_timeout: float = 60) -> List[Any]:
    """[build(0), ..., build(world - 1)], each called on its own thread (ranks that set up
    together); the first exception raised by any of them is raised here."""
    out: list = [None] * world
    errors: list = []

    def run_one(rank: int) -> None:
        try:
            out[rank] = build(rank)
        except BaseException as exc:  # noqa: B902 - handed to the caller
            errors.append(exc)

    threads = [threading.Thread(target=run_one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join_timeout)
    if errors:
        raise errors[0]
    return out
