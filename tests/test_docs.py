"""The documentation a user clones: every relative link and #anchor resolves, nothing points
outside the repository (a clone has no ../shared), and the README stays a five-minute read."""
import re
import subprocess

import pytest

from tests.harness import ROOT

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "tests" / "upstream" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]


def anchors(path):
    """GitHub's heading slugs (lower case, punctuation but - and _ dropped, spaces to -) and <a id>s."""
    text = path.read_text()
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for line in text.splitlines():
        heading = re.match(r"#+\s+(.*)", line)
        if heading:
            out.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return out


def links(path):
    in_code = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        if not in_code:
            for target in LINK.findall(line):
                if not re.match(r"[a-z]+:", target):  # http(s):, mailto:
                    yield number, target


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc):
    bad = []
    for number, target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            bad.append(f"{number}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{number}: {target}: no such anchor")
    assert not bad, bad


def test_nothing_in_the_repository_points_outside_it():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    outside = re.compile(r"\.\./shared|shared/papers|DESIGN\.md")
    hits = [f"{name}:{n}" for name in tracked.split()
            if (ROOT / name).is_file() and not name.startswith("tests/upstream/horovod/")
            for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
            if outside.search(line) and name != "tests/test_docs.py"]
    assert not hits, hits


def test_the_readme_is_a_five_minute_read():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
