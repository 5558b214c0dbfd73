"""Layer-wise adaptive rates: what LARS and LAMB share (shi2021 sec. 4.2, eq. 11), whatever the Keras.

Both scale each layer's step by a trust ratio computed from two per-layer norms, ||w|| and
||d|| (d: the gradient for LARS, eq. 11; the Adam direction for LAMB). Every rank holds the
same w and d after aggregation, so the norms can be computed in three ways (`parallel=`):

- None: replicated; every rank computes every layer's sums of squares, in one graph (all
  L reductions dispatched together, not a Python loop of tf.norm calls);
- "pto": the parallel tensor operator (hvdx.pto.parallel_map): each rank reduces a share of
  the layers balanced by element count, one all-gather of the 2L scalars. Bit-identical to
  the replicated norms;
- "slices": where the aggregation strategy reduce-scattered the gradient buffer inside the
  node (hvdx.DistributedOptimizer with "hierarchical" or "hitopk"), each rank reduces the
  element ranges of its own slice, and one all-gather of 2L partial sums inside the node
  (the fast links) gives every rank all the norms, folded in rank order (apex's
  DistributedFusedLAMB works this way). Float-tolerance equal to the replicated norms.
  Where no slices exist over all ranks (dense allreduce, Horovod's DistributedOptimizer, a
  tape) it runs as "pto"; where the aggregation averaged over a process set and left no
  slices (hvdx.DASO's node-local allreduce) it raises ValueError rather than run as
  something else.

"pto" and "slices" assume what aggregation guarantees: the gradients and weights are the
same on every rank of the set the gradients were averaged over. That set comes from the
aggregation's record (`AggregationRecord.process_set`): all ranks by default, the ranks of
one node under hvdx.DASO, where each node holds its own gradients, so the norms are shared
inside the node only. Variables that stay local (hvdx's / Horovod's register_local_var) are
reduced locally in every mode.

This module imports no Keras. `Layerwise` holds the optimizers' Keras-neutral part (options,
weight-decay and adaptation patterns, the step's phases, the trust ratios and norms in every
mode, the hook of hvdx.DistributedOptimizer); `lars.py` and `lamb.py` hold the update rules;
the Keras adapters (`keras2.py`: Keras 2 / tf_keras, `keras3.py`: Keras 3) put them on their
Keras' Optimizer and give them its slots and assignments (`_slot`, `_assign`, `_assign_sub`).
"""
from __future__ import annotations

import numbers
import re
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdx import pto
from hvdx.arguments import real
from hvdx.buckets import AggregationObserver, AggregationRecord, Ranges
from hvdx.variables import tf_variable

__all__ = ["Layerwise", "MODES", "check_learning_rate", "flag", "layerwise_options", "number", "squared_norm"]

MODES = (None, "pto", "slices")


def squared_norm(x: tf.Tensor) -> tf.Tensor:
    """sum(x**2) in float32: the one reduction every mode uses, so that the per-layer scalars
    of "pto" are bit-identical to the replicated ones (same kernel, same contiguous data)."""
    x = tf.convert_to_tensor(x)
    if x.dtype != tf.float32:
        x = tf.cast(x, tf.float32)
    return tf.reduce_sum(tf.square(x))


def range_squared_norm(x: tf.Tensor, ranges: Ranges) -> tf.Tensor:
    """sum(x.flat[a:b]**2) over `ranges`, added in the order given."""
    n = x.shape.num_elements()
    if ranges == [(0, n)]:
        return squared_norm(x)
    if not ranges:
        return tf.zeros([], tf.float32)
    flat = tf.reshape(x, [-1])
    total = squared_norm(flat[ranges[0][0]:ranges[0][1]])
    for a, b in ranges[1:]:
        total = total + squared_norm(flat[a:b])
    return total


def patterns(value: Union[None, str, Iterable[str]], argument: str) -> Optional[Tuple[str, ...]]:
    """Regex patterns from None, one string (one pattern, not a list of characters) or a list;
    ValueError naming `argument` for anything else or a pattern that does not compile."""
    if value is None:
        return None
    items = (value,) if isinstance(value, str) else value
    try:
        items = tuple(items)
    except TypeError:
        raise ValueError(f"{argument} must be a regex string or a list of them, got {value!r}") from None
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{argument} must be a regex string or a list of them, got {item!r} in {value!r}")
        try:
            re.compile(item)
        except re.error as exc:
            raise ValueError(f"{argument}: {item!r} is not a valid regular expression ({exc})") from None
    return items


