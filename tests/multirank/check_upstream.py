"""Runs an adapted upstream file on this rank (tests/test_horovod_upstream.py adapts them):

- "script": an example, as `python <path> <args>` would (in its own directory);
- "pytest": its tests under pytest, in phases: (k-expression, $HVDX_DENSITY or "") each.

Each rank records what happened (the pytest outcome of every test, per phase).
"""
import os
import runpy
import sys
from typing import Sequence


class Outcomes:
    """A pytest plugin that keeps each test's outcome."""

    def __init__(self):
        self.outcomes = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid.split("::")[-1]] = report.outcome


def run_script(path: str, args: Sequence[str] = ()) -> dict:
    """Runs the script; returns its path, the package tf.keras resolves to in this rank
    ("keras": Keras 3, "tf_keras": Keras 2), and the files it left in its directory."""
    os.chdir(os.path.dirname(path))  # the examples write their checkpoints into the cwd
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(path))
    runpy.run_path(path, run_name="__main__")
    import tensorflow as tf

    from hvdx import legacy_keras

    return {"ran": path, "tf_keras": legacy_keras.keras_package(tf), "files": sorted(os.listdir("."))}


def run_pytest(path: str, phases: Sequence[Sequence[str]]) -> dict:
    import pytest

    os.chdir(os.path.dirname(path))
    results = {}
    for expression, density in phases:
        if density:
            os.environ["HVDX_DENSITY"] = density
        plugin = Outcomes()
        # Horovod's tests use no Hypothesis; its plugin's end-of-session hook took ~3 CPU s per rank on 2x2 (py-spy)
        code = pytest.main([path, "-q", "-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-k", expression,
                            "-W", "ignore::DeprecationWarning"], plugins=[plugin])
        results[f"{expression} @ {density}"] = {"exit": int(code), "outcomes": plugin.outcomes}
    return results


CHECKS = {"script": run_script, "pytest": run_pytest}
