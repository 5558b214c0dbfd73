"""Runs a command and writes the CPU seconds it used, its every descendant included.

    python tests/cpu_meter.py OUT.json -- COMMAND...

The job is this process's only child: `os.wait4` hands back the rusage of it and of every
descendant it (and they) waited for, exactly, and OUT.json gets
{"cpu_seconds": user + system, "returncode": ...}. SIGTERM and SIGINT are passed on to the
job; this process exits with the job's exit status (128 + N for a signal N).

Why a process of its own: the suite launches in a thread of the pytest process, whose
RUSAGE_CHILDREN also grows by every subprocess of the test running meanwhile; a launch's own
CPU is only known from its own parent (tests/harness.py wraps every launch in this).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import List


def main(argv: List[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        raise SystemExit("usage: cpu_meter.py OUT.json -- COMMAND...")
    out, command = Path(argv[0]), argv[2:]
    child = subprocess.Popen(command)  # inherits stdin/stdout/stderr, session and environment

    def forward(signum, _frame):
        try:
            child.send_signal(signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            _, status, usage = os.wait4(child.pid, 0)
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
    child.returncode = os.waitstatus_to_exitcode(status)
    tmp = out.with_name("." + out.name)
    tmp.write_text(json.dumps({"cpu_seconds": usage.ru_utime + usage.ru_stime, "returncode": child.returncode}))
    tmp.rename(out)
    code = child.returncode
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