def variable_name(variable) -> str:
    """The name patterns are matched against, without ':0': a Keras 3 variable's path
    ("sequential/dense/kernel", also the name of the tf.Variable behind it), a Keras 2 one's name."""
    return re.sub(r":\d+$", "", getattr(variable, "path", None) or variable.name)


def flag(value: Any, argument: str) -> bool:
    """A boolean argument as a bool: True, False (or NumPy's); ValueError naming `argument` for
    anything else (bool("no") would be True)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{argument} must be True or False, got {value!r}")


def number(value: Any, argument: str, low: float = 0.0, high: Optional[float] = None, *,
           low_open: bool = False, high_open: bool = False, optional: bool = False) -> Optional[float]:
    """A real number (NumPy's too) in the given interval, as a float; ValueError naming
    `argument` otherwise (`hvdx.arguments.real`, bounded below by 0 unless told)."""
    return real(value, argument, low, high, low_open=low_open, high_open=high_open, optional=optional)


def check_learning_rate(learning_rate) -> Any:
    """The learning rate as given, a plain number as a float (>= 0: ValueError naming it
    otherwise); a schedule or callable as it is."""
    if isinstance(learning_rate, numbers.Real) and not isinstance(learning_rate, bool):
        return number(learning_rate, "learning_rate")
    return learning_rate


def layerwise_options(*, weight_decay: float, exclude_from_weight_decay, exclude_from_layer_adaptation,
                      min_trust_ratio: Optional[float], max_trust_ratio: Optional[float],
                      parallel: Optional[str]) -> Dict[str, Any]:
    """The options every layer-wise optimizer takes, checked (`Layerwise._adopt` takes them).

    Raises:
      ValueError: naming the argument.
    """
    options = dict(weight_decay=number(weight_decay, "weight_decay"),
                   decay_patterns=patterns(exclude_from_weight_decay, "exclude_from_weight_decay") or (),
                   adaptation_patterns=patterns(exclude_from_layer_adaptation, "exclude_from_layer_adaptation"),
                   min_trust_ratio=number(min_trust_ratio, "min_trust_ratio", optional=True),
                   max_trust_ratio=number(max_trust_ratio, "max_trust_ratio", low_open=True, optional=True))
    low, high = options["min_trust_ratio"], options["max_trust_ratio"]
    if low is not None and high is not None and low > high:
        raise ValueError(f"min_trust_ratio ({low}) must not exceed max_trust_ratio ({high})")
    if parallel not in MODES:
        raise ValueError(f"parallel must be one of {MODES}, got {parallel!r}")
    options["parallel"] = parallel
    return options


class Layerwise(AggregationObserver):
    """The Keras-neutral part of hvdx's LARS and LAMB, on either Keras' Optimizer.

    A step runs in three phases over all variables at once (`_plan`, called by the adapter's
    hook that sees every variable of the step): `_prepare` (each layer's direction d, updating
    moment slots), the trust ratios from ||w|| and ||d|| in the configured mode, then `_apply`
    per variable (`_update`, from Keras' per-variable update step). The rules (lars.py,
    lamb.py) define `_prepare`, `_ratio` (the formula, vectorised over layers), `_apply` and
    `_rule_config`; the adapters `_slot(kind, variable)`, `_assign`, `_assign_sub`.

    Weight decay belongs to the update rule (weight_decay=, exclude_from_weight_decay=), not
    to Keras' decoupled weight decay, which stays off. Layers matching
    exclude_from_layer_adaptation (default: the weight-decay exclusions) keep ratio 1.
    Trust ratios are clipped to [min_trust_ratio, max_trust_ratio] when given.
    """

    #: The rule's slots: kind (the slot variables' name suffix) -> the attribute holding their list.
    _SLOTS: Dict[str, str] = {}

    def _adopt(self, options: Dict[str, Any], hyper: Dict[str, Any]) -> None:
        """Takes `layerwise_options` and the rule's checked hyper-parameters (after the Keras
        Optimizer's __init__)."""
        self._book = _Book()  # Python-side state, kept out of Keras' and tf.Module's attribute tracking
        self._book.decay_patterns = options["decay_patterns"]
        self._book.adaptation_patterns = options["adaptation_patterns"]
        self.weight_decay = options["weight_decay"]
        self.min_trust_ratio = options["min_trust_ratio"]
        self.max_trust_ratio = options["max_trust_ratio"]
        self.parallel = options["parallel"]
        for key, value in hyper.items():
            setattr(self, key, value)

    @property
    def last_mode(self) -> Optional[str]:
        """The mode the last trust-ratio computation used (None: replicated)."""
        return self._book.last_mode

    # -- what the adapters give -----------------------------------------------------------
    def _slot(self, kind: str, variable) -> Any:
        """The slot variable of `kind` (a key of `_SLOTS`) kept for `variable`."""
        raise NotImplementedError

    def _assign(self, variable, value) -> Any:
        raise NotImplementedError

    def _assign_sub(self, variable, value) -> Any:
        raise NotImplementedError

    def _slot_lists(self, var_list, add: Callable[[Any, str], Any]) -> None:
        """Creates the rule's slots for `var_list` with `add(variable, kind)` (the Keras'
        add_variable_from_reference), every kind's list in turn."""
        for kind, attribute in self._SLOTS.items():
            setattr(self, attribute, [add(v, kind) for v in var_list])

    # -- configuration -----------------------------------------------------------------
    @property
    def exclude_from_weight_decay_patterns(self) -> Tuple[str, ...]:
        return self._book.decay_patterns

    @property
    def exclude_from_layer_adaptation_patterns(self) -> Tuple[str, ...]:
        book = self._book
        return book.adaptation_patterns if book.adaptation_patterns is not None else book.decay_patterns

    def _decays(self, variable) -> bool:
        """Whether weight decay applies to `variable` (Keras' exclude_from_weight_decay()
        method is honoured too)."""
        name = variable_name(variable)
        return bool(self.weight_decay) and self._use_weight_decay(variable) and not any(
            re.search(p, name) for p in self._book.decay_patterns)

    def _adapts(self, variable) -> bool:
        name = variable_name(variable)
        return not any(re.search(p, name) for p in self.exclude_from_layer_adaptation_patterns)

    def _apply_weight_decay(self, variables) -> None:
        """Keras' decoupled weight decay: off (the update rules apply their own)."""

    def _layerwise_config(self) -> Dict[str, Any]:
        """The layer-wise options and the rule's, as the constructor takes them."""
        book = self._book
        config = dict(weight_decay=self.weight_decay, exclude_from_weight_decay=list(book.decay_patterns),
                      exclude_from_layer_adaptation=None if book.adaptation_patterns is None
                      else list(book.adaptation_patterns),
                      min_trust_ratio=self.min_trust_ratio, max_trust_ratio=self.max_trust_ratio,
                      parallel=self.parallel)
        config.update(self._rule_config())
        return config

    def _rule_config(self) -> Dict[str, Any]:
        raise NotImplementedError

    # -- the hook of hvdx.DistributedOptimizer -------------------------------------------
    def observe_aggregation(self, record: AggregationRecord) -> None:
        """Called by hvdx.DistributedOptimizer after each aggregation: records which
        variables' gradients were averaged, over which process set (the norms of "pto" and
        "slices" are shared inside it) and, where the strategy left reduce-scattered slices,
        this rank's element ranges of each."""
        self._book.aggregated = record.aggregated_variables()
        self._book.process_set = record.process_set

    # -- the step ------------------------------------------------------------------------
    def _prepare(self, gradients: List[tf.Tensor], variables: List[Any]) -> List[tf.Tensor]:
        raise NotImplementedError

    def _ratio(self, w_norm: tf.Tensor, d_norm: tf.Tensor, decay: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    def _apply(self, gradient: tf.Tensor, direction: tf.Tensor, variable, ratio: tf.Tensor, learning_rate):
        raise NotImplementedError

    def _plan(self, gradients: Sequence[tf.Tensor], variables: Sequence[Any]) -> None:
        """The first two phases of a step over all its variables: directions (moment slots
        updated) and trust ratios, kept for `_update` (by the Keras' variable key) until
        `_planned` ends."""
        gradients, variables = [tf.convert_to_tensor(g) for g in gradients], list(variables)  # IndexedSlices: dense
        directions = self._prepare(gradients, variables)
        if self._book.trust_applied:  # LARS.local_trusted's aggregate: rates applied before aggregation
            ratios = [tf.ones([], tf.float32)] * len(variables)
        else:
            ratios = self.trust_ratios(variables, directions)
        self._book.pending = {self._var_key(v): (d, r) for v, d, r in zip(variables, directions, ratios)}

    def _update(self, gradient, variable, learning_rate):
        """The last phase for one variable: its planned direction and ratio applied (called on
        its own, outside a planned step: this variable's rate, replicated)."""
        gradient = tf.convert_to_tensor(gradient)
        pending = self._book.pending.pop(self._var_key(variable), None)
        if pending is None:
            direction = self._prepare([gradient], [variable])[0]
            ratio = self.trust_ratios([variable], [direction], mode=None)[0]
        else:
            direction, ratio = pending
        return self._apply(gradient, direction, variable, ratio, learning_rate)

    def _unplan(self) -> None:
        self._book.pending = {}

    # -- trust ratios ----------------------------------------------------------------------
    def trust_ratios(self, variables: Sequence[Any], directions: Sequence[tf.Tensor],
                     mode: Union[str, None, bool] = True,
                     direction_squares: Optional[Callable[[List[tf.Tensor]], List[tf.Tensor]]] = None
                     ) -> List[tf.Tensor]:
        """Every layer's trust ratio (1 for layers excluded from adaptation), as float32
        scalars. mode: True for the configured `parallel`, or None / "pto" / "slices".
        direction_squares: given the adapted layers' directions, their ||d||^2 in place of
        computing them (LARS.local_trusted: the norm of the ranks' average, sketched); the
        weights' norms are then computed on this rank (as mode None)."""
        mode = self.parallel if mode is True else mode
        adapted = [i for i, v in enumerate(variables) if self._adapts(v)]
        ratios: List[tf.Tensor] = [tf.ones([], tf.float32)] * len(variables)
        if not adapted:
            return ratios
        chosen, towards = [variables[i] for i in adapted], [directions[i] for i in adapted]
        if direction_squares is None:
            squares = self.squared_norms(chosen, towards, mode)
            w_norm, d_norm = tf.sqrt(squares[:, 0]), tf.sqrt(squares[:, 1])
        else:  # no pass over the directions here: their norms are given
            self._book.last_mode = None
            w_norm = tf.sqrt(tf.stack([squared_norm(_value(v)) for v in chosen]))
            d_norm = tf.sqrt(tf.stack(direction_squares(towards)))
        decay = tf.constant([self.weight_decay if self._decays(variables[i]) else 0.0 for i in adapted], tf.float32)
        ratio = tf.where((w_norm > 0) & (d_norm > 0), self._ratio(w_norm, d_norm, decay), tf.ones_like(w_norm))
        if self.min_trust_ratio is not None:
            ratio = tf.maximum(ratio, self.min_trust_ratio)
        if self.max_trust_ratio is not None:
            ratio = tf.minimum(ratio, self.max_trust_ratio)
        for i, r in zip(adapted, tf.unstack(ratio, num=len(adapted))):
            ratios[i] = r
        return ratios

    def squared_norms(self, variables: Sequence[Any], directions: Sequence[tf.Tensor],
                      mode: Optional[str]) -> tf.Tensor:
        """[L, 2]: sum(w**2) and sum(d**2) of every layer, computed as `mode` says, inside the
        process set the gradients were averaged over (all ranks unless the aggregation's
        record names a set); the mode actually used is left in `last_mode` ("slices" runs as
        "pto" where an aggregation over all ranks left no slices; a set of one rank computes
        locally).

        Raises:
          ValueError: mode "slices" after an aggregation over a process set (hvdx.DASO's
            node-local average) that left no slices.
        """
        process_set = self._book.process_set
        if process_set is hvd.global_process_set:
            process_set = None
        _, size = pto.set_rank_and_size(process_set)
        if mode is None or size == 1:
            self._book.last_mode = None
            return _replicated(variables, directions)
        shared = self._shared(variables)
        aggregated = self._book.aggregated
        if mode == "slices" and aggregated is not None:
            ranges = [aggregated.get(_ref(v)) if s else None for v, s in zip(variables, shared)]
            if any(r is not None for r in ranges):
                self._book.last_mode = "slices"
                return self._slice_norms(variables, directions, ranges)
            if process_set is not None:
                raise ValueError(
                    f"{type(self).__name__}(parallel='slices') computes the norms on the slices that a "
                    "reduce-scattering aggregation leaves (hvdx.DistributedOptimizer with "
                    f"communication='hierarchical' or 'hitopk'); these gradients were averaged over a process "
                    f"set of {size} ranks without slices (hvdx.DASO averages inside each node): use "
                    "parallel='pto' (the norms shared inside that set) or parallel=None")
        self._book.last_mode = "pto"
        squares = _replicated(variables, directions, [not s for s in shared])  # local variables
        together = [i for i, s in enumerate(shared) if s]
        if not together:
            return squares
        gathered = pto.parallel_map(lambda w, d: tf.stack([squared_norm(w), squared_norm(d)]),
                                    [(_value(variables[i]), directions[i]) for i in together], output_shape=[2],
                                    process_set=process_set,
                                    name=self._collective_name("pto", [variables[i] for i in together]))
        return tf.tensor_scatter_nd_update(squares, [[i] for i in together], gathered)

    def _shared(self, variables: Sequence[Any]) -> List[bool]:
        """Which variables hold the same gradient on every rank: those an attached hvdx
        aggregator averaged; without one, all but Horovod's registered local variables."""
        if self._book.aggregated is not None:
            return [_ref(v) in self._book.aggregated for v in variables]
        local = getattr(self, "_local_vars", None) or set()  # hvd.DistributedOptimizer's register_local_var
        return [_ref(v) not in local for v in variables]

    def _slice_norms(self, variables, directions, ranges: List[Optional[Ranges]]) -> tf.Tensor:
        from hvdx.topology import topology

        local_set = topology().local_set
        _, n = pto.set_rank_and_size(local_set)
        covered = [i for i, r in enumerate(ranges) if r is not None]
        squares = _replicated(variables, directions, [r is None for r in ranges])
        partial = tf.stack([tf.stack([range_squared_norm(_value(variables[i]), ranges[i]),
                                      range_squared_norm(directions[i], ranges[i])]) for i in covered])
        if n > 1:  # one all-gather inside the node; partial sums folded in rank order
            gathered = hvd.allgather(partial, process_set=local_set,
                                     name=self._collective_name("slices", [variables[i] for i in covered]))
            partial = tf.reduce_sum(tf.reshape(gathered, [n, len(covered), 2]), axis=0)
        return tf.tensor_scatter_nd_update(squares, [[i] for i in covered], partial)

    def _collective_name(self, kind: str, variables: Sequence[Any]) -> str:
        """The same on every rank, and different for different models and optimizers."""
        signature = "|".join(f"{variable_name(v)}{tuple(v.shape)}" for v in variables)
        return f"hvdx.{type(self).__name__.lower()}.{kind}.{self.name}.{zlib.crc32(signature.encode()):08x}"


class _Book:
    """What a layer-wise optimizer keeps on the Python side (never checkpointed)."""

    def __init__(self) -> None:
        self.decay_patterns: Tuple[str, ...] = ()
        self.adaptation_patterns: Optional[Tuple[str, ...]] = None
        self.aggregated: Optional[Dict[Any, Optional[Ranges]]] = None  # variable ref -> this rank's ranges
        self.process_set: Optional[hvd.ProcessSet] = None  # what they were averaged over (None: all ranks)
        self.pending: Dict[Any, Tuple[tf.Tensor, tf.Tensor]] = {}  # var key -> (direction, ratio), one step
        self.last_mode: Optional[str] = None
        self.trust_applied = False  # LARS.trust_applied(): the gradients carry their trust ratio


def _ref(variable) -> Any:
    """The key of `variable` in an aggregation's record: the tf.Variable behind it (a Keras 3
    variable's `.value`), by `ref()`."""
    return tf_variable(variable).ref()


def _value(variable) -> tf.Tensor:
    return variable if isinstance(variable, tf.Tensor) else tf.convert_to_tensor(tf_variable(variable))


def _replicated(variables: Sequence[Any], directions: Sequence[tf.Tensor],
                which: Optional[Sequence[bool]] = None) -> tf.Tensor:
    """[L, 2] squared norms computed on this rank (zeros where `which` is False)."""
    if which is not None and not any(which):
        return tf.zeros([len(variables), 2], tf.float32)
    rows = [tf.stack([squared_norm(_value(v)), squared_norm(d)]) if which is None or which[i]
            else tf.zeros([2], tf.float32) for i, (v, d) in enumerate(zip(variables, directions))]
    return tf.stack(rows)
