#!/usr/bin/env bash
# Runs hvdx's CUDA kernels on this machine's NVIDIA GPU, which CI never does:
#   1. checks the GPU and the driver (nvidia-smi), and finds a CUDA compiler of the major
#      version TensorFlow 2.15 was built with (12);
#   2. copies the checkout to a work folder and bootstraps it there into its own venv with
#      the GPU TensorFlow (tensorflow[and-cuda]) instead of tensorflow-cpu, Horovod built
#      against it, and the op library built with HVDX_WITH_CUDA=ON;
#   3. runs the op tests with HVDX_REQUIRE_GPU=1, so the CUDA parity tests run instead of
#      skipping: MSTopK's thresholds and selection equal to the CPU kernel's (every pattern
#      of tests/test_mstopk.py: heavy tails, NaN/Inf, ties, k = 0, k >= d; int32 and int64
#      indices), sparse_accumulate bit for bit equal to the CPU's and across runs;
#   4. runs the Figure 6 benchmark on the GPU (benchmarks/topk.py --device gpu).
# Results (pytest log and JUnit XML, topk_gpu.json/png, a README with the GPU table) go to
# the output folder; with --commit, topk_gpu.json/png also go to benchmarks/results/ and
# the table to benchmarks/README.md (section topk-gpu) of this checkout.
#
#   scripts/gpu_check.sh [--commit] [--quick] [--work DIR] [--out DIR]
#
# Needs network access to PyPI (the GPU wheels), Python 3.11 (TensorFlow 2.15 supports
# 3.9-3.11), cmake, g++, and a CUDA 12 toolkit: PyPI's nvidia-cuda-nvcc-cu12 ships ptxas
# but no nvcc driver, so install one (NVIDIA's cuda-toolkit-12-x package or runfile) or
# point CUDACXX at its bin/nvcc. HVDX_ALLOW_CUDA_MISMATCH=ON builds with another major
# version anyway (the driver must then support both). Environment: HVDX_PYTHON,
# HVDX_CUDA_ARCHITECTURES (default: auto, every common one nvcc supports).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${HVDX_GPU_WORK:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdx/gpu-check}
OUT=""
COMMIT=0
QUICK=()
TF_CUDA_MAJOR=12   # TensorFlow 2.15.1 is built with CUDA 12.2
while [ $# -gt 0 ]; do
  case "$1" in
    --commit) COMMIT=1 ;;
    --quick) QUICK=(--quick) ;;
    --work) WORK=$2; shift ;;
    --out) OUT=$2; shift ;;
    -h|--help) sed -n '2,28p' "${BASH_SOURCE[0]}"; exit 0 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
  shift
done
OUT=${OUT:-$(mktemp -d /tmp/hvdx-gpu-check.XXXXXX)}
mkdir -p "$WORK" "$OUT"
log() { printf '[gpu_check] %s\n' "$*"; }
die() { printf '[gpu_check] error: %s\n' "$*" >&2; exit 1; }

