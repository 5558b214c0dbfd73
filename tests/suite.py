"""One launch per topology: the multi-rank checks the collected tests need, run in one job each.

A test names the check it asserts on and where it runs, and gets every rank's data:

    @suite.runs(suite.check("daso.merge", "2x2"), suite.check("daso.merge", "3x2"))
    def test_merge(ranks):            # ranks: {rank: what CHECKS["merge"] of check_daso.py returned}
        ...

The first test that needs a topology launches it once (tests/multirank/suite.py under
horovodrun, or on the emulated cluster) with the union of the checks that the session's
selected tests need there, in collection order; every other test of that topology reads its
check's result. A check that failed fails only its tests, with each rank's traceback. A check
that hangs or crashes a rank ends at its timeout naming the rank and the check; the checks
after it run in a fresh launch of their own.

In a whole session (`Suite.start_ahead`), the launches start at once in a background thread,
one after another in the order the tests need them, while the tests that launch nothing run;
those tests run first, the multi-rank tests after them, each waiting for its launch only if it
has not ended yet (HVDX_LAUNCH_AHEAD=0: each launch when its first test needs it).

Topologies: "2x2" (2 nodes x 2 ranks, harness.hosts), "1+2" (nodes of different sizes,
harness.host_list), "cluster:2x2" (the emulated cluster, 1 Gbit/s links; "cluster:2x2@100mbit"),
"keras3:2x2" (2x2 with tf.keras left to TensorFlow: no $TF_USE_LEGACY_KERAS, Keras 3 from
TensorFlow 2.16 on, where the suite's own processes have tf.keras as Keras 2: tests/conftest.py).
"""
from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import psutil
import pytest

from tests import harness

STARTUP = 180  # seconds a launch may spend starting (horovodrun, TensorFlow's import) and ending
GRACE = 120  # seconds past a check's timeout before the host stops a launch (the rank's own watchdog did not)
_LINE = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")


@dataclass(frozen=True)
class Topology:
    """Where a launch runs: `nodes` x `per_node` ranks (or `sizes` ranks per node)."""

    name: str
    sizes: Tuple[int, ...]
    cluster_rate: Optional[str] = None
    keras3: bool = False

    @classmethod
    def parse(cls, name: str) -> "Topology":
        spec, rate = name, None
        if spec.startswith("keras3:"):
            inner = cls.parse(spec[len("keras3:"):])
            if inner.cluster_rate is not None:
                raise ValueError(f"bad topology {name!r}: keras3: takes a loopback topology ('keras3:2x2')")
            return cls(name, inner.sizes, keras3=True)
        if spec.startswith("cluster:"):
            spec, _, rate = spec[len("cluster:"):].partition("@")
            rate = rate or "1gbit"
        if re.fullmatch(r"\d+x\d+", spec):
            nodes, per_node = map(int, spec.split("x"))
            return cls(name, (per_node,) * nodes, rate)
        if re.fullmatch(r"\d+(\+\d+)+", spec) and rate is None:
            return cls(name, tuple(int(n) for n in spec.split("+")))
        raise ValueError(f"bad topology {name!r}: give 'NODESxRANKS' (e.g. '2x2'), sizes per node ('1+2'), "
                         "'cluster:NODESxRANKS[@RATE]' or 'keras3:NODESxRANKS'")

    @property
    def np(self) -> int:
        return sum(self.sizes)

    @property
    def nodes(self) -> int:
        return len(self.sizes)

    @property
    def per_node(self) -> int:
        if len(set(self.sizes)) != 1:
            raise ValueError(f"{self.name} has nodes of different sizes")
        return self.sizes[0]

    def launch(self, plan: Path, timeout: float) -> harness.Launch:
        """Runs tests/multirank/suite.py on `plan` here, under `timeout`."""
        if self.cluster_rate is not None:
            return harness.launch_on_cluster("suite.py", str(plan), nodes=self.nodes, ranks_per_node=self.per_node,
                                             rate=self.cluster_rate, timeout=timeout)
        env = {"TF_USE_LEGACY_KERAS": None} if self.keras3 else None
        return harness.launch("suite.py", str(plan), np=self.np, hosts=harness.host_list(self.sizes),
                              timeout=timeout, env=env)


@dataclass(frozen=True)
class Check:
    """A check of tests/multirank/check_<module>.py (`name` = "<module>.<key of its CHECKS>") on
    `topology`, with keyword arguments and environment variables; `setup(workdir)`, run on the
    host before the launch, returns more keyword arguments (paths of files it wrote there)."""

    name: str
    topology: str
    kwargs: Tuple[Tuple[str, Any], ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    setup: Optional[Callable[[Path], Dict[str, Any]]] = None
    timeout: float = 300

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs + self.env)
        return f"{self.name}({args}) on {self.topology}"


