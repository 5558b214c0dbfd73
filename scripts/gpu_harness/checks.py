"""Correctness of the kernels through the harness, on the CPU and (when built with CUDA) the GPU.

- parity: MSTopK's CPU functor against tests/mstopk_reference.py (Algorithm 1 of Shi et
  al. 2021, arXiv:2010.10458, run round by round): the same thresholds bit for bit, the
  same selection for the window offset the random word gives; the GPU functor equal to the
  CPU's bit for bit (values, indices, thresholds), as kernels/mstopk.h specifies. Sparse
  accumulation against np.add.at in float32 (entries added in ascending order), the GPU
  equal to the CPU bit for bit;
- determinism: the GPU functors give the same bits on a second run (no atomics in the
  order of additions);
- errors: an injected too-large grid comes back as status 13 naming the CUDA error, and
  an invalid device pointer makes the call or the next synchronisation fail, never a
  silent result (in a child process: such a fault ends the CUDA context).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from scripts.gpu_harness import inputs
from scripts.gpu_harness.lib import ROOT, Harness, HarnessError, TopK


def _load_reference():
    """tests/mstopk_reference.py by its path (importing the tests package is not needed)."""
    spec = importlib.util.spec_from_file_location("hvdx_mstopk_reference", ROOT / "tests" / "mstopk_reference.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


ref = _load_reference()
U64 = 2**64


def window_offset(random: int, count: int, need: int) -> int:
    """mstopk::WindowOffset: the window's start, uniform over 0..count-need."""
    return ((random % U64) * (count - need + 1)) >> 64