# --- 1. GPU, driver, compiler ------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "no nvidia-smi: this machine has no NVIDIA driver"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv | tee "$OUT/gpus.csv"
nvcc_major() { "$1" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p'; }
NVCC=${CUDACXX:-}
if [ -z "$NVCC" ]; then
  for candidate in "$(command -v nvcc || true)" /usr/local/cuda-${TF_CUDA_MAJOR}*/bin/nvcc /usr/local/cuda/bin/nvcc; do
    if [ -x "$candidate" ] && [ "$(nvcc_major "$candidate")" = "$TF_CUDA_MAJOR" ]; then NVCC=$candidate; break; fi
  done
fi
if [ -z "$NVCC" ]; then
  found=$(command -v nvcc || true)
  if [ -n "$found" ] && [ "${HVDX_ALLOW_CUDA_MISMATCH:-OFF}" = "ON" ]; then
    NVCC=$found
    log "warning: building with CUDA $(nvcc_major "$found") ($found), TensorFlow uses CUDA $TF_CUDA_MAJOR"
  else
    die "no CUDA $TF_CUDA_MAJOR compiler (nvcc) found${found:+ (only CUDA $(nvcc_major "$found") at $found)}: install a CUDA $TF_CUDA_MAJOR toolkit and set CUDACXX=<toolkit>/bin/nvcc (PyPI's nvidia-cuda-nvcc-cu$TF_CUDA_MAJOR has ptxas only), or set HVDX_ALLOW_CUDA_MISMATCH=ON"
  fi
fi
log "nvcc: $NVCC ($("$NVCC" --version | tail -1))"
PYTHON=${HVDX_PYTHON:-$(command -v python3.11 || true)}
[ -n "$PYTHON" ] || die "TensorFlow 2.15 needs Python 3.9-3.11: set HVDX_PYTHON"

# --- 2. own copy, own venv with the GPU TensorFlow ----------------------------------------
SRC=$WORK/src
log "copying the checkout to $SRC"
mkdir -p "$SRC"
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +   # keep the incremental build
(cd "$ROOT" && git ls-files -co --exclude-standard -z | tar --null -T - -cf -) | tar -xf - -C "$SRC"
# The tf2.15 stack's pins with the GPU wheel (its includes, -r, by their path in the checkout).
sed -e 's/^tensorflow-cpu==/tensorflow[and-cuda]==/' -e "s|^-r  *|-r $ROOT/requirements/|" \
  "$ROOT/requirements/tf2.15.txt" > "$WORK/requirements-gpu.txt"
grep -q '^tensorflow\[and-cuda\]==' "$WORK/requirements-gpu.txt" || die "requirements/tf2.15.txt pins no tensorflow-cpu"
log "bootstrapping $WORK/venv (GPU TensorFlow, Horovod, hvdx with CUDA kernels)"
HVDX_VENV=$WORK/venv HVDX_PYTHON=$PYTHON HVDX_REQUIREMENTS=$WORK/requirements-gpu.txt \
  HVDX_WHEEL_CACHE=$WORK/wheels HVDX_WITH_CUDA=ON CUDACXX=$NVCC \
  bash "$SRC/scripts/bootstrap.sh" 2>&1 | tee "$OUT/bootstrap.log"
cp "$SRC/build/bootstrap-hvdx.log" "$OUT/build.log" 2>/dev/null || true
PY=$WORK/venv/bin/python
cd "$SRC"
# The import-time check turns into an error here: the driver and the GPU must run the kernels.
"$PY" -W error::RuntimeWarning - <<'EOF' 2>&1 | tee "$OUT/build_info.txt"
import json, tensorflow as tf, hvdx
gpus = tf.config.list_physical_devices("GPU")
assert gpus, "TensorFlow sees no GPU: is the GPU wheel installed and the driver loaded?"
info = hvdx.ops.build_info()
assert info["cuda"], f"the op library was built without CUDA: {info}"
print(json.dumps({"build": info, "tensorflow": tf.__version__, "tf_build": dict(tf.sysconfig.get_build_info()),
                  "gpus": [tf.config.experimental.get_device_details(g) for g in gpus]}, indent=2, default=str))
EOF

# --- 3. the CUDA parity tests (failing, not skipping, without a GPU) ----------------------
log "running the op tests on the GPU"
status=0
HVDX_REQUIRE_GPU=1 TF_CPP_MIN_LOG_LEVEL=2 "$PY" -m pytest -q -rs -p no:cacheprovider \
  tests/test_mstopk.py tests/test_sparse_accumulate.py tests/test_ops_loader.py \
  --junitxml "$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log" || status=$?

# --- 4. Figure 6 on the GPU -------------------------------------------------------------
if [ "$COMMIT" = 1 ]; then
  bench_out=$ROOT/benchmarks/results
  readme=$ROOT/benchmarks/README.md
else
  bench_out=$OUT
  readme=$OUT/README.md
fi
log "benchmarks/topk.py --device gpu ${QUICK[*]}"
TF_CPP_MIN_LOG_LEVEL=2 "$PY" benchmarks/topk.py --device gpu "${QUICK[@]}" --out "$bench_out" --readme "$readme" \
  --cache "$WORK/cache" 2>&1 | tee "$OUT/topk_gpu.log" || status=$?
log "results in $OUT (the GPU table in $readme); tests and benchmark exit status: $status"
exit "$status"
