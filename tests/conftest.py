"""Session-wide guards and the multi-rank suite.

- tf.keras is what TensorFlow makes it in the tests' process, as in a user's: Keras 3 from
  TensorFlow 2.16 on, unless the one who runs the tests sets $TF_USE_LEGACY_KERAS=1. Tests of
  hvdx's Keras 2 code in this process take Keras 2 from `hvdx.legacy_keras.keras2()` (tf_keras
  beside Keras 3); the rank scripts (`harness.test_env`) run with tf.keras as Keras 2 (the Keras
  2 checks), but for the "keras3:" topologies and the launches that remove the variable.
- No test may write into the checkout, nor leave files in the machine's temporary directory:
  the session's processes (the ranks it launches, TensorFlow's autograph files) get their own
  ($TMPDIR, set here before anything creates a temporary file), removed when the session passes
  and named in the summary when it fails.
- Tests made with `tests.suite.runs` get their check's result as the `ranks` fixture: each
  topology is launched once, for the union of the checks that the selected tests need. The
  launches start with the session, in the background, and those tests run after the others
  (HVDX_LAUNCH_AHEAD=0: in collection order, each launch when its first test needs it). Of
  the others, those that launch ranks themselves run after those that launch nothing: the
  one-process tests keep one core busy beside the suite's launch, and the launching ones, which
  want both cores, meet fewer of the suite's launches still running.
- Tests that launch are marked `multirank`, those CI's second stack runs too `second_stack`,
  long runs and benchmark smoke tests `slow` (pyproject.toml).
"""
import os
import resource
import shutil
import subprocess
import tempfile
import time

SESSION_TMP = tempfile.mkdtemp(prefix="hvdx-tests-")
os.environ["TMPDIR"] = SESSION_TMP  # inherited by every process the session starts
tempfile.tempdir = None  # this process reads $TMPDIR again

import pytest  # noqa: E402

from tests import suite  # noqa: E402
from tests.harness import ROOT  # noqa: E402

SUITE = pytest.StashKey[suite.Suite]()
COST = pytest.StashKey[dict]()


def _cpu(config) -> float:
    """CPU seconds of this process and of its children that ended (a test's subprocesses and
    launches), less the session suite's launches (reaped by their thread, whichever test runs
    then: the summary reports them on their own)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    launched = config.stash[SUITE].ledger.total if SUITE in config.stash else 0.0
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime - launched


def _status():
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return set(out.stdout.splitlines()) if out.returncode == 0 else None


def pytest_sessionstart(session):
    session.config._hvdx_status = _status()


def pytest_unconfigure(config):
    """The session's temporary directory goes, unless the session failed and left files there
    (then they are kept); a run that never reached a session (`--help`) ran nothing to keep."""
    if getattr(config, "_hvdx_failed", False) and os.listdir(SESSION_TMP):
        print(f"\nthe session's temporary files are kept in {SESSION_TMP}")
    else:
        shutil.rmtree(SESSION_TMP, ignore_errors=True)


def pytest_sessionfinish(session, exitstatus):
    before, after = getattr(session.config, "_hvdx_status", None), _status()
    new = sorted(after - before) if before is not None and after is not None else []
    if new:
        print("\nthe tests wrote into the checkout (use a tmp dir):\n  " + "\n  ".join(new))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config._hvdx_failed = session.exitstatus not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


def _launch_ahead() -> bool:
    return os.environ.get("HVDX_LAUNCH_AHEAD", "1") != "0"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """The tests that launch nothing first, then those that launch ranks themselves, then the
    suite's (their launches run while the others do); a test that may launch its topology
    may take that launch's time beyond its own timeout. Where tf.keras is Keras 3 here, the
    tests marked keras2 that run in this process are skipped (`make test` runs them after, in
    a process with tf.keras as Keras 2)."""
    _skip_keras2_tests(items)
    if _launch_ahead():
        items.sort(key=_phase)  # stable: collection order within each
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


def _skip_keras2_tests(items) -> None:
    marked = [item for item in items
              if item.get_closest_marker("keras2") is not None and item.get_closest_marker("multirank") is None]
    if not marked:
        return
    from hvdx import legacy_keras

    if legacy_keras.tf_keras_is_keras3():
        skip = pytest.mark.skip(reason="Keras 2 as tf.keras in the tests' process: `make test` runs it with "
                                       "TF_USE_LEGACY_KERAS=1 after (tests/keras2_pass.sh)")
        for item in marked:
            item.add_marker(skip)


def _phase(item: pytest.Item) -> int:
    """0: launches nothing; 1: launches ranks itself (marked multirank); 2: a suite check's test."""
    if suite.needed(item) is not None:
        return 2
    return 1 if item.get_closest_marker("multirank") is not None else 0


