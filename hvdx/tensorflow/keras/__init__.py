"""`hvdx.tensorflow.keras` is `hvdx.keras` (as `horovod.tensorflow.keras` is Horovod's): the
same names, bound to the same objects."""
import hvdx.keras as _keras

globals().update({name: getattr(_keras, name) for name in dir(_keras) if not name.startswith("_")})
__all__ = list(_keras.__all__)


def __getattr__(name: str):
    return getattr(_keras, name)  # names Horovod's module gains later (hvdx.keras finds them)
