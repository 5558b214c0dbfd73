"""A Keras callback that follows the model it is given: Horovod's callbacks (bound to tf.keras
when Horovod is imported) hand a Keras 3 model to their Keras 3 counterpart.

Horovod's `horovod.tensorflow.keras.callbacks` classes derive from tf.keras's Callback as it
was when Horovod was imported, and work on that Keras' models only. A user holds one callback
object before `fit` gives it a model, so the choice is made at `set_model`:
`follows(horovod_class, "module:Class")` is a subclass of `horovod_class` (isinstance checks
against Horovod's classes hold) that, given a Keras 3 model (`is_keras3_object`), makes the
named Keras 3 class with the same arguments and hands it every hook it implements; given a
Keras 2 model, it is `horovod_class`. Keras 3's CallbackList calls hooks by name, so the object
serves both `fit`s where tf.keras is Keras 2; where tf.keras is Keras 3 it is a Keras 3
callback throughout.
"""
from __future__ import annotations

import importlib
from typing import Any, Dict, Optional

from hvdx.legacy_keras import is_keras3_object

__all__ = ["HOOKS", "follows"]

#: The callback hooks both Keras call.
HOOKS = ("on_train_begin", "on_train_end", "on_epoch_begin", "on_epoch_end", "on_batch_begin", "on_batch_end",
         "on_train_batch_begin", "on_train_batch_end", "on_test_begin", "on_test_end", "on_test_batch_begin",
         "on_test_batch_end", "on_predict_begin", "on_predict_end", "on_predict_batch_begin",
         "on_predict_batch_end")


def _load(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _overrides(cls: type, name: str) -> bool:
    """Whether `cls` implements hook `name` beyond Keras' no-op Callback."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not (klass.__name__ == "Callback" and (klass.__module__ or "").split(".")[0] in ("keras", "tf_keras"))
    return False


def _forward(name: str):
    def hook(self, *args, **kwargs):
        if self._keras3 is not None:
            return getattr(self._keras3, name)(*args, **kwargs)
        return getattr(super(type(self)._hvdx_follows, self), name)(*args, **kwargs)

    hook.__name__ = name
    return hook


def follows(horovod_class: type, keras3_target: str, hooks: Optional[tuple] = None) -> type:
    """The subclass of `horovod_class` that hands a Keras 3 model to `keras3_target`
    ("module:Class", imported at the first Keras 3 model). It overrides the hooks that either
    class implements (`hooks`: those of the Keras 3 class, given where importing it here would
    be circular), so that Keras 2's `fit` calls no batch hook neither needs."""
    own = {name for name in HOOKS if _overrides(horovod_class, name)}
    forwarded = own | set(hooks if hooks is not None else (n for n in HOOKS if _overrides(_load(keras3_target), n)))

    def __init__(self, *args, **kwargs) -> None:
        horovod_class.__init__(self, *args, **kwargs)
        self._hvdx_arguments = (args, kwargs)
        self._keras3 = None
        self._hvdx_params: Dict[str, Any] = {}

    def set_model(self, model) -> None:
        if is_keras3_object(model):
            if self._keras3 is None:
                args, kwargs = self._hvdx_arguments
                self._keras3 = _load(keras3_target)(*args, **kwargs)
                if self._hvdx_params:
                    self._keras3.set_params(self._hvdx_params)
            self._keras3.set_model(model)
            return
        self._keras3 = None
        horovod_class.set_model(self, model)

    def set_params(self, params) -> None:
        self._hvdx_params = params
        if self._keras3 is not None:
            self._keras3.set_params(params)
        else:
            horovod_class.set_params(self, params)

    namespace = {"__init__": __init__, "set_model": set_model, "set_params": set_params,
                 "__module__": horovod_class.__module__, "__qualname__": horovod_class.__qualname__,
                 "__doc__": (horovod_class.__doc__ or "") + f"\n\n    Given a Keras 3 model: {keras3_target}."}
    namespace.update({name: _forward(name) for name in sorted(forwarded)})
    made = type(horovod_class.__name__, (horovod_class,), namespace)
    made._hvdx_follows = made
    return made
