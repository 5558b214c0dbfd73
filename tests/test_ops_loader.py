"""The op library loads once, and a missing or stale build says how to rebuild."""
import os
import shutil
import subprocess
import sys

import pytest
import tensorflow as tf

import hvdx
from hvdx import ops
from tests import harness


def test_loaded_library_matches_running_tensorflow():
    info = ops.build_info()
    assert info["tf_version"] == tf.__version__
    assert ops.read_build_info(info["path"]) == {k: v for k, v in info.items() if k != "path"}


def test_missing_library_explains_how_to_rebuild(tmp_path):
    with pytest.raises(ImportError, match=r"missing.*does not exist.*make build"):
        ops.load_library(tmp_path / "_hvdx_ops.so")


def test_library_built_against_other_tensorflow_is_refused_before_loading(tmp_path):
    fake = tmp_path / "_hvdx_ops.so"
    fake.write_bytes(b"\x7fELF junk hvdx-build-info:" + b'{"tf_version": "0.0.1", "cuda": false}' + b"\0 junk")
    with pytest.raises(ImportError, match=r"built against TensorFlow 0\.0\.1.*Rebuild"):
        ops.load_library(fake)


def test_file_that_is_no_hvdx_library_is_refused(tmp_path):
    fake = tmp_path / "_hvdx_ops.so"
    fake.write_bytes(b"\x7fELF not ours")
    with pytest.raises(ImportError, match="not an hvdx op library"):
        ops.load_library(fake)


@pytest.mark.parametrize("code", ["import hvdx.ops", "import hvdx; hvdx.DistributedOptimizer"])
def test_the_first_use_of_the_ops_fails_with_the_hint_when_library_is_missing(tmp_path, code):
    """`import hvdx` is lazy (it loads no op library); what needs the ops fails on first use,
    saying how to build them."""
    env = harness.test_env(str(tmp_path))
    env["HVDX_OPS_LIBRARY"] = str(tmp_path / "nowhere.so")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "ImportError: hvdx's op library is missing" in proc.stderr and "make build" in proc.stderr


def test_cuda_kernels_were_compiled_when_nvcc_is_present():
    """CI compiles the .cu.cc sources wherever nvcc is installed (nothing runs them here)."""
    if not (shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")):
        pytest.skip("no nvcc on this machine: the library was built without CUDA kernels")
    if os.environ.get("HVDX_WITH_CUDA", "").upper() == "OFF":
        pytest.skip("built with HVDX_WITH_CUDA=OFF (CI's second stack: the default stack's build compiles them)")
    assert ops.build_info()["cuda"] is True, ops.build_info()


def test_gpu_problems_name_what_cannot_run():
    """The import-time check (warnings when TensorFlow sees GPUs), on made-up devices."""
    built = {"cuda": True, "cuda_version": "12.3.107",
             "cuda_architectures": "75-real;80-real;86-real;89-real;90-real;120"}
    devices = [("T4", (7, 5)), ("A10G", (8, 6)), ("L40S", (8, 9)), ("H100", (9, 0)), ("RTX 5090", (12, 0)),
               ("A30", (8, 0)), ("Orin", (8, 7)), ("future", (13, 0))]
    assert ops.gpu_problems(built, devices, driver_version=12040) == []
    problems = ops.gpu_problems(built, [("P100", (6, 0)), ("B200", (10, 0))], driver_version=11080)
    assert len(problems) == 3
    assert "driver supports CUDA 11.8" in problems[0] and "built with CUDA 12.3.107" in problems[0]
    assert problems[1].startswith("P100 (compute capability 6.0) cannot run") and "=60" in problems[1]
    assert problems[2].startswith("B200 (compute capability 10.0)")
    assert ops.gpu_problems(built, [], driver_version=None) == []
    assert "built without CUDA" in ops.gpu_problems({"cuda": False}, [("T4", (7, 5))], None)[0]
