"""A strategy choice, resolved once: which strategy, with which options, for which optimizer.

hvdx's optimizer wrappers and tape hand what the user gave to `StrategyChoice.resolve`:

- communication: a registered name or alias, an `hvdx.comm.Strategy` instance, or None:
  $HVDX_COMMUNICATION (and $HVDX_DENSITY, for a strategy that takes a density), else
  "allreduce", exactly Horovod's averaging (`environment_default`);
- the strategy options, one mapping (density=, num_samplings=, wire_dtype=, DGC's aids, a
  registered strategy's own options): each must be an option of a registered strategy
  (`Strategy.options`), and of the chosen one (checked by `build`, `Strategy.from_options`);
- Horovod's options that strategies take (op, process_set, prescale_factor,
  postscale_factor): passed to the strategies that take them;
- the aids hvdx's optimizer wrapper applies itself (`WRAPPER_AIDS`), as given;
- the wrapped optimizer's traits (`hvdx.comm.traits`; `OptimizerTraits()` for the tape).

`build()` makes the strategy: the given options over the defaults the strategy decides for
those traits (`Strategy.defaults_for`); a strategy instance is used as it is.
`switch(communication)` is the same choice for another strategy (hvdx.callbacks'
SwitchCommunication): the given options that apply to it are kept, and its defaults for
the same traits apply, as if it had been the first.
"""
from __future__ import annotations

import dataclasses
import os
import types
from typing import Any, Dict, Mapping, Optional, Tuple, Type, Union

import horovod.tensorflow as hvd
import tensorflow as tf

from hvdx.comm import registry
from hvdx.comm.base import Strategy
from hvdx.comm.traits import OptimizerTraits

__all__ = ["ENV_COMMUNICATION", "ENV_DENSITY", "StrategyChoice", "WRAPPER_AIDS", "environment_default"]

#: The environment variables that choose the strategy (and its density) when none is given.
ENV_COMMUNICATION, ENV_DENSITY = "HVDX_COMMUNICATION", "HVDX_DENSITY"

#: The aids hvdx.DistributedOptimizer applies itself around the strategy, each True, False
#: or None (the strategy's default, `Strategy.defaults_for`): momentum_correction (the
#: wrapped Keras optimizer's momentum moves into the strategy's `momentum`, DGC) and
#: local_trust_ratio (hvdx's LARS: eq. 11 on each rank's gradient before the strategy).
#: False is accepted beside any strategy (one that lacks the aid has it off anyway).
WRAPPER_AIDS = ("momentum_correction", "local_trust_ratio")

_AID_HINTS = {
    "momentum_correction": "it moves the momentum of the Keras optimizer it wraps into the strategy; without one "
                           "pass the strategy's momentum=m (DGC's momentum correction) and apply the aggregated "
                           "gradients with an optimizer without momentum",
    "local_trust_ratio": "it applies the trust ratio of the hvdx.optimizers.LARS it wraps to each rank's gradient",
}


def environment_default() -> Tuple[str, Optional[float]]:
    """The strategy (and density) used when none is given: dense averaging, exactly what
    Horovod does, unless $HVDX_COMMUNICATION (and $HVDX_DENSITY, for a strategy that takes
    a density) say otherwise, which lets an unmodified Horovod script run sparse.

    Raises:
      ValueError: $HVDX_COMMUNICATION names no registered strategy.
    """
    key = registry.resolve_name(os.environ.get(ENV_COMMUNICATION, "allreduce"))
    density = os.environ.get(ENV_DENSITY)
    if not density or "density" not in registry.strategy_class(key).options:
        return key, None
    return key, float(density)


def _frozen(mapping: Optional[Mapping[str, Any]] = None) -> Mapping[str, Any]:
    """A read-only copy of `mapping` without its None values (None: not given)."""
    return types.MappingProxyType({k: v for k, v in (mapping or {}).items() if v is not None})


