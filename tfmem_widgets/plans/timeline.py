"""A planned step over its program: the bytes XLA's buffers hold at each point, by Keras layer and phase.

XLA places the program's temporaries in one allocation, taken whole from TensorFlow's allocator when a run
starts; inside it the heap simulator's trace says when each buffer is live (its events follow the program's
instructions in the order they run). ``timeline_of`` replays that trace (plans/hlo._place_changes: buffers
that share a place count once) and keeps the live bytes of the owners that hold the most at any point (a Keras
layer and a phase: plans/owners.py), the rest together, at most ``points`` moments (the peak among them).
StepPlan.plot draws it (views/plans.py) as XProf's memory viewer draws a program.
"""

from __future__ import annotations

from dataclasses import dataclass

REST = "(the rest)"


@dataclass(frozen=True)
class Timeline:
    """The live bytes of the step's temporary allocation at moments of its heap simulator's trace."""

    moments: tuple[int, ...]  # event numbers of the trace (in program order), each a moment below
    series: tuple[tuple[str, tuple[int, ...]], ...]  # (owner "layer: phase", its live bytes at each moment)
    events: int  # how many events the trace has
    peak_moment: int  # the event at which the most bytes are live
    peak_bytes: int  # the most bytes live at once (at most the allocation's size)
    allocation_bytes: int  # the temporary allocation's size, taken whole at the run's start


def _label(key: str, phase: str) -> str:
    return f"{key}: {phase}"


def timeline_of(proto, temp, index, owners, keep: int = 7, points: int = 400) -> Timeline | None:
    """The Timeline of `temp` (hlo.Allocation) from the plan's HloProto; None where its trace is empty. The trace
    is read once into changes (event, owner, bytes taken or given back); a first pass over them finds the peak
    and each owner's most bytes, a second keeps the live bytes at the moments drawn."""
    from . import hlo

    holders: dict = {}
    owner_of_place: dict = {}
    changes: list[tuple[int, str, int]] = []
    for k, taken, place, buffer in hlo._place_changes(proto, temp, holders):
        if taken:
            key = owner_of_place[place] = _label(*owners.of(index.instruction_of(buffer)))
            changes.append((k, key, place[1]))
        elif place in owner_of_place:
            changes.append((k, owner_of_place.pop(place), -place[1]))
    if not changes:
        return None
    live: dict[str, int] = {}
    most: dict[str, int] = {}  # each owner's most bytes live at once: the largest are drawn on their own
    total, best, best_at = 0, -1, 0
    for i, (_, key, n) in enumerate(changes):
        live[key] = live.get(key, 0) + n
        most[key] = max(most.get(key, 0), live[key])
        total += n
        if total > best:
            best, best_at = total, i
    kept = sorted((key for key, n in most.items() if n > 0), key=lambda key: -most[key])[:keep]
    step = max(1, len(changes) // points)
    chosen = set(range(0, len(changes), step)) | {best_at, len(changes) - 1}
    series: dict[str, list[int]] = {key: [] for key in kept}
    rest: list[int] = []
    live, total, moments = {}, 0, []
    for i, (k, key, n) in enumerate(changes):
        live[key] = live.get(key, 0) + n
        total += n
        if i in chosen:
            moments.append(k)
            for owner in kept:
                series[owner].append(max(0, live.get(owner, 0)))
            rest.append(max(0, total - sum(live.get(owner, 0) for owner in kept)))
    out = [(key, tuple(values)) for key, values in series.items()]
    if any(rest):
        out.append((REST, tuple(rest)))
    return Timeline(tuple(moments), tuple(out), changes[-1][0] + 1, changes[best_at][0], best, temp.size)
