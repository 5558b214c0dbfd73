"""A user's own environment (README, "Installing into your own environment"): a fresh venv
with TensorFlow (and tf-keras, without its dependencies) from the registry, Horovod 0.28.1
patched for that TensorFlow by
`scripts/install_horovod.sh` (the bootstrap's step; its wheel cache makes a second build free),
hvdx installed from a copy of the checkout; then a Keras 3 script, with no environment
variable, trains through hvdx.keras on one rank."""
import importlib.metadata
import os
import shutil
import subprocess
import sys

import pytest

from tests.harness import ROOT

SCRIPT = """
import keras
import numpy as np
import hvdx.keras as hvd

hvd.init()
x = np.random.default_rng(0).standard_normal((64, 8)).astype("float32")
y = (np.arange(64) % 3).astype("int32")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(3)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), communication="hitopk", density=0.5),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
loss = model.fit(x, y, epochs=3, verbose=0, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)]).history["loss"]
import tensorflow as tf
from hvdx import legacy_keras
print(legacy_keras.keras_package(tf), type(model.optimizer).__module__, loss[-1] < loss[0])
"""


def _tensorflow_pin() -> str:
    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return f"{name}=={importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    raise AssertionError("no TensorFlow in the test's environment")


def _tf_keras_pin() -> str:
    """tf-keras of the installed TensorFlow's minor version (hvdx's Keras 2 code needs it)."""
    major, minor = _tensorflow_pin().split("==")[1].split(".")[:2]
    return f"tf-keras~={major}.{minor}.0"


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=1800, **kwargs)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow
@pytest.mark.timeout(2400)  # TensorFlow's install and two builds from source (Horovod's only without its cache)
def test_a_fresh_venv_gets_patched_horovod_and_hvdx_and_trains_keras3(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_USE_LEGACY_KERAS", "PYTHONPATH", "VIRTUAL_ENV")}
    venv = tmp_path / "venv"
    _run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", str(venv)], env=env)
    python = str(venv / "bin" / "python")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"  # the user's activated venv
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", _tensorflow_pin(), "numpy<2",
          "setuptools", "wheel", "packaging"], env=env)
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps", _tf_keras_pin()], env=env)
    _run(["bash", str(ROOT / "scripts" / "install_horovod.sh")], env=env)
    source = tmp_path / "hvdx"  # a copy of the tracked files: nothing is built into the checkout
    files = _run(["git", "ls-files", "-z"], cwd=ROOT).stdout.split("\0")
    for name in filter(None, files):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    _run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation",
          str(source)], env=dict(env, HVDX_WITH_CUDA="OFF"))
    proc = _run([python, "-c", SCRIPT], cwd=tmp_path, env=dict(env, TF_CPP_MIN_LOG_LEVEL="3"))
    assert proc.stdout.split()[-3:] == ["keras", "hvdx.keras3_optimizer", "True"], proc.stdout
