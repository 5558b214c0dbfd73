"""Rank side of one launch per topology: runs the requested multi-rank checks in one job.

    python tests/multirank/suite.py PLAN.json        # what tests/suite.py plans and launches
    python tests/multirank/suite.py daso.blocking …  # by name, for debugging (under horovodrun)

A check is `CHECKS[name]` of tests/multirank/check_<module>.py, named `<module>.<name>`; it
takes keyword arguments (`topo=hvdx.init()` when it has that parameter) and returns
JSON-able data. Every rank runs the plan's checks in the plan's order, each one:

- with the plan's environment variables for it, in a fresh Keras session (made once before
  the first check and after each check: 0.14 CPU s a time); the environment, working
  directory, sys.argv, sys.path and the float32 policy are restored afterwards;
- under a watchdog: past its `timeout` the rank writes which check it was in, prints every
  thread's stack and exits (so horovodrun stops the job);
- its result (data, or traceback) written to `<plan dir>/<id>/rank-<r>.json`, then a
  barrier of every rank; `<plan dir>/progress-<r>.json` names the check (or the barrier
  after it) a rank is in, so a launch that dies still says where;
- between output markers `hvdx-suite: begin <id>` / `hvdx-suite: end <id>` on stdout and
  stderr, so the host hands each check its own output.

The job ends with `tests.multirank.rank.run`'s global barrier; a rank whose checks failed
exits with 1.
"""
from __future__ import annotations

import faulthandler
import gc
import importlib
import inspect
import json
import os
import resource
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from tests.multirank.rank import run

MARKER = "hvdx-suite:"
GRACE = 60  # seconds faulthandler's C-level watchdog waits beyond a check's timeout


def resolve(name: str) -> Callable[..., Any]:
    """The check function `<module>.<check>` = CHECKS[<check>] of tests/multirank/check_<module>.py."""
    module_name, _, check = name.partition(".")
    module = importlib.import_module(f"tests.multirank.check_{module_name}")
    checks = getattr(module, "CHECKS", {})
    if check not in checks:
        raise KeyError(f"no check {name!r}: tests/multirank/check_{module_name}.py's CHECKS has {sorted(checks)}")
    return checks[check]


def this_rank() -> int:
    import horovod.tensorflow as hvd

    return hvd.rank() if hvd.is_initialized() else int(os.environ.get("HOROVOD_RANK", "0"))


def _write(path: Path, obj: dict) -> None:
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps(obj, default=str))
    tmp.rename(path)


