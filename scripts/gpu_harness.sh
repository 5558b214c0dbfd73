#!/usr/bin/env bash
# One command on a GPU machine without TensorFlow (CUDA + nvcc, CMake, Python 3 with NumPy;
# PyTorch for the benchmark, CuPy optional; no network, no pip): builds the TensorFlow-free
# harness of hvdx's kernels (csrc/harness, the very sources of the op library's kernels)
# for this machine's GPU and runs, writing everything under OUT:
#   1. build.log     CMake + nvcc (HVDX_HARNESS_CUDA=ON, the GPU's own architecture);
#   2. summary.json  parity: MSTopK's GPU functor equal to the CPU functor bit for bit and
#                    both equal to tests/mstopk_reference.py (Algorithm 1 round by round) on
#                    normal, Laplace, Student-t(3), Cauchy, exact zeros, ties, NaN/Inf, d from
#                    1 to 2^28; sparse accumulation equal to np.add.at and error feedback to
#                    its float32 reference, CPU = GPU bit for
#                    bit; the wire's quantize / dequantize equal to their NumPy form, CPU = GPU
#                    bit for bit (NaN payloads aside); every GPU result equal on a second run; injected launch errors (a
#                    too-large grid, an invalid pointer) returned as errors;
#      report.md, bench.json, fig6.png
#                    Figure 6: MSTopK vs torch.topk, CuPy argpartition and one read of x,
#                    d 2^20..2^28, density 0.001 and 0.01; sparse accumulation vs the
#                    scatter-adds of PyTorch and CuPy at nnz 1e4..1e7;
#      two-pass/    the MSTopK checks (quick sizes) of a second build whose select takes the
#                    two-pass path at every d (the path of d >= 2^31);
#   3. sanitizer.txt compute-sanitizer memcheck and racecheck over the small GPU cases
#                    (when compute-sanitizer is installed);
#      run.log       all of the above as it ran.
# 110 s on an H100 (2026-11-26: build 22 s, checks 57 s, benchmark 20 s). The whole run
# keeps within HVDX_HARNESS_BUDGET_S seconds
# (default 540, under the device tool's 10-minute limit): checks + benchmark get at most 360 s,
# each sanitizer at most 90 s, each cut to what is left. Exit status: 0 when every check passed.
#
#   scripts/gpu_harness.sh [OUT]        (default: $OUT, else /tmp/hvdx-gpu-harness)
#   scripts/gpu_harness.sh --quick [OUT]   small sizes only (a smoke run, ~2 minutes)
#   scripts/gpu_harness.sh --kernels mstopk [OUT]   one kernel's checks and benchmark
#                                          (mstopk, sparse_accumulate, error_feedback, quantize; default all)
# Environment: PYTHON (default python3), HVDX_HARNESS_CUDA_ARCHITECTURES (default native).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
QUICK=()
KERNELS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=(--quick); shift ;;
    --kernels) KERNELS=(--kernels "$2"); shift 2 ;;
    *) break ;;
  esac
