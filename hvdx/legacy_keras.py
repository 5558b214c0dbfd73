"""Keras 2 as tf.keras on every TensorFlow hvdx supports: from TensorFlow 2.16 on, tf.keras
routed to the tf_keras package.

TensorFlow 2.16 made Keras 3 its tf.keras. Horovod's Keras integration, and hvdx's built on
it, needs Keras 2: under Keras 3 every Horovod path fails ("'Variable' object has no
attribute 'ref'", horovod#4290). TensorFlow routes tf.keras to tf_keras (Keras 2) when
$TF_USE_LEGACY_KERAS is "1", "true" or "True" at `import tensorflow`; it reads the variable
once, then, and a later change leaves tf.keras half routed.

`import hvdx` calls `prepare()` first: it sets TF_USE_LEGACY_KERAS=1 where the user did not
set it, TensorFlow is not imported yet and tf_keras is installed (TensorFlow 2.15 reads the
variable too and fails without tf_keras); where TensorFlow is imported already, it checks
tf.keras at once, unless the user chose Keras 3 (`keras3_chosen`: the variable set to
another value). `require_keras2()` raises `Keras3Error` where tf.keras is Keras 3, saying
what to do; the Keras wrappers call it before they use tf.keras. Under Keras 3,
`hvdx.keras3_optimizer.DistributedOptimizer` wraps a Keras 3 optimizer for `Model.fit`, and
`hvdx.init()`, `hvdx.DistributedGradientTape` and `hvdx.broadcast_variables` work in a
custom training loop (docs/keras3.md). Importing this module imports no TensorFlow
(`import hvdx` stays light).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional, Tuple

__all__ = ["ENV", "KERAS3_NATIVE", "KERAS3_SINCE", "Keras3Error", "keras3_chosen", "keras_package", "prepare",
           "require_keras2", "route_to_tf_keras"]

ENV = "TF_USE_LEGACY_KERAS"
KERAS3_SINCE = (2, 16)   # the first TensorFlow whose tf.keras is Keras 3 by default
_ON = ("1", "true", "True")   # the values TensorFlow reads as "route to tf_keras"


_checked = False  # the running TensorFlow's tf.keras passed `require_keras2`


#: What works under Keras 3 (docs/keras3.md), for the messages.
KERAS3_NATIVE = ("hvdx.keras3_optimizer.DistributedOptimizer around a Keras 3 optimizer in Model.fit, and hvdx.init(), "
                 "hvdx.DistributedGradientTape and hvdx.broadcast_variables in a custom training loop")


class Keras3Error(ImportError):
    """tf.keras is Keras 3, with which Horovod's and hvdx's Keras integration fails."""


def keras3_chosen() -> bool:
    """Whether the user chose Keras 3 as tf.keras: $TF_USE_LEGACY_KERAS set to a value
    TensorFlow does not read as "route to tf_keras" (e.g. "0")."""
    return ENV in os.environ and os.environ[ENV] not in _ON


def route_to_tf_keras() -> bool:
    """Sets $TF_USE_LEGACY_KERAS=1 for TensorFlow's coming import, where that is safe.

    Returns:
        Whether it set the variable: not where the user set it (to anything), where
        TensorFlow is already imported (it read the variable then), or where tf_keras is
        not installed.
    """
    if ENV in os.environ or "tensorflow" in sys.modules or importlib.util.find_spec("tf_keras") is None:
        return False
    os.environ[ENV] = "1"
    return True


def _version(tf: ModuleType) -> Tuple[int, int]:
    return tuple(int(part) for part in tf.__version__.split(".")[:2])


def keras_package(tf: ModuleType) -> str:
    """The top-level package tf.keras resolves to: "keras" or "tf_keras" (loads Keras)."""
    return tf.keras.Model.__module__.split(".")[0]


def require_keras2(tf: Optional[ModuleType] = None, what: str = "hvdx's Keras integration") -> None:
    """Checks that tf.keras is Keras 2 (once per process where it is).

    Args:
        tf: the imported tensorflow module (None: imported here).
        what: what needs Keras 2, for the message.

    Raises:
        Keras3Error: TensorFlow >= 2.16 with tf.keras resolved to Keras 3; the message says
            why (tf_keras missing, the variable set otherwise, TensorFlow imported before
            hvdx), how to fix it, and what works under Keras 3 instead.
    """
    global _checked
    if tf is None:
        if _checked:
            return
        import tensorflow as tf
    if _version(tf) < KERAS3_SINCE or keras_package(tf) == "tf_keras":
        _checked = _checked or tf is sys.modules.get("tensorflow")
        return
    minor = ".".join(str(part) for part in _version(tf))
    if importlib.util.find_spec("tf_keras") is None:
        why = f"the tf_keras package is not installed: `pip install tf-keras~={minor}.0`"
    elif keras3_chosen():
        why = f"${ENV} is set to {os.environ[ENV]!r}: set it to 1 (or unset it and import hvdx first)"
    else:
        why = (f"tensorflow was imported before hvdx without ${ENV}=1: import hvdx before tensorflow, "
               f"or set {ENV}=1 in the environment (or in os.environ before `import tensorflow`)")
    raise Keras3Error(
        f"{what} needs Keras 2 as tf.keras, and TensorFlow {tf.__version__}'s tf.keras is Keras 3 here (Horovod's "
        f"Keras integration fails under Keras 3, horovod#4290): {why}. Under Keras 3, use {KERAS3_NATIVE} "
        f"(docs/keras3.md).")


def prepare() -> None:
    """At `import hvdx`: tf.keras routed to tf_keras before TensorFlow's import
    (`route_to_tf_keras`); where TensorFlow is imported already, checked now
    (`require_keras2`) unless the user chose Keras 3 (`keras3_chosen`). Raises Keras3Error
    as `require_keras2`."""
    route_to_tf_keras()
    if "tensorflow" in sys.modules and not keras3_chosen():
        require_keras2(what="hvdx")
