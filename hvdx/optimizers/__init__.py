"""Optimizers with layer-wise adaptive rates whose per-layer norms can be computed in
parallel across ranks (shi2021 sec. 4.2): `LARS`, `LAMB`; `parallel=None | "pto" | "slices"`.

Which Keras: `hvdx.optimizers.LARS`, `LAMB` and `LayerwiseOptimizer` follow tf.keras, as hvdx
does where nothing else says (`hvdx.legacy_keras`): the Keras 3 classes where tf.keras is
Keras 3 (TensorFlow >= 2.16 without TF_USE_LEGACY_KERAS=1, `hvdx.legacy_keras.tf_keras_is_keras3`),
else the Keras 2 ones. Both are importable by name whatever tf.keras is:

    from hvdx.optimizers.keras3 import LARS, LAMB   # Keras 3 (`import keras`): keras.Model.fit
    from hvdx.optimizers.keras2 import LARS, LAMB   # Keras 2 (tf.keras as Keras 2, or tf_keras)

Both take the same arguments, apply the same rules (`lars.py`, `lamb.py`, Keras-neutral, on
`layerwise.py`) and plug into hvdx.DistributedOptimizer the same way; they save under different
names ("hvdx>LARS" in Keras 2's registry, "hvdx>Keras3LARS" in Keras 3's). The choice is made
when one of these names is first read (importing this package imports no Keras).
"""
__all__ = ["LAMB", "LARS", "LayerwiseOptimizer"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from hvdx import legacy_keras

    if legacy_keras.tf_keras_is_keras3():
        from hvdx.optimizers import keras3 as module
    else:
        from hvdx.optimizers import keras2 as module
    value = getattr(module, name)
    globals()[name] = value
    return value
