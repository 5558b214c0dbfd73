"""What the ranks' progress says, in a user's words: the watchdog's reports (`hvdx.watchdog`).

A rank's state is what its watchdog answers on the side channel, a JSON-able dict:

- "rank": its global rank;
- "counts": [[label, detail, entered, left], ...], its collective calls (`hvdx.progress`):
  strategy, buffer, calls begun, calls completed;
- "where": where its main thread is (the innermost frames of the user's code and hvdx's);
- "waited": seconds it has waited in a collective call without progress (None: in none);
- "exited": whether it is the state the rank left when it exited.

A rank that did not answer has no state (None). Pure functions: no I/O, no TensorFlow.
"""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["State", "calls", "inside", "mismatch_report", "ranks_text", "stall_report"]

State = Mapping[str, object]
Key = Tuple[str, str]

#: Where the watchdog is documented, for the reports' last line.
DOCS = "docs/comm.md, 'The progress watchdog'"


def ranks_text(ranks: Sequence[int]) -> str:
    """"rank 1" or "ranks 0, 2, 3"."""
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _counts(state: State) -> Dict[Key, Tuple[int, int]]:
    return {(str(label), str(detail)): (int(entered), int(left))
            for label, detail, entered, left in state.get("counts", ())}  # type: ignore[union-attr]


def calls(states: Mapping[int, Optional[State]]) -> Dict[Key, Dict[int, Tuple[int, int]]]:
    """(label, detail) -> {rank: (entered, left)} over the ranks that answered; a rank that
    answered without a counter has (0, 0) for it."""
    answered = {rank: _counts(state) for rank, state in states.items() if state is not None}
    keys = sorted({key for counts in answered.values() for key in counts})
    return {key: {rank: counts.get(key, (0, 0)) for rank, counts in answered.items()} for key in keys}


def inside(table: Mapping[Key, Mapping[int, Tuple[int, int]]], rank: int) -> List[Key]:
    """The collective calls `rank` is inside (began more than it completed) in `calls`' table."""
    return [key for key, per_rank in table.items()
            if per_rank.get(rank, (0, 0))[0] > per_rank.get(rank, (0, 0))[1]]


def _call_name(key: Key) -> str:
    label, detail = key
    return f"collective {label!r} on buffer {detail!r}" if detail else f"collective {label!r}"


def _by_value(values: Mapping[int, int]) -> List[Tuple[int, List[int]]]:
    """(value, ranks with it), the most common value last."""
    groups: Dict[int, List[int]] = {}
    for rank, value in sorted(values.items()):
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda item: (len(item[1]), -item[0]))


def _disagreements(table: Dict[Key, Dict[int, Tuple[int, int]]], states: Mapping[int, Optional[State]],
                   inside_verb: str = "wait") -> List[str]:
    """One paragraph per collective call the ranks are not level on (someone is inside it, or
    the ranks began different numbers of calls), naming who is where; `inside_verb` says what
    the ranks inside a call do there ("wait", or "failed" after an error)."""
    lines = []
    for key, per_rank in table.items():
        entered = {rank: e for rank, (e, _) in per_rank.items()}
        inside = {rank: e for rank, (e, left) in per_rank.items() if e > left}
        if not inside and len(set(entered.values())) <= 1:
            continue
        parts = []
        for calls_begun, ranks in _by_value(inside):
            verb = inside_verb + ("s" if len(ranks) == 1 and inside_verb == "wait" else "")
            parts.append(f"{ranks_text(ranks)} {verb} in call {calls_begun}")
        outside = {rank: e for rank, e in entered.items() if rank not in inside}
        for done, ranks in _by_value(outside):
            exited = [r for r in ranks if (states.get(r) or {}).get("exited")]
            state = ("exited" if exited and len(exited) == len(ranks)
                     else "are not in it" if len(ranks) > 1 else "is not in it")
            parts.append(f"{ranks_text(ranks)} completed {done} call{'s' if done != 1 else ''} and {state}")
        line = f"{_call_name(key)}: " + "; ".join(parts)
        groups = _by_value(entered)
        if len(groups) > 1:
            usual, usual_ranks = groups[-1]
            odd = "; ".join(f"{ranks_text(r)} ran {n} call{'s' if n != 1 else ''}" for n, r in groups[:-1])
            others = "the others" if len(usual_ranks) > 1 else ranks_text(usual_ranks)
            line += f". {odd[0].upper()}{odd[1:]}, {others} {usual}"
        lines.append(line)
    return lines


