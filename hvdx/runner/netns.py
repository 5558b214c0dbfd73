"""Network namespaces for the emulated cluster: create, wire (bridge, veth pairs), address,
enter, and remove them, also those a killed launcher left behind. Needs root and iproute2.

Namespaces are named `hvdx-<launcher pid>-<k>-<sw|n<i>>`; `cleanup_stale` removes those
whose launcher is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

from hvdx.shm import pid_alive

ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
NAME_RE = re.compile(r"^hvdx-(\d+)-(\d+)-(sw|n\d+)$")
_CLONE_NEWNET = 0x40000000


class ClusterError(RuntimeError):
    """The emulated cluster could not be built or used (no root, no iproute2, bad spec)."""


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `ip ARGS...`.

    Raises:
        ClusterError: `ip` is missing, or (with `check`) failed; the message has its stderr.
    """
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise ClusterError("`ip` not found: install iproute2 (scripts/bootstrap.sh does)") from exc
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def namespaces() -> List[str]:
    """Every network namespace on this machine, by name."""
    out = ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def add_namespace(ns: str) -> None:
    """Creates namespace `ns` with its loopback up."""
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")


def add_bridge(ns: str, bridge: str, address: str) -> None:
    """A bridge `bridge` in `ns`, up, with `address` (CIDR, e.g. 10.77.0.254/24)."""
    ip("-n", ns, "link", "add", bridge, "type", "bridge")
    ip("-n", ns, "addr", "add", address, "dev", bridge)
    ip("-n", ns, "link", "set", bridge, "up")


def add_port(ns: str, bridge: str, port: str, peer_ns: str, peer: str, address: str, mtu: int) -> None:
    """A veth pair: `port` in `ns` on `bridge`, `peer` in `peer_ns` with `address` (CIDR);
    both ends up, with MTU `mtu`."""
    ip("-n", ns, "link", "add", port, "mtu", str(mtu), "type", "veth", "peer", "name", peer, "mtu", str(mtu),
       "netns", peer_ns)
    ip("-n", ns, "link", "set", port, "master", bridge)
    ip("-n", ns, "link", "set", port, "up")
    ip("-n", peer_ns, "addr", "add", address, "dev", peer)
    ip("-n", peer_ns, "link", "set", peer, "up")


def write_hosts(ns: str, lines: Sequence[str]) -> None:
    """`lines` become /etc/hosts for the processes `ip netns exec ns` starts."""
    folder = ETC_NETNS / ns
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "hosts").write_text("\n".join(lines) + "\n")


def kill_all(ns: str) -> int:
    """SIGKILLs every process in `ns`; returns how many there were."""
    pids = ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    return len(pids)


def delete_namespace(ns: str) -> None:
    """Kills what still runs in `ns`, then deletes it (its veth ends and qdiscs go with it)."""
    kill_all(ns)
    ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when no other namespace keeps files there


def cleanup_stale() -> List[str]:
    """Removes the namespaces of hvdx clusters whose launcher is gone; returns their names."""
    stale = [ns for ns in namespaces()
             if (m := NAME_RE.match(ns)) and not pid_alive(int(m.group(1)))]
    for ns in stale:
        delete_namespace(ns)
    return stale


@contextlib.contextmanager
def in_namespace(ns: str) -> Iterator[None]:
    """Runs the block with the calling thread inside network namespace `ns`.

    Sockets keep the namespace they were created in, so a server started here goes on
    listening inside `ns` after the block (that is how the rendezvous server is placed).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{ns}") as target, open("/proc/thread-self/ns/net") as home:
        if libc.setns(target.fileno(), _CLONE_NEWNET) != 0:
            raise ClusterError(f"setns({ns}) failed: {os.strerror(ctypes.get_errno())}")
        try:
            yield
        finally:
            if libc.setns(home.fileno(), _CLONE_NEWNET) != 0:  # pragma: no cover - would be a kernel bug
                raise ClusterError(f"could not return from namespace {ns}: {os.strerror(ctypes.get_errno())}")


def unavailable() -> Optional[str]:
    """Why namespaces cannot be built here (None when they can): no root, no iproute2, or
    a kernel or container that refuses them (tried with a namespace made and removed)."""
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