def check(name: str, topology: str, *, timeout: float = 300, env: Optional[Dict[str, str]] = None,
          setup: Optional[Callable[[Path], Dict[str, Any]]] = None, **kwargs: Any) -> Check:
    """A `Check`; `timeout` bounds the check on each rank (the launch adds its start-up)."""
    Topology.parse(topology)
    frozen = {key: tuple(value) if isinstance(value, list) else value for key, value in kwargs.items()}
    return Check(name, topology, tuple(sorted(frozen.items())), tuple(sorted((env or {}).items())), setup, timeout)


_PARAM = type(pytest.param(None))  # what pytest.param returns


def runs(*checks: Any, ids: Optional[Sequence[str]] = None):
    """Parametrizes a test by `checks`: its `ranks` fixture is the check's `RankResults`; marks
    it `multirank`. A check may come as `pytest.param(check, marks=...)` to carry marks of its
    own (`second_stack` on one topology of a test). `ids` default to the topologies."""
    planned = [c.values[0] if isinstance(c, _PARAM) else c for c in checks]
    if not all(isinstance(c, Check) for c in planned):
        raise TypeError(f"suite.runs takes Checks (suite.check) or pytest.param(Check), got {checks!r}")
    if ids is None:
        ids = [c.topology for c in planned]

    def mark(test):
        test = pytest.mark.parametrize("ranks", list(checks), indirect=True, ids=list(ids))(test)
        return pytest.mark.multirank(test)

    return mark


class RankResults(dict):
    """{rank: data} of one check on every rank, with the check's own part of the job's output."""

    def __init__(self, planned: Check, data: Dict[int, Any], output: str, workdir: Path):
        super().__init__(data)
        self.check, self.output, self.workdir = planned, output, workdir
        self.topology = Topology.parse(planned.topology)
        self.nodes = self.topology.nodes

    @property
    def per_node(self) -> int:
        return self.topology.per_node

    def every(self) -> List[Any]:
        """Every rank's data, in rank order."""
        return [self[rank] for rank in sorted(self)]

    def rank_output(self, rank: int, lines: int = 25) -> str:
        """The check's last lines of output from `rank`."""
        mine = [line for line in self.output.splitlines() if line.startswith(f"[{rank}]")]
        return "\n".join(mine[-lines:])


def needed(item: pytest.Item) -> Optional[Check]:
    """The check a collected test asserts on, if it is a `runs` test."""
    callspec = getattr(item, "callspec", None)
    planned = callspec.params.get("ranks") if callspec is not None else None
    return planned if isinstance(planned, Check) else None


def budget(checks: Iterable[Check]) -> float:
    """Seconds a launch of `checks` may take, its retries included."""
    return STARTUP + sum(c.timeout for c in checks)


def split_output(output: str) -> Dict[str, str]:
    """Each check's lines of a launch's output (horovodrun's `[rank]<stream>:` lines between
    the ranks' `hvdx-suite: begin/end <id>` markers), by check id."""
    current: Dict[Tuple[str, str], Optional[str]] = {}
    parts: Dict[str, List[str]] = {}
    for line in output.splitlines():
        match = _LINE.match(line)
        if not match:
            continue
        rank, stream, text = match.groups()
        if text.startswith("hvdx-suite: begin "):
            current[rank, stream] = text.split()[2]
        elif text.startswith("hvdx-suite: end "):
            current[rank, stream] = None
        elif current.get((rank, stream)):
            parts.setdefault(current[rank, stream], []).append(line)
    return {check_id: "\n".join(lines) for check_id, lines in parts.items()}


@dataclass
class _Planned:
    check: Check
    id: str
    workdir: Path
    kwargs: Dict[str, Any] = field(default_factory=dict)
    outcome: Any = None  # RankResults, or the message that fails its tests


