"""Ranks must agree on what they aggregate; hvdx checks it once per layout, collectively.

Every rank of a job fuses its gradients into buckets and runs the same collectives on them.
If one rank's gradient is None where another's is not, or its buffer has another length,
another density or another strategy, Horovod either mixes unrelated numbers silently or
waits for ever. Whoever issues the collectives (the aggregator for a whole step, a
strategy called directly on a buffer) describes each new layout as a flat dict of strings
and `check_agreement` all-gathers the descriptions (once per layout, not per step: it is a
collective) and raises `RankMismatchError` on every rank, naming the ranks that differ from
the lowest rank and how. Layout checks share one collective name (`AGREEMENT`), so two ranks
that reach different checks still meet and compare, rather than wait for each other.
"""
from __future__ import annotations

from typing import Any, Dict, List, Set

import horovod.tensorflow as hvd
import tensorflow as tf

__all__ = ["AGREEMENT", "Agreed", "RankMismatchError", "check_agreement", "checks_made", "describe_differences"]

#: The collective name of the layout checks of the aggregator and the strategies.
AGREEMENT = "hvdx.agreement"
_checks_made = 0


class Agreed:
    """The layouts the ranks of one membership checked (`check_agreement`): empty again under
    another membership (Elastic Horovod's reset, `hvdx.topology.reinit`), whose ranks, the
    survivors with the added ones, must check again together."""

    def __init__(self) -> None:
        self._layouts: Set[Any] = set()
        self._membership: Any = None

    def under(self, membership: Any) -> Set[Any]:
        """The set of layouts agreed under `membership` (a `Topology`, or None before
        `hvdx.init()`); the caller adds what it checked."""
        if membership is not self._membership:
            self._layouts, self._membership = set(), membership
        return self._layouts


def checks_made() -> int:
    """How many agreement collectives this process has made (diagnostics and tests: a
    layout is checked once, whoever aggregates it)."""
    return _checks_made


class RankMismatchError(ValueError):
    """Ranks disagree on the layout or options of a collective step."""


def describe_differences(descriptions: List[Dict[str, str]], ranks: List[int]) -> List[str]:
    """One line per rank whose description differs from the first rank's, naming each field."""
    reference, lines = descriptions[0], []
    for rank, mine in zip(ranks[1:], descriptions[1:]):
        fields = [f"{key}={mine.get(key, '<missing>')} (rank {ranks[0]}: {reference.get(key, '<missing>')})"
                  for key in sorted(set(reference) | set(mine)) if mine.get(key) != reference.get(key)]
        if fields:
            lines.append(f"rank {rank}: " + "; ".join(fields))
    return lines


def check_agreement(description: Dict[str, str], what: str, name: str = AGREEMENT,
                    process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
    """Collective: raises RankMismatchError on every rank of `process_set` unless all of them
    pass the same `description`. Runs eagerly, also while a tf.function is being traced.

    Args:
      description: what this rank is about to do, field -> value.
      what: names the step in the message ("the gradients to aggregate").
      name: the collective's name: the same on every rank (never a per-rank counter).
      process_set: the ranks that must agree.
    Raises:
      RankMismatchError: on every rank, one line per rank that differs from the lowest.
    """
    global _checks_made
    with tf.init_scope():
        if not tf.executing_eagerly():  # a TF1-style graph: no collective can run before its session
            return
        _checks_made += 1
        gathered = hvd.allgather_object((hvd.rank(), dict(description)), name=name, process_set=process_set)
    ranks = [rank for rank, _ in gathered]
    lines = describe_differences([d for _, d in gathered], ranks)
    if lines:
        raise RankMismatchError(
            f"hvdx: the ranks disagree on {what}; every rank must aggregate the same gradients "
            "(same variables, shapes and dtypes, no gradient None on some ranks only) with the same "
            "options:\n  " + "\n  ".join(lines))
