"""The MPI side of launching: `mpirun` (Open MPI), `horovodrun --mpi` and `srun` command lines,
and several nodes emulated on one machine for `mpirun`.

What a user types is documented in docs/launching.md; these builders produce exactly those
command lines, so the tests and benchmarks run what the documentation shows:

- `mpirun_command`: `mpirun -np N [-H HOSTS | --hostfile F] ... COMMAND`, with what a root user
  (`--allow-run-as-root`) and a machine with fewer cores than ranks (`--oversubscribe`) need;
- `EmulatedNodes`: a real m-node x n-rank topology on one machine under `mpirun` (root): a
  hostfile of m names and an rsh agent (uts_agent.sh) that starts Open MPI's daemon in a UTS
  namespace named after its host, so Open MPI and Horovod see m machines;
- `srun_command`: `srun --mpi=pmix -N m --ntasks-per-node n COMMAND` (SLURM with PMIx);
- `rank_lines` / `failed_ranks` / `explain`: what each rank printed and which ranks failed,
  from the output of `mpirun --tag-output` or `srun --label`;
- a throwaway SLURM cluster for `srun` on one machine: hvdx/runner/slurm.py.

Horovod's MPI controller busy-polls while it waits: ranks that outnumber the cores spin and
steal the cores the working ranks need. `OVERSUBSCRIBED_MCA` is what a job whose ranks share
cores passes to Open MPI (mpirun sets it by itself only when it knows the node is
oversubscribed, i.e. with --oversubscribe and more ranks than slots); hvdx.init() sets it
itself when it can tell (hvdx/mpi_defaults.py).

Nothing here imports TensorFlow or Horovod.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["AGENT", "OVERSUBSCRIBED_MCA", "EmulatedNodes", "emulation_unavailable", "explain", "failed_ranks",
           "mpi_unavailable", "mpirun_command", "rank_lines", "srun_command"]

#: The rsh agent that starts Open MPI's daemon in a UTS namespace named after its host.
AGENT = Path(__file__).resolve().with_name("uts_agent.sh")

#: Open MPI parameters for ranks that share cores with more ranks than there are cores:
#: yield the core while polling for messages instead of spinning on it (docs/launching.md).
OVERSUBSCRIBED_MCA: Dict[str, str] = {"mpi_yield_when_idle": "1"}

#: Environment variables a rank needs from the launching shell; `mpirun -x NAME` forwards them
#: to ranks on other machines (ranks on this machine inherit mpirun's environment anyway).
FORWARDED = ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "VIRTUAL_ENV")

_TAG = re.compile(r"^\[(\d+),(\d+)\]<(stdout|stderr)>:(.*)$")
_LABEL = re.compile(r"^\s*(\d+): (.*)$")


def mpi_unavailable() -> Optional[str]:
    """Why `mpirun` (Open MPI) cannot be used here; None when it can."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return "mpirun is not on PATH (Debian: apt-get install openmpi-bin libopenmpi-dev)"
    try:
        version = subprocess.run([mpirun, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`mpirun --version` failed: {exc}"
    if "Open MPI" not in version:
        return f"mpirun is not Open MPI ({version.strip().splitlines()[:1]}); hvdx.runner.mpi builds Open MPI's flags"
    return None


def emulation_unavailable() -> Optional[str]:
    """Why `EmulatedNodes` cannot work here (needs root and unshare); None when it can."""
    if os.geteuid() != 0:
        return "emulated MPI nodes need root (unshare --uts)"
    if shutil.which("unshare") is None:
        return "unshare is not on PATH (Debian: util-linux)"
    return mpi_unavailable()


def mpirun_command(command: Sequence[str], *, np: int, hosts: Optional[str] = None,
                   hostfile: Optional[Path] = None, oversubscribe: bool = False,
                   mca: Optional[Mapping[str, str]] = None, forward: Sequence[str] = FORWARDED,
                   root: Optional[bool] = None, bind_to: Optional[str] = None,
                   agent: Optional[Path] = None) -> List[str]:
    """`mpirun -np NP [--allow-run-as-root] [--oversubscribe] [-H HOSTS | --hostfile F]
    [--bind-to B] [--mca K V]... [-x NAME]... --tag-output COMMAND...`.

    Args:
        command: what every rank runs.
        np: number of ranks.
        hosts: mpirun's -H value ("a:2,b:2"); None with no hostfile: this machine.
        hostfile: a hostfile ("a slots=2" per line) instead of `hosts`.
        oversubscribe: let mpirun start more ranks than slots (cores) on a machine; mpirun then
            also makes the ranks yield while they wait.
        mca: Open MPI parameters (`--mca K V`), e.g. OVERSUBSCRIBED_MCA.
        forward: environment variables to forward (`-x`), those set here only.
        root: pass --allow-run-as-root; None: when this process runs as root.
        bind_to: `--bind-to` value ("none", "core"); None: Open MPI's default.
        agent: rsh agent used to start daemons on the hosts (`--mca plm_rsh_agent`).

    Raises:
        ValueError: np < 1, an empty command, or both hosts and hostfile.
    """
    if np < 1 or not command:
        raise ValueError(f"need np >= 1 and a command, got np={np}, command={list(command)}")
    if hosts is not None and hostfile is not None:
        raise ValueError("pass hosts or hostfile, not both")
    out = ["mpirun", "-np", str(np)]
    if root if root is not None else os.geteuid() == 0:
        out.append("--allow-run-as-root")
    if oversubscribe:
        out.append("--oversubscribe")
    if hosts is not None:
        out += ["-H", hosts]
    if hostfile is not None:
        out += ["--hostfile", str(hostfile)]
    if bind_to is not None:
        out += ["--bind-to", bind_to]
    if agent is not None:
        out += ["--mca", "plm_rsh_agent", str(agent)]
    for key, value in (mca or {}).items():
        out += ["--mca", key, str(value)]
    for name in forward:
        if name in os.environ:
            out += ["-x", name]
    return out + ["--tag-output", *command]


def srun_command(command: Sequence[str], *, nodes: int, ranks_per_node: int, mpi: str = "pmix",
                 extra: Sequence[str] = ()) -> List[str]:
    """`srun --mpi=pmix -N NODES --ntasks-per-node N [extra...] COMMAND...`: every node runs the
    same number of ranks, as hvdx.init() requires; Debian's Open MPI needs PMIx (not PMI-2).

    Raises:
        ValueError: nodes or ranks_per_node < 1, or an empty command.
    """
    if nodes < 1 or ranks_per_node < 1 or not command:
        raise ValueError(f"need nodes, ranks_per_node >= 1 and a command, got {nodes}, {ranks_per_node}, "
                         f"{list(command)}")
    return ["srun", f"--mpi={mpi}", "-N", str(nodes), "--ntasks-per-node", str(ranks_per_node),
            "-n", str(nodes * ranks_per_node), *extra, *command]


class EmulatedNodes:
    """`nodes` machines of `ranks_per_node` slots each, emulated on this one for `mpirun`.

    A context manager that writes a hostfile of the names `hvdx-node0`, `hvdx-node1`, ... into a
    temporary folder (removed on exit); `command()` is the mpirun command line that starts Open
    MPI's daemon for each name through AGENT, in a UTS namespace of that name (root only). The
    nodes share this machine's cores: the command passes OVERSUBSCRIBED_MCA when the ranks of all
    nodes outnumber the cores, and binds no rank to a core (every node would bind its first rank
    to core 0).

    >>> with EmulatedNodes(2, 2) as nodes:
    ...     hvdx.runner.run(nodes.command(["python", "train.py"]), timeout=600)
    """

    def __init__(self, nodes: int, ranks_per_node: int, prefix: str = "hvdx-node") -> None:
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError(f"need nodes, ranks_per_node >= 1, got {nodes}, {ranks_per_node}")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.names = [f"{prefix}{i}" for i in range(nodes)]
        self._dir: Optional[tempfile.TemporaryDirectory] = None
        self.hostfile: Optional[Path] = None

    def __enter__(self) -> "EmulatedNodes":
        self._dir = tempfile.TemporaryDirectory(prefix="hvdx-mpi-")
        self.hostfile = Path(self._dir.name) / "hostfile"
        self.hostfile.write_text("".join(f"{name} slots={self.ranks_per_node}\n" for name in self.names))
        return self

    def __exit__(self, *exc) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir, self.hostfile = None, None

    def command(self, command: Sequence[str], mca: Optional[Mapping[str, str]] = None) -> List[str]:
        """The mpirun command line running `command` on every rank of the emulated nodes.

        Raises:
            RuntimeError: outside the `with` block (no hostfile).
        """
        if self.hostfile is None:
            raise RuntimeError("EmulatedNodes.command() needs the `with EmulatedNodes(...)` block")
        np = self.nodes * self.ranks_per_node
        params = dict(OVERSUBSCRIBED_MCA) if np > (os.cpu_count() or 1) else {}
        params.update(mca or {})
        return mpirun_command(command, np=np, hostfile=self.hostfile, agent=AGENT, bind_to="none", mca=params)


def rank_lines(output: str) -> Dict[int, List[str]]:
    """Each rank's lines from the output of `mpirun --tag-output` ("[job,rank]<stdout>:line")
    or, when there are none of those, of `srun --label` ("rank: line")."""
    out: Dict[int, List[str]] = {}
    for line in output.splitlines():
        match = _TAG.match(line)
        if match:
            out.setdefault(int(match.group(2)), []).append(match.group(4))
    if not out:
        for line in output.splitlines():
            match = _LABEL.match(line)
            if match:
                out.setdefault(int(match.group(1)), []).append(match.group(2))
    return out


def failed_ranks(output: str) -> List[int]:
    """The ranks mpirun or srun reports as having failed (non-zero exit or killed by a signal)."""
    found = set()
    for match in re.finditer(r"Process name: \[\[\d+,\d+\],(\d+)\]", output):
        found.add(int(match.group(1)))
    for match in re.finditer(r"rank (\d+) with PID \d+ on node \S+ exited on signal", output):
        found.add(int(match.group(1)))
    for match in re.finditer(r"task (\d+): (?:Exited with exit code|Killed|Terminated|Segmentation)", output):
        found.add(int(match.group(1)))  # srun
    return sorted(found)


def explain(output: str, returncode: int, timed_out: bool, np: int, lines: int = 15) -> List[str]:
    """Why an `mpirun --tag-output` or `srun --label` job failed, one entry per rank at fault (the ranks mpirun
    names, else every rank when the job timed out), each with that rank's last output lines;
    empty when the job succeeded.
    """
    if returncode == 0 and not timed_out:
        return []
    per_rank = rank_lines(output)
    ranks = failed_ranks(output) or list(range(np))
    why = "timed out" if timed_out else f"failed (the launcher exited with {returncode})"
    out = []
    for rank in ranks:
        tail = "\n".join(per_rank.get(rank, [])[-lines:]) or "(no output)"
        out.append(f"rank {rank} {why}; its last output:\n{tail}")
    if not per_rank:
        out.append("the launcher's own output:\n" + "\n".join(output.splitlines()[-lines:]))
    return out
