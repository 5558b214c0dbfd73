"""Command lines that start a Horovod job, and running one under a timeout.

Two launchers, one shape: `horovodrun_command` (Horovod's own launcher, on the hosts of
hvdx/runner/hosts.py or real ones) and `cluster_command` (the emulated cluster of
hvdx/runner/cluster.py: one network namespace per node, shaped links; needs root). Both
take the rank's command line and return the launcher's. `run` runs either under a
timeout and kills the job's whole process tree when it expires; `run_ranks` starts the
ranks of a job itself (as the emulated cluster does) and stops them all at the first failure.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Dict, List, Optional, Sequence, Tuple

#: horovodrun of the running interpreter's environment.
HOROVODRUN = Path(sys.executable).parent / "horovodrun"
#: The emulated cluster's command line, run as a file (it loads without TensorFlow).
CLUSTER_SCRIPT = Path(__file__).resolve().with_name("cluster.py")
#: Controllers horovodrun_command can start: Gloo, or MPI (`horovodrun --mpi` runs mpirun;
#: mpirun and srun themselves: hvdx/runner/mpi.py).
CONTROLLERS = ("gloo", "mpi")


def horovodrun_command(command: Sequence[str], *, np: int, hosts: str, controller: str = "gloo") -> List[str]:
    """`horovodrun -np NP -H HOSTS --gloo|--mpi COMMAND...`.

    Under --mpi, horovodrun passes -H to mpirun with its slots: `-H localhost:4` on 2 cores is
    4 ranks that mpirun does not know oversubscribe the machine (hvdx.init() then tells Open
    MPI to yield; docs/launching.md).

    Args:
        command: what every rank runs (e.g. [sys.executable, "train.py"]).
        np: number of ranks.
        hosts: horovodrun's -H value, e.g. hvdx.runner.hosts(2, 2).
        controller: one of CONTROLLERS.

    Raises:
        ValueError: an unknown controller, np < 1 or an empty command.
    """
    if controller not in CONTROLLERS:
        raise ValueError(f"controller {controller!r} is not supported (yet): use one of {CONTROLLERS}")
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np}, command={list(command)}")
    return [str(HOROVODRUN), "-np", str(np), "-H", hosts, f"--{controller}", *command]


def cluster_command(command: Sequence[str], *, nodes: int, ranks_per_node: int, rate: str = "1gbit",
                    no_delay: bool = False, timeout: Optional[float] = None, mpi: bool = False) -> List[str]:
    """`python hvdx/runner/cluster.py --nodes N --ranks-per-node M --rate RATE [--no-delay]
    [--timeout T] [--mpi] -- COMMAND...`: `command` on the emulated cluster (root only).

    Args:
        rate: each node's link rate, tc syntax ("1gbit").
        no_delay: no netem delay on the links (else the cluster's default delay, where the
            kernel has netem).
        timeout: seconds before the cluster launcher kills the job (status 124).
        mpi: start the ranks with mpirun (Open MPI) instead of Horovod's Gloo environment.
    """
    options = ["--nodes", str(nodes), "--ranks-per-node", str(ranks_per_node), "--rate", rate]
    options += ["--no-delay"] if no_delay else []
    options += ["--timeout", str(timeout)] if timeout is not None else []
    options += ["--mpi"] if mpi else []
    return [sys.executable, str(CLUSTER_SCRIPT), *options, "--", *command]


@dataclass
class Finished:
    """How a job run by `run` ended."""

    command: List[str]
    returncode: int
    timed_out: bool
    output: Optional[str]  # stdout and stderr, interleaved; None when not captured


def run(command: Sequence[str], *, timeout: Optional[float] = None, env: Optional[Dict[str, str]] = None,
        cwd: Optional[Path] = None, capture: bool = True) -> Finished:
    """Runs `command` to its end, or until `timeout` seconds pass: then its process tree is
    killed (SIGKILL, every descendant, whatever its session) and `timed_out` is True.

    Args:
        env: the job's whole environment (None: this process's).
        capture: collect stdout and stderr into `output`, in a session of the job's own (a
            terminal's Ctrl-C does not reach it); else they go to this process's, and Ctrl-C
            reaches the job as it reaches this process.

    Raises:
        KeyboardInterrupt: after the job has ended (at most 30 s later: then it is killed).
    """
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE if capture else None,
                            stderr=subprocess.STDOUT if capture else None, stdin=subprocess.DEVNULL,
                            text=True, env=env, cwd=cwd, start_new_session=capture)
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill_tree(proc.pid)
        output, _ = proc.communicate()
    except KeyboardInterrupt:
        # The job must not outlive this call, but is asked first (in this session it got the same
        # Ctrl-C; in its own, a SIGTERM): horovodrun stops its ranks, the cluster removes its namespaces.
        if capture:
            proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(proc.pid)
        raise
    return Finished(command=list(command), returncode=proc.returncode, timed_out=timed_out, output=output)


def kill_tree(pid: int) -> None:
    """SIGKILL to `pid` and all its descendants; waits up to 10 s for them to end, except for
    `pid` when it is this process's child: its Popen reaps it and so keeps its exit status."""
    import psutil  # Horovod's dependency; imported here so that the CLI starts fast

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
    psutil.wait_procs([p for p in procs if p.pid != pid or parent.ppid() != os.getpid()], timeout=10)