def _suite(config, tmp_path_factory) -> suite.Suite:
    if SUITE not in config.stash:
        base = tmp_path_factory.mktemp("multirank")
        config.stash[SUITE] = suite.Suite(lambda: base)
    return config.stash[SUITE]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtestloop(session):
    """Starts the launches the selected tests need before the first test runs; stops any
    still running when the tests end (an early stop, -x, Ctrl-C)."""
    if _launch_ahead() and not session.config.option.collectonly and any(map(suite.needed, session.items)):
        _suite(session.config, session.config._tmp_path_factory).start_ahead(session.items)
    try:
        yield
    finally:
        if SUITE in session.config.stash:
            session.config.stash[SUITE].stop()


@pytest.fixture(scope="session")
def multirank_suite(request, tmp_path_factory) -> suite.Suite:
    """The session's launches (tests.suite.Suite), their files under pytest's tmp directory."""
    return _suite(request.config, tmp_path_factory)


@pytest.fixture
def ranks(request, multirank_suite) -> suite.RankResults:
    """Every rank's data of the check this test is parametrized by (`tests.suite.runs`)."""
    return multirank_suite.result(request.param, request.session.items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's wall and CPU seconds (setup, call, teardown; the subprocesses and launches it
    started itself included, the suite's launches not: the summary has a line for each) for
    the session's summary."""
    wall, cpu = time.monotonic(), _cpu(item.config)
    yield
    item.config.stash.setdefault(COST, {})[item.nodeid] = (time.monotonic() - wall, _cpu(item.config) - cpu)


def _cost_summary(terminalreporter, config) -> None:
    top = int(os.environ.get("HVDX_COST_TOP", "25"))  # the costliest files and tests listed
    costs = config.stash.get(COST, {})
    if not costs:
        return
    total_cpu = sum(cpu for _, cpu in costs.values())
    by_file: dict = {}
    for nodeid, (wall, cpu) in costs.items():
        w, c = by_file.get(nodeid.split("::")[0], (0.0, 0.0))
        by_file[nodeid.split("::")[0]] = (w + wall, c + cpu)
    terminalreporter.section(f"cost: {len(costs)} tests, {total_cpu:.0f} CPU s in all (the suite's launches "
                             "not included: see 'multi-rank suite')")
    for name, (wall, cpu) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[:top]:
        terminalreporter.write_line(f"{cpu:7.0f} CPU s {wall:7.0f} s  {name}")
    terminalreporter.write_line("tests:")
    for name, (wall, cpu) in sorted(costs.items(), key=lambda kv: -kv[1][1])[:top]:
        terminalreporter.write_line(f"{cpu:7.0f} CPU s {wall:7.0f} s  {name}")


def pytest_terminal_summary(terminalreporter, config):
    _cost_summary(terminalreporter, config)
    if SUITE not in config.stash or not config.stash[SUITE].launches:
        return
    launches = config.stash[SUITE].launches
    measured = sum(record.cpu_seconds or 0.0 for record in launches)
    terminalreporter.section(f"multi-rank suite: {len(launches)} launch(es), {measured:.0f} CPU s")
    for record in launches:
        terminalreporter.write_line(str(record))
