"""Optimizers with layer-wise adaptive rates whose per-layer norms can be computed in
parallel across ranks (shi2021 sec. 4.2): `LARS`, `LAMB`; `parallel=None | "pto" | "slices"`."""
from hvdx.optimizers.lamb import LAMB
from hvdx.optimizers.lars import LARS
from hvdx.optimizers.layerwise import LayerwiseOptimizer

__all__ = ["LAMB", "LARS", "LayerwiseOptimizer"]
