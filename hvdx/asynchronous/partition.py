"""PASSM's partition of the model among a node's processes, and restricted backpropagation
(Kungurtsev, Egan, Chatterjee, Alistarh, "Asynchronous Optimization Methods for Efficient
Training of Deep Neural Networks with Guarantees", AAAI 2021, arXiv 1905.11845, sec. 4
"Block Partitioned Subgradients" and Appendix D "Restricted Backpropagation").

"We assign the layers to concurrent processes according to roughly equal division of
weights": the layers, in the model's order, are cut into P contiguous groups of about
total / P parameters each; process p updates group p only, and computes the gradient of
its own variables only (`tape.gradient(loss, own)`), which TensorFlow prunes to the part of
backpropagation those variables need.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np
import tensorflow as tf

__all__ = ["Unit", "layer_units", "partition", "backprop_flops_saved"]


@dataclass(frozen=True)
class Unit:
    """A layer's trainable variables: indices [first, last) into the model's variable list,
    elements [begin, end) of the flat model."""

    name: str
    first: int
    last: int
    begin: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.begin


def layer_units(model_or_variables) -> Tuple[List[tf.Variable], List[Unit]]:
    """(the variables, in the model's order; the units: consecutive variables of one layer).

    A Keras model is split by its innermost layers; a list of variables gives one unit per
    variable. Raises ValueError for no variables or a non-float one."""
    if hasattr(model_or_variables, "_flatten_layers") and hasattr(model_or_variables, "trainable_variables"):
        variables = list(model_or_variables.trainable_variables)
        owner: Dict[int, str] = {}
        for layer in model_or_variables._flatten_layers(include_self=False):
            if not list(layer._flatten_layers(include_self=False)):   # a leaf layer
                for v in layer.trainable_weights:
                    owner.setdefault(id(v), layer.name)
    else:
        variables = list(model_or_variables)
        owner = {}
    if not variables:
        raise ValueError("the model has no trainable variables: build it first (call it once or give Input shapes)")
    for v in variables:
        if v.dtype != tf.float32:
            raise ValueError(f"variable {v.name!r} is {v.dtype.name}: the shared model holds float32 variables "
                             f"(mixed precision keeps float32 variables; pass those)")
    units: List[Unit] = []
    offset = 0
    for i, v in enumerate(variables):
        size = int(np.prod(v.shape))
        key = owner.get(id(v), f"#{i}:{v.name}")
        if units and units[-1].name == key and units[-1].last == i:
            u = units[-1]
            units[-1] = Unit(u.name, u.first, i + 1, u.begin, offset + size)
        else:
            units.append(Unit(key, i, i + 1, offset, offset + size))
        offset += size
    return variables, units


def partition(units: Sequence[Unit], processes: int) -> List[Tuple[int, int]]:
    """PASSM's assignment: `processes` contiguous groups of units, [first unit, last unit)
    each, of roughly equal parameter counts (each cut at the unit boundary closest to
    k * total / processes). Disjoint, in order, covering every unit; none empty.

    Raises ValueError when there are fewer units (layers) than processes."""
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if len(units) < processes:
        raise ValueError(f"PASSM gives each of the node's {processes} processes whole layers, and the model has "
                         f"{len(units)} layers with trainable variables: use at most {len(units)} processes per "
                         f"node, or ASSM / AsyncMiniBatch")
    ends = np.cumsum([u.size for u in units])
    total = float(ends[-1])
    cuts = [0]
    for k in range(1, processes):
        target = k * total / processes
        j = int(np.argmin(np.abs(ends - target))) + 1   # cut after unit j - 1
        j = max(j, cuts[-1] + 1)                        # every group at least one unit
        j = min(j, len(units) - (processes - k))        # and leave one for each group after
        cuts.append(j)
    cuts.append(len(units))
    return [(cuts[i], cuts[i + 1]) for i in range(processes)]


def backprop_flops_saved(groups: Sequence[Tuple[int, int]], unit_flops: Sequence[float]) -> float:
    """The fraction of weight-gradient backpropagation flops that P processes save per step
    with restricted backpropagation, against each computing the full gradient (the paper's
    Appendix D count): process p backpropagates from the output down to its first unit, so
    it skips the units below it. `unit_flops`: backprop flops of each unit (e.g. 4 x its
    parameters x batch for a dense layer: the input-gradient and the weight-gradient
    products); returns saved / (P x full)."""
    full = float(np.sum(unit_flops))
    if full <= 0:
        return 0.0
    spent = sum(float(np.sum(unit_flops[first:])) for first, _ in groups)
    return 1.0 - spent / (len(groups) * full)