def _where(rank: int, state: Optional[State], table: Dict[Key, Dict[int, Tuple[int, int]]]) -> str:
    if state is None:
        return f"rank {rank}: did not answer (it exited or died, or its process is stopped)"
    waiting_in = inside(table, rank)
    where = state.get("where") or "unknown"
    if state.get("exited"):
        return f"rank {rank}: exited (last at {where})"
    if waiting_in:
        waited = state.get("waited")
        how_long = f" for {float(waited):.1f} s" if waited is not None else ""  # type: ignore[arg-type]
        return f"rank {rank}: waiting{how_long} in {', '.join(_call_name(k) for k in waiting_in)}, at {where}"
    return f"rank {rank}: in no hvdx collective, at {where}"


def _places(states: Mapping[int, Optional[State]], table: Dict[Key, Dict[int, Tuple[int, int]]]) -> List[str]:
    """Each rank's place (`_where`), ranks at the same place in one line ("ranks 0, 2, 3: ...")."""
    by_text: Dict[str, List[int]] = {}
    for rank in sorted(states):
        text = _where(rank, states[rank], table).split(": ", 1)[1]
        by_text.setdefault(text, []).append(rank)
    return [f"{ranks_text(ranks)}: {text}" for text, ranks in sorted(by_text.items(), key=lambda item: item[1][0])]


def stall_report(states: Mapping[int, Optional[State]], size: int, timeout: float, reporter: int) -> str:
    """The watchdog's report of a stall that rank `reporter` found (it waited in a collective
    call for more than `timeout` s without progress): a headline naming the ranks and the
    collective calls they are not level on, each rank's place, and what to do."""
    states = {rank: states.get(rank) for rank in range(size)}
    table = calls(states)
    mine = states.get(reporter) or {}
    where = ", ".join(f"{_call_name(k)} (call {table[k][reporter][0]})" for k in inside(table, reporter)) \
        or "a collective call"
    waited = float(mine.get("waited") or timeout)  # type: ignore[arg-type]
    lines = [f"hvdx watchdog: the job stopped making progress: rank {reporter} waited "
             f"{waited:.1f} s in {where}, longer than the bound of {timeout:g} s "
             "(HVDX_STALL_TIMEOUT_SECONDS or hvdx.init(stall_timeout=...)). Ending the job."]
    lines += ["  " + line for line in _disagreements(table, states)]
    lines += ["  " + line for line in _places(states, table)]
    lines.append("  Every rank must make the same collective calls in the same order: run the same number of "
                 "steps on every rank (the same number of batches, the same strategy calls), and keep a rank's "
                 "time outside hvdx's collectives (a step, an evaluation, a checkpoint) under the bound. "
                 f"See {DOCS}.")
    return "\n".join(lines) + "\n"


def mismatch_report(states: Mapping[int, Optional[State]], size: int, error: str) -> Optional[str]:
    """What a Horovod error (`error`, its first line) means where the ranks' counters
    disagree: which ranks ran how many calls of which collective. None when every rank that
    answered is level on every call (hvdx cannot tell the cause)."""
    states = {rank: states.get(rank) for rank in range(size)}
    table = calls(states)
    lines = _disagreements(table, states, inside_verb="failed")
    if not lines:
        return None
    head = (f"hvdx: the ranks did not make the same collective calls, which is what Horovod's error "
            f"({error}) comes from:")
    silent = [rank for rank, state in states.items() if state is None]
    tail = [f"  {ranks_text(silent)} did not answer (exited or died)"] if silent else []
    return "\n".join([head] + ["  " + line for line in lines] + tail + [
        "  Run the same number of steps (and strategy calls) on every rank, e.g. the same number of batches "
        f"per rank. See {DOCS}."]) + "\n"