done
OUT_DIR=${1:-${OUT:-/tmp/hvdx-gpu-harness}}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUILD=$(mktemp -d /tmp/hvdx-harness-build.XXXXXX)
LOG=$OUT_DIR/run.log
: > "$LOG"
log() { printf '[gpu_harness.sh] %s\n' "$*" | tee -a "$LOG"; }
DEADLINE=$(( $(date +%s) + ${HVDX_HARNESS_BUDGET_S:-540} ))
# budget WANT RESERVE: at most WANT seconds, leaving RESERVE for what comes after.
budget() { local left=$(( DEADLINE - $(date +%s) - $2 )); [ "$left" -lt "$1" ] && echo "$left" || echo "$1"; }
status=0
cd "$ROOT"
# CMake and nvcc: on PATH, else beside the Python (a pip-installed cmake) and CUDA's default place.
CMAKE=$(command -v cmake || ls "$(dirname "$(command -v "$PY")")/cmake" 2>/dev/null || true)
[ -n "$CMAKE" ] || { log "error: no cmake on PATH or beside $PY"; exit 1; }
if ! command -v nvcc >/dev/null && [ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDACXX=/usr/local/cuda/bin/nvcc PATH=/usr/local/cuda/bin:$PATH
fi

log "repository $ROOT, results in $OUT_DIR, build in $BUILD"
{ nvidia-smi --query-gpu=name,driver_version,compute_cap,memory.total --format=csv 2>&1 || true
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" -c 'import sys, numpy; print("python", sys.version.split()[0], "numpy", numpy.__version__)'
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 | tail -1
  "$PY" -c 'import cupy; print("cupy", cupy.__version__)' 2>&1 | tail -1
} | tee -a "$LOG"

# --- 1. build ------------------------------------------------------------------------------
t0=$(date +%s)
if ! { "$CMAKE" -S csrc/harness -B "$BUILD" -DHVDX_HARNESS_CUDA=ON \
         -DHVDX_HARNESS_CUDA_ARCHITECTURES="${HVDX_HARNESS_CUDA_ARCHITECTURES:-native}" &&
       "$CMAKE" --build "$BUILD" -j "$(nproc)"; } > "$OUT_DIR/build.log" 2>&1; then
  tail -n 40 "$OUT_DIR/build.log" | tee -a "$LOG"
  log "error: the harness did not build (log: $OUT_DIR/build.log)"
  exit 1
fi
LIB=$BUILD/libhvdx_harness.so
log "built $LIB in $(( $(date +%s) - t0 )) s"

# --- 2. checks and the benchmark ----------------------------------------------------------
T=$(budget 360 100)
log "checks and benchmark (at most $T s)"
PYTHONUNBUFFERED=1 timeout "$T" "$PY" -m scripts.gpu_harness.run --lib "$LIB" --out "$OUT_DIR" "${QUICK[@]}" "${KERNELS[@]}" \
  2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
[ "$rc" = 0 ] || { log "checks: exit $rc (124: timed out)"; status=1; }

# --- 2b. the two-pass select (MSTopK's path for d >= 2^31) on small inputs ------------------
if [ -z "${KERNELS[*]}" ] || [ "${KERNELS[1]:-}" = mstopk ]; then
  T=$(budget 60 100)
  if [ "$T" -ge 20 ] && "$CMAKE" -S csrc/harness -B "$BUILD-two-pass" -DHVDX_HARNESS_CUDA=ON \
       -DHVDX_HARNESS_CUDA_ARCHITECTURES="${HVDX_HARNESS_CUDA_ARCHITECTURES:-native}" \
       -DCMAKE_CUDA_FLAGS=-DHVDX_MSTOPK_TWO_PASS_SELECT > "$OUT_DIR/build-two-pass.log" 2>&1 &&
     "$CMAKE" --build "$BUILD-two-pass" -j "$(nproc)" >> "$OUT_DIR/build-two-pass.log" 2>&1; then
    log "MSTopK with the two-pass select at every d: quick parity (at most $T s)"
    PYTHONUNBUFFERED=1 timeout "$T" "$PY" -m scripts.gpu_harness.run --lib "$BUILD-two-pass/libhvdx_harness.so" \
      --out "$OUT_DIR/two-pass" --quick --skip-bench --kernels mstopk 2>&1 | tee -a "$LOG" | grep -E "checks:|FAILED"
    [ "${PIPESTATUS[0]}" = 0 ] || { log "two-pass select: checks failed (results: $OUT_DIR/two-pass)"; status=1; }
  else
    log "two-pass select: not built or out of time (log: $OUT_DIR/build-two-pass.log)"; status=1
  fi
fi

# --- 3. compute-sanitizer -------------------------------------------------------------------
SANITIZER=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -n "$SANITIZER" ]; then
  : > "$OUT_DIR/sanitizer.txt"
  for tool in memcheck racecheck; do
    T=$(budget 90 5)
    if [ "$T" -lt 20 ]; then log "$tool: skipped, out of time"; status=1; continue; fi
    log "compute-sanitizer --tool $tool over the small GPU cases (at most $T s)"
    PYTHONUNBUFFERED=1 timeout "$T" "$SANITIZER" --tool "$tool" --error-exitcode 9 \
      "$PY" -m scripts.gpu_harness.run --lib "$LIB" --out "$BUILD/sanitizer-$tool" --sanitizer-subset "${KERNELS[@]}" \
      >> "$OUT_DIR/sanitizer.txt" 2>&1
    rc=$?
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY" "$OUT_DIR/sanitizer.txt" | tail -1)
    log "$tool: exit $rc; ${summary:-no summary line}"
    [ "$rc" = 0 ] || status=1
  done
else
  log "no compute-sanitizer on this machine: skipped"
fi

log "done in $(( $(date +%s) - t0 )) s, exit $status; results: $(ls "$OUT_DIR" | tr '\n' ' ')"
exit $status
