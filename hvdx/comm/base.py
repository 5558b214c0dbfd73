"""What every gradient aggregation strategy shares: the call contract and its result.

A strategy is called on one fused 1-D gradient buffer of d elements (the same d on every
rank) and returns the average of all ranks' buffers, as seen through the strategy's
compression. Collective: every rank calls the same strategy on the same buffers, in the
same order. The first call on each layout (buffer name, length, pieces, dtype) checks that
every rank makes the same call (`hvdx.agreement`), whoever calls: the aggregator, or a user on
a buffer of their own. Sparse strategies keep error-feedback residuals (`hvdx.comm.memory`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, List, Mapping, Optional, Sequence, Set, Tuple, Union

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from hvdx import progress
from hvdx.arguments import integer, real
from hvdx.comm import registry
from hvdx.comm.traits import OptimizerTraits
from hvdx.agreement import Agreed, check_agreement
# the node-local collectives, below the strategies; re-exported here, where they were
from hvdx.topology import Topology, initialized, set_rank_and_size, topology

__all__ = ["Aggregated", "DEFAULT_BUCKET_BYTES", "HOROVOD_OPTIONS", "Shapes", "Strategy", "check_density",
           "check_hierarchical", "check_positive_int", "check_shapes", "get"]

#: Horovod's own options. A strategy may take them (`Allreduce` does); the optimizer saves
#: them in its config itself, so they are not part of a strategy's `get_config()`.
HOROVOD_OPTIONS = ("op", "process_set", "prescale_factor", "postscale_factor", "compression")


def check_density(density: float) -> float:
    """A density in (0, 1], as a float (NumPy numbers too); ValueError otherwise."""
    return real(density, "density", 0, 1, low_open=True, expected="a number in (0, 1]")


def check_hierarchical(hierarchical: Optional[bool]) -> Optional[bool]:
    """A strategy's `hierarchical` option: True, False or None (automatic: on a 2-tier job);
    ValueError otherwise (1 and 0 too: a flag, not a count)."""
    if not (hierarchical is None or isinstance(hierarchical, bool)):
        raise ValueError(f"hierarchical must be True, False or None (automatic), got {hierarchical!r}")
    return hierarchical


def check_positive_int(value: Any, argument: str) -> int:
    """An int >= 1 (NumPy integers too), as a Python int; ValueError naming `argument` otherwise
    (`hvdx.arguments.integer`)."""
    return integer(value, argument, 1)


@dataclass
class Aggregated:
    """What one strategy call leaves behind (graph tensors of the current trace).

    output: the averaged buffer (length d), identical on every rank; None where the
      strategy averaged a bucket's pieces without fusing them (`Strategy.aggregate_pieces`).
    updates: residual writes not yet made, (variable, new value) pairs: the caller makes
      them only if the step's averaged gradients are finite (`hvdx.comm.memory.commit`).
    local_slice: (this rank's averaged slice of the buffer, its offset) where the strategy
      reduce-scatters inside the node (2DTAR, HiTopK): LARS/LAMB compute their partial
      norms on it instead of another pass over d (shi2021 sec. 4.2).
    finite: a boolean scalar, identical on every rank, true iff what the ranks exchanged is
      finite, computed on the exchanged (value, index) pairs rather than on the d-vector
      (sparse strategies). None: the caller checks `output` itself.
    """

    output: Optional[tf.Tensor]
    updates: List[Tuple[tf.Variable, tf.Tensor]] = field(default_factory=list)
    local_slice: Optional[Tuple[tf.Tensor, int]] = None
    finite: Optional[tf.Tensor] = None


#: The default bucket size: a bucket closes once it holds this many bytes (PyTorch DDP's
#: rule; Horovod's fusion threshold plays the same part). Buckets fill in reverse order of
#: the variables, the order backpropagation produces their gradients, so the first
#: bucket's collectives run while the backward pass of earlier layers goes on.
DEFAULT_BUCKET_BYTES = 32 << 20

#: The methods a strategy inherits as they are: they check rank agreement before any
#: collective. A strategy implements `_aggregate` (and may implement `_aggregate_pieces`).
_ENTRY_POINTS = ("__call__", "aggregate", "aggregate_pieces")

#: A layout: (buffer name, piece lengths, dtype name).
Layout = Tuple[str, Tuple[int, ...], str, Optional[Tuple[Optional[Tuple[int, ...]], ...]]]
#: Each piece's gradient shape (None for a piece that is part of a gradient), or None for all.
Shapes = Optional[Sequence[Optional[Tuple[int, ...]]]]


def check_shapes(shapes: Shapes, sizes: Sequence[int]) -> Optional[List[Optional[Tuple[int, ...]]]]:
    """`shapes` as a list of tuples of ints (or None), one per piece of `sizes` elements.

    Raises:
      ValueError: not one shape per piece, or a shape whose element count is not its piece's.
    """
    if shapes is None:
        return None
    shapes = [None if shape is None else tuple(int(n) for n in shape) for shape in shapes]
    if len(shapes) != len(sizes):
        raise ValueError(f"{len(shapes)} shapes for {len(sizes)} pieces: give one shape per piece (None for a "
                         "piece that is part of a gradient)")
    for shape, size in zip(shapes, sizes):
        if shape is not None and int(np.prod(shape, dtype=np.int64)) != size:
            raise ValueError(f"shape {shape} has {int(np.prod(shape, dtype=np.int64))} elements, its piece {size}")
    return shapes


def _layout(name: str, sizes: Sequence[int], dtype: tf.DType, shapes: Shapes) -> Layout:
    """The key under which a call's layout is agreed once (`Strategy.agree`, `agreed`)."""
    checked = check_shapes(shapes, sizes)
    return (name, tuple(int(s) for s in sizes), tf.as_dtype(dtype).name,
            None if checked is None else tuple(checked))


class Strategy:
    """Base of the aggregation strategies: `strategy(buffer, name) -> averaged buffer`.

    `aggregate(buffer, name, residual_scale)` is the two-phase form: it returns an
    `Aggregated` whose residual updates the caller commits once it knows the whole step is
    finite; `aggregate_pieces` the same for a bucket given as pieces. Calling the strategy
    directly commits them at once when the output is finite (a non-finite step leaves
    every residual as it was).

    Every entry point first makes sure that all ranks agree on the call (`agree`): once per
    layout (buffer name, length, pieces, dtype) and strategy instance, a collective that
    raises `hvdx.RankMismatchError` on every rank naming what differs (strategy, density,
    wire dtype, buffer name, length, pieces, dtype, number of ranks), instead of a hang or a
    silently wrong average. Later calls on a layout make no check (a collective costs
    milliseconds). A subclass implements `_aggregate` (and `_aggregate_pieces` where it can
    average pieces without fusing them); it does not override the entry points.
    """

    #: The name the registry knows the strategy by (set by `hvdx.comm.register`).
    key: ClassVar[str] = ""
    #: Whether the strategy keeps error-feedback residuals (sparse) or is exact (dense).
    lossy: ClassVar[bool] = False
    #: The options of hvdx's optimizer and tape that the strategy takes: keywords of its
    #: constructor, each validated there (the one place).
    options: ClassVar[Tuple[str, ...]] = ()
    #: Options that `get_config` and `repr` leave out while they hold these values (their
    #: defaults), so that configs and agreement records name only what a user changed.
    quiet_defaults: ClassVar[Mapping[str, Any]] = {}
    #: The ranks that take part in the strategy's collectives (`Allreduce` takes another).
    process_set: Any = None
    #: The bucket size hvdx's optimizer and tape use with this strategy unless given one
    #: (`bucket_bytes="auto"`, their default).
    bucket_bytes: ClassVar[int] = DEFAULT_BUCKET_BYTES
    #: Whether `_aggregate_pieces` sends each piece as soon as it exists (no fused buffer):
    #: the call's "enter" mark (`hvdx.progress`) then waits for the piece backpropagation
    #: yields first (the bucket's last), not for all of them, so that the pieces' collectives
    #: overlap the rest of backpropagation.
    sends_pieces_apart: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = [method for method in _ENTRY_POINTS if method in vars(cls)]
        if overridden:
            raise TypeError(f"{cls.__qualname__} overrides {', '.join(overridden)}: a strategy implements "
                            "_aggregate(buffer, name, residual_scale) (and optionally _aggregate_pieces); the "
                            "entry points of hvdx.comm.Strategy check that every rank makes the same call "
                            "before any collective")

    def __init__(self, topo: Optional[Topology] = None) -> None:
        self._topo = topo
        self._agreed = Agreed()

    @classmethod
    def from_options(cls, *, strict: bool = True, **options: Any) -> "Strategy":
        """The strategy built from the options of hvdx's optimizer or tape.

        Args:
          strict: an option the strategy does not take raises (True) or is dropped (False).
          options: keywords of `cls.options`.
        Raises:
          ValueError: an option it does not take (strict, naming the strategies that take
            it), or a bad value (from the constructor).
        """
        extra = sorted(set(options) - set(cls.options))
        if extra and strict:
            kind = " is dense and lossless and" if not cls.lossy else ""
            taken = "; ".join(f"{o} by {registry.takers(o) or 'none'}" for o in extra)
            raise ValueError(f"communication={cls.key!r}{kind} does not take {', '.join(extra)} (taken: {taken}). "
                             "Drop them, or choose a strategy that takes them.")
        return cls(**{k: v for k, v in options.items() if k in cls.options})

    @classmethod
    def defaults_for(cls, traits: OptimizerTraits, options: Mapping[str, Any]) -> Dict[str, Any]:
        """The aids this strategy applies by default for an optimizer of `traits`
        (`hvdx.comm.traits`), given the `options` the user gave (its options, and the aids of
        hvdx's optimizer wrapper, `hvdx.comm.choice.WRAPPER_AIDS`, that were given).

        Returns:
          The options to use where the user gave none (keys of `cls.options`), and wrapper
          aids to turn on (e.g. local_trust_ratio); a key of `options` is never among them.
          The base strategy (the dense ones): {}. `hvdx.comm.choice.StrategyChoice` asks it
          when a strategy is chosen by name (a strategy instance is used as it is); the tape
          wraps no optimizer and asks with `OptimizerTraits()`.
        """
        return {}

    def get_config(self) -> Dict[str, Any]:
        """This strategy's own options (not Horovod's, `HOROVOD_OPTIONS`) as JSON values;
        `from_config` rebuilds an equal strategy from them. Options left at None, and those at
        their `quiet_defaults`, are omitted."""
        config: Dict[str, Any] = {}
        for option in self.options:
            value = getattr(self, option, None)
            if option in HOROVOD_OPTIONS or value is None or self._quiet(option, value):
                continue
            config[option] = value.name if isinstance(value, tf.DType) else value
        return config

    def _quiet(self, option: str, value: Any) -> bool:
        return option in self.quiet_defaults and value == self.quiet_defaults[option]

    def _changed_options(self) -> List[str]:
        """`name=value` of each of `quiet_defaults` that differs from its default, for `repr`."""
        return [f"{option}={getattr(self, option)!r}" for option in self.quiet_defaults
                if not self._quiet(option, getattr(self, option))]

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "Strategy":
        """The inverse of `get_config` (dtype options may be given by name)."""
        return cls.from_options(**config)

    @property
    def topology(self) -> Topology:
        return self._topo or topology()

    # -- the entry points: agreement first, then the strategy's own work ------------------
    @tf.autograph.experimental.do_not_convert
    def __call__(self, buffer: tf.Tensor, name: str = "grads") -> tf.Tensor:
        from hvdx.comm.memory import commit

        result = self.aggregate(self._check(buffer), name)
        if result.updates:
            finite = result.finite if result.finite is not None else tf.reduce_all(tf.math.is_finite(result.output))
            with tf.control_dependencies([commit(result.updates, finite)]):
                return tf.identity(result.output)
        return result.output

    @staticmethod
    def _check(buffer: tf.Tensor) -> tf.Tensor:
        buffer = tf.convert_to_tensor(buffer)
        if buffer.shape.rank != 1 or buffer.shape[0] is None:
            raise ValueError(f"a strategy takes a 1-D buffer of known length, got {buffer.shape}")
        return buffer

    @tf.autograph.experimental.do_not_convert
    def aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        """Averages `buffer` (1-D, of static length d) over all ranks. Collective.

        Args:
          buffer: this rank's buffer.
          name: the buffer's name: its residual's key, and part of the collectives' names.
          residual_scale: multiplies stored residuals before use (the loss scale changed
            since they were stored); None: 1.
        Returns:
          The `Aggregated` (output of length d; residual updates not yet made). A buffer of
          no elements comes back as it is, with no collective after the agreement check.
        Raises:
          hvdx.RankMismatchError: on every rank, when the ranks make different calls (first
            call on a layout only).
        """
        buffer = self._check(buffer)
        self.agree(name, (int(buffer.shape[0]),), buffer.dtype)
        if buffer.shape[0] == 0:
            return Aggregated(buffer)
        (buffer,) = progress.mark([buffer], self.progress_label, name, "enter")
        result = self._aggregate(buffer, name, residual_scale)
        if result.output is not None:
            (result.output,) = progress.mark([result.output], self.progress_label, name, "leave")
        return result

    @tf.autograph.experimental.do_not_convert
    def aggregate_pieces(self, pieces: Sequence[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor] = None,
                         *, grouped: bool = False, shapes: Shapes = None) -> Tuple[List[tf.Tensor], Aggregated]:
        """Averages a bucket given as 1-D pieces (its gradients, flattened, in order; one
        dtype). Collective, checked like `aggregate`. `grouped`: the pieces must travel in
        one collective (Horovod's `groups` / `num_groups`); a strategy that fuses the pieces
        into one buffer always does, `Allreduce` otherwise hands each piece to Horovod on
        its own. `shapes`: each piece's gradient shape, None for a piece that is part of a
        gradient (or None for all): a compressor that works on matrices (PowerSGD) reads
        them; the others ignore them.

        Returns:
          (the averaged pieces, of the pieces' lengths, and the `Aggregated`). Pieces of no
          elements at all come back as they are, with no collective after the check.
        Raises:
          hvdx.RankMismatchError: as `aggregate`; ValueError: no pieces, or pieces of
            several dtypes.
        """
        pieces = [self._check(piece) for piece in pieces]
        if not pieces or len({piece.dtype for piece in pieces}) != 1:
            raise ValueError(f"aggregate_pieces takes one or more 1-D pieces of one dtype, got {pieces!r}")
        sizes = tuple(int(piece.shape[0]) for piece in pieces)
        shapes = check_shapes(shapes, sizes)
        self.agree(name, sizes, pieces[0].dtype, shapes)
        if sum(sizes) == 0:
            return pieces, Aggregated(tf.zeros([0], pieces[0].dtype))
        if self.sends_pieces_apart:  # entered with the first piece backpropagation yields (the bucket's last)
            pieces[-1:] = progress.mark(pieces[-1:], self.progress_label, name, "enter")
        else:
            pieces = progress.mark(pieces, self.progress_label, name, "enter")
        outputs, result = self._aggregate_pieces(pieces, name, residual_scale, grouped=grouped, shapes=shapes)
        return progress.mark(outputs, self.progress_label, name, "leave"), result

    @property
    def corrects_momentum(self) -> bool:
        """Whether the strategy applies the optimizer's momentum itself before it aggregates
        (Deep Gradient Compression's momentum correction): the wrapped optimizer must then apply
        the aggregate without a momentum of its own. None does by default."""
        return False

    @property
    def progress_label(self) -> str:
        """The name of this strategy's collective calls in the watchdog's reports
        (`hvdx.progress`): its registered name, else its class's."""
        return self.key or type(self).__name__

    # -- rank agreement -----------------------------------------------------------------
    def describe(self, name: str, sizes: Sequence[int], dtype: tf.DType, shapes: Shapes = None) -> Dict[str, str]:
        """What every rank must agree on for a call on a buffer `name` made of pieces of
        `sizes` elements of `dtype` (and of gradient `shapes`, where given: a strategy that
        treats gradients as matrices sends factors of their shapes): the strategy with its
        options (`signature`), the buffer and the number of ranks taking part."""
        _, ranks = set_rank_and_size(self.process_set)
        out = {**self.signature(), "buffer name": name, "buffer elements": str(sum(sizes)),
               "buffer pieces": str(list(sizes)), "buffer dtype": tf.as_dtype(dtype).name, "ranks": str(ranks)}
        if shapes is not None:
            out["buffer piece shapes"] = str([None if shape is None else list(shape) for shape in shapes])
        return out

    def agree(self, name: str, sizes: Sequence[int], dtype: tf.DType, shapes: Shapes = None) -> None:
        """Collective on a layout's first call only: checks that every rank of the
        strategy's process set makes the same call (`describe`).

        Raises:
          hvdx.RankMismatchError: on every rank, naming the ranks and what differs.
        """
        layout = _layout(name, sizes, dtype, shapes)
        if layout in self._agreed_layouts():
            return
        check_agreement(self.describe(name, sizes, dtype, shapes), f"a call of a strategy on buffer {name!r}",
                        process_set=self.process_set or hvd.global_process_set)
        self.agree_state([name], self.process_set or hvd.global_process_set)
        self._agreed_layouts().add(layout)

    def agreed(self, name: str, sizes: Sequence[int], dtype: tf.DType, shapes: Shapes = None) -> None:
        """Records a layout that the caller has checked itself (the aggregator checks a
        whole step's layout in one collective, bucket layouts and gradient shapes included,
        then calls `agree_state` on its buffers): no second check."""
        self._agreed_layouts().add(_layout(name, sizes, dtype, shapes))

    def _agreed_layouts(self) -> Set[Layout]:
        """The layouts the ranks of the current topology agreed on: none after a new
        membership (Elastic Horovod's reset, `hvdx.topology.reinit`), whose ranks check again."""
        return self._agreed.under(self._topo or (topology() if initialized() else None))

    # -- what a strategy implements -----------------------------------------------------
    def _aggregate(self, buffer: tf.Tensor, name: str, residual_scale: Optional[tf.Tensor] = None) -> Aggregated:
        """The strategy's work on a buffer the ranks agree on (d >= 1): see `aggregate`."""
        raise NotImplementedError

    def _aggregate_pieces(self, pieces: List[tf.Tensor], name: str, residual_scale: Optional[tf.Tensor] = None,
                          grouped: bool = False, shapes: Shapes = None) -> Tuple[List[tf.Tensor], Aggregated]:
        """The strategy's work on pieces the ranks agree on: fuses them into one buffer
        (one copy), calls `_aggregate`, and splits the result (another); a strategy that
        can average the pieces as they are overrides this (`Allreduce`: Horovod fuses them
        in its own buffer). `grouped`: see `aggregate_pieces` (one buffer is one collective);
        `shapes` (checked: one per piece, or None) are not used here."""
        with tf.name_scope("fuse"):
            buffer = tf.concat(pieces, axis=0) if len(pieces) > 1 else pieces[0]
        result = self._aggregate(buffer, name, residual_scale)
        if len(pieces) == 1:
            return [result.output], result
        with tf.name_scope("split"):
            return tf.split(result.output, [int(p.shape[0]) for p in pieces]), result

    def agree_state(self, names: Sequence[str], process_set: hvd.ProcessSet) -> None:
        """Collective over `process_set`, made right after the layout check of buffers `names`
        (once per layout and membership, eagerly, also while a step is traced): makes the
        state that must be the same on every rank before the first call (e.g. a step
        counter that picks the collectives' shapes) the same. After an elastic reset a
        returning node's new processes meet survivors that trained on. Default: nothing."""

    def create_state(self, name: str, d: int, shapes: Shapes = None) -> None:
        """Creates the state (residuals) of buffer `name` of length d before the first call,
        so that a checkpoint or a saved model restores into it at once. `shapes`: as
        `aggregate_pieces` will be given them (None: a flat buffer)."""

    def signature(self) -> Dict[str, str]:
        """The strategy's part of what every rank must agree on (`describe`): its class and
        options, as `repr` shows them."""
        return {"strategy": repr(self)}

    @property
    def memory(self):
        """The strategy's `ResidualMemory` (sparse strategies), else None."""
        return None

    @property
    def memories(self) -> list:
        """Every `ResidualMemory` of the strategy (checkpointed with the aggregator): the
        residuals', and others a strategy keeps (DGC's velocities)."""
        return [self.memory] if self.memory is not None else []

    @property
    def variables(self) -> Dict[str, tf.Variable]:
        """The strategy's residuals by buffer name; empty for dense strategies."""
        return self.memory.variables_by_name if self.memory is not None else {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def get(strategy: Union[str, Strategy], *, strict: bool = True, **options: Any) -> Strategy:
    """A strategy from its name (the registered class's `Strategy.from_options`) or an
    instance (kept as is); `hvdx.comm.get`.

    Args:
      strategy: a registered name or alias (`hvdx.comm.registry`), or a `Strategy` instance.
      strict: options the strategy does not take raise ValueError (True) or are dropped
        (False: switching strategies keeps the options that apply).
      options: the strategy's options (`cls.options` lists them).
    Raises:
      ValueError: unknown name, an option the strategy does not take (strict), a bad
        value, or options given beside an instance (configure the instance itself).
    """
    if isinstance(strategy, Strategy):
        if options:
            raise ValueError(f"options {sorted(options)} given with a strategy instance {strategy!r}: "
                             "configure the instance itself, e.g. hvdx.comm.HiTopK(density=0.01)")
        return strategy
    return registry.strategy_class(strategy).from_options(strict=strict, **options)
