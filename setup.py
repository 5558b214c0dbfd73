"""Builds hvdx: the Python package plus the op library compiled from csrc/ by CMake.

The op library is built against the TensorFlow found in the build environment (install
with ``pip install --no-build-isolation``), whichever wheel that is: tensorflow-cpu or the
GPU build. TensorFlow is therefore not an install requirement; the extras ``[cpu]`` and
``[gpu]`` name the pinned wheels for a fresh environment.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
TF_PIN = "2.15.1"


class CMakeExtension(Extension):
    """An extension whose single output file is produced by CMake, not by setuptools."""

    def __init__(self, name: str) -> None:
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    """Configures csrc/ once in build/cmake-<python> and rebuilds incrementally there."""

    def build_extension(self, ext: Extension) -> None:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            import tensorflow  # noqa: F401  (only checks that it is importable)
        except ImportError as exc:
            raise RuntimeError(
                "hvdx builds its op library against the installed TensorFlow, and none is "
                f"importable ({exc}). Install tensorflow-cpu=={TF_PIN} (or tensorflow=="
                f"{TF_PIN}) first and build with `pip install --no-build-isolation`."
            ) from exc
        output = Path(self.get_ext_fullpath(ext.name)).resolve()
        # One build folder per interpreter (each stack's venv has its own Python and
        # TensorFlow), so that switching stacks keeps both incremental builds.
        build_dir = Path(os.environ.get("HVDX_BUILD_DIR", ROOT / "build" / f"cmake-{sys.implementation.cache_tag}"))
        build_dir.mkdir(parents=True, exist_ok=True)
        configure = [
            "cmake", "-S", str(ROOT), "-B", str(build_dir),
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DHVDX_OUTPUT_FILE={output}",
            f"-DHVDX_WITH_CUDA={os.environ.get('HVDX_WITH_CUDA', 'AUTO')}",
            f"-DCMAKE_BUILD_TYPE={os.environ.get('HVDX_BUILD_TYPE', 'Release')}",
        ]
        if os.environ.get("HVDX_ALLOW_CUDA_MISMATCH"):
            configure.append(f"-DHVDX_ALLOW_CUDA_MISMATCH={os.environ['HVDX_ALLOW_CUDA_MISMATCH']}")
        if "HVDX_CUDA_ARCHITECTURES" in os.environ:
            configure.append(f"-DHVDX_CUDA_ARCHITECTURES={os.environ['HVDX_CUDA_ARCHITECTURES']}")
        jobs = os.environ.get("HVDX_BUILD_JOBS", str(os.cpu_count() or 2))
        subprocess.check_call(configure)
        subprocess.check_call(["cmake", "--build", str(build_dir), "-j", jobs])
        if not output.exists():
            raise RuntimeError(f"CMake finished but did not produce {output}")


setup(
    name="hvdx",
    version=re.search(r'__version__ = "([^"]+)"', (ROOT / "hvdx" / "version.py").read_text()).group(1),
    description="Horovod + TensorFlow extension for clusters with fast intra-node and slow "
                "inter-node links: MSTopK, HiTopKComm, LARS with a parallel tensor operator, "
                "DataCache, DASO.",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["hvdx", "hvdx.*"]),
    package_data={"hvdx.runner": ["uts_agent.sh"]},  # mpirun's agent for emulated nodes (hvdx/runner/mpi.py)
    ext_modules=[CMakeExtension("hvdx._hvdx_ops")],
    cmdclass={"build_ext": CMakeBuild},
    install_requires=["numpy<2", "horovod>=0.28.1", "lmdb>=1.4"],
    extras_require={
        "cpu": [f"tensorflow-cpu=={TF_PIN}"],
        "gpu": [f"tensorflow=={TF_PIN}"],
    },
    zip_safe=False,
)
