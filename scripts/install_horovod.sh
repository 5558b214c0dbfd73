#!/usr/bin/env bash
# Installs Horovod 0.28.1 built from source against the TensorFlow of a Python environment,
# with the patches of scripts/patches/horovod-0.28.1/ whose "# tensorflow:" range holds that
# TensorFlow (Horovod's last release stops at TensorFlow 2.15: docs/horovod.md), the built
# wheel kept in a cache keyed by the TensorFlow and Python versions and the patches.
#
#   bash scripts/install_horovod.sh            # into the active environment (`python` on PATH)
#
# Needs: TensorFlow installed there; OpenMPI with headers, CMake, a C++17 compiler, patch
# (Debian: openmpi-bin libopenmpi-dev cmake g++ make patch). Environment:
#   HVDX_PYTHON_FOR_HOROVOD (default: python on PATH), HVDX_WHEEL_CACHE (default
#   ~/.cache/hvdx/wheels), HVDX_HOROVOD_STAMP (a file that records what is installed: with it,
#   a second run that finds the same key does nothing; scripts/bootstrap.sh passes its venv's).
# Exits non-zero saying why: no TensorFlow, a patch that does not apply, a build without
# TensorFlow, Gloo or MPI support.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
HOROVOD_VERSION=0.28.1
PATCHES=$ROOT/scripts/patches/horovod-$HOROVOD_VERSION
PY=${HVDX_PYTHON_FOR_HOROVOD:-$(command -v python || command -v python3)}
JOBS=$(nproc 2>/dev/null || echo 2)

log() { printf '[install_horovod] %s\n' "$*"; }
die() { printf '[install_horovod] error: %s\n' "$*" >&2; exit 1; }

TF_VERSION=$("$PY" -c 'import importlib.metadata as m
for d in ("tensorflow-cpu", "tensorflow", "tensorflow-gpu", "tf-nightly"):
    try: print(m.version(d)); break
    except m.PackageNotFoundError: pass')
[ -n "$TF_VERSION" ] || die "TensorFlow is not installed for $PY: install it first (pip install tensorflow)"
"$PY" -c 'import packaging' 2>/dev/null || "$PY" -m pip install -q --disable-pip-version-check packaging
# The patches for this TensorFlow: those whose "# tensorflow: <specifier>" header holds it.
patches=()
for patch in "$PATCHES"/*.patch; do
  [ -f "$patch" ] || continue
  spec=$(sed -n 's/^# tensorflow: *//p' "$patch" | head -n 1)
  [ -n "$spec" ] || die "$patch has no '# tensorflow: <specifier>' line"
  if "$PY" -c 'import sys; from packaging.specifiers import SpecifierSet
sys.exit(sys.argv[2] not in SpecifierSet(sys.argv[1]))' "$spec" "$TF_VERSION"; then patches+=("$patch"); fi
done
hvd_key="horovod-$HOROVOD_VERSION-tf-$TF_VERSION-$($PY -c 'import sys; print("py%d%d" % sys.version_info[:2])')"
if [ ${#patches[@]} -gt 0 ]; then
  hvd_key+="-patches-$(cat "${patches[@]}" | sha256sum | cut -c1-12)"
fi
stamp=${HVDX_HOROVOD_STAMP:-}
if [ -n "$stamp" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$hvd_key" ]; then
  exit 0
fi
wheels=${HVDX_WHEEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvdx/wheels}/$hvd_key
if ! ls "$wheels"/horovod-*.whl >/dev/null 2>&1; then
  log "building Horovod $HOROVOD_VERSION from source against TensorFlow $TF_VERSION with ${#patches[@]} patch(es) (3-6 minutes on 2 idle cores)"
  cmake_major=$(cmake --version | sed -n 's/^cmake version \([0-9]*\).*/\1/p')
  [ "${cmake_major:-3}" -lt 4 ] || export CMAKE_POLICY_VERSION_MINIMUM=3.5  # Horovod's bundled Gloo
  src=$(mktemp -d "${TMPDIR:-/tmp}/hvdx-horovod.XXXXXX")
  trap 'rm -rf "$src"' EXIT
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: -d "$src" "horovod==$HOROVOD_VERSION"
  tar -xzf "$src/horovod-$HOROVOD_VERSION.tar.gz" -C "$src"
  for patch in "${patches[@]}"; do
    log "applying $(basename "$patch")"
    patch -s -p1 -d "$src/horovod-$HOROVOD_VERSION" < "$patch" || die "$patch does not apply to Horovod $HOROVOD_VERSION's sdist"
  done
  mkdir -p "$wheels.tmp"
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$JOBS" \
    "$PY" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-build-isolation \
      --no-deps -w "$wheels.tmp" "$src/horovod-$HOROVOD_VERSION"
  rm -rf "$wheels" && mv "$wheels.tmp" "$wheels"
fi
log "installing Horovod from $wheels"
"$PY" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$wheels"/horovod-*.whl
# Horovod's own dependencies (the wheel was installed without them), as its metadata names them.
"$PY" -m pip install -q --disable-pip-version-check cloudpickle psutil pyyaml packaging
"$PY" - <<'PYEOF' || die "Horovod was built without TensorFlow, Gloo or MPI support (see the log above)"
import horovod.tensorflow as hvd
missing = [n for n, ok in (("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built())) if not ok]
raise SystemExit("missing: " + ", ".join(missing) if missing else 0)
PYEOF
[ -z "$stamp" ] || echo "$hvd_key" > "$stamp"
