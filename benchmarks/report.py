"""Shared by the benchmark scripts: their tables in benchmarks/README.md."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]], text_columns: int = 0) -> str:
    """A Markdown table: the first `text_columns` columns left-aligned, the others (numbers) right."""
    align = ["---"] * text_columns + ["---:"] * (len(header) - text_columns)
    return "\n".join("| " + " | ".join(str(cell) for cell in line) + " |" for line in [header, align, *rows])


def update_readme(section: str, body: str, readme: Path) -> None:
    """Replaces the text between the section's markers in benchmarks/README.md."""
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    text = readme.read_text() if readme.exists() else "# hvdx benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text:
        text = re.sub(re.escape(begin) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def launch_ranks(script: str, worker_args: List[str], nodes: int, per_node: int, *, local: bool, rate: str,
                 env: Optional[Dict[str, str]] = None) -> None:
    """Runs `script` with `worker_args` on nodes x per_node ranks: horovodrun over loopback
    (`local`) or the emulated cluster with `rate` links between nodes (root)."""
    worker = [sys.executable, script, *worker_args]
    if local:
        sys.path.insert(0, str(ROOT))
        from tests.harness import hosts

        horovodrun = Path(sys.executable).parent / "horovodrun"
        command = [str(horovodrun), "-np", str(nodes * per_node), "-H", hosts(nodes, per_node), "--gloo", *worker]
    else:
        command = [sys.executable, str(ROOT / "hvdx" / "runner" / "cluster.py"), "--nodes", str(nodes),
                   "--ranks-per-node", str(per_node), "--rate", rate, "--no-delay", "--", *worker]
    print("launching:", " ".join(command), flush=True)
    code = subprocess.call(command, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})))
    if code:
        raise SystemExit(f"the {nodes}x{per_node} run failed (exit status {code})")


def per_topology(topologies: str, launch: Callable[[int, int, Path], None]) -> Iterator[dict]:
    """For each "MxN" of `topologies`: `launch(nodes, per_node, json_path)`, then the JSON its
    rank 0 wrote, with the machine's 1-minute load average before and after the run (the
    2 cores may be shared: a reader should know how busy they were)."""
    for topology in topologies.split(","):
        nodes, per_node = (int(x) for x in topology.split("x"))
        load_before = os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "ranks.json"
            launch(nodes, per_node, path)
            result = json.loads(path.read_text())
        result["load_average"] = [load_before, os.getloadavg()[0]]
        yield result
