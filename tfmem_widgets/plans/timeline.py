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

    def total_at(self, i: int) -> int:
        return sum(values[i] for _, values in self.series)


def _label(key: str, phase: str) -> str:
    return f"{key}: {phase}"


def timeline_of(proto, temp, index, owners, keep: int = 7, points: int = 400) -> Timeline | None:
    """The Timeline of `temp` (hlo.Allocation) from the plan's HloProto; None where its trace is empty."""
    from . import hlo

    holders: dict = {}
    owner_of_place: dict = {}
    live: dict[str, int] = {}
    changes: list[tuple[int, dict[str, int]]] = []
    total, best, best_at, last = 0, -1, 0, 0
    for k, taken, place, buffer in hlo._place_changes(proto, temp, holders):
        if taken:
            key = _label(*owners.of(index.instruction_of(buffer)))
            owner_of_place[place] = key
            live[key] = live.get(key, 0) + place[1]
            total += place[1]
        else:
            key = owner_of_place.pop(place, None)
            if key is None:
                continue
            live[key] -= place[1]
            total -= place[1]
        changes.append((k, dict(live)))
        last = k
        if total > best:
            best, best_at = total, len(changes) - 1
    if not changes:
        return None
    most: dict[str, int] = {}  # each owner's most bytes live at once: the largest are drawn on their own
    for _, now in changes:
        for key, n in now.items():
            most[key] = max(most.get(key, 0), n)
    kept = sorted((key for key, n in most.items() if n > 0), key=lambda key: -most[key])[:keep]
    step = max(1, len(changes) // points)
    chosen = sorted(set(range(0, len(changes), step)) | {best_at, len(changes) - 1})
    series = {key: [] for key in kept}
    rest = []
    for i in chosen:
        now = changes[i][1]
        for key in kept:
            series[key].append(max(0, now.get(key, 0)))
        rest.append(max(0, sum(n for key, n in now.items() if key not in series)))
    out = [(key, tuple(values)) for key, values in series.items()]
    if any(rest):
        out.append((REST, tuple(rest)))
    return Timeline(tuple(changes[i][0] for i in chosen), tuple(out), last + 1, changes[best_at][0], best,
                    temp.size)
