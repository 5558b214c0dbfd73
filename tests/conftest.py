"""Session-wide guards and the multi-rank suite.

- No test may write into the checkout.
- Tests made with `tests.suite.runs` get their check's result as the `ranks` fixture: each
  topology is launched once, for the union of the checks that the selected tests need.
- Tests that launch are marked `multirank`; benchmark smoke tests `slow` (pyproject.toml).
"""
import subprocess

import pytest

from tests import suite
from tests.harness import ROOT

SUITE = pytest.StashKey[suite.Suite]()


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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """A test that may launch its topology may take that launch's time beyond its own timeout."""
    if not config.pluginmanager.hasplugin("timeout"):
        return
    import pytest_timeout

    default = pytest_timeout.get_env_settings(config).timeout
    if not default:
        return  # no timeout
    checks = [c for c in dict.fromkeys(suite.needed(item) for item in items) if c is not None]
    for item in items:
        wanted = suite.needed(item)
        if wanted is not None and item.get_closest_marker("timeout") is None:
            launch = suite.budget(c for c in checks if c.topology == wanted.topology)
            item.add_marker(pytest.mark.timeout(default + launch))


@pytest.fixture(scope="session")
def multirank_suite(request, tmp_path_factory) -> suite.Suite:
    """The session's launches (tests.suite.Suite), their files under pytest's tmp directory."""
    if SUITE not in request.config.stash:
        base = tmp_path_factory.mktemp("multirank")
        request.config.stash[SUITE] = suite.Suite(lambda: base)
    return request.config.stash[SUITE]


@pytest.fixture
def ranks(request, multirank_suite) -> suite.RankResults:
    """Every rank's data of the check this test is parametrized by (`tests.suite.runs`)."""
    return multirank_suite.result(request.param, request.session.items)


def pytest_terminal_summary(terminalreporter, config):
    if SUITE not in config.stash or not config.stash[SUITE].launches:
        return
    launches = config.stash[SUITE].launches
    terminalreporter.section(f"multi-rank suite: {len(launches)} launch(es)")
    for record in launches:
        terminalreporter.write_line(str(record))