@dataclass
class LaunchRecord:
    """One launch made, for the session's summary. CPU seconds are the launch's own (measured
    by its parent, tests/cpu_meter.py), split into the ranks' start-up (interpreter, TensorFlow,
    Horovod and hvdx imports), their checks, the rest of their time (the barriers between
    checks, writing results), and the launcher's (horovodrun, its rendezvous, the ranks' exit)."""

    topology: str
    checks: int
    seconds: float
    failed: List[str]
    cpu_seconds: Optional[float] = None  # None: the launch was killed before it could be measured
    check_seconds: Dict[str, float] = field(default_factory=dict)  # the slowest rank's, by check id
    check_cpu: Dict[str, float] = field(default_factory=dict)  # CPU seconds of every rank together, by check id
    start_up_cpu: float = 0.0  # every rank together, up to its first check
    ranks_cpu: float = 0.0  # every rank's own total (0: a rank did not report it)
    max_rss_mib: float = 0.0  # the largest peak resident memory of a rank (0: not reported)

    def __str__(self) -> str:
        slowest = sorted(self.check_seconds.items(), key=lambda kv: -kv[1])[:10]
        in_checks = sum(self.check_cpu.values())
        text = f"{self.topology}: {self.checks} check(s) in {self.seconds:.0f} s ("
        if self.cpu_seconds is None:
            text += f"CPU not measured, {in_checks:.0f} CPU s in the checks)"
        elif self.ranks_cpu:
            between = self.ranks_cpu - self.start_up_cpu - in_checks
            text += (f"{self.cpu_seconds:.0f} CPU s = start-up {self.start_up_cpu:.0f} + checks {in_checks:.0f} + "
                     f"between checks {between:.0f} + launcher and exit {self.cpu_seconds - self.ranks_cpu:.0f})")
        else:
            text += f"{self.cpu_seconds:.0f} CPU s, {in_checks:.0f} in the checks)"
        if slowest:
            text += " (slowest: " + ", ".join(
                f"{cid} {sec:.0f} s, {self.check_cpu.get(cid, 0):.0f} CPU s" for cid, sec in slowest) + ")"
        if self.max_rss_mib:
            text += f" (largest rank: {self.max_rss_mib:.0f} MiB)"
        return text + (f"; failed: {', '.join(self.failed)}" if self.failed else "")


class Ledger:
    """CPU seconds of a suite's launches that have ended, for the per-test cost: the pytest
    process's RUSAGE_CHILDREN grows by a launch when its thread reaps it, whichever test runs
    then, so conftest subtracts what the session suite's ledger grew by in the same window."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0.0

    def add(self, seconds: Optional[float]) -> None:
        with self._lock:
            self._total += seconds or 0.0

    @property
    def total(self) -> float:
        with self._lock:
            return self._total


def _stop_processes(marker: str, prefix: bool = False) -> None:
    """SIGTERM to every process with `marker` as an argument (with `prefix`: an argument that
    starts with it), the launcher cleans up; SIGKILL to those left 30 s later."""
    def matches(cmdline: Sequence[str]) -> bool:
        if str(harness.CPU_METER) in cmdline:
            return False  # it passes a SIGTERM on to its job, which gets one of its own here
        return any(arg.startswith(marker) for arg in cmdline) if prefix else marker in cmdline

    procs = [p for p in psutil.process_iter(["cmdline"]) if matches(p.info["cmdline"] or ())]
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=30)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


class _StallWatch(threading.Thread):
    """Stops a launch whose ranks stopped reporting: some never began their checks within
    STARTUP seconds, or one has been in a check (or the barrier after it) past the check's
    timeout and its own watchdog's grace. `reason` says which."""

    def __init__(self, out: Path, plan: Path, timeouts: Dict[str, float], np: int):
        super().__init__(daemon=True)
        self.out, self.plan, self.timeouts, self.np = out, plan, timeouts, np
        self.reason: Optional[str] = None
        self._done = threading.Event()

    def run(self) -> None:
        start = time.time()
        while not self._done.wait(5):
            self.reason = self._why(time.time() - start)
            if self.reason:
                _stop_processes(str(self.plan))
                return

    def _why(self, elapsed: float) -> Optional[str]:
        states = {}
        for rank in range(self.np):
            with contextlib.suppress(OSError, ValueError):
                states[rank] = json.loads((self.out / f"progress-{rank}.json").read_text())
        missing = sorted(set(range(self.np)) - set(states))
        if missing and elapsed > STARTUP:
            return f"rank(s) {missing} did not begin their checks within {STARTUP} s of the launch"
        for rank, state in states.items():
            limit = self.timeouts.get(state.get("check"), 0) + GRACE
            if state.get("check") and time.time() - state["since"] > limit:
                return f"rank {rank} was in {state['check']} ({state['phase']}) for more than {limit:.0f} s"
        return None

    def stop(self) -> None:
        self._done.set()
        self.join()


