"""Link shaping for the emulated cluster with `tc`: a token bucket (tbf) at the link's rate,
under netem's delay and loss where the kernel has netem.

Rates and times use tc's syntax: '1gbit' is 10**9 bits per second (SI units; 'mbps',
bytes per second in tc, is refused as ambiguous), '0.1ms' is 1e-4 seconds.
"""
from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from typing import Optional

from .netns import ClusterError

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_TIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


def parse_rate(rate: str) -> int:
    """`tc` rate syntax in bits per second: '1gbit' -> 10**9.

    Raises:
        ClusterError: not a positive number with one of the units bit, kbit, mbit, gbit, tbit.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-z]*)\s*", str(rate).lower())
    unit = match.group(2) if match else None
    if unit == "":
        unit = "bit"
    if not match or unit not in _RATE_UNITS or float(match.group(1)) <= 0:
        raise ClusterError(f"bad rate {rate!r}: use a positive number with one of {', '.join(_RATE_UNITS)} "
                           "(bits per second, e.g. 1gbit or 100mbit)")
    return int(float(match.group(1)) * _RATE_UNITS[unit])


def parse_time(value: str) -> float:
    """'0.1ms' -> 1e-4 seconds (units s, ms, us).

    Raises:
        ClusterError: not a number with one of those units.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)\s*", str(value).lower())
    if not match:
        raise ClusterError(f"bad delay {value!r}: use a number with s, ms or us (e.g. 0.1ms)")
    return float(match.group(1)) * _TIME_UNITS[match.group(2)]


@dataclass(frozen=True)
class LinkSpec:
    """What each node's link to the switch looks like, in `tc` syntax.

    Raises:
        ClusterError: a bad rate, delay, loss (a percentage such as "0.1%") or MTU (576..65535).
    """

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


def tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Runs `tc -n NS ARGS...`.

    Raises:
        ClusterError: (with `check`) tc failed; the message has its stderr.
    """
    proc = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ClusterError(f"tc -n {ns} {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def netem_available(ns: str) -> bool:
    """Whether this kernel has the netem qdisc (tried on the loopback of namespace `ns`)."""
    probe = tc(ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "0ms", check=False)
    if probe.returncode == 0:
        tc(ns, "qdisc", "del", "dev", "lo", "root", check=False)
    return probe.returncode == 0


def shape(ns: str, dev: str, link: LinkSpec, *, netem: bool) -> None:
    """Egress of `dev` in `ns` at `link.rate`: tbf whose bucket holds 1 ms of traffic (at
    least one 64 KiB GSO segment) and whose queue holds 20 ms; with `netem`, under netem's
    delay and loss (handle 1:, tbf as its child 10:)."""
    rate_bps = link.rate_bps
    burst = max(rate_bps // 8 // 1000, 64 * 1024 + 2 * link.mtu)
    limit = max(rate_bps // 8 // 50, 4 * burst)
    tbf = ["tbf", "rate", str(rate_bps), "burst", str(burst), "limit", str(limit)]
    if netem:
        emulation = ["netem"]
        if link.delay is not None:
            emulation += ["delay", link.delay]
        if link.loss is not None:
            emulation += ["loss", link.loss]
        tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *emulation)
        tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
    else:
        tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)
