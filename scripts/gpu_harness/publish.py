"""Takes the results of a GPU run (scripts/gpu_harness.sh OUT) into the checkout:
OUT/bench.json -> benchmarks/results/gpu_harness.json (with the checks' counts),
OUT/fig6.png -> benchmarks/results/gpu_harness_fig6.png, and the tables of OUT/report.md
into benchmarks/README.md's section "gpu-harness".

    python3 -m scripts.gpu_harness.publish OUT [--readme benchmarks/README.md]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from scripts.gpu_harness.lib import ROOT

COMMAND = "scripts/gpu_harness.sh OUT"


def section_body(report: str, summary: dict, figure: bool = False) -> str:
    """The README text: how many checks passed, the tables, and the command."""
    mstopk = summary.get("mstopk", {}).get("cases", [])
    sparse = summary.get("sparse_accumulate", {}).get("cases", [])
    largest = max((c["d"] for c in mstopk), default=0)
    lines = [f"Checks of the same run: {len(mstopk)} MSTopK cases (d up to {largest:,}) and {len(sparse)} sparse "
             f"accumulation cases, GPU against CPU bit for bit, against tests/mstopk_reference.py, and run to run; "
             f"injected launch errors; **{len(summary.get('failures', []))} failures**. "
             f"Made by `{COMMAND}` and `python3 -m scripts.gpu_harness.publish OUT` ([gpu.md](../docs/gpu.md)).", ""]
    tables = re.split(r"^# .*\n", report, maxsplit=1, flags=re.M)[-1].strip()
    lines.append(re.sub(r"^Checks: .*\n?", "", tables, flags=re.M).strip())
    if figure:
        lines += ["", "![Figure 6 on the GPU](results/gpu_harness_fig6.png)"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder scripts/gpu_harness.sh wrote")
    parser.add_argument("--readme", type=Path, default=ROOT / "benchmarks" / "README.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    summary = json.loads((args.out / "summary.json").read_text())
    if not (args.out / "bench.json").exists():
        print(f"{args.out} has no bench.json: the run did not benchmark (no GPU, or PyTorch missing)", file=sys.stderr)
        return 1
    results = args.results
    results.mkdir(parents=True, exist_ok=True)
    bench = json.loads((args.out / "bench.json").read_text())
    bench["checks"] = {"mstopk_cases": len(summary["mstopk"]["cases"]),
                       "sparse_cases": len(summary["sparse_accumulate"]["cases"]),
                       "failures": summary["failures"]}
    (results / "gpu_harness.json").write_text(json.dumps(bench, indent=1))
    if (args.out / "fig6.png").exists():
        shutil.copyfile(args.out / "fig6.png", results / "gpu_harness_fig6.png")
    sys.path.insert(0, str(ROOT))
    from benchmarks.common import update_readme
    body = section_body((args.out / "report.md").read_text(), summary, (args.out / "fig6.png").exists())
    update_readme("gpu-harness", body, args.readme)
    print(f"wrote {results / 'gpu_harness.json'} and the gpu-harness section of {args.readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