class Suite:
    """Launches each topology once, when a test first needs it (or ahead of the tests:
    `start_ahead`), and keeps every check's outcome."""

    def __init__(self, base: Callable[[], Path]):
        self._base = base
        self._outcomes: Dict[Check, Any] = {}
        self._count = 0
        self.launches: List[LaunchRecord] = []
        self.ledger = Ledger()  # the CPU seconds of its launches that have ended
        self._ahead: Dict[str, threading.Event] = {}  # topology -> set when its launch ahead has ended
        self._ahead_thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def start_ahead(self, items: Sequence[pytest.Item]) -> List[str]:
        """Starts, in a background thread, one launch per topology that `items` need (all its
        checks), one after another in the order of first need; returns those topologies.
        `result` then waits for a topology's launch instead of making it."""
        plan: Dict[str, List[Check]] = {}
        for c in dict.fromkeys(needed(i) for i in items):
            if c is not None:
                plan.setdefault(c.topology, []).append(c)
        self._ahead = {name: threading.Event() for name in plan}

        def run() -> None:
            for name, checks in plan.items():
                try:
                    if not self._stopping.is_set():
                        self.launch(name, checks)
                except Exception as exc:  # noqa: BLE001 - its tests fail with the reason
                    for c in checks:
                        self._outcomes.setdefault(c, f"{c}: the launch ahead of the tests failed: {exc!r}")
                finally:
                    self._ahead[name].set()

        self._ahead_thread = threading.Thread(target=run, name="hvdx-launch-ahead", daemon=True)
        self._ahead_thread.start()
        return list(plan)

    def stop(self) -> None:
        """Ends the launches ahead: no new one starts, the running one is stopped."""
        self._stopping.set()
        if self._ahead_thread is not None and self._ahead_thread.is_alive():
            _stop_processes(str(self._base()), prefix=True)
            self._ahead_thread.join(timeout=60)

    def result(self, wanted: Check, items: Sequence[pytest.Item]) -> RankResults:
        """`wanted`'s result; launches its topology first (with every check `items` need there),
        or waits for its launch ahead."""
        ahead = self._ahead.get(wanted.topology)
        if ahead is not None:
            ahead.wait()
        if wanted not in self._outcomes:
            same = [c for c in dict.fromkeys(needed(i) for i in items) if c is not None and c.topology == wanted.topology
                    and c not in self._outcomes]
            self.launch(wanted.topology, same if wanted in same else [wanted] + same)
        return self.outcome(wanted)

    def outcome(self, planned: Check) -> RankResults:
        """The result of a check launched before; AssertionError saying why when it failed."""
        outcome = self._outcomes[planned]
        if isinstance(outcome, str):
            raise AssertionError(outcome)
        return outcome

    def launch(self, topology_name: str, checks: List[Check]) -> None:
        """Runs `checks` (all on `topology_name`) in one launch, or more when one dies early."""
        assert all(c.topology == topology_name for c in checks), checks
        topology = Topology.parse(topology_name)
        self._count += 1
        root = self._base() / (f"{self._count}-" + re.sub(r"[^\w.+-]", "_", topology_name))
        planned = []
        for index, c in enumerate(checks):
            p = _Planned(c, f"{index:02d}-{c.name}", root / "work" / f"{index:02d}-{c.name}", dict(c.kwargs))
            p.workdir.mkdir(parents=True)
            if c.setup is not None:
                try:
                    p.kwargs.update(c.setup(p.workdir))
                except Exception as exc:  # noqa: BLE001 - fails this check's tests only
                    p.outcome = f"{c}: its setup on the host failed: {exc!r}"
            planned.append(p)
        deadline = time.monotonic() + budget(checks)
        todo = [p for p in planned if p.outcome is None]
        attempt = 0
        while todo:
            attempt += 1
            todo = self._attempt(topology, todo, root / f"launch-{attempt}", deadline)
        for p in planned:
            self._outcomes[p.check] = p.outcome

    def _attempt(self, topology: Topology, todo: List[_Planned], out: Path, deadline: float) -> List[_Planned]:
        """Launches `todo` once; settles each check that ran; returns those that never started
        when the launch died early (they get a launch of their own), else []."""
        out.mkdir(parents=True)
        plan = out / "plan.json"
        plan.write_text(json.dumps({"checks": [{"id": p.id, "name": p.check.name, "kwargs": p.kwargs,
                                                "env": dict(p.check.env), "timeout": p.check.timeout}
                                               for p in todo]}, indent=1))
        start = time.monotonic()
        watch = _StallWatch(out, plan, {p.id: p.check.timeout for p in todo}, topology.np)
        watch.start()
        try:
            job = topology.launch(plan, timeout=max(deadline - start, 60))
        finally:
            watch.stop()
        self.ledger.add(job.cpu_seconds)
        ended = (f"was stopped ({watch.reason})" if watch.reason else "timed out" if job.timed_out else
                 f"ended with exit status {job.returncode}")
        outputs = split_output(job.output)
        reached = self._reached(out, [p.id for p in todo], topology.np)
        never_started = [p for i, p in enumerate(todo) if all(r < i for r in reached.values())]
        for p in todo:
            if p not in never_started:
                p.outcome = self._settle(p, out, job, ended, outputs.get(p.id, ""), reached, [q.id for q in todo])
        self.launches.append(LaunchRecord(topology.name, len(todo), time.monotonic() - start,
                                          [p.id for p in todo if isinstance(p.outcome, str)], job.cpu_seconds,
                                          *self._seconds(out, [p.id for p in todo]),
                                          *self._rank_cpu(out, topology.np)))
        if not never_started:
            return []
        problems = "\n\n".join(job.failures()) or "(no rank reported a problem)"
        if len(never_started) == len(todo) or time.monotonic() > deadline - STARTUP:
            for p in never_started:  # no progress, or no time left: say why, do not try again
                p.outcome = (f"{p.check} did not run: its launch ({' '.join(job.command)}) {ended} before it:"
                             f"\n\n{problems}")
            return []
        return never_started

    @staticmethod
    def _seconds(out: Path, ids: List[str]) -> Tuple[Dict[str, float], Dict[str, float]]:
        """How long each check that ended ran (its slowest rank), and its CPU seconds (all ranks)."""
        seconds, cpu = {}, {}
        for check_id in ids:
            results = [json.loads(path.read_text()) for path in (out / check_id).glob("rank-*.json")]
            if results:
                seconds[check_id] = max(r.get("seconds", 0.0) for r in results)
                cpu[check_id] = sum(r.get("cpu_seconds", 0.0) for r in results)
        return seconds, cpu

    @staticmethod
    def _rank_cpu(out: Path, np: int) -> Tuple[float, float, float]:
        """The ranks' start-up CPU seconds and their own totals, all together, and the largest
        rank's peak memory in MiB; zeros unless every rank reported them
        (tests/multirank/suite.py writes cpu-<rank>.json at its end)."""
        reports = [json.loads(path.read_text()) for path in out.glob("cpu-*.json")]
        if len(reports) != np:
            return 0.0, 0.0, 0.0
        return (sum(r["start_up"] for r in reports), sum(r["total"] for r in reports),
                max(r.get("max_rss_mib", 0.0) for r in reports))

    @staticmethod
    def _reached(out: Path, ids: List[str], np: int) -> Dict[int, int]:
        """The index of the check each rank got to (len(ids) when done, -1 before the first)."""
        reached = {}
        for rank in range(np):
            path = out / f"progress-{rank}.json"
            state = json.loads(path.read_text()) if path.exists() else {"check": None, "phase": "none"}
            reached[rank] = len(ids) if state["phase"] == "done" else (
                ids.index(state["check"]) if state["check"] in ids else -1)
        return reached

    @staticmethod
    def _settle(p: _Planned, out: Path, job: harness.Launch, ended: str, output: str, reached: Dict[int, int],
                ids: List[str]) -> Any:
        """`p`'s RankResults, or the message that fails its tests (each rank's failure, or
        where it was when the launch ended)."""
        results = {}
        for path in (out / p.id).glob("rank-*.json"):
            result = json.loads(path.read_text())
            results[result["rank"]] = result
        index = ids.index(p.id)
        problems = []
        for rank in range(job.np):
            result = results.get(rank)
            if result is not None and result["ok"]:
                continue
            if result is not None:
                problems.append(f"rank {rank} failed:\n{result['error']}")
                continue
            progress_path = out / f"progress-{rank}.json"
            state = json.loads(progress_path.read_text()) if progress_path.exists() else {}
            if reached[rank] == index and state.get("timed_out"):
                why = f"timed out after {state['timed_out']:.0f} s in it ({state.get('phase')})"
            elif reached[rank] == index:
                why = f"did not finish it ({state.get('phase')}): the launch {ended}"
            elif reached[rank] < index:
                stuck = ids[reached[rank]] if reached[rank] >= 0 else "its start-up"
                why = f"never reached it: it stopped in {stuck}"
            else:
                why = "wrote no result for it"
            tail = "\n".join([line for line in output.splitlines() if line.startswith(f"[{rank}]")][-25:])
            problems.append(f"rank {rank} {why}; its last output in this check:\n{tail}")
        if problems:
            return (f"{p.check} failed on {len(problems)} of {job.np} ranks (launch: {' '.join(job.command)}):\n\n"
                    + "\n\n".join(problems))
        return RankResults(p.check, {rank: results[rank]["data"] for rank in sorted(results)}, output, p.workdir)
