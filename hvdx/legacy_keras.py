"""Which Keras: tf.keras is TensorFlow's choice; hvdx's Keras 2 code names the Keras 2 package.

From TensorFlow 2.16 on, tf.keras is Keras 3 unless $TF_USE_LEGACY_KERAS is "1", "true" or
"True" at `import tensorflow` (then it is the tf_keras package, Keras 2). hvdx leaves that
choice to the user and TensorFlow: importing it sets nothing and requires nothing, in any
import order. Both Keras can be in one process (`import keras` is Keras 3 from 2.16 on,
whatever tf.keras is), and hvdx takes the path of the object it is given:

- its Keras 2 code (the Keras 2 optimizer adapter, DASO, LARS/LAMB, the training methods'
  callbacks) uses `keras2()`: tf.keras where that is Keras 2 (TensorFlow <= 2.15, or the
  variable set), else the tf_keras package;
- its Keras 3 code imports `keras`;
- where it must choose without an object, it follows tf.keras (`tf_keras_is_keras3`).

A script written for Keras 2 as tf.keras (hvdx's own examples and benchmarks; Horovod's
examples as written) calls `use_keras2()` before TensorFlow's import, or is run with
$TF_USE_LEGACY_KERAS=1, as TensorFlow requires of such a script.

Importing this module imports no TensorFlow (`import hvdx` stays light).
"""
from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import Dict, Tuple

__all__ = ["ENV", "KERAS3_SINCE", "Keras2Missing", "is_keras3_object", "keras2", "keras_of", "keras_package",
           "keras2_env", "tf_keras_is_keras3", "use_keras2"]

ENV = "TF_USE_LEGACY_KERAS"
KERAS3_SINCE = (2, 16)   # the first TensorFlow whose tf.keras is Keras 3 by default


class Keras2Missing(ImportError):
    """hvdx's Keras 2 code was asked for where no Keras 2 is installed (TensorFlow >= 2.16
    without the tf_keras package)."""


_ON = ("1", "true", "True")   # the values TensorFlow reads as "tf.keras is tf_keras"


def _installed_version(package: str) -> Tuple[int, int]:
    """(major, minor) of the installed distribution that provides the top-level `package`
    (tensorflow comes as tensorflow, tensorflow-cpu, ...), (0, 0) where none does."""
    from importlib import metadata

    def version(name: str) -> Tuple[int, int]:
        try:
            return tuple(int(part) for part in metadata.version(name).split(".")[:2])
        except (metadata.PackageNotFoundError, ValueError):
            return (0, 0)

    found = version(package)
    if found == (0, 0):  # another distribution's name (a scan of every installed one)
        found = max((version(name) for name in metadata.packages_distributions().get(package, ())), default=(0, 0))
    return found


def use_keras2(script: str = "this script") -> None:
    """For a script written for Keras 2 as tf.keras: sets $TF_USE_LEGACY_KERAS=1 before
    TensorFlow's import, where TensorFlow reads it (2.16 on; before, tf.keras is Keras 2).

    Raises:
        RuntimeError: TensorFlow is imported already with tf.keras as Keras 3, or the user set
            the variable to another value; the message says what to change.
        Keras2Missing: TensorFlow >= 2.16 without the tf_keras package.
    """
    if "tensorflow" in sys.modules:
        if tf_keras_is_keras3():
            raise RuntimeError(f"{script} is written for Keras 2 as tf.keras, and TensorFlow was imported before "
                               f"with tf.keras as Keras 3: call use_keras2() before `import tensorflow`, or run it "
                               f"with {ENV}=1")
        return
    if os.environ.get(ENV, "1") not in _ON and _installed_version("tensorflow") >= KERAS3_SINCE:
        raise RuntimeError(f"{script} is written for Keras 2 as tf.keras, and ${ENV} is set to "
                           f"{os.environ[ENV]!r}: unset it or set it to 1")
    os.environ.update(keras2_env(script))


def keras2_env(script: str = "a script written for Keras 2") -> Dict[str, str]:
    """The environment entries that make tf.keras Keras 2 in a process started with them (a
    script written for Keras 2 launched from a Keras 3 process): {ENV: "1"} from TensorFlow
    2.16 on, {} before (tf.keras is Keras 2 there). Imports no TensorFlow. `script`: named
    in the error.

    Raises:
        Keras2Missing: TensorFlow >= 2.16 without the tf_keras package.
    """
    version = _installed_version("tensorflow")
    if version < KERAS3_SINCE:
        return {}
    if _installed_version("tf_keras") == (0, 0):
        raise Keras2Missing(f"{script} is written for Keras 2 as tf.keras, which TensorFlow "
                            f"{'.'.join(map(str, version))} takes from the tf_keras package: "
                            f"`pip install tf-keras~={'.'.join(map(str, version))}.0`")
    return {ENV: "1"}


def _tensorflow() -> ModuleType:
    import tensorflow as tf

    return tf


def _version(tf: ModuleType) -> Tuple[int, int]:
    return tuple(int(part) for part in tf.__version__.split(".")[:2])


def keras_package(tf: ModuleType) -> str:
    """The top-level package tf.keras resolves to: "keras" or "tf_keras" (loads Keras)."""
    return tf.keras.Model.__module__.split(".")[0]


def tf_keras_is_keras3(tf: ModuleType = None) -> bool:
    """Whether tf.keras is Keras 3 in this process (TensorFlow >= 2.16 without
    $TF_USE_LEGACY_KERAS=1 at its import). `tf`: the tensorflow module (None: imported here)."""
    tf = tf or _tensorflow()
    return _version(tf) >= KERAS3_SINCE and keras_package(tf) != "tf_keras"


def keras2() -> ModuleType:
    """The Keras 2 API: tf.keras where it is Keras 2, else the tf_keras package.

    Raises:
        Keras2Missing: tf.keras is Keras 3 and tf_keras is not installed; the message names
            the package to install.
    """
    tf = _tensorflow()
    if not tf_keras_is_keras3(tf):
        return tf.keras
    try:
        import tf_keras
    except ImportError as error:
        minor = ".".join(str(part) for part in _version(tf))
        raise Keras2Missing(
            f"this part of hvdx is Keras 2 code (tf_keras), and TensorFlow {tf.__version__}'s tf.keras is Keras 3 "
            f"here with no tf_keras installed: `pip install tf-keras~={minor}.0` (docs/keras3.md lists what works "
            f"on Keras 3 alone)") from error
    return tf_keras


def is_keras3_object(obj) -> bool:
    """Whether `obj` (a model, layer, optimizer, variable, callback) belongs to Keras 3: its
    class comes from the `keras` package and that package is Keras 3. Loads nothing."""
    keras = sys.modules.get("keras")
    if keras is None or not str(getattr(keras, "__version__", "0")).startswith("3."):
        return False
    return any((cls.__module__ or "").split(".")[0] == "keras" for cls in type(obj).__mro__)


def keras_of(obj) -> ModuleType:
    """The Keras API `obj` (an optimizer, a model, a variable) belongs to: the `keras` package
    for a Keras 3 object, else Keras 2 (`keras2()`).

    Raises:
        Keras2Missing: a Keras 2 object's API asked for where tf_keras is not installed (it
            cannot happen for an object that exists).
    """
    if is_keras3_object(obj):
        return sys.modules["keras"]
    return keras2()
