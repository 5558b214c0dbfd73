"""hvdx runs on Keras 2 on every TensorFlow it supports (hvdx/legacy_keras.py): importing hvdx
before TensorFlow routes tf.keras to tf_keras from TensorFlow 2.16 on, a user's own setting
of $TF_USE_LEGACY_KERAS stays as it is, and where tf.keras is Keras 3 all the same the import
fails saying why and what to do."""
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


@pytest.fixture
def fresh(monkeypatch):
    """A process state before TensorFlow's import: no $TF_USE_LEGACY_KERAS, tensorflow not
    in sys.modules, tf_keras installed (unless a test says otherwise)."""
    monkeypatch.setenv(legacy_keras.ENV, "")  # recorded, so the variable the test sets is removed after it
    monkeypatch.delenv(legacy_keras.ENV)
    monkeypatch.delitem(sys.modules, "tensorflow")
    monkeypatch.setattr(legacy_keras.importlib.util, "find_spec", lambda name: object() if name == "tf_keras" else None)
    return monkeypatch


def test_routes_to_tf_keras_before_tensorflow_is_imported(fresh):
    assert legacy_keras.route_to_tf_keras()
    assert os.environ[legacy_keras.ENV] == "1"


@pytest.mark.parametrize("value", ["0", "1", "false", ""])
def test_leaves_the_users_setting_alone(fresh, value):
    fresh.setenv(legacy_keras.ENV, value)
    assert not legacy_keras.route_to_tf_keras()
    assert os.environ[legacy_keras.ENV] == value


def test_sets_nothing_once_tensorflow_is_imported(fresh):
    """TensorFlow read the variable at its import; setting it now would route tf.keras half."""
    fresh.setitem(sys.modules, "tensorflow", types.ModuleType("tensorflow"))
    assert not legacy_keras.route_to_tf_keras()
    assert legacy_keras.ENV not in os.environ


def test_sets_nothing_without_tf_keras(fresh):
    """TensorFlow 2.15 reads the variable too, and without tf_keras its tf.keras fails."""
    fresh.setattr(legacy_keras.importlib.util, "find_spec", lambda name: None)
    assert not legacy_keras.route_to_tf_keras()
    assert legacy_keras.ENV not in os.environ


@pytest.mark.parametrize("version,module", [("2.15.1", "keras.src.engine.training"),
                                            ("2.21.0", "tf_keras.src.engine.training")])
def test_keras_2_passes(version, module):
    legacy_keras.require_keras2(fake_tf(version, module))


@pytest.mark.parametrize("env,tf_keras,says", [
    (None, False, "pip install tf-keras~=2.21.0"),
    ("0", True, "TF_USE_LEGACY_KERAS is set to '0': set it to 1"),
    (None, True, "tensorflow was imported before hvdx without $TF_USE_LEGACY_KERAS=1: import hvdx before tensorflow"),
])
def test_keras_3_fails_saying_why_and_what_to_do(monkeypatch, env, tf_keras, says):
    if env is None:
        monkeypatch.delenv(legacy_keras.ENV, raising=False)
    else:
        monkeypatch.setenv(legacy_keras.ENV, env)
    monkeypatch.setattr(legacy_keras.importlib.util, "find_spec", lambda name: object() if tf_keras else None)
    with pytest.raises(legacy_keras.Keras3Error, match="Keras 3") as error:
        legacy_keras.require_keras2(fake_tf("2.21.0", "keras.src.models.model"))
    assert says in str(error.value)
    assert isinstance(error.value, ImportError)


@pytest.mark.parametrize("env,refused", [(None, True), ("0", False), ("false", False)])
def test_import_after_tensorflow_refuses_keras_3_unless_the_user_chose_it(fresh, env, refused):
    """$TF_USE_LEGACY_KERAS set to a value other than 1 chooses Keras 3 (docs/keras3.md): the
    Keras integration checks again where it is used."""
    fresh.setitem(sys.modules, "tensorflow", fake_tf("2.21.0", "keras.src.models.model"))
    fresh.setattr(legacy_keras, "_checked", False)
    if env is not None:
        fresh.setenv(legacy_keras.ENV, env)
    assert legacy_keras.keras3_chosen() is not refused
    if refused:
        with pytest.raises(legacy_keras.Keras3Error, match="import hvdx before tensorflow"):
            legacy_keras.prepare()
    else:
        legacy_keras.prepare()
        with pytest.raises(legacy_keras.Keras3Error, match=f"set to '{env}': set it to 1"):
            legacy_keras.require_keras2(what="hvdx.DistributedOptimizer")


def run(code: str, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter of this venv, from the checkout, without the user's
    $TF_USE_LEGACY_KERAS (unless given)."""
    environ = {k: v for k, v in os.environ.items() if k != legacy_keras.ENV}
    environ.update(env, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True,
                          timeout=300)


def test_importing_hvdx_first_gives_keras_2():
    proc = run("import hvdx, tensorflow as tf; from hvdx import legacy_keras\n"
               "print(legacy_keras.keras_package(tf), tf.keras.optimizers.SGD.__module__)")
    assert proc.returncode == 0, proc.stderr
    package, sgd = proc.stdout.split()
    assert package == ("tf_keras" if KERAS3_TF else "keras")
    assert sgd.startswith(package + ".")


@pytest.mark.skipif(not KERAS3_TF, reason=f"TensorFlow {tf.__version__}'s tf.keras is Keras 2 whatever the order")
def test_importing_tensorflow_first_fails_clearly_on_keras_3():
    proc = run("import tensorflow\nimport hvdx")
    assert proc.returncode != 0
    assert "Keras3Error" in proc.stderr and "import hvdx before tensorflow" in proc.stderr, proc.stderr[-2000:]
    ok = run("import tensorflow\nimport hvdx", TF_USE_LEGACY_KERAS="1")
    assert ok.returncode == 0, ok.stderr[-2000:]
