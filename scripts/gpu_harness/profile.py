"""Where the CUDA kernels' time goes: every kernel MSTopK and sparse accumulation launch,
timed by CUPTI through torch.profiler (the harness's kernels run in the same process and
context), at the benchmark's largest cases. Writes OUT/profile.json and prints a table:
per kernel, calls per run and microseconds per run.

    python3 -m scripts.gpu_harness.profile --lib build/libhvdx_harness.so --out DIR

Needs PyTorch with CUDA (no TensorFlow, no Nsight).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from scripts.gpu_harness import bench
from scripts.gpu_harness.lib import Harness


def kernel_sequence(fn: Callable[[], None]) -> List[dict]:
    """The CUDA kernels (and memsets, copies) of one call of fn in launch order, with microseconds."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if (getattr(e, "device_time", None) or getattr(e, "cuda_time", 0))]
    events.sort(key=lambda e: e.time_range.start)
    return [{"kernel": e.name[:120], "us": getattr(e, "device_time", None) or e.cuda_time} for e in events]


def kernel_times(fn: Callable[[], None], runs: int = 10) -> List[dict]:
    """Per CUDA kernel (or memset/memcpy) of fn: calls and microseconds per run, CUPTI's."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn()
        torch.cuda.synchronize()
    totals: Dict[str, List[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        us = getattr(event, "device_time", None)
        if us is None:
            us = getattr(event, "cuda_time", 0.0)
        if not us:
            continue
        totals[event.name][0] += 1
        totals[event.name][1] += us
    rows = [{"kernel": name[:120], "calls_per_run": n / runs, "us_per_run": us / runs}
            for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda r: -r["us_per_run"])


def main(argv: Optional[Sequence[str]] = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lib", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    h = Harness(args.lib)
    result: dict = {"device": torch.cuda.get_device_name(0), "mstopk": {}, "sparse": {}}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for d, density in ((2**22, 0.001), (100_000_000, 0.001), (100_000_000, 0.01)):
        x = torch.randn(d, device="cuda", generator=gen)
        run = bench.MsTopKRunner(h, x, int(d * density))
        result["mstopk"][f"{d} {density}"] = {
            "total_ms": bench.cuda_median_ms(run)["ms"],
            "floor_ms": bench.cuda_median_ms(lambda: torch.linalg.vector_norm(x, float("inf")))["ms"],
            "kernels": kernel_times(run), "sequence": kernel_sequence(run)}
        del x
    d = bench.SPARSE_D
    for nnz in (10_000, 1_000_000, 10_000_000):
        values = torch.randn(nnz, device="cuda", generator=gen)
        idx32 = torch.randint(0, d, (nnz,), device="cuda", generator=gen, dtype=torch.int32)
        accumulate = bench.SparseRunner(h, values, idx32, d)
        idx64 = idx32.long()
        result["sparse"][str(nnz)] = {
            "total_ms": bench.cuda_median_ms(accumulate)["ms"],
            "index_add_ms": bench.cuda_median_ms(lambda: torch.zeros(d, device="cuda").index_add_(0, idx64, values))["ms"],
            "kernels": kernel_times(accumulate),
            "index_add_kernels": kernel_times(lambda: torch.zeros(d, device="cuda").index_add_(0, idx64, values))}
    (args.out / "profile.json").write_text(json.dumps(result, indent=1))
    for part in ("mstopk", "sparse"):
        for size, r in result[part].items():
            print(f"{part} {size}: total {r['total_ms']:.3f} ms" +
                  (f", floor {r['floor_ms']:.3f} ms" if "floor_ms" in r else f", index_add {r['index_add_ms']:.3f} ms"))
            for k in r["kernels"]:
                print(f"   {k['us_per_run']:9.1f} us  x{k['calls_per_run']:.0f}  {k['kernel'][:90]}")
            for k in r.get("sequence", []):
                print(f"      call {k['us']:9.1f} us  {k['kernel'][:70]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
