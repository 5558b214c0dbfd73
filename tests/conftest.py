"""Session-wide guards: no test may write into the checkout."""
import subprocess

import pytest

from tests.harness import ROOT


def _status():
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    session.config._hvdx_status = _status()


def pytest_sessionfinish(session, exitstatus):
    before, after = getattr(session.config, "_hvdx_status", None), _status()
    if before is None or after is None:
        return
    new = sorted(after - before)
    if new:
        print("\nthe tests wrote into the checkout (use a tmp dir):\n  " + "\n  ".join(new))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
