"""Builds the harness and runs every check (and, on a GPU, the Figure 6 benchmark),
writing the results under --out:

    summary.json   every check's cases and outcomes, the failures, the environment
    bench.json     the timings (GPU only, unless --skip-bench)
    report.md      the tables (markdown; what benchmarks/README.md's GPU section takes)
    fig6.png       the figure (when matplotlib is there)
    build.log      CMake's output

    python3 -m scripts.gpu_harness.run --out DIR [--lib PATH | --build-dir DIR]
        [--cpu-only] [--quick] [--skip-bench] [--sanitizer-subset] [--kernels mstopk,sparse_accumulate,error_feedback,quantize]

Exit status 1 when a check failed. summary.json is rewritten after each part, and a crash
of the process (a segmentation fault in a kernel's host code) prints the Python stack
(faulthandler), so what ran before it is kept and where it stopped is named. Needs NumPy;
the benchmark needs PyTorch (CuPy optional).
Never imports TensorFlow (summary.json records that it was not loaded).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from scripts.gpu_harness import bench, checks, inputs
from scripts.gpu_harness.lib import DeviceBuffer, Harness, HarnessError, build

FULL_SIZES = [1, 2, 17, 4095, 4096, 4097, 65_537, 1_000_003, 2**24]
QUICK_SIZES = [1, 17, 4097, 65_537]
CPU_ONLY_SIZES = [1, 17, 4097, 65_537, 1_000_003]
SANITIZER_SIZES = [1, 4097, 100_003]
DENSITIES = [0.001, 0.01, 0.1]
LARGEST = 2**28   # one case at the issue's largest d (normal, density 0.001, int64 indices)
KERNELS = ("mstopk", "sparse_accumulate", "error_feedback", "quantize")


def gpu_name() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            return f"{p.name} ({p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB)"
    except Exception:
        pass
    return "unknown GPU"


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the results (created)")
    parser.add_argument("--lib", type=Path, help="an already built libhvdx_harness.so")
    parser.add_argument("--build-dir", type=Path, help="where to build the harness (default: a temporary folder)")
    parser.add_argument("--cuda", default="AUTO", choices=["AUTO", "ON", "OFF"], help="HVDX_HARNESS_CUDA")
    parser.add_argument("--cpu-only", action="store_true", help="check the CPU kernels only (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="small sizes only (a smoke run)")
    parser.add_argument("--skip-bench", action="store_true", help="no speed benchmark")
    parser.add_argument("--sanitizer-subset", action="store_true",
                        help="the small GPU cases only, no errors injected, no benchmark: what compute-sanitizer runs")
    parser.add_argument("--threads", type=int, default=0, help="CPU kernel threads (0: all)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"which kernels to check and benchmark, comma-separated (default: {','.join(KERNELS)})")
    args = parser.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown or not kernels:
        parser.error(f"--kernels takes a comma-separated list of {', '.join(KERNELS)}; got {args.kernels!r}")
    faulthandler.enable()
    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    log_lines: List[str] = []

    def log(text: str) -> None:
        line = f"[gpu_harness {time.time() - t0:6.1f}s] {text}"
        print(line, flush=True)
        log_lines.append(line)

    lib_path = args.lib
    if lib_path is None:
        build_dir = args.build_dir or Path(tempfile.mkdtemp(prefix="hvdx-harness-"))
        log(f"building the harness in {build_dir} (HVDX_HARNESS_CUDA={'OFF' if args.cpu_only else args.cuda})")
        lib_path = build(build_dir, "OFF" if args.cpu_only else args.cuda, log=args.out / "build.log")
    h = Harness(lib_path)
    gpu = h.has_cuda and not args.cpu_only
    no_gpu = None
    if gpu:  # built with CUDA: is there a GPU to run on?
        try:
            DeviceBuffer(h, 256).free()
        except HarnessError as err:
            no_gpu = f"the harness has CUDA kernels but no GPU can run them: {err}"
            log(no_gpu + "; checking the CPU kernels only")
            gpu = False
    log(f"loaded {lib_path}: CUDA {'on' if h.has_cuda else 'off'}; checking on {'CPU and GPU' if gpu else 'CPU'}")

    summary: dict = {"lib": str(lib_path), "cuda": h.has_cuda, "gpu_checked": gpu, "python": sys.version.split()[0],
                     "numpy": np.__version__, "machine": platform.machine(), "failures": []}
    if no_gpu:
        summary["failures"].append({"part": "gpu", "check": "device", "differences": [no_gpu]})
    if args.sanitizer_subset:
        sizes, dists, densities, largest = SANITIZER_SIZES, ["normal", "cauchy", "ties", "nonfinite"], [0.01], []
    elif args.quick:
        sizes, dists, densities, largest = QUICK_SIZES, inputs.DISTRIBUTIONS, DENSITIES, []
    elif not gpu:
        sizes, dists, densities, largest = CPU_ONLY_SIZES, inputs.DISTRIBUTIONS, DENSITIES, []
    else:
        sizes, dists, densities, largest = FULL_SIZES, inputs.DISTRIBUTIONS, DENSITIES, [LARGEST]

    def save() -> None:  # after each part: a crash later keeps what ran
        summary["tensorflow_loaded"] = "tensorflow" in sys.modules
        summary["seconds"] = time.time() - t0
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))

    empty: dict = {"cases": [], "failures": []}
    summary["kernels"] = kernels
    summary["mstopk"] = summary["sparse_accumulate"] = summary["error_feedback"] = summary["quantize"] = empty
    if "mstopk" in kernels:
        small = [d for d in sizes if d <= 1 << 20]
        cases = checks.mstopk_cases(small, dists, densities, args.seed)
        if len(small) < len(sizes):  # the large sizes at the Figure 6 densities only (time)
            cases += checks.mstopk_cases([d for d in sizes if d > 1 << 20], dists, [0.001, 0.01], args.seed + 1)
        cases += [dict(dist=dist, d=d, k=d // 1000, num_samplings=30, index_bits=64, random=2**63 + 12345)
                  for d in largest for dist in ("normal",)]
        log(f"MSTopK parity: {len(cases)} cases, d up to {max(c['d'] for c in cases):,}")
        summary["mstopk"] = checks.check_mstopk(h, cases, gpu, reference_max_d=max(sizes + largest), seed=args.seed,
                                                threads=args.threads)
        save()
    if "sparse_accumulate" in kernels:
        sparse_cases = checks.sparse_cases(args.seed)
        if args.quick or args.sanitizer_subset:
            sparse_cases = [c for c in sparse_cases if c["nnz"] <= 100_000 and c["size"] <= 1_000_000]
        log(f"sparse accumulation parity: {len(sparse_cases)} cases")
        summary["sparse_accumulate"] = checks.check_sparse(h, sparse_cases, gpu, seed=args.seed, threads=args.threads)
        save()
    if "error_feedback" in kernels:
        ef_cases = checks.error_feedback_cases()
        if args.quick or args.sanitizer_subset:
            ef_cases = [c for c in ef_cases if c["n"] <= 1_000_003]
        log(f"error feedback parity: {len(ef_cases)} cases")
        summary["error_feedback"] = checks.check_error_feedback(h, ef_cases, gpu, seed=args.seed, threads=args.threads)
        save()
    if "quantize" in kernels:
        q_cases = checks.quantize_cases()
        if args.quick or args.sanitizer_subset:
            q_cases = [c for c in q_cases if c["n"] <= 1 << 20]
        log(f"quantize / dequantize parity: {len(q_cases)} cases")
        summary["quantize"] = checks.check_quantize(h, q_cases, gpu, seed=args.seed, threads=args.threads)
        save()
    summary["argument_errors"] = checks.check_argument_errors(h)
    if gpu and not args.sanitizer_subset:
        log("injected launch errors")
        summary["injected_errors"] = checks.check_injected_errors(h, str(lib_path), kernels=kernels)
    for part in ("mstopk", "sparse_accumulate", "error_feedback", "quantize", "argument_errors", "injected_errors"):
        for failure in summary.get(part, {}).get("failures", []):
            summary["failures"].append({"part": part, **failure})
    n_cases = sum(len(summary[part]["cases"]) for part in ("mstopk", "sparse_accumulate", "error_feedback",
                                                           "quantize"))
    log(f"checks: {n_cases} cases, {len(summary['failures'])} failures")
    save()  # kept if the bench is cut
    report = [f"# hvdx kernel harness: {'GPU' if gpu else 'CPU'} run ({', '.join(kernels)})", "",
              f"Checks: {n_cases} parity cases (MSTopK vs tests/mstopk_reference.py"
              f"{', GPU vs CPU bit for bit, GPU run to run' if gpu else ''}; sparse accumulation vs np.add.at; "
              f"error feedback vs its float32 reference; quantize / dequantize vs their NumPy form), "
              f"**{len(summary['failures'])} failures**.", ""]
    if gpu and not args.skip_bench and not args.sanitizer_subset:
        device = gpu_name()
        log(f"Figure 6 benchmark on {device}")
        topk: list = []
        dists_rows: list = []
        sparse: list = []
        verdict: dict = {}

        def save_bench() -> None:
            (args.out / "bench.json").write_text(json.dumps(
                {"device": device, "kernels": kernels, "topk": topk, "distributions": dists_rows, "sparse": sparse,
                 "goal": verdict}, indent=1))

        try:
            if "mstopk" in kernels:
                topk = bench.bench_topk(h, bench.QUICK_SIZES if args.quick else bench.SIZES, bench.DENSITIES, log)
                verdict = bench.goal(topk)
                save_bench()
                dists_rows = bench.bench_distributions(h, 2**22 if args.quick else bench.DIST_D, 0.001, log)
                save_bench()
            if "sparse_accumulate" in kernels:
                sparse = bench.bench_sparse(h, 2**22 if args.quick else bench.SPARSE_D,
                                            bench.SPARSE_NNZ[:2] if args.quick else bench.SPARSE_NNZ, log)
                verdict = bench.goal(topk, sparse)
                save_bench()
            report.append(bench.markdown(device, topk, dists_rows, sparse, verdict))
            if not bench.plot(args.out / "fig6.png", topk, sparse):
                report.append("(no matplotlib: no fig6.png; the tables above are the figure)")
            if verdict:
                summary["goal"] = verdict
        except ImportError as err:
            log(f"benchmark skipped: {err} (it needs PyTorch with CUDA)")
            summary["bench_skipped"] = str(err)
        except Exception as err:  # a failed MSTopK call, out of memory, ...: reported, checks kept
            text = traceback.format_exc()
            log(f"benchmark failed: {text}")
            summary["failures"].append({"part": "bench", "check": "run", "differences": [f"{type(err).__name__}: {err}"]})
            report.append(f"Benchmark failed: `{type(err).__name__}: {err}` (traceback in run.log).")
    save()
    (args.out / "report.md").write_text("\n".join(report) + "\n")
    log(f"wrote {args.out}/summary.json, report.md; tensorflow loaded: {summary['tensorflow_loaded']}")
    for failure in summary["failures"][:20]:
        log(f"FAILED: {json.dumps(failure, default=str)[:400]}")
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
