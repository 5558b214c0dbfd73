"""CI's entry point fails when no test runs: pytest exits 5 when nothing is selected, and
`make test`, which .ci/run runs under `set -e`, passes that on as a failure."""
import re
import subprocess
import sys
from pathlib import Path

from tests.harness import ROOT


def test_ci_runs_make_test_under_set_e():
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    strict = next(i for i, line in enumerate(lines) if re.fullmatch(r"set -[a-z]*e[a-z]*( pipefail)?", line))
    test = lines.index("make test")  # the whole line: no `|| true`, no `; exit 0`
    assert strict < test, lines
    recipe = re.search(r"^test: .*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "-m pytest" in recipe and not re.search(r"^\t-|\|\||; *exit 0", recipe, re.M), recipe


def test_make_test_fails_when_no_test_is_selected():
    venv = Path(sys.executable).parents[1]
    proc = subprocess.run(["make", "-o", "bootstrap", "test", f"VENV={venv}",
                           "PYTEST_ARGS=tests/test_ci.py -k no_test_has_this_name -p no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stdout + proc.stderr
    assert "0 selected" in proc.stdout and "Error 5" in proc.stderr, proc.stdout + proc.stderr
