"""Does AD-PSGD's gossip keep up with the computation? Averagings per step of two (or more)
AD-PSGD ranks as processes over loopback, without TensorFlow (lian2018 Algorithm 1 averages
once per step: Lian, Zhang, Zhang, Liu, "Asynchronous Decentralized Parallel Stochastic
Gradient Descent", ICML 2018, arXiv 1710.06952).

Each rank runs `--steps` steps of `--step-ms` of "computation" on a float32 model of
`--size` elements, handing a small update to `Gossip.step()` after each, then the final
average. The computation either releases the GIL (`sleep`, `numpy`: a matmul loop) or holds
it (`python`: a pure-Python loop, as Keras' per-step Python does; a fixed amount of work,
about `--step-ms` on a quiet core), so the gossip's threads
get the GIL only when the interpreter switches (every `sys.getswitchinterval()` seconds).
Reported: each rank's exchanges over its steps. Counts, not times: valid on a loaded machine
(the load average is reported beside them), although load lowers them somewhat.

    python benchmarks/adpsgd_probe.py                          # python / numpy / sleep, on and off
    python benchmarks/adpsgd_probe.py --json benchmarks/results/adpsgd_probe.json   # benchmarks/README.md's run
    python benchmarks/adpsgd_probe.py --compute python --switch-interval none

Used by tests/test_adpsgd.py (`probe()`), which asserts on the ratio with and without the
switch interval.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPUTES = ("python", "numpy", "sleep")


def _bare_packages() -> None:
    """hvdx's gossip and transports without TensorFlow (hvdx/__init__.py imports it): the
    packages as bare namespaces, so a rank starts in a fraction of a second."""
    sys.path.insert(0, ROOT)
    for name in ("hvdx", "hvdx.transport", "hvdx.adpsgd"):
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(ROOT, *name.split("."))]
        sys.modules.setdefault(name, module)


def _file_allgather(directory: str, rank: int, world: int, timeout: float = 60.0):
    """allgather(obj) through files in `directory` (a fresh name per call), for processes."""
    calls = [0]

    def tuples(obj):
        return tuple(tuples(x) for x in obj) if isinstance(obj, list) else obj

    def allgather(obj):
        calls[0] += 1
        tmp = os.path.join(directory, f"{calls[0]}.{rank}.tmp")
        with open(tmp, "w") as f:
            json.dump(obj, f)
        os.replace(tmp, os.path.join(directory, f"{calls[0]}.{rank}.json"))
        deadline = time.monotonic() + timeout
        out = []
        for r in range(world):
            path = os.path.join(directory, f"{calls[0]}.{r}.json")
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"probe: rank {r} did not publish its address within {timeout} s")
                time.sleep(0.01)
            with open(path) as f:
                out.append(tuples(json.load(f)))
        return out
    return allgather


def _compute(kind: str, seconds: float, a, b) -> None:
    end = time.perf_counter() + seconds
    if kind == "sleep":
        time.sleep(seconds)
    elif kind == "numpy":
        while time.perf_counter() < end:
            a @ b
    else:  # pure Python: holds the GIL except at the interpreter's switches. A fixed amount of
        # work (about `seconds` on a quiet core of the machine this was written on, 27 ns an
        # iteration), not a fixed wall time: on a loaded machine the step then keeps its share
        # of CPU against the gossip's threads
        x = 0
        for i in range(int(seconds * 37e6)):
            x += i


def worker(directory: str, rank: int, world: int, args: argparse.Namespace) -> None:
    _bare_packages()
    import numpy as np

    from hvdx.adpsgd.gossip import Gossip
    from hvdx.adpsgd.graph import build_graph
    from hvdx.transport.peer import PeerTransport
    from hvdx.transport.ring import GroupTransport

    allgather = _file_allgather(directory, rank, world)
    graph = build_graph("ring", world)
    peers = PeerTransport._create(list(graph.neighbours(rank)), rank, "probe.peers", 30.0, world, allgather)
    ring = GroupTransport._create([list(range(world))], rank, "probe.ring", 60.0, world, allgather)
    interval = None if args.switch_interval == "none" else float(args.switch_interval)
    try:
        gossip = Gossip(np.zeros(args.size, np.float32), graph, rank, peers, ring, timeout=30.0,
                        finish_timeout=120.0, switch_interval=interval)
    except TypeError:  # a Gossip without the option (to compare with an older checkout): set it here
        if interval is not None:
            sys.setswitchinterval(interval)
        gossip = Gossip(np.zeros(args.size, np.float32), graph, rank, peers, ring, timeout=30.0,
                        finish_timeout=120.0)
    rng = np.random.default_rng(rank)
    update = (rng.normal(size=args.size) * 1e-4).astype(np.float32)
    a = rng.normal(size=(64, 64))
    for _ in range(args.steps):
        _compute(args.compute, args.step_ms / 1000.0, a, a)
        gossip.step(update)
    exchanges, steps = gossip.exchanges, gossip.steps  # before the final average (which exchanges nothing)
    gossip.average(final=True)
    with open(os.path.join(directory, f"result.{rank}.json"), "w") as f:
        json.dump({"rank": rank, "active": gossip.active, "steps": steps, "exchanges": exchanges}, f)


def probe(compute: str = "python", switch_interval: Optional[float] = 0.001, *, steps: int = 300,
          step_ms: float = 3.0, size: int = 85_000, ranks: int = 2, timeout: float = 300.0) -> List[Dict]:
    """Runs `ranks` probe ranks as processes; returns each rank's {rank, active, steps, exchanges}.

    Raises RuntimeError with a rank's output if one fails or does not end within `timeout` s.
    """
    with tempfile.TemporaryDirectory(prefix="hvdx-adpsgd-probe-") as directory:
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", directory, "--compute", compute,
               "--switch-interval", "none" if switch_interval is None else repr(float(switch_interval)),
               "--steps", str(steps), "--step-ms", str(step_ms), "--size", str(size), "--ranks", str(ranks)]
        procs = [subprocess.Popen(cmd + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                 for r in range(ranks)]
        outputs = []
        try:
            for p in procs:
                outputs.append(p.communicate(timeout=timeout)[0].decode(errors="replace"))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"probe ranks did not end within {timeout} s") from None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        for r, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"probe rank {r} failed ({p.returncode}):\n{outputs[r][-3000:]}")
        results = []
        for r in range(ranks):
            with open(os.path.join(directory, f"result.{r}.json")) as f:
                results.append(json.load(f))
        return results


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compute", default=",".join(COMPUTES), help=f"comma-separated, of {COMPUTES}")
    parser.add_argument("--switch-interval", default="0.001,none",
                        help="comma-separated seconds, or none (Python's own, 0.005)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=3.0)
    parser.add_argument("--size", type=int, default=85_000, help="model elements (float32)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", help="also write the rows to this file (results/adpsgd_probe.json)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.rank, args.ranks, args)
        return
    rows = []
    for compute in args.compute.split(","):
        for interval in args.switch_interval.split(","):
            value = None if interval == "none" else float(interval)
            results = probe(compute, value, steps=args.steps, step_ms=args.step_ms, size=args.size, ranks=args.ranks)
            per_step = [round(r["exchanges"] / r["steps"], 3) for r in results]
            rows.append({"compute": compute, "switch_interval": interval, "averagings_per_step": per_step,
                         "load_average": round(os.getloadavg()[0], 2)})
            print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": {k: v for k, v in vars(args).items() if k not in ("rank", "worker", "json")},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
