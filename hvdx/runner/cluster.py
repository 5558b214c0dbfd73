"""Emulated cloud cluster: nodes as network namespaces joined by rate-shaped links.

The papers' speed-ups come from the gap between fast links inside a node and slow ones
between nodes (NVLink vs 25 GbE); over loopback that gap does not exist. This launcher
builds the gap on one machine (DESIGN.md, "Emulated cloud cluster") and runs a Horovod
job across it, the way horovodrun would, but without ssh:

    python -m hvdx.runner.cluster --nodes 2 --ranks-per-node 2 --rate 1gbit -- python benchmarks/comm.py
    python -m hvdx.runner.cluster --nodes 2 --rate 1gbit --probe     # measure the links only
    python -m hvdx.runner.cluster --cleanup                          # what a killed launcher left

Layout (every address exists only inside namespaces this script creates and removes):

    hvdx-<pid>-<k>-sw   "switch": bridge br0 (10.77.0.254/24), one port p<i> per node
    hvdx-<pid>-<k>-n<i> node i: eth0 = 10.77.0.<i+1>/24, the far end of a veth pair from p<i>

Both ends of each veth pair are egress-shaped with `tbf` at `rate`, so every node has a
full-duplex NIC of that rate on a non-blocking switch. Ranks of one node reach each other
through the node's own address, which the kernel routes over the namespace's loopback:
unshaped, as fast as memory. Delay and loss need `netem`; where the kernel lacks it (as on
the machines this project runs on) they are left out with a warning, and the job sees
`"delay_applied": false` in $HVDX_CLUSTER.

Each rank gets horovodrun's Gloo environment (HOROVOD_RANK/SIZE, LOCAL_*, CROSS_*,
HOROVOD_HOSTNAME=node<i>, HOROVOD_GLOO_IFACE=eth0, the rendezvous address) and
HVDX_CLUSTER, a JSON description of the emulated network. The Gloo rendezvous server is
Horovod's own, listening inside the switch namespace. Output lines are prefixed with
`[rank]<stdout>:` / `[rank]<stderr>:` like horovodrun's. The job fails (exit status of the
first failing rank, 124 on timeout) as soon as any rank fails; the other ranks are killed
and everything created is removed, also on error, SIGTERM and Ctrl-C.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Dict, Iterator, List, Optional, Sequence, Tuple

SUBNET = "10.77.0"
SWITCH_ADDR = f"{SUBNET}.254"
NODE_IFACE = "eth0"
ETC_NETNS = Path("/etc/netns")  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*
NAME_RE = re.compile(r"^hvdx-(\d+)-(\d+)-(sw|n\d+)$")
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
_CLONE_NEWNET = 0x40000000
_counter = 0


class ClusterError(RuntimeError):
    """The emulated cluster could not be built or used (no root, no iproute2, bad spec)."""


def parse_rate(rate: str) -> int:
    """`tc` rate syntax in bits per second: '1gbit' -> 10**9 (SI units; 'mbps' = bytes is refused)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(rate).lower())
    unit = match.group(2) if match else None
    if unit == "":
        unit = "bit"
    if not match or unit not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ClusterError(f"bad rate {rate!r}: use a positive number with one of {', '.join(_RATE_UNITS)} "
                           "(bits per second, e.g. 1gbit or 100mbit)")
    return int(float(match.group(1)) * _RATE_UNITS[unit])


