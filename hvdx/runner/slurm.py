"""A throwaway SLURM cluster on one machine, for running `srun --mpi=pmix` jobs (root only).

`LocalSlurm(nodes, cpus_per_node)` is a context manager that starts, in a temporary folder of
its own: munged (its own key and socket), slurmctld, and one slurmd per node, each slurmd in a
UTS namespace named after its node (`hvdx-node0`, ...) and with its own port, spool, PID file
and TmpFS, so that Open MPI and Horovod see separate machines; it waits until every node is
idle, and on exit stops every daemon by the PID it started (SIGTERM, then SIGKILL) and removes
the folder, also when the block raises. `command()` is the `srun --mpi=pmix` line
(hvdx/runner/mpi.py) and `environment()` the environment that points srun at this cluster.

It uses Debian's packages (`apt-get install slurmctld slurmd slurm-client munge`, SLURM 22.05;
`scripts/bootstrap.sh --with-slurm`) and touches nothing outside its folder: no system
services, no /etc. Nothing here imports TensorFlow or Horovod.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .launch import stop
from .mpi import OVERSUBSCRIBED_MCA, srun_command

__all__ = ["DAEMONS", "LocalSlurm", "SlurmError", "slurm_unavailable"]

#: What LocalSlurm starts; all must be on PATH (or in /usr/sbin).
DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "unshare")


class SlurmError(RuntimeError):
    """The throwaway cluster could not be started (the daemons' last log lines attached)."""


def _which(name: str) -> Optional[str]:
    return shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")


def slurm_unavailable() -> Optional[str]:
    """Why LocalSlurm cannot run here; None when it can."""
    if os.geteuid() != 0:
        return "a throwaway SLURM cluster needs root (its daemons, UTS namespaces)"
    missing = [name for name in DAEMONS if _which(name) is None]
    if missing:
        return (f"{', '.join(missing)} not found: install SLURM and munge "
                "(apt-get install slurmctld slurmd slurm-client munge, or scripts/bootstrap.sh --with-slurm)")
    return None


def _free_ports(count: int) -> List[int]:
    socks = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class LocalSlurm:
    """`nodes` SLURM nodes of `cpus_per_node` CPUs each on this machine; see the module's doc.

    Raises (on entering):
        SlurmError: slurm_unavailable(), or a daemon that exits or nodes not idle within `timeout`.
    """

    def __init__(self, nodes: int = 2, cpus_per_node: int = 2, timeout: float = 60,
                 prefix: str = "hvdx-node") -> None:
        if nodes < 1 or cpus_per_node < 1:
            raise ValueError(f"need nodes, cpus_per_node >= 1, got {nodes}, {cpus_per_node}")
        self.nodes, self.cpus_per_node, self.timeout = nodes, cpus_per_node, timeout
        self.names = [f"{prefix}{i}" for i in range(nodes)]
        self.dir: Optional[Path] = None
        self._procs: List[subprocess.Popen] = []
        self._tmp: Optional[tempfile.TemporaryDirectory] = None

    # -- configuration -------------------------------------------------------------------------
    def _write_config(self, ctld_port: int, node_ports: Sequence[int]) -> Path:
        d = self.dir
        for sub in ("state", "log", "tmp", *(f"spool/{n}" for n in self.names), *(f"tmp/{n}" for n in self.names)):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=hvdx",
            f"SlurmctldHost={socket.gethostname()}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={d / 'munge.sock'}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
            f"TmpFS={d / 'tmp'}/%n",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=pmix",
            "SchedulerType=sched/backfill", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "JobAcctGatherType=jobacct_gather/none",
            "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0", "KillWait=5", "MinJobAge=5",
        ]
        for name, port in zip(self.names, node_ports):
            lines.append(f"NodeName={name} NodeAddr=127.0.0.1 NodeHostname={name} Port={port} "
                         f"CPUs={self.cpus_per_node} State=UNKNOWN")
        lines.append(f"PartitionName=hvdx Nodes={','.join(self.names)} Default=YES MaxTime=INFINITE State=UP")
        conf = d / "slurm.conf"
        conf.write_text("\n".join(lines) + "\n")
        return conf

    def environment(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """`base` (default: this process's environment) with SLURM_CONF pointing at this cluster.

        Raises:
            RuntimeError: outside the `with` block.
        """
        if self.dir is None:
            raise RuntimeError("LocalSlurm.environment() needs the `with LocalSlurm(...)` block")
        env = dict(os.environ if base is None else base, SLURM_CONF=str(self.dir / "slurm.conf"))
        if self.nodes * self.cpus_per_node > (os.cpu_count() or 1):
            # the emulated nodes share this machine's cores: let Open MPI yield (docs/launching.md)
            env.update({f"OMPI_MCA_{k}": v for k, v in OVERSUBSCRIBED_MCA.items()})
        return env

    def command(self, command: Sequence[str], ranks_per_node: Optional[int] = None) -> List[str]:
        """`srun --mpi=pmix -N nodes --ntasks-per-node n -n N COMMAND...` on this cluster."""
        return srun_command(command, nodes=self.nodes, ranks_per_node=ranks_per_node or self.cpus_per_node,
                            extra=["--kill-on-bad-exit=1", "--label"])

    # -- daemons -------------------------------------------------------------------------------
    def _start(self, argv: List[str], log: str) -> subprocess.Popen:
        out = open(self.dir / "log" / log, "w")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=self.environment({"PATH": os.environ.get("PATH", "")}))
        out.close()
        self._procs.append(proc)
        return proc

    def logs(self, lines: int = 20) -> str:
        """The last lines of every daemon's log."""
        if self.dir is None:
            return ""
        out = []
        for path in sorted((self.dir / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.timeout
        state = ""
        while time.monotonic() < deadline:
            dead = [p.args for p in self._procs if p.poll() is not None]
            if dead:
                raise SlurmError(f"{dead[0][:3]} exited while starting:\n{self.logs()}")
            out = subprocess.run([_which("sinfo"), "-h", "-N", "-o", "%N %t"], capture_output=True, text=True,
                                 env=self.environment(), timeout=30)
            state = out.stdout.strip()
            if out.returncode == 0 and len(state.splitlines()) == self.nodes and all(
                    line.split()[1] == "idle" for line in state.splitlines()):
                return
            time.sleep(0.5)
        raise SlurmError(f"nodes not idle within {self.timeout:g} s (sinfo: {state!r}):\n{self.logs()}")

    def __enter__(self) -> "LocalSlurm":
        why = slurm_unavailable()
        if why:
            raise SlurmError(why)
        self._tmp = tempfile.TemporaryDirectory(prefix="hvdx-slurm-")
        self.dir = Path(self._tmp.name)
        try:
            ctld_port, *node_ports = _free_ports(1 + self.nodes)
            conf = self._write_config(ctld_port, node_ports)
            d = self.dir
            self._start([_which("munged"), "--foreground", "--force", f"--socket={d / 'munge.sock'}",
                         f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
                         f"--seed-file={d / 'munged.seed'}", f"--log-file={d / 'log' / 'munged.log'}"],
                        "munged.out")
            deadline = time.monotonic() + self.timeout
            while not (d / "munge.sock").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            self._start([_which("slurmctld"), "-D", "-i", "-f", str(conf)], "slurmctld.out")
            for name in self.names:
                self._start([_which("unshare"), "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name,
                             _which("slurmd"), "-D", "-N", name, "-f", str(conf)], f"slurmd-{name}.out")
            self._wait_idle()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        import psutil  # Horovod's dependency

        # slurmd's step daemons (slurmstepd) run in sessions of their own: stopping slurmd's
        # process group can leave one behind (seen after a CI run), so they are collected first
        # and killed if they outlive it.
        steps = []
        for proc in self._procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                steps += psutil.Process(proc.pid).children(recursive=True)
        stop(list(reversed(self._procs)), grace=10)
        for step in steps:
            with contextlib.suppress(psutil.NoSuchProcess):
                step.kill()
        psutil.wait_procs(steps, timeout=10)
        self._procs = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self.dir = None, None