def stop(procs: Sequence[subprocess.Popen], grace: float = 5.0) -> None:
    """Ends processes started with start_new_session=True, with their process groups:
    SIGTERM to each group still running, SIGKILL to those not done `grace` seconds later."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _pump(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()


def _outcome(codes: List[Optional[int]], ranks_per_node: int, deadline: Optional[float],
             timeout: Optional[float]) -> Tuple[Optional[int], Optional[str]]:
    """(exit status, why) once the job is over, (None, None) while it runs."""
    failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
    if failed:
        rank, code = failed[0]
        why = f"exited with status {code}" if code > 0 else f"was killed by signal {-code}"
        return (code if code > 0 else 128 - code,
                f"rank {rank} (node {rank // ranks_per_node}) {why}; stopping the other ranks")
    if all(c == 0 for c in codes):
        return 0, None
    if deadline is not None and time.monotonic() > deadline:
        running = [r for r, c in enumerate(codes) if c is None]
        return 124, f"timed out after {timeout:g} s; rank(s) {running} still running"
    return None, None


def run_ranks(commands: Sequence[Sequence[str]], envs: Sequence[Dict[str, str]], *, ranks_per_node: int,
              timeout: Optional[float] = None, out: IO[str] = sys.stdout, name: str = "hvdx") -> int:
    """Starts rank r as commands[r] with environment envs[r], each in a session of its own,
    and writes every line of its output to `out` prefixed with `[r]<stdout>:` or `[r]<stderr>:`.

    Returns 0 once every rank has succeeded; else the exit status of the first rank that
    failed (128 + N when killed by signal N), or 124 when `timeout` seconds pass first: then
    the other ranks are stopped (`stop`), and a line on `out` says why, after `name: `.
    """
    procs: List[subprocess.Popen] = []
    lock = threading.Lock()
    pumps: List[threading.Thread] = []
    try:
        for rank, (command, env) in enumerate(zip(commands, envs)):
            proc = subprocess.Popen(list(command), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
            procs.append(proc)
            for stream, tag in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                pump = threading.Thread(target=_pump, args=(stream, f"[{rank}]<{tag}>:", out, lock), daemon=True)
                pump.start()
                pumps.append(pump)
        deadline = None if timeout is None else time.monotonic() + timeout
        status, why = _outcome([p.poll() for p in procs], ranks_per_node, deadline, timeout)
        while status is None:
            time.sleep(0.05)
            status, why = _outcome([p.poll() for p in procs], ranks_per_node, deadline, timeout)
        if why:
            with lock:
                print(f"{name}: {why}", file=out, flush=True)
        return status
    finally:
        stop(procs)
        for pump in pumps:
            pump.join(timeout=5)
