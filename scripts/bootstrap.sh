#!/usr/bin/env bash
# Takes a fresh Debian machine to a working hvdx development install of one stack,
# idempotently:
#   1. Debian packages: OpenMPI (runtime + headers), CMake, a C++ compiler, iproute2, patch;
#   2. the stack's virtual environment with the pins of requirements/<stack>.txt (and of
#      requirements/<stack>.no-deps.txt, installed without dependencies), on the Python
#      version its "# python: X.Y" line names;
#   3. Horovod 0.28.1 built from source against that TensorFlow (TF, Gloo, MPI), with the
#      patches of scripts/patches/horovod-0.28.1/ whose "# tensorflow:" range holds that
#      TensorFlow, the built wheel kept in a cache keyed by the TensorFlow and Python
#      versions (and the patches) so later runs reuse it;
#   4. hvdx installed editable through setup.py, which builds csrc/ with CMake.
# Every step checks first and does nothing when its result is already in place, so a
# second run takes seconds.
#
# Stacks (docs/design.md, "Stack"): HVDX_STACK=tf2.21 (the default, requirements/default-stack:
# TensorFlow 2.21 with tf_keras on Python 3.12, venv .venv-tf2.21) or HVDX_STACK=tf2.15
# (TensorFlow 2.15 on Python 3.11, venv .venv). `bootstrap.sh --venv` prints the stack's venv
# and exits (the Makefile's VENV). Environment overrides:
#   HVDX_VENV (default: the "# venv:" line of requirements/<stack>.txt, else .venv-<stack>),
#   HVDX_PYTHON (default: python<X.Y> on PATH, else pyenv's newest <X.Y>),
#   HVDX_WHEEL_CACHE (default ~/.cache/hvdx/wheels), HVDX_WITH_CUDA (AUTO|ON|OFF),
#   HVDX_REQUIREMENTS (default requirements/<stack>.txt; scripts/gpu_check.sh: the GPU wheel),
#   HVDX_WITH_SLURM=1 (or the flag --with-slurm; CI sets it): also SLURM and munge, for the
#   srun/sbatch tests' throwaway cluster (hvdx/runner/slurm.py; no service is started).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEFAULT_STACK=$(cat "$ROOT/requirements/default-stack")
STACK=${HVDX_STACK:-$DEFAULT_STACK}
# A stack's venv: the "# venv: <dir>" line of its requirements file, else .venv-<stack>; it does
# not depend on which stack is the default, so a checkout keeps its venvs when the default changes.
NAMED_VENV=$(sed -n 's/^# venv: *\([^ ]*\).*/\1/p' "$ROOT/requirements/$STACK.txt" 2>/dev/null | head -n 1 || true)
VENV=${HVDX_VENV:-$ROOT/${NAMED_VENV:-.venv-$STACK}}
if [ "${1:-}" = "--venv" ]; then echo "$VENV"; exit 0; fi
[ "${1:-}" = "--with-slurm" ] && HVDX_WITH_SLURM=1
HOROVOD_VERSION=0.28.1   # scripts/install_horovod.sh builds it
REQS=${HVDX_REQUIREMENTS:-$ROOT/requirements/$STACK.txt}
NO_DEPS=${REQS%.txt}.no-deps.txt

log() { printf '[bootstrap] %s\n' "$*"; }
die() { printf '[bootstrap] error: %s\n' "$*" >&2; exit 1; }
t0=$(date +%s)

# --- 1. system packages -----------------------------------------------------------
missing=()
pkgs=(openmpi-bin libopenmpi-dev cmake g++ make iproute2 patch)
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

