"""`hvdx.tensorflow.keras` is `hvdx.keras` (as `horovod.tensorflow.keras` is Horovod's)."""
from hvdx.keras import *  # noqa: F401,F403 - the same module under Horovod's path
from hvdx.keras import __all__, callbacks  # noqa: F401