def parse_time(value: str) -> float:
    """'0.1ms' -> 1e-4 seconds (units s, ms, us)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)\s*", str(value).lower())
    if not match:
        raise ClusterError(f"bad delay {value!r}: use a number with s, ms or us (e.g. 0.1ms)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


@dataclass(frozen=True)
class LinkSpec:
    """What each node's link to the switch looks like, in `tc` syntax."""

    rate: str = "1gbit"
    delay: Optional[str] = "0.1ms"
    loss: Optional[str] = None  # e.g. "0.1%"
    mtu: int = 1500

    def __post_init__(self) -> None:
        parse_rate(self.rate)
        if self.delay is not None:
            parse_time(self.delay)
        if self.loss is not None and not re.fullmatch(r"[0-9]*\.?[0-9]+%", self.loss):
            raise ClusterError(f"bad loss {self.loss!r}: use a percentage such as 0.1%")
        if not 576 <= self.mtu <= 65535:
            raise ClusterError(f"bad mtu {self.mtu}: use 576..65535")

    @property
    def rate_bps(self) -> int:
        return parse_rate(self.rate)

    def wants_netem(self) -> bool:
        return (self.delay is not None and parse_time(self.delay) > 0) or self.loss is not None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    except FileNotFoundError as exc:
        raise ClusterError("`ip` not found: install iproute2 (scripts/bootstrap.sh does)") from exc
    if check and proc.returncode != 0:
        raise ClusterError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"tc -n {ns} {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def namespaces() -> List[str]:
    """Every network namespace on this machine, by name."""
    out = _ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _delete_namespace(ns: str) -> None:
    """Kills what still runs in `ns`, then deletes it (its veth ends and qdiscs go with it)."""
    pids = _ip("netns", "pids", ns, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", ns, check=False)
    shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
    with contextlib.suppress(OSError):
        ETC_NETNS.rmdir()  # only when no other namespace keeps files there


def cleanup_stale() -> List[str]:
    """Removes the namespaces of hvdx clusters whose launcher is gone; returns their names."""
    stale = [ns for ns in namespaces()
             if (m := NAME_RE.match(ns)) and not _pid_alive(int(m.group(1)))]
    for ns in stale:
        _delete_namespace(ns)
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


@dataclass
class Cluster:
    """`nodes` namespaces behind one switch namespace; a context manager that removes them all.

    >>> with Cluster(2, LinkSpec(rate="1gbit")) as c:
    ...     run_job(c, 2, ["python", "train.py"])
    """

    nodes: int
    link: LinkSpec = field(default_factory=LinkSpec)
    delay_applied: bool = False
    created: List[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        global _counter
        if not 1 <= self.nodes <= 250:
            raise ClusterError(f"nodes must be in 1..250, got {self.nodes}")
        _counter += 1
        self.prefix = f"hvdx-{os.getpid()}-{_counter}"

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def node_namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    @staticmethod
    def node_address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    @staticmethod
    def node_hostname(node: int) -> str:
        return f"node{node}"

    def describe(self) -> dict:
        """What HVDX_CLUSTER tells the ranks (and benchmarks write next to their results)."""
        return {"nodes": self.nodes, "rate": self.link.rate, "rate_bps": self.link.rate_bps,
                "delay": self.link.delay if self.delay_applied else None,
                "loss": self.link.loss if self.delay_applied else None,
                "delay_applied": self.delay_applied, "delay_requested": self.link.delay,
                "mtu": self.link.mtu, "qdisc": "netem+tbf" if self.delay_applied else "tbf"}

    # -- building and removing ---------------------------------------------------------
    def __enter__(self) -> "Cluster":
        if os.geteuid() != 0:
            raise ClusterError("the emulated cluster needs root (network namespaces, tc)")
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def _add_namespace(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self.created.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_namespace(self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "addr", "add", f"{SWITCH_ADDR}/24", "dev", "br0")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        self.delay_applied = self.link.wants_netem() and self._netem_available()
        if self.link.wants_netem() and not self.delay_applied:
            print(f"hvdx-cluster: warning: this kernel has no netem qdisc, so delay {self.link.delay}"
                  f"{' and loss ' + self.link.loss if self.link.loss else ''} cannot be emulated; "
                  f"links are rate-shaped only ({self.link.rate})", file=sys.stderr, flush=True)
        for node in range(self.nodes):
            ns, port = self.node_namespace(node), f"p{node}"
            self._add_namespace(ns)
            _ip("-n", self.switch, "link", "add", port, "mtu", str(self.link.mtu), "type", "veth",
                "peer", "name", NODE_IFACE, "mtu", str(self.link.mtu), "netns", ns)
            _ip("-n", self.switch, "link", "set", port, "master", "br0")
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", ns, "addr", "add", f"{self.node_address(node)}/24", "dev", NODE_IFACE)
            _ip("-n", ns, "link", "set", NODE_IFACE, "up")
            self._shape(ns, NODE_IFACE)          # node -> switch (the NIC's transmit side)
            self._shape(self.switch, port)       # switch -> node (the NIC's receive side)
            self._write_hosts(node)

    def _write_hosts(self, node: int) -> None:
        """The node's /etc/hosts: this machine's host name is the node's own address there.

        Horovod 0.28 creates the Gloo devices of process sets without HOROVOD_GLOO_IFACE,
        from the address the host name resolves to; on a real cluster that is the node's
        NIC, and here it must be too (the machine's /etc/hosts maps it to 127.0.0.1).
        """
        lines = ["127.0.0.1 localhost", "::1 localhost ip6-localhost ip6-loopback",
                 f"{self.node_address(node)} {socket.gethostname()} {self.node_hostname(node)}",
                 f"{SWITCH_ADDR} switch"]
        lines += [f"{self.node_address(j)} {self.node_hostname(j)}" for j in range(self.nodes) if j != node]
        folder = ETC_NETNS / self.node_namespace(node)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text("\n".join(lines) + "\n")

    def _netem_available(self) -> bool:
        probe = _tc(self.switch, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms", check=False)
        if probe.returncode == 0:
            _tc(self.switch, "qdisc", "del", "dev", "lo", "root", check=False)
        return probe.returncode == 0

    def _shape(self, ns: str, dev: str) -> None:
        rate_bps = self.link.rate_bps
        # The bucket holds 1 ms of traffic, at least one 64 KiB GSO segment; the queue 20 ms.
        burst = max(rate_bps // 8 // 1000, 64 * 1024 + 2 * self.link.mtu)
        limit = max(rate_bps // 8 // 50, 4 * burst)
        tbf = ["tbf", "rate", str(rate_bps), "burst", str(burst), "limit", str(limit)]
        if self.delay_applied:
            netem = ["netem"]
            if self.link.delay is not None:
                netem += ["delay", self.link.delay]
            if self.link.loss is not None:
                netem += ["loss", self.link.loss]
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem)
            _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
        else:
            _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)

    def destroy(self) -> None:
        """Kills anything left in the namespaces and deletes them; safe to call twice."""
        while self.created:
            _delete_namespace(self.created.pop())

    # -- running things inside -----------------------------------------------------------
    def command(self, node: int, argv: Sequence[str]) -> List[str]:
        """`argv` wrapped to run inside node `node`'s namespace."""
        return ["ip", "netns", "exec", self.node_namespace(node), *argv]


# -- the Horovod job ---------------------------------------------------------------------
def rank_environments(cluster: Cluster, ranks_per_node: int,
                      rendezvous_port: int) -> Tuple[List[Dict[str, str]], list]:
    """horovodrun's Gloo environment for every rank, placed node by node (rank r on node r // n),
    and Horovod's slot plan for the rendezvous server."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    hosts = ",".join(f"{cluster.node_hostname(i)}:{ranks_per_node}" for i in range(cluster.nodes))
    plan = get_host_assignments(parse_hosts(hosts), cluster.nodes * ranks_per_node)
    description = json.dumps(dict(cluster.describe(), ranks_per_node=ranks_per_node))
    envs = []
    for slot in plan:
        envs.append({
            "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
            "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
            "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": SWITCH_ADDR, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
            "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_GLOO_IFACE": NODE_IFACE, "NCCL_SOCKET_IFNAME": NODE_IFACE,
            "HVDX_CLUSTER": description, "PYTHONUNBUFFERED": "1",
        })
    return envs, plan


def _pump(stream: IO[str], prefix: str, out: IO[str], lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()


def run_job(cluster: Cluster, ranks_per_node: int, command: Sequence[str], *, timeout: Optional[float] = None,
            env: Optional[Dict[str, str]] = None, out: IO[str] = sys.stdout) -> int:
    """Runs `command` as ranks_per_node ranks in every node of `cluster`; 0 when every rank succeeds.

    Returns the exit status of the first rank that fails (the others are killed then), or
    124 when `timeout` seconds pass first. Says which rank on `out`.
    """
    from horovod.runner.http.http_server import RendezvousServer

    if ranks_per_node < 1:
        raise ClusterError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if not command:
        raise ClusterError("no command to run")
    server = RendezvousServer()
    with in_namespace(cluster.switch):
        port = server.start()
    procs: List[subprocess.Popen] = []
    lock = threading.Lock()
    pumps: List[threading.Thread] = []
    try:
        envs, plan = rank_environments(cluster, ranks_per_node, port)
        server.init(plan)
        for rank_env in envs:
            rank, node = int(rank_env["HOROVOD_RANK"]), int(rank_env["HOROVOD_CROSS_RANK"])
            proc = subprocess.Popen(cluster.command(node, command), env={**os.environ, **(env or {}), **rank_env},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, errors="replace", start_new_session=True)
            procs.append(proc)
            for stream, tag in ((proc.stdout, "stdout"), (proc.stderr, "stderr")):
                pump = threading.Thread(target=_pump, args=(stream, f"[{rank}]<{tag}>:", out, lock), daemon=True)
                pump.start()
                pumps.append(pump)
        deadline = None if timeout is None else time.monotonic() + timeout
        status = None
        while status is None:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                status = code if code > 0 else 128 - code
                why = f"exited with status {code}" if code > 0 else f"was killed by signal {-code}"
                message = f"rank {rank} (node {rank // ranks_per_node}) {why}; stopping the other ranks"
            elif all(c == 0 for c in codes):
                status, message = 0, None
            elif deadline is not None and time.monotonic() > deadline:
                running = [r for r, c in enumerate(codes) if c is None]
                status = 124
                message = f"timed out after {timeout:g} s; rank(s) {running} still running"
            else:
                time.sleep(0.05)
        if message:
            with lock:
                print(f"hvdx-cluster: {message}", file=out, flush=True)
        return status
    finally:
        _kill(procs)
        for pump in pumps:
            pump.join(timeout=5)
        server.stop()


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- link probes ---------------------------------------------------------------------------
_PROBE_PORT = 5201


def _endpoint(role: str, host: str, nbytes: int, rounds: int) -> None:
    """The far side of a probe: 'recv' counts bulk bytes, 'echo' answers pings (stdout: JSON)."""
    server = socket.create_server((host, _PROBE_PORT))
    print("ready", flush=True)
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if role == "recv":
        got, start = 0, None
        buf = bytearray(1 << 20)
        while got < nbytes:
            n = conn.recv_into(buf)
            if n == 0:
                break
            if start is None:
                start = time.perf_counter()
            got += n
        elapsed = time.perf_counter() - start
        conn.sendall(b"k")
        print(json.dumps({"bytes": got, "seconds": elapsed}), flush=True)
    else:
        for _ in range(rounds):
            conn.sendall(conn.recv(1))
    conn.close()


def _client(role: str, host: str, nbytes: int, rounds: int) -> None:
    for _ in range(200):  # the endpoint said "ready", but give the listen a moment anyway
        try:
            conn = socket.create_connection((host, _PROBE_PORT), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.01)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if role == "recv":
        chunk = bytes(1 << 20)
        left = nbytes
        while left > 0:
            left -= conn.send(memoryview(chunk)[:min(left, len(chunk))])
        conn.recv(1)
    else:
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            conn.sendall(b"p")
            conn.recv(1)
            times.append(time.perf_counter() - start)
        print(json.dumps({"rtt_seconds": statistics.median(times[rounds // 10:])}), flush=True)


def _probe(cluster: Cluster, src: int, dst: int, role: str, nbytes: int = 0, rounds: int = 0) -> dict:
    host = cluster.node_address(dst)
    args = ["--nbytes", str(nbytes), "--rounds", str(rounds), "--host", host]
    server = subprocess.Popen(cluster.command(dst, [sys.executable, __file__, "--endpoint", role, *args]),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        client = subprocess.run(cluster.command(src, [sys.executable, __file__, "--client", role, *args]),
                                capture_output=True, text=True, timeout=300)
        if client.returncode != 0:
            raise ClusterError(f"probe client failed: {client.stderr.strip()}")
        server_out, _ = server.communicate(timeout=60)
    finally:
        _kill([server])
    return json.loads((server_out if role == "recv" else client.stdout).strip().splitlines()[-1])


def throughput(cluster: Cluster, src: int, dst: int, nbytes: int = 64 << 20) -> float:
    """Bits per second of one TCP stream from node `src` to node `dst` (src == dst: inside a node)."""
    result = _probe(cluster, src, dst, "recv", nbytes=nbytes)
    return 8 * result["bytes"] / result["seconds"]


def round_trip(cluster: Cluster, src: int, dst: int, rounds: int = 500) -> float:
    """Median round-trip time in seconds of a 1-byte TCP ping-pong from `src` to `dst`."""
    return _probe(cluster, src, dst, "echo", rounds=rounds)["rtt_seconds"]


def probe_links(cluster: Cluster, nbytes: int = 64 << 20) -> dict:
    """Throughput and round trip between nodes 0 and 1 and inside node 0."""
    if cluster.nodes < 2:
        raise ClusterError("probing the links needs at least 2 nodes")
    inter_bytes = min(nbytes, max(4 << 20, cluster.link.rate_bps // 8 * 2))  # about 2 s of traffic
    return {"inter_bps": throughput(cluster, 0, 1, inter_bytes), "intra_bps": throughput(cluster, 0, 0, nbytes),
            "inter_rtt_s": round_trip(cluster, 0, 1), "intra_rtt_s": round_trip(cluster, 0, 0),
            "configured_bps": cluster.link.rate_bps}


# -- command line --------------------------------------------------------------------------
def _raise_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, command = argv[:split], argv[split + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     usage="%(prog)s [options] [--probe | --cleanup | -- command ...]")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", default="1gbit", help="per-node link rate, tc syntax (default 1gbit)")
    parser.add_argument("--delay", default="0.1ms", help="one-way delay per link end (netem; default 0.1ms)")
    parser.add_argument("--no-delay", action="store_true", help="no netem at all")
    parser.add_argument("--loss", default=None, help="loss per link end, e.g. 0.1%% (netem)")
    parser.add_argument("--mtu", type=int, default=1500)
    parser.add_argument("--timeout", type=float, default=None, help="seconds before the job is killed")
    parser.add_argument("--probe", action="store_true", help="measure the links and exit")
    parser.add_argument("--cleanup", action="store_true", help="remove namespaces of dead launchers")
    for hidden in ("--endpoint", "--client"):
        parser.add_argument(hidden, choices=("recv", "echo"), help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--nbytes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.endpoint or args.client:
        (_endpoint if args.endpoint else _client)(args.endpoint or args.client, args.host, args.nbytes, args.rounds)
        return 0
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed {len(removed)} namespace(s){': ' + ' '.join(removed) if removed else ''}")
        return 0
    if not command and not args.probe:
        parser.error("give a command after --, or --probe")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    try:
        link = LinkSpec(rate=args.rate, delay=None if args.no_delay else args.delay, loss=args.loss, mtu=args.mtu)
        with Cluster(args.nodes, link) as cluster:
            print(f"hvdx-cluster: {args.nodes} node(s) x {args.ranks_per_node} rank(s), "
                  f"links {json.dumps(cluster.describe())}", flush=True)
            if args.probe:
                result = probe_links(cluster)
                print(json.dumps(result))
                print(f"inter-node {result['inter_bps'] / 1e6:.0f} Mbit/s (configured "
                      f"{result['configured_bps'] / 1e6:.0f}), intra-node {result['intra_bps'] / 1e6:.0f} Mbit/s; "
                      f"round trip {result['inter_rtt_s'] * 1e6:.0f} us between nodes, "
                      f"{result['intra_rtt_s'] * 1e6:.0f} us inside one")
                return 0
            print(f"hvdx-cluster: running {shlex.join(command)}", flush=True)
            return run_job(cluster, args.ranks_per_node, command, timeout=args.timeout)
    except ClusterError as exc:
        print(f"hvdx-cluster: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("hvdx-cluster: interrupted; cleaned up", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