# --- 2. virtual environment with the stack's pins --------------------------------------
[ -f "$REQS" ] || die "no stack '$STACK': $REQS does not exist (stacks: $(cd "$ROOT/requirements" && ls ./*.txt | grep -v 'no-deps\|common' | sed 's|^\./||; s/\.txt$//' | paste -sd' '))"
PY_VERSION=$(sed -n 's/^# python: *\([0-9.]*\).*/\1/p' "$REQS" | head -n 1)
runs() { [ -n "$1" ] && "$1" -c 'import sys' >/dev/null 2>&1; }   # pyenv's shims exist for versions not selected
find_python() {
  local candidate
  for candidate in "$(command -v "python$1" || true)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}/versions/$1".*/bin/"python$1" 2>/dev/null | sort -t. -k3 -n -r); do
    if runs "$candidate"; then echo "$candidate"; return; fi
  done
}
if [ ! -x "$VENV/bin/python" ]; then
  PYTHON=${HVDX_PYTHON:-$(if [ -n "$PY_VERSION" ]; then find_python "$PY_VERSION"; else command -v python3; fi)}
  runs "$PYTHON" || die "stack $STACK needs Python ${PY_VERSION:-3}: install it (e.g. \`pyenv install $PY_VERSION\`, or Debian's python$PY_VERSION-venv) or set HVDX_PYTHON"
  log "creating $VENV with $PYTHON (stack $STACK)"
  "$PYTHON" -m venv "$VENV"
fi
PY=$VENV/bin/python
have=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ -z "$PY_VERSION" ] || [ -n "${HVDX_PYTHON:-}" ] || [ "$have" = "$PY_VERSION" ] \
  || die "$VENV has Python $have, stack $STACK needs $PY_VERSION: remove it (rm -rf $VENV) or choose its stack (HVDX_STACK)"
# The stack's files: the requirements, the files they include (-r), the no-deps list.
req_files=("$REQS")
while read -r included; do
  case "$included" in /*) req_files+=("$included") ;; *) req_files+=("$(dirname "$REQS")/$included") ;; esac
done \
  < <(sed -n 's/^-r  *\([^ ]*\).*/\1/p' "$REQS")
[ -f "$NO_DEPS" ] && req_files+=("$NO_DEPS")
stamp_reqs=$VENV/.hvdx-requirements.sha256
want=$(cat "${req_files[@]}" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp_reqs" 2>/dev/null)" != "$want" ]; then
  log "installing the pins of stack $STACK into $VENV"
  "$PY" -m pip install -q --disable-pip-version-check -r "$REQS"
  [ ! -f "$NO_DEPS" ] || "$PY" -m pip install -q --disable-pip-version-check --no-deps -r "$NO_DEPS"
  echo "$want" > "$stamp_reqs"
fi

# --- 3. Horovod from source against this TensorFlow (scripts/install_horovod.sh) ----
HVDX_PYTHON_FOR_HOROVOD=$PY HVDX_HOROVOD_STAMP=$VENV/.hvdx-horovod bash "$ROOT/scripts/install_horovod.sh"
TF_VERSION=$("$PY" -c 'import importlib.metadata as m
for d in ("tensorflow-cpu", "tensorflow"):
    try: print(m.version(d)); break
    except m.PackageNotFoundError: pass')

# --- 4. hvdx itself: editable install, op library built by CMake (incremental) ------
mkdir -p "$ROOT/build"
build_log=$ROOT/build/bootstrap-hvdx-$STACK.log
if "$PY" -m pip show -q hvdx >/dev/null 2>&1; then
  build=("$PY" setup.py build_ext --inplace)      # incremental: CMake reuses build/cmake-<python>
else
  log "installing hvdx (editable) and building the op library"
  build=("$PY" -m pip install --disable-pip-version-check --no-build-isolation --no-deps -e "$ROOT")
fi
if ! (cd "$ROOT" && "${build[@]}") >"$build_log" 2>&1; then
  tail -n 60 "$build_log" >&2
  die "building hvdx failed; the whole log is in $build_log"
fi

log "ready in $(( $(date +%s) - t0 )) s: stack $STACK in $VENV (Python $have, TensorFlow $TF_VERSION, Horovod $HOROVOD_VERSION)"
