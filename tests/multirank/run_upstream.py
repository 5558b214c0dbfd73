"""Runs an adapted upstream file on this rank (tests/test_horovod_upstream.py adapts them):

    run_upstream.py script <path> [args...]     # an example, as `python <path> args`
    run_upstream.py pytest <path> <k-expression> [<density>]
                                                # its tests under pytest, one or more phases

Each rank records what happened (the pytest outcome of every test, per phase), then meets
the others at the final barrier.
"""
import os
import runpy
import sys

from tests.multirank.rank import run


class Outcomes:
    """A pytest plugin that keeps each test's outcome."""

    def __init__(self):
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid.split("::")[-1]] = report.outcome


def run_script(path, args):
    os.chdir(os.path.dirname(path))  # the examples write their checkpoints into the cwd
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
    return {"ran": path}


def run_pytest(path, phases):
    import pytest

    os.chdir(os.path.dirname(path))
    results = {}
    for expression, density in phases:
        if density:
            os.environ["HVDX_DENSITY"] = density
        plugin = Outcomes()
        code = pytest.main([path, "-q", "-p", "no:cacheprovider", "-k", expression, "-W", "ignore::DeprecationWarning"],
                           plugins=[plugin])
        results[f"{expression} @ {density}"] = {"exit": int(code), "outcomes": plugin.outcomes}
    return results


def main():
    mode, path, *rest = sys.argv[1:]
    if mode == "script":
        return run_script(path, rest)
    phases = [(rest[i], rest[i + 1] if i + 1 < len(rest) else "") for i in range(0, len(rest), 2)]
    return run_pytest(path, phases)


if __name__ == "__main__":
    run(main)
