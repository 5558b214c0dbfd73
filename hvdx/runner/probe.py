"""Measures the emulated cluster's links: one TCP stream's throughput and a 1-byte TCP
ping-pong's round trip, between two nodes or inside one.

The two ends run as `python hvdx/runner/cluster.py --endpoint|--client ROLE ...` inside the
nodes' namespaces (hidden options of the command line, hvdx/runner/cli.py).
"""
from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from typing import TYPE_CHECKING

from .launch import CLUSTER_SCRIPT, stop
from .netns import ClusterError

if TYPE_CHECKING:
    from .cluster import Cluster

PORT = 5201


def endpoint(role: str, host: str, nbytes: int, rounds: int) -> None:
    """The far side of a probe: 'recv' counts bulk bytes, 'echo' answers pings (stdout: JSON)."""
    server = socket.create_server((host, PORT))
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


def client(role: str, host: str, nbytes: int, rounds: int) -> None:
    """The near side: sends `nbytes` ('recv'), or pings `rounds` times ('echo', stdout: JSON)."""
    for _ in range(200):  # the endpoint said "ready", but give the listen a moment anyway
        try:
            conn = socket.create_connection((host, PORT), timeout=30)
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


def _probe(cluster: "Cluster", src: int, dst: int, role: str, nbytes: int = 0, rounds: int = 0) -> dict:
    host = cluster.node_address(dst)
    args = ["--nbytes", str(nbytes), "--rounds", str(rounds), "--host", host]
    script = [sys.executable, str(CLUSTER_SCRIPT)]
    server = subprocess.Popen(cluster.command(dst, [*script, "--endpoint", role, *args]),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        near = subprocess.run(cluster.command(src, [*script, "--client", role, *args]),
                              capture_output=True, text=True, timeout=300)
        if near.returncode != 0:
            raise ClusterError(f"probe client failed: {near.stderr.strip()}")
        server_out, _ = server.communicate(timeout=60)
    finally:
        stop([server])
    return json.loads((server_out if role == "recv" else near.stdout).strip().splitlines()[-1])


def throughput(cluster: "Cluster", src: int, dst: int, nbytes: int = 64 << 20) -> float:
    """Bits per second of one TCP stream from node `src` to node `dst` (src == dst: inside a node)."""
    result = _probe(cluster, src, dst, "recv", nbytes=nbytes)
    return 8 * result["bytes"] / result["seconds"]


def round_trip(cluster: "Cluster", src: int, dst: int, rounds: int = 500) -> float:
    """Median round-trip time in seconds of a 1-byte TCP ping-pong from `src` to `dst`."""
    return _probe(cluster, src, dst, "echo", rounds=rounds)["rtt_seconds"]


def probe_links(cluster: "Cluster", nbytes: int = 64 << 20) -> dict:
    """Throughput and round trip between nodes 0 and 1 and inside node 0.

    Raises:
        ClusterError: fewer than 2 nodes.
    """
    if cluster.nodes < 2:
        raise ClusterError("probing the links needs at least 2 nodes")
    inter_bytes = min(nbytes, max(4 << 20, cluster.link.rate_bps // 8 * 2))  # about 2 s of traffic
    return {"inter_bps": throughput(cluster, 0, 1, inter_bytes), "intra_bps": throughput(cluster, 0, 0, nbytes),
            "inter_rtt_s": round_trip(cluster, 0, 1), "intra_rtt_s": round_trip(cluster, 0, 0),
            "configured_bps": cluster.link.rate_bps}
