"""tf.keras is what TensorFlow makes it (hvdx/legacy_keras.py): importing hvdx sets nothing and
refuses nothing, in either import order; hvdx's Keras 2 code reaches Keras 2 through
`keras2()` (tf.keras where it is Keras 2, else tf_keras); a script written for Keras 2 asks for
it with `use_keras2()` before TensorFlow's import, and is told what to change where it is too
late or not possible."""
import os
import subprocess
import sys
import types

import pytest
import tensorflow as tf

from hvdx import legacy_keras
from tests.harness import ROOT

KERAS3_TF = tuple(int(p) for p in tf.__version__.split(".")[:2]) >= legacy_keras.KERAS3_SINCE


def fake_tf(version: str, model_module: str) -> types.ModuleType:
    """A stand-in for the tensorflow module: its version and the module of tf.keras.Model."""
    model = type("Model", (), {"__module__": model_module})
    return types.SimpleNamespace(__version__=version, keras=types.SimpleNamespace(Model=model))


@pytest.mark.parametrize("version,module,keras3", [("2.15.1", "keras.src.engine.training", False),
                                                   ("2.21.0", "tf_keras.src.engine.training", False),
                                                   ("2.21.0", "keras.src.models.model", True)])
def test_tf_keras_is_keras3_from_216_unless_routed_to_tf_keras(version, module, keras3):
    assert legacy_keras.tf_keras_is_keras3(fake_tf(version, module)) is keras3


def test_tf_keras_in_this_suite_is_tensorflows_choice_and_keras2_is_keras_2_either_way():
    """The suite's process has tf.keras as TensorFlow makes it (tests/conftest.py): keras2() is
    tf.keras where that is Keras 2, else the tf_keras package beside it."""
    if legacy_keras.tf_keras_is_keras3():
        import tf_keras

        assert legacy_keras.keras2() is tf_keras and legacy_keras.keras_package(tf) == "keras"
    else:
        assert legacy_keras.keras2() is tf.keras


def test_keras2_env_is_what_a_keras2_child_process_needs():
    """From TensorFlow 2.16 on, {TF_USE_LEGACY_KERAS: "1"}; before, nothing (tf.keras is Keras 2)."""
    env = legacy_keras.keras2_env()
    if tuple(int(p) for p in tf.__version__.split(".")[:2]) >= legacy_keras.KERAS3_SINCE:
        assert env == {legacy_keras.ENV: "1"}
    else:
        assert env == {}
    with pytest.MonkeyPatch.context() as patched:  # TensorFlow 2.21 without tf_keras: the package to install
        patched.setattr(legacy_keras, "_installed_version", lambda package: (2, 21) if package == "tensorflow" else (0, 0))
        with pytest.raises(legacy_keras.Keras2Missing, match=r"pip install tf-keras~=2\.21\.0"):
            legacy_keras.keras2_env()


def test_keras2_names_the_package_to_install_where_there_is_none(monkeypatch):
    monkeypatch.setattr(legacy_keras, "_tensorflow", lambda: fake_tf("2.21.0", "keras.src.models.model"))
    monkeypatch.setitem(sys.modules, "tf_keras", None)  # `import tf_keras` raises ImportError
    with pytest.raises(legacy_keras.Keras2Missing, match=r"pip install tf-keras~=2\.21\.0"):
        legacy_keras.keras2()


@pytest.fixture
def before_tensorflow(monkeypatch):
    """A process state before TensorFlow's import, TensorFlow 2.21 and tf_keras installed, no
    $TF_USE_LEGACY_KERAS (unless a test sets it)."""
    monkeypatch.setenv(legacy_keras.ENV, "")  # recorded, so the variable a test sets is removed after it
    monkeypatch.delenv(legacy_keras.ENV)
    monkeypatch.delitem(sys.modules, "tensorflow")
    versions = {"tensorflow": (2, 21), "tf_keras": (2, 21)}
    monkeypatch.setattr(legacy_keras, "_installed_version", lambda package: versions[package])
    return versions


def test_use_keras2_sets_the_variable_before_tensorflows_import(before_tensorflow):
    legacy_keras.use_keras2()
    assert os.environ[legacy_keras.ENV] == "1"


def test_use_keras2_sets_nothing_where_tensorflow_reads_nothing(before_tensorflow):
    before_tensorflow["tensorflow"] = (2, 15)
    legacy_keras.use_keras2()
    assert legacy_keras.ENV not in os.environ


def test_use_keras2_refuses_a_users_choice_of_keras3(before_tensorflow, monkeypatch):
    monkeypatch.setenv(legacy_keras.ENV, "0")
    with pytest.raises(RuntimeError, match="set to '0': unset it or set it to 1"):
        legacy_keras.use_keras2("train.py")


def test_use_keras2_without_tf_keras_names_the_package(before_tensorflow):
    before_tensorflow["tf_keras"] = (0, 0)
    with pytest.raises(legacy_keras.Keras2Missing, match=r"pip install tf-keras~=2\.21\.0"):
        legacy_keras.use_keras2()
    assert legacy_keras.ENV not in os.environ


def test_use_keras2_after_tensorflow_with_keras3_says_what_to_change(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", fake_tf("2.21.0", "keras.src.models.model"))
    monkeypatch.setattr(legacy_keras, "_tensorflow", lambda: sys.modules["tensorflow"])
    with pytest.raises(RuntimeError, match="before `import tensorflow`, or run it with TF_USE_LEGACY_KERAS=1"):
        legacy_keras.use_keras2()


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this venv, from the checkout, without the suite's
    $TF_USE_LEGACY_KERAS (unless given)."""
    environ = {k: v for k, v in os.environ.items() if k != legacy_keras.ENV}
    environ.update(env, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300)


PROBE = ("from hvdx import legacy_keras\nimport tensorflow as tf\n"
         "print(legacy_keras.keras_package(tf), legacy_keras.keras2().__name__, hvdx.keras.DistributedOptimizer.__module__)")


@pytest.mark.parametrize("order", ["hvdx first", "tensorflow first"])
def test_importing_hvdx_changes_nothing_in_either_order(order):
    """tf.keras is TensorFlow's default (Keras 3 from 2.16 on) whether hvdx or TensorFlow comes
    first, and hvdx's Keras namespace imports either way."""
    imports = "import hvdx, hvdx.keras\nimport tensorflow\n" if order == "hvdx first" else \
        "import tensorflow\nimport hvdx, hvdx.keras\n"
    proc = run(imports + PROBE)
    assert proc.returncode == 0, proc.stderr[-3000:]
    package, keras2, _ = proc.stdout.split()
    assert package == "keras"  # Keras 3 from TensorFlow 2.16 on; TensorFlow 2.15's Keras 2 package before
    if KERAS3_TF:
        assert keras2 == "tf_keras"


@pytest.mark.skipif(not KERAS3_TF, reason=f"TensorFlow {tf.__version__}'s tf.keras is Keras 2 whatever the variable")
def test_the_variable_still_routes_tf_keras_to_tf_keras():
    proc = run("import hvdx, hvdx.keras\n" + PROBE, TF_USE_LEGACY_KERAS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    package, keras2, _ = proc.stdout.split()
    assert package == "tf_keras" and keras2.split(".")[0] == "tf_keras"