def _say(text: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        print(f"{MARKER} {text}", file=stream, flush=True)


class Watchdog:
    """Ends this rank when one check (with its barrier) runs past its timeout, saying where."""

    def __init__(self, progress: Path):
        self.progress = progress
        self.timer: Optional[threading.Timer] = None

    def arm(self, check_id: str, timeout: float) -> None:
        self.timer = threading.Timer(timeout, self._expire, args=(check_id, timeout))
        self.timer.daemon = True
        self.timer.start()
        faulthandler.dump_traceback_later(timeout + GRACE, exit=True)  # should the GIL never come back

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.timer is not None:
            self.timer.cancel()

    def _expire(self, check_id: str, timeout: float) -> None:
        state = json.loads(self.progress.read_text()) if self.progress.exists() else {}
        _write(self.progress, dict(state, check=check_id, timed_out=timeout))
        print(f"{MARKER} rank {this_rank()} timed out after {timeout:.0f} s in check {check_id} "
              f"({state.get('phase', 'check')}); every thread's stack:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(sys.stderr, all_threads=True)
        sys.stdout.flush()
        os._exit(124)


def _fresh_state() -> None:
    """Keras' global state reset, then what is left after a collection is frozen (`gc.freeze`):
    every later collection, the next check's automatic ones and its closing one, traverses
    only the objects made since. Without it a rank spent 18 % of its CPU in the collector,
    traversing TensorFlow's and Keras' long-lived objects again on every collection
    (docs/developing.md). The objects frozen were reachable; one that later becomes part of an
    unreachable cycle is never freed (the launch line reports the largest rank's peak memory)."""
    import tensorflow as tf

    tf.keras.backend.clear_session()
    tf.keras.mixed_precision.set_global_policy("float32")
    gc.collect()
    gc.freeze()


def _cpu() -> float:
    """CPU seconds this rank used so far (every thread: TensorFlow's, Horovod's), and its
    subprocesses that ended (a check that runs a script)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _start_up() -> None:
    """Imports what every check needs (TensorFlow, Horovod, hvdx), so that the first check is
    not charged for them."""
    import horovod.tensorflow  # noqa: F401
    import tensorflow  # noqa: F401

    import hvdx  # noqa: F401


def run_check(check: Dict[str, Any]) -> dict:
    """Runs one planned check here; {"ok": True, "data": …} or {"ok": False, "error": traceback}."""
    cwd, env, argv, path = os.getcwd(), dict(os.environ), list(sys.argv), list(sys.path)
    os.environ.update(check.get("env", {}))
    started, cpu = time.perf_counter(), _cpu()
    try:  # the state is fresh: run_plan made it so before the first check, and every check after itself
        function = resolve(check["name"])
        kwargs = dict(check.get("kwargs", {}))
        if "topo" in inspect.signature(function).parameters:
            import hvdx

            kwargs["topo"] = hvdx.init()
        data = function(**kwargs)
        result = {"ok": True, "data": {} if data is None else data}
    except BaseException as exc:  # noqa: B902 - report anything, including SystemExit
        result = {"ok": False, "error": "".join(traceback.format_exception(exc))}
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(env)
        sys.argv[:], sys.path[:] = argv, path
        _fresh_state()
    result["seconds"] = time.perf_counter() - started
    result["cpu_seconds"] = _cpu() - cpu
    return result


def barrier() -> None:
    import horovod.tensorflow as hvd

    if hvd.is_initialized():
        import hvdx

        hvdx.barrier()


def run_plan(checks: List[Dict[str, Any]], out_dir: Path) -> dict:
    """Runs `checks` in order on this rank (see the module docstring); which ones failed."""
    rank = this_rank()
    progress = out_dir / f"progress-{rank}.json"
    watchdog = Watchdog(progress)
    failed = []
    _start_up()
    _fresh_state()
    cpu = {"start_up": _cpu()}  # since the process began: the interpreter, the imports, Horovod's start
    for check in checks:
        check_id = check["id"]
        _write(progress, {"check": check_id, "phase": "check", "since": time.time()})
        _say(f"begin {check_id}")
        watchdog.arm(check_id, check.get("timeout", 600))
        result = run_check(check)
        rank = this_rank()  # hvdx.init() may have run in the check
        (out_dir / check_id).mkdir(exist_ok=True)
        _write(out_dir / check_id / f"rank-{rank}.json", dict(result, rank=rank))
        if not result["ok"]:
            print(result["error"], file=sys.stderr, flush=True)
            failed.append(check_id)
        _write(progress, {"check": check_id, "phase": "barrier after it", "since": time.time()})
        barrier()  # a rank that failed half-way through a check's collectives hangs here: the watchdog ends it
        watchdog.disarm()
        _say(f"end {check_id} {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.1f} s")
    _write(progress, {"check": None, "phase": "done", "since": time.time()})
    cpu["total"] = _cpu()
    cpu["max_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    _write(out_dir / f"cpu-{rank}.json", cpu)
    if failed:
        raise AssertionError(f"checks failed on rank {rank}: {', '.join(failed)}")
    return {"checks": [c["id"] for c in checks]}


def main(argv: List[str]) -> dict:
    if len(argv) == 1 and argv[0].endswith(".json"):
        plan = Path(argv[0])
        return run_plan(json.loads(plan.read_text())["checks"], plan.parent)
    if not argv:
        raise SystemExit("usage: suite.py PLAN.json | CHECK [CHECK …]   (a CHECK is e.g. daso.blocking)")
    out_dir = Path(os.environ.get("HVDX_RESULT_DIR") or tempfile.mkdtemp(prefix="hvdx-suite-"))
    return run_plan([{"id": name, "name": name} for name in argv], out_dir)


if __name__ == "__main__":
    run(lambda: main(sys.argv[1:]))