@dataclasses.dataclass(frozen=True)
class StrategyChoice:
    """What the user chose, validated: `communication` (a registered strategy's canonical
    name, or the user's instance), `options` (the strategy options given, $HVDX_DENSITY's
    included), `horovod` (Horovod's options, for the strategies that take them), `aids`
    (`WRAPPER_AIDS` given) and the wrapped optimizer's `traits`. Make one with `resolve`."""

    communication: Union[str, Strategy]
    options: Mapping[str, Any] = dataclasses.field(default_factory=_frozen)
    horovod: Mapping[str, Any] = dataclasses.field(default_factory=_frozen)
    aids: Mapping[str, bool] = dataclasses.field(default_factory=_frozen)
    traits: OptimizerTraits = OptimizerTraits()

    @classmethod
    def resolve(cls, communication: Union[str, Strategy, None] = None, options: Optional[Mapping[str, Any]] = None,
                *, horovod: Optional[Mapping[str, Any]] = None, aids: Optional[Mapping[str, Any]] = None,
                traits: Optional[OptimizerTraits] = None) -> "StrategyChoice":
        """The choice made of what the user gave (None values: not given).

        Args:
          communication: a registered name or alias, a Strategy instance, or None (the
            environment's, `environment_default`).
          options: strategy options by name.
          horovod: Horovod's options by name (op, process_set, prescale_factor, postscale_factor).
          aids: `WRAPPER_AIDS` by name (only hvdx's optimizer wrapper passes them).
          traits: the wrapped optimizer's (`hvdx.comm.traits.traits_of`); None: no optimizer.
        Raises:
          TypeError: an option that no registered strategy takes (naming the wrapper's own aids
            where one was given elsewhere), or an unknown aid.
          ValueError: an unknown strategy name; options beside an instance; Horovod's op=Adasum
            or process_set= with a strategy that does not take them.
        """
        options, horovod, aids = _frozen(options), _frozen(horovod), _frozen(aids)
        unknown_aids = sorted(set(aids) - set(WRAPPER_AIDS))
        if unknown_aids:
            raise TypeError(f"unknown aids {unknown_aids}: the optimizer wrapper's aids are {list(WRAPPER_AIDS)}")
        _check_names(options)
        if isinstance(communication, Strategy):
            if options:
                raise ValueError(f"options {sorted(options)} given with the strategy instance {communication!r}: "
                                 "configure the instance itself, e.g. hvdx.comm.HiTopK(density=0.01)")
            if horovod and "op" not in communication.options:
                raise ValueError("op, gradient_predivide_factor and process_set apply to strategies that take them "
                                 f"({registry.takers('op')}); {communication!r} averages over every rank of "
                                 "hvdx.init()'s topology")
            return cls(communication, options, horovod, aids, traits or OptimizerTraits())
        if communication is None:
            key, density = environment_default()
            if density is not None and "density" not in options:
                options = types.MappingProxyType({**options, "density": density})
        else:
            key = registry.resolve_name(communication)
        takes = registry.strategy_class(key).options
        if horovod.get("op") is hvd.Adasum and "op" not in takes:
            raise ValueError(f"op=hvd.Adasum combines gradients pairwise and needs a strategy that takes op "
                             f"({registry.takers('op')}), not communication={key!r}")
        if "process_set" in horovod and "process_set" not in takes:
            raise ValueError(f"process_set= runs on a subset of ranks and needs a strategy that takes it "
                             f"({registry.takers('process_set')}); {key!r} aggregates over every rank of "
                             "hvdx.init()'s topology")
        return cls(key, options, horovod, aids, traits or OptimizerTraits())

    @property
    def strategy_class(self) -> Type[Strategy]:
        """The chosen strategy's class."""
        if isinstance(self.communication, Strategy):
            return type(self.communication)
        return registry.strategy_class(self.communication)

    def defaults(self) -> Dict[str, Any]:
        """What the chosen strategy applies by default for `traits` and the given options and
        aids (`Strategy.defaults_for`); {} for an instance (used as it is)."""
        if isinstance(self.communication, Strategy):
            return {}
        return self.strategy_class.defaults_for(self.traits, {**self.options, **self.aids})

    def aid(self, name: str) -> bool:
        """Whether the wrapper aid `name` (`WRAPPER_AIDS`) is on with the chosen strategy: as
        given, else the strategy's default."""
        if name in self.aids:
            return bool(self.aids[name])
        return bool(self.defaults().get(name, False))

    def build(self, *, strict: bool = True) -> Strategy:
        """The chosen strategy: the instance, or the class built from the given options over
        its defaults, with the Horovod options it takes.

        Args:
          strict: a given option the strategy does not take raises (construction) or is
            dropped (a switch keeps the options that apply).
        Raises:
          ValueError: (strict) an option the strategy does not take, naming the strategies
            that take it; a bad value (from the strategy's constructor).
        """
        if isinstance(self.communication, Strategy):
            return self.communication
        cls = self.strategy_class
        defaults = {k: v for k, v in self.defaults().items() if k in cls.options}
        horovod = {k: v for k, v in self.horovod.items() if k in cls.options}
        return cls.from_options(strict=strict, **{**defaults, **self.options, **horovod})

    def switch(self, communication: Union[str, Strategy], traits: Optional[OptimizerTraits] = None
               ) -> "StrategyChoice":
        """This choice with another strategy: the same options and aids (`build` it with
        strict=False: the options it does not take are dropped), and the same traits, or
        `traits` (the wrapped optimizer's now: its momentum may have been set since).

        Raises:
          ValueError: an unknown name (or not a name nor a Strategy).
        """
        if not isinstance(communication, Strategy):
            communication = registry.resolve_name(communication)
        return dataclasses.replace(self, communication=communication, traits=traits or self.traits)

    def pinned(self, strategy: Strategy, saved: Mapping[str, Any]) -> Dict[str, Any]:
        """What a saved config needs beside `saved` (the strategy's config and the wrapper's
        aids) so that resolving and building it by name gives `strategy` again, not other
        defaults: every option the strategy's `defaults_for` would set on reload, at the value
        `strategy` has (a config omits options at their quiet defaults)."""
        cls = type(strategy)
        given = {k: v for k, v in saved.items() if (k in cls.options or k in WRAPPER_AIDS) and v is not None}
        out: Dict[str, Any] = {}
        while True:
            new = [k for k in cls.defaults_for(self.traits, given) if k not in given]
            if not new:
                return out
            for key in new:
                value = getattr(strategy, key, None) if key in cls.options else self.aid(key)
                given[key] = out[key] = value.name if isinstance(value, tf.DType) else value


def _check_names(options: Mapping[str, Any]) -> None:
    """Every option is one a registered strategy takes (TypeError otherwise)."""
    known = {option for name in registry.names() for option in registry.strategy_class(name).options}
    for option in sorted(set(options) - known):
        if option in WRAPPER_AIDS:
            raise TypeError(f"{option}= is an option of hvdx.DistributedOptimizer: {_AID_HINTS[option]}")
        raise TypeError(f"unexpected option {option}=: no registered strategy takes it (the strategies' options: "
                        f"{', '.join(sorted(known))}; hvdx.comm.registry.takers(option) names who takes one)")
