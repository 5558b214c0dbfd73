"""Which launcher started this rank, and the MPI settings ranks that outnumber cores need.

Horovod's MPI controller (mpirun, `horovodrun --mpi`, srun) waits for the other ranks inside
Open MPI, which polls for messages without sleeping. When a machine runs more ranks than it
has cores, a waiting rank spins on a core that a computing rank needs, the computing rank
falls behind, and every other rank spins longer: training crawls (benchmarks/README.md,
launchers.py: on 2 cores with 4 ranks each rank burned 61 CPU ms per step of the digits demo's
model, 94 % in Horovod's background thread, against 3.6 ms yielding and 7.8 ms under Gloo,
whose ranks sleep in the kernel while they wait). Open MPI yields the core instead when its parameter
`mpi_yield_when_idle` is 1; mpirun sets it itself only when it knows it oversubscribes a
node (`--oversubscribe` with more ranks than slots), not when the slots were declared
(`-H a:4`, a hostfile, `horovodrun --mpi`, which passes `-H localhost:N`) or when several
emulated nodes share one machine.

Open MPI reads its parameters from the environment (`OMPI_MCA_<name>`) in MPI_Init, which
hvd.init() calls, so `apply_mpi_defaults()` (called by hvdx.init() before hvd.init()) can set
them for this process; `oversubscription_warning()` (called by hvdx.init() once the ranks
know each other) names the flags to pass when it was too late or the launcher hid the
oversubscription. Neither imports TensorFlow or Horovod.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, MutableMapping, Optional, Sequence

__all__ = ["MPI_DEFAULTS", "LaunchInfo", "MachineFacts", "apply_mpi_defaults", "detect", "machine_facts",
           "oversubscription_warning", "usable_cores"]

#: What hvdx sets (where unset) for Open MPI ranks that outnumber their machine's cores.
MPI_DEFAULTS: Dict[str, str] = {"OMPI_MCA_mpi_yield_when_idle": "1"}

#: The same settings as mpirun flags, for messages.
MPI_FLAGS = " ".join(f"--mca {key[len('OMPI_MCA_'):]} {value}" for key, value in MPI_DEFAULTS.items())


@dataclass(frozen=True)
class LaunchInfo:
    """What the environment says about how this rank was started (before MPI_Init).

    launcher: "openmpi" (mpirun / horovodrun --mpi), "slurm" (srun), "horovodrun" (Gloo), or
    "none"; local_size: ranks on this machine as the launcher counts them (None: unknown);
    cores: usable_cores().
    """

    launcher: str
    local_size: Optional[int]
    cores: int

    @property
    def mpi(self) -> bool:
        """Whether Horovod will initialize MPI (a launcher that starts an MPI job)."""
        return self.launcher in ("openmpi", "slurm")

    @property
    def oversubscribed(self) -> bool:
        """More ranks on this machine than cores, as far as the launcher tells."""
        return self.local_size is not None and self.local_size > self.cores


def usable_cores(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """The cores this process's machine offers it: os.cpu_count(), capped by a cgroup v2 CPU
    quota (`cpu.max`) where one is set. Not the affinity mask: a rank bound to one core by
    its launcher still shares the machine with the other ranks."""
    cores = os.cpu_count() or 1
    try:
        quota, period = open(os.path.join(cgroup_root, "cpu.max")).read().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def _slurm_local_size(env: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node from SLURM_STEP_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not spec:
        return None
    per_node: List[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            return None
        per_node += [int(match.group(1))] * int(match.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else None


def detect(env: Optional[Mapping[str, str]] = None, cores: Optional[int] = None) -> LaunchInfo:
    """The launcher and this machine's rank count, from the environment alone."""
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else cores
    if "OMPI_COMM_WORLD_SIZE" in env:
        local = env.get("OMPI_COMM_WORLD_LOCAL_SIZE")
        return LaunchInfo("openmpi", int(local) if local else None, cores)
    if "SLURM_STEP_ID" in env or "SLURM_PROCID" in env:
        return LaunchInfo("slurm", _slurm_local_size(env), cores)
    if "HOROVOD_RANK" in env and "HOROVOD_GLOO_RENDEZVOUS_ADDR" in env:
        local = env.get("HOROVOD_LOCAL_SIZE")
        return LaunchInfo("horovodrun", int(local) if local else None, cores)
    return LaunchInfo("none", None, cores)


def apply_mpi_defaults(env: Optional[MutableMapping[str, str]] = None,
                       info: Optional[LaunchInfo] = None) -> Dict[str, str]:
    """Sets MPI_DEFAULTS in `env` (default: this process's environment), each only where unset,
    when this rank runs under an MPI launcher on a machine with more ranks than cores.

    Call before MPI_Init (hvd.init()); hvdx.init() does. The user's own values win: an explicit
    OMPI_MCA_mpi_yield_when_idle=0 stays. `HVDX_MPI_DEFAULTS=0` turns this off.

    Returns:
        What was set (empty when nothing was).
    """
    env = os.environ if env is None else env
    info = detect(env) if info is None else info
    if env.get("HVDX_MPI_DEFAULTS", "1") == "0" or not (info.mpi and info.oversubscribed):
        return {}
    applied = {key: value for key, value in MPI_DEFAULTS.items() if key not in env}
    env.update(applied)
    return applied


@dataclass(frozen=True)
class MachineFacts:
    """What one rank says about its machine, for oversubscription_warning."""

    machine: str  # the kernel's boot id: equal for emulated nodes of one machine
    cores: int
    yields: bool  # MPI_DEFAULTS were in effect when MPI was initialized


def machine_facts(yields: Optional[bool] = None) -> MachineFacts:
    """This rank's MachineFacts; `yields` defaults to whether the environment holds
    MPI_DEFAULTS' values now."""
    try:
        machine = open("/proc/sys/kernel/random/boot_id").read().strip()
    except OSError:
        import socket

        machine = socket.gethostname()
    if yields is None:
        yields = all(os.environ.get(key) == value for key, value in MPI_DEFAULTS.items())
    return MachineFacts(machine, usable_cores(), yields)


def oversubscription_warning(facts: Sequence[MachineFacts], mpi: bool) -> Optional[str]:
    """A message naming the flags to pass, when a machine runs more MPI ranks than it has cores
    and some of them poll without yielding; None otherwise (always None without MPI).

    Args:
        facts: every rank's MachineFacts, by rank.
        mpi: whether Horovod runs its MPI controller (hvd.mpi_enabled()).
    """
    if not mpi:
        return None
    by_machine: Dict[str, List[int]] = {}
    for rank, fact in enumerate(facts):
        by_machine.setdefault(fact.machine, []).append(rank)
    crowded = []
    for ranks in by_machine.values():
        cores = facts[ranks[0]].cores
        spinning = [r for r in ranks if not facts[r].yields]
        if len(ranks) > cores and spinning:
            crowded.append(f"{len(ranks)} ranks on {cores} core(s), rank(s) {spinning} polling without yielding")
    if not crowded:
        return None
    return ("hvdx: more MPI ranks than cores on a machine (" + "; ".join(crowded) + "): ranks that wait "
            "for messages spin on the cores the others compute on, and training slows down many times. "
            f"Make Open MPI yield the core while it waits: pass `{MPI_FLAGS}` to mpirun (or "
            f"`export {' '.join(f'{k}={v}' for k, v in MPI_DEFAULTS.items())}` before srun or horovodrun --mpi), "
            "or call hvdx.init() before anything initializes MPI (hvd.init(), mpi4py) so that hvdx can "
            "set it. See docs/launching.md.")
