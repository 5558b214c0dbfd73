#!/usr/bin/env bash
# Takes a fresh Debian machine to a working hvdx development install, idempotently:
#   1. Debian packages: OpenMPI (runtime + headers), CMake, a C++ compiler, iproute2;
#   2. a virtual environment (.venv) with the pinned stack of requirements-dev.txt;
#   3. Horovod 0.28.1 built from source against that TensorFlow (TF, Gloo, MPI), the
#      built wheel kept in a cache keyed by the TensorFlow version so later runs reuse it;
#   4. hvdx installed editable through setup.py, which builds csrc/ with CMake.
# Every step checks first and does nothing when its result is already in place, so a
# second run takes seconds. Environment overrides:
#   HVDX_VENV (default .venv), HVDX_PYTHON (default python3.11, else python3),
#   HVDX_WHEEL_CACHE (default ~/.cache/hvdx/wheels), HVDX_WITH_CUDA (AUTO|ON|OFF),
#   HVDX_REQUIREMENTS (default requirements-dev.txt; scripts/gpu_check.sh: the GPU wheel),
#   HVDX_WITH_SLURM=1 (or the flag --with-slurm; CI sets it): also SLURM and munge, for the
#   srun/sbatch tests' throwaway cluster (hvdx/runner/slurm.py; no service is started).
set -euo pipefail
[ "${1:-}" = "--with-slurm" ] && HVDX_WITH_SLURM=1

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HVDX_VENV:-$ROOT/.venv}
HOROVOD_VERSION=0.28.1
REQS=${HVDX_REQUIREMENTS:-$ROOT/requirements-dev.txt}
JOBS=$(nproc 2>/dev/null || echo 2)

log() { printf '[bootstrap] %s\n' "$*"; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }
t0=$(date +%s)

# --- 1. system packages -----------------------------------------------------------
missing=()
pkgs=(openmpi-bin libopenmpi-dev cmake g++ make iproute2)
[ "${HVDX_WITH_SLURM:-0}" = 1 ] && pkgs+=(slurmctld slurmd slurm-client munge)
for pkg in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get: install OpenMPI (with headers), CMake >= 3.18 and a C++17 compiler, then rerun"
  SUDO=""
  [ "$(id -u)" = 0 ] || SUDO=sudo
  log "installing Debian packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# --- 2. virtual environment with the pinned stack -----------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  PYTHON=${HVDX_PYTHON:-$(command -v python3.11 || command -v python3)}
  log "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
stamp_reqs=$VENV/.hvdx-requirements.sha256
want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "$(cat "$stamp_reqs" 2>/dev/null)" != "$want" ]; then
  log "installing requirements-dev.txt"
  "$PY" -m pip install -q --disable-pip-version-check -r "$REQS"
  echo "$want" > "$stamp_reqs"
fi

# --- 3. Horovod from source against this TensorFlow --------------------------------
TF_VERSION=$("$PY" -c 'import importlib.metadata as m
for d in ("tensorflow-cpu", "tensorflow"):
    try: print(m.version(d)); break
    except m.PackageNotFoundError: pass')
[ -n "$TF_VERSION" ] || die "TensorFlow is not installed in $VENV"
hvd_key="horovod-$HOROVOD_VERSION-tf-$TF_VERSION-$($PY -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
stamp_hvd=$VENV/.hvdx-horovod
if [ "$(cat "$stamp_hvd" 2>/dev/null)" != "$hvd_key" ]; then
  wheels=${HVDX_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdx/wheels}/$hvd_key
  if ! ls "$wheels"/horovod-*.whl >/dev/null 2>&1; then
    log "building Horovod $HOROVOD_VERSION from source against TensorFlow $TF_VERSION (a few minutes)"
    cmake_major=$(cmake --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')
    [ "${cmake_major:-3}" -lt 4 ] || export CMAKE_POLICY_VERSION_MINIMUM=3.5  # Horovod's bundled Gloo
    mkdir -p "$wheels.tmp"
    HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$JOBS" \
      "$PY" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-build-isolation \
        --no-deps -w "$wheels.tmp" "horovod==$HOROVOD_VERSION"
    rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
  fi
  log "installing Horovod from $wheels"
  "$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/horovod-*.whl
  "$PY" - <<'EOF' || die "Horovod was built without TensorFlow, Gloo or MPI support (see the log above)"
import horovod.tensorflow as hvd
missing = [n for n, ok in (("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built())) if not ok]
raise SystemExit("missing: " + ", ".join(missing) if missing else 0)
EOF
  echo "$hvd_key" > "$stamp_hvd"
fi

# --- 4. hvdx itself: editable install, op library built by CMake (incremental) ------
mkdir -p "$ROOT/build"
build_log=$ROOT/build/bootstrap-hvdx.log
if "$PY" -m pip show -q hvdx >/dev/null 2>&1; then
  build=("$PY" setup.py build_ext --inplace)      # incremental: CMake reuses build/cmake
else
  log "installing hvdx (editable) and building the op library"
  build=("$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -e "$ROOT")
fi
if ! (cd "$ROOT" && "${build[@]}") >"$build_log" 2>&1; then
  tail -n 60 "$build_log" >&2
  die "building hvdx failed; the whole log is in $build_log"
fi

log "ready in $(( $(date +%s) - t0 )) s: $VENV (TensorFlow $TF_VERSION, Horovod $HOROVOD_VERSION)"