def random_for_offset(offset: int, count: int, need: int) -> int:
    """The smallest random word whose window starts at `offset` (inverse of window_offset)."""
    return -(-offset * U64 // (count - need + 1))


def expected_topk(x: np.ndarray, k: int, num_samplings: int, random: int) -> TopK:
    """What the reference selects for this random word."""
    d = x.size
    k = min(k, d)
    sel = ref.mstopk(x, k, num_samplings, offset=0) if 0 < k < d else ref.mstopk(x, k, num_samplings)
    need = k - sel.above.size
    indices = sel.indices
    if sel.offset is not None and need > 0:
        offset = window_offset(random, sel.band.size, need)
        indices = np.concatenate([sel.above, sel.band[offset:offset + need]])
    if k in (0, d):
        thresholds = (float("inf"), 0.0)
    else:
        thresholds = (float(sel.thres1), float(sel.thres2))
    return TopK(x[indices], indices.astype(np.int64), thresholds)


def topk_differences(got: TopK, want: TopK) -> List[str]:
    """Where two selections differ: values (bitwise, NaN payloads too), indices, thresholds."""
    problems = []
    if got.indices.shape != want.indices.shape:
        return [f"{got.indices.size} selected, expected {want.indices.size}"]
    if not np.array_equal(got.indices, want.indices):
        first = int(np.flatnonzero(got.indices != want.indices)[0])
        problems.append(f"indices differ first at {first}: {int(got.indices[first])} vs {int(want.indices[first])}")
    if got.values.view(np.uint32).tobytes() != want.values.view(np.uint32).tobytes():
        problems.append("values differ bitwise")
    g, w = np.array(got.thresholds, np.float64), np.array(want.thresholds, np.float64)
    if g.tobytes() != w.tobytes():
        problems.append(f"thresholds {got.thresholds} vs {want.thresholds}")
    return problems


def sparse_reference(values: np.ndarray, indices: np.ndarray, size: int,
                     dense: Optional[np.ndarray] = None) -> np.ndarray:
    """dense (or zeros) + values at indices, each element adding its entries in ascending
    order in float32: np.add.at is unbuffered and goes through the entries in order."""
    out = np.zeros(size, np.float32) if dense is None else np.array(dense, np.float32)
    np.add.at(out, indices.astype(np.int64), values.astype(np.float32))
    return out


def _case_k(d: int, density: float) -> int:
    return max(1, int(round(density * d))) if density < 1 else int(density * d)


def mstopk_cases(sizes: Sequence[int], distributions: Sequence[str], densities: Sequence[float],
                 seed: int) -> List[dict]:
    """(distribution, d, k, num_samplings, index_bits, random) for every combination, plus
    the corners: k = 0, k = d - 1, k = d, k > d, N = 1 and N = 5, int64 indices."""
    cases = []
    rng = np.random.default_rng(seed)
    for d in sizes:
        for dist in distributions:
            ks = sorted({min(d, _case_k(d, p)) for p in densities})
            for k in ks:
                cases.append(dict(dist=dist, d=d, k=k, num_samplings=30, index_bits=32,
                                  random=int(rng.integers(0, 2**63)) * 2 + 1))
    small = [d for d in sizes if d <= 1 << 16] or [min(sizes)]
    for d in small:
        for k, ns, bits in ((0, 30, 32), (max(d - 1, 0), 30, 64), (d, 30, 32), (d + 5, 30, 64),
                            (max(1, d // 10), 1, 64), (max(1, d // 10), 5, 32)):
            cases.append(dict(dist="normal", d=d, k=k, num_samplings=ns, index_bits=bits,
                              random=int(rng.integers(0, 2**63))))
    return cases


def check_mstopk(h: Harness, cases: Sequence[dict], gpu: bool, reference_max_d: int, seed: int = 0,
                 threads: int = 0) -> dict:
    """Runs every case: CPU vs reference (d <= reference_max_d), GPU vs CPU and GPU run twice.

    Returns {"cases": [...], "failures": [...]}: each case with its outcome per comparison
    ("equal", a list of differences, or "skipped").
    """
    results, failures = [], []
    inputs_cache: Dict[tuple, np.ndarray] = {}
    for case in cases:
        key = (case["dist"], case["d"])
        if key not in inputs_cache:
            inputs_cache.clear()
            inputs_cache[key] = inputs.make(case["dist"], case["d"], seed)
        x = inputs_cache[key]
        args = (case["k"], case["num_samplings"], case["random"], case["index_bits"])
        row = dict(case)
        t0 = time.perf_counter()
        cpu = h.mstopk_cpu(x, *args, threads=threads)
        row["cpu_s"] = time.perf_counter() - t0
        if case["d"] <= reference_max_d:
            want = expected_topk(x, case["k"], case["num_samplings"], case["random"])
            row["cpu_vs_reference"] = topk_differences(cpu, want) or "equal"
        else:
            row["cpu_vs_reference"] = "skipped"
        if gpu:
            first = h.mstopk_gpu(x, *args)
            second = h.mstopk_gpu(x, *args)
            row["gpu_vs_cpu"] = topk_differences(first, cpu) or "equal"
            row["gpu_run_to_run"] = topk_differences(second, first) or "equal"
        row["k_selected"] = int(cpu.indices.size)
        row["thresholds"] = list(cpu.thresholds)
        for field in ("cpu_vs_reference", "gpu_vs_cpu", "gpu_run_to_run"):
            if isinstance(row.get(field), list):
                failures.append({"case": case, "check": field, "differences": row[field]})
        results.append(row)
    return {"cases": results, "failures": failures}


def sparse_cases(seed: int) -> List[dict]:
    """(size, nnz, dense or zeros, index bits): few entries, one per element, many
    duplicates (nnz >> size, the order of additions matters), nnz = 0, size = 1."""
    return [dict(size=s, nnz=n, dense=dn, index_bits=b) for s, n, dn, b in (
        (1, 1000, True, 32), (1000, 0, True, 32), (1000, 10, False, 64), (4096, 4096, True, 32),
        (10_000, 1_000_000, True, 32), (1_000_000, 10_000, False, 64), (1_000_000, 2_000_000, True, 64),
        (25_000_000, 500_000, False, 32))]


def check_sparse(h: Harness, cases: Sequence[dict], gpu: bool, seed: int = 0, threads: int = 0) -> dict:
    """CPU vs np.add.at (bitwise), GPU vs CPU (bitwise), GPU run twice (bitwise)."""
    rng = np.random.default_rng(seed)
    results, failures = [], []
    for case in cases:
        size, nnz = case["size"], case["nnz"]
        values = rng.standard_normal(nnz, np.float32) * np.float32(1e3)
        indices = rng.integers(0, size, nnz).astype(np.int32 if case["index_bits"] == 32 else np.int64)
        dense = rng.standard_normal(size, np.float32) if case["dense"] else None
        row = dict(case)
        cpu = h.sparse_accumulate_cpu(values, indices, size, dense, threads=threads)
        want = sparse_reference(values, indices, size, dense)
        row["cpu_vs_reference"] = "equal" if cpu.tobytes() == want.tobytes() else \
            [f"{int(np.count_nonzero(cpu.view(np.uint32) != want.view(np.uint32)))} elements differ"]
        if gpu:
            first = h.sparse_accumulate_gpu(values, indices, size, dense)
            second = h.sparse_accumulate_gpu(values, indices, size, dense)
            row["gpu_vs_cpu"] = "equal" if first.tobytes() == cpu.tobytes() else \
                [f"{int(np.count_nonzero(first.view(np.uint32) != cpu.view(np.uint32)))} elements differ"]
            row["gpu_run_to_run"] = "equal" if second.tobytes() == first.tobytes() else ["runs differ"]
        for field in ("cpu_vs_reference", "gpu_vs_cpu", "gpu_run_to_run"):
            if isinstance(row.get(field), list):
                failures.append({"case": case, "check": field, "differences": row[field]})
        results.append(row)
    return {"cases": results, "failures": failures}


def error_feedback_cases() -> List[dict]:
    """(n, gradients, momentum, decay): empty, one element, a ragged tail, 25M (the MLP's
    bucket), with and without momentum correction and decay."""
    return [dict(n=n, count=c, momentum=m, decay=dc) for n, c, m, dc in (
        (0, 1, 0.9, 1.0), (1, 2, 0.9, 1.0), (1000, 1, 0.0, 1.0), (4097, 3, 0.9, 0.5), (1_000_003, 8, 0.9, 1.0),
        (1_000_003, 2, 0.0, 0.75), (25_000_000, 2, 0.9, 1.0))]


def error_feedback_reference(grads: Sequence[np.ndarray], residual: np.ndarray, velocity: Optional[np.ndarray],
                             momentum: float, decay: float):
    """float32 in the functor's order (kernels/error_feedback.h): (acc, u')."""
    g = grads[0].copy()
    for x in grads[1:]:
        g = g + x
    if velocity is not None:
        g = np.float32(momentum) * velocity + g
    r = residual if decay == 1.0 else np.float32(decay) * residual
    return r + g, (None if velocity is None else g)


def check_error_feedback(h: Harness, cases: Sequence[dict], gpu: bool, seed: int = 0, threads: int = 0) -> dict:
    """CPU vs the float32 reference (bitwise), GPU vs CPU (bitwise), GPU run twice (bitwise)."""
    rng = np.random.default_rng(seed)
    results, failures = [], []

    def differ(got, want) -> Union[str, List[str]]:
        pairs = [(x, y) for x, y in zip(got, want) if x is not None]
        wrong = sum(int(np.count_nonzero(x.view(np.uint32) != y.view(np.uint32))) for x, y in pairs)
        return "equal" if not wrong else [f"{wrong} elements differ"]

    for case in cases:
        n = case["n"]
        grads = [rng.standard_normal(n, np.float32) for _ in range(case["count"])]
        residual = rng.standard_normal(n, np.float32)
        velocity = rng.standard_normal(n, np.float32) if case["momentum"] else None
        row = dict(case)
        cpu = h.error_feedback_cpu(grads, residual, velocity, case["momentum"], case["decay"], threads=threads)
        row["cpu_vs_reference"] = differ(cpu, error_feedback_reference(grads, residual, velocity, case["momentum"],
                                                                       case["decay"]))
        if gpu:
            first = h.error_feedback_gpu(grads, residual, velocity, case["momentum"], case["decay"])
            second = h.error_feedback_gpu(grads, residual, velocity, case["momentum"], case["decay"])
            row["gpu_vs_cpu"] = differ(first, cpu)
            row["gpu_run_to_run"] = differ(second, first)
        for field in ("cpu_vs_reference", "gpu_vs_cpu", "gpu_run_to_run"):
            if isinstance(row.get(field), list):
                failures.append({"case": case, "check": field, "differences": row[field]})
        results.append(row)
    return {"cases": results, "failures": failures}


def quantize_cases() -> List[dict]:
    """(n, bits, chunk, what): empty, one chunk of 2, ties at half steps, zero and non-finite
    chunks, a chunk wider than a block's threads, LowBit's 5.2M at chunk 1024, 25M at 4 bits."""
    return [dict(n=n, bits=b, chunk=c, what=w) for n, b, c, w in (
        (0, 8, 1024, "normal"), (2, 8, 2, "normal"), (2, 4, 2, "normal"), (64 * 33, 8, 64, "ties"),
        (64 * 33, 4, 64, "ties"), (1024 * 9, 8, 1024, "special"), (1024 * 9, 4, 1024, "special"),
        (4096 * 5, 8, 4096, "normal"), (4096 * 5, 4, 4096, "laplace"), (1024 * 5120, 8, 1024, "normal"),
        (256 * 97_657, 4, 256, "normal"))]


def quantize_input(case: dict, rng: np.random.Generator) -> np.ndarray:
    """The case's values: normal or Laplace, `ties` (multiples of half a step: round half to
    even decides), `special` (a chunk of zeros, one of -0.0, one with a NaN, one with an inf,
    one of denormals, the rest normal)."""
    n, chunk, level = case["n"], case["chunk"], 2 ** (case["bits"] - 1) - 1
    if case["what"] == "laplace":
        return rng.laplace(size=n).astype(np.float32)
    x = rng.standard_normal(n).astype(np.float32)
    if case["what"] == "ties" and n:
        x = (rng.integers(-2 * level, 2 * level + 1, n) / 2).astype(np.float32)
        x[::chunk] = level  # each chunk's max |x| is level: s = 1, x / s exact
    elif case["what"] == "special" and n >= 5 * chunk:
        x[:chunk] = 0.0
        x[chunk:2 * chunk] = -0.0
        x[2 * chunk + 3] = np.nan
        x[3 * chunk + 5] = -np.inf
        x[4 * chunk:5 * chunk] = (rng.standard_normal(chunk) * 1e-40).astype(np.float32)
    return x


def quantize_reference(x: np.ndarray, bits: int, chunk: int):
    """(packed, dequantized) by kernels/quantize.h's equations in NumPy float32."""
    level = np.float32(2 ** (bits - 1) - 1)
    rows = x.reshape(-1, chunk)
    high = (rows.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=1, initial=0)
    with np.errstate(all="ignore"):
        scale = high.view(np.float32) / level
        scale[high > 0x7F800000] = np.float32("nan")
        zero = (scale == 0) | ~np.isfinite(scale)
        q = np.clip(np.rint(rows / scale[:, None]), -level, level).astype(np.float32)
        q[zero] = 0.0
        dequantized = (q * scale[:, None]).reshape(-1)
    if bits == 8:
        codes = q.reshape(-1).astype(np.int8).view(np.uint8)
    else:
        pairs = (q.reshape(-1, 2) + 8).astype(np.uint8)
        codes = pairs[:, 0] * 16 + pairs[:, 1]
    return np.concatenate([codes, scale.astype("<f4").view(np.uint8)]), dequantized


def _values_differ(got: np.ndarray, want: np.ndarray, zero_sign: bool = True) -> int:
    """Elements whose bits differ, a NaN equal to any NaN (its payload is the device's);
    zero_sign=False: -0.0 equal to 0.0 too (a code of 0 decodes to +0.0 whatever q's sign)."""
    nan = np.isnan(got)
    unequal = got.view(np.uint32) != want.view(np.uint32) if zero_sign else got != want
    return int(np.count_nonzero(nan != np.isnan(want)) + np.count_nonzero(unequal & ~nan))


def check_quantize(h: Harness, cases: Sequence[dict], gpu: bool, seed: int = 0, threads: int = 0) -> dict:
    """CPU quantize vs quantize_reference and CPU dequantize of its bytes vs its values; the
    GPU's bytes and values vs the CPU's, the GPU's dequantize of the CPU's bytes, a second GPU run."""
    rng = np.random.default_rng(seed)
    results, failures = [], []

    def differ(got, want, zero_sign: bool = True) -> Union[str, List[str]]:
        wrong = []
        if got[0] is not None and not np.array_equal(got[0], want[0]):
            wrong.append(f"{int(np.count_nonzero(got[0] != want[0]))} packed bytes differ")
        values = _values_differ(got[1], want[1], zero_sign)
        if values:
            wrong.append(f"{values} values differ")
        return wrong or "equal"

    for case in cases:
        n, bits, chunk = case["n"], case["bits"], case["chunk"]
        x = quantize_input(case, rng)
        row = dict(case)
        cpu = h.quantize_cpu(x, bits, chunk, threads=threads)
        row["cpu_vs_reference"] = differ(cpu, quantize_reference(x, bits, chunk))
        decoded = h.dequantize_cpu(cpu[0], n, bits, chunk, threads=threads)
        row["cpu_decode"] = differ((None, decoded), cpu, zero_sign=False)
        if gpu:
            first, second = h.quantize_gpu(x, bits, chunk), h.quantize_gpu(x, bits, chunk)
            row["gpu_vs_cpu"] = differ(first, cpu)
            row["gpu_run_to_run"] = differ(second, first)
            row["gpu_decode_vs_cpu"] = differ((None, h.dequantize_gpu(cpu[0], n, bits, chunk)), (None, decoded))
        for field in ("cpu_vs_reference", "cpu_decode", "gpu_vs_cpu", "gpu_run_to_run", "gpu_decode_vs_cpu"):
            if isinstance(row.get(field), list):
                failures.append({"case": case, "check": field, "differences": row[field]})
        results.append(row)
    return {"cases": results, "failures": failures}


def check_argument_errors(h: Harness) -> dict:
    """Bad arguments come back as status 3 with the op's message, on the CPU."""
    outcomes = {}
    x = np.ones(10, np.float32)
    for name, call in (
            ("negative_k", lambda: h.mstopk_cpu(x, -1)),
            ("index_out_of_range", lambda: h.sparse_accumulate_cpu(np.ones(2, np.float32),
                                                                   np.array([0, 10], np.int32), 10)),
            ("quantize_ragged", lambda: h.quantize_cpu(np.ones(10, np.float32), 8, 4))):
        try:
            call()
            outcomes[name] = {"code": 0, "message": "no error"}
        except HarnessError as err:
            outcomes[name] = {"code": err.code, "message": err.message}
    ok = outcomes["negative_k"]["code"] == 3 and "k must be >= 0" in outcomes["negative_k"]["message"] and \
        outcomes["index_out_of_range"]["code"] == 3 and "out of range" in outcomes["index_out_of_range"]["message"] and \
        outcomes["quantize_ragged"]["code"] == 3 and "multiple of chunk" in outcomes["quantize_ragged"]["message"]
    return {"outcomes": outcomes, "failures": [] if ok else [outcomes]}


REFUSED_LAUNCH = ("cudaErrorInvalidConfiguration", "cudaErrorInvalidValue")
INVALID_POINTER = 0x1000  # page 1: never a device allocation


def _sync_outcome(h: Harness) -> dict:
    """{"code", "message"} of synchronising the default stream (0: nothing failed)."""
    try:
        h.sync()
        return {"code": 0, "message": ""}
    except HarnessError as err:
        return {"code": err.code, "message": err.message}


def inject_invalid_pointer(h: Harness, which: str) -> dict:
    """In this process (a child of check_injected_errors): a functor reads through an
    invalid device pointer; the call or the synchronisation after it must fail, and so must
    a correct call after it (the fault is sticky), rather than return data."""
    d, k = 1 << 22, 1 << 12
    out: dict = {"which": which}
    scratch_bytes = h.mstopk_gpu_scratch_bytes(d)
    from scripts.gpu_harness.lib import DeviceBuffer
    workspace_bytes = h.sparse_accumulate_gpu_workspace_bytes(k, d, 32)
    try:
        with DeviceBuffer.upload(h, inputs.make("normal", d)) as x, DeviceBuffer(h, 4 * k) as v, \
                DeviceBuffer.upload(h, np.arange(k, dtype=np.int32)) as i, DeviceBuffer(h, 16) as t, \
                DeviceBuffer(h, scratch_bytes) as s, DeviceBuffer(h, workspace_bytes) as w:
            def mstopk(src: int) -> int:
                return h.mstopk_gpu_raw(src, d, k, 30, 12345, v.ptr, i.ptr, 32, t.ptr, s.ptr)

            def sparse(idx: int) -> int:
                return h.sparse_accumulate_gpu_raw(v.ptr, idx, 32, k, None, x.ptr, d, w.ptr)

            bad = mstopk if which == "mstopk" else sparse
            good_arg = x.ptr if which == "mstopk" else i.ptr
            code = bad(INVALID_POINTER)
            out["call"] = {"code": code, "message": h.last_message}
            out["sync"] = _sync_outcome(h)
            code = mstopk(good_arg) if which == "mstopk" else sparse(good_arg)
            out["next_call"] = {"code": code, "message": h.last_message}
            out["next_sync"] = _sync_outcome(h)
    except HarnessError as err:  # freeing the buffers fails too once the context has faulted
        out["free"] = {"code": err.code, "message": err.message}
    return out


def check_injected_errors(h: Harness, lib_path: str, timeout: float = 120,
                          kernels: Sequence[str] = ("mstopk", "sparse_accumulate")) -> dict:
    """The too-large grid in this process; an invalid pointer into each of `kernels` in a
    child process."""
    results: dict = {}
    failures = []
    code = h.call("hvdx_inject_too_large_grid", 0)
    results["too_large_grid"] = {"code": code, "message": h.last_message}
    # CUDA 13 on an H100 names a grid beyond the device's limits cudaErrorInvalidValue; the
    # runtime's documentation suggests cudaErrorInvalidConfiguration. Either is the launch
    # refused, named.
    if code != 13 or not any(name in h.last_message for name in REFUSED_LAUNCH):
        failures.append({"check": "too_large_grid", "got": results["too_large_grid"]})
    # Not sticky: the next launch works and gives the CPU's answer.
    x = inputs.make("normal", 100_000, 1)
    after = topk_differences(h.mstopk_gpu(x, 100, random=7), h.mstopk_cpu(x, 100, random=7))
    results["after_too_large_grid"] = after or "equal"
    if after:
        failures.append({"check": "after_too_large_grid", "got": after})
    for which in [k for k in kernels if k in ("mstopk", "sparse_accumulate")]:  # the kernels that read indices
        proc = subprocess.run([sys.executable, "-m", "scripts.gpu_harness.checks", "--lib", lib_path,
                               "--inject-invalid-pointer", which], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout)
        try:
            got = json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            got = {"error": f"child exited {proc.returncode}", "stderr": proc.stderr[-2000:]}
        results[f"invalid_pointer_{which}"] = got
        surfaced = any(got.get(step, {}).get("code", 0) != 0 for step in ("call", "sync"))
        sticky = any(got.get(step, {}).get("code", 0) != 0 for step in ("next_call", "next_sync"))
        if not (surfaced and sticky):
            failures.append({"check": f"invalid_pointer_{which}", "got": got})
    return {"results": results, "failures": failures}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="child process of check_injected_errors")
    parser.add_argument("--lib", required=True)
    parser.add_argument("--inject-invalid-pointer", choices=["mstopk", "sparse_accumulate"], required=True)
    args = parser.parse_args(argv)
    print(json.dumps(inject_invalid_pointer(Harness(args.lib), args.inject_invalid_pointer)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
