"""A plan at another batch without a compile: from one plan's shapes, or between two plans.

A step's buffers are near-linear in the batch while XLA lays the program out the same way, so a plan
says what XLA would plan at another batch: ``planned_by_shapes`` scales each of its buffers that has
an axis of the batch (hlo.batch_profile), ``planned_between`` draws each allocation on the line
through two plans. Both are for aiming a search's next compile (plans/largest.py), never reported:
where the layout changes they miss.
"""

from __future__ import annotations

from dataclasses import replace

from ..tf.allocator import rounded, worst_take
from . import hlo
from .plan import StepPlan


def planned_by_shapes(planned: StepPlan, batch: int) -> StepPlan | None:
    """The plan at `batch` as one plan's own shapes say: each of its allocations at that batch by its
    batch_profile (hlo.py: the buffers with an axis of the batch scaled, the others as they are), the
    inputs in proportion to their rows. Near the plan compiled there while XLA lays the program out the
    same way, off where the layout changes: for aiming only, never reported. None where the plan has no
    profile."""
    profiles = planned.step_profiles
    if not profiles or len(profiles) != len(planned.step_allocations) or not all(profiles):
        return None
    ratio = batch / planned.batch_size
    allocations = tuple(sorted((hlo.bytes_at(size, profile, ratio)
                                for size, profile in zip(planned.step_allocations, profiles)), reverse=True))
    inputs = tuple(size // planned.batch_size * batch for size in planned.batch_sizes)
    return replace(planned, batch_size=batch, step_allocations=allocations, step_profiles=(),
                   step_bytes=sum(rounded(x) for x in allocations), worst_take_bytes=sum(worst_take(x) for x in allocations),
                   batch_sizes=inputs, batch_bytes=sum(inputs), notes=(f"the plan at {planned.batch_size:,} scaled",))


def clear_of_widths(batch: int, widths: frozenset[int], lowest: int) -> int:
    """The largest batch from `lowest` to `batch` whose plan tells its batch axis from the model's widths
    (at 512 rows a Dense layer's activations are shaped as its 512-by-1024 kernel); `batch` where none
    within 64 below it does."""
    for candidate in range(batch, max(lowest, batch - 64) - 1, -1):
        if hlo.told_apart(candidate, widths):
            return candidate
    return batch


def edge_by_shapes(planned: StepPlan, fits, low: int, high: int) -> int | None:
    """The largest batch from `low` to `high` whose plan by `planned`'s shapes fits (low - 1: none);
    None where the plan has no profile."""
    if planned_by_shapes(planned, low) is None:
        return None
    if fits(planned_by_shapes(planned, high)):
        return high
    ok, bad = low - 1, high
    while bad - ok > 1:
        middle = (ok + bad) // 2
        if fits(planned_by_shapes(planned, middle)):
            ok = middle
        else:
            bad = middle
    return ok


def planned_between(a: StepPlan, b: StepPlan, batch: int) -> StepPlan | None:
    """The plan at `batch` as two planned ones of the same program say: each of the step's allocations
    (by rank, largest first) on the line through its bytes in the two, the batch's bytes in proportion
    to its rows; None where the two differ in their number of allocations or inputs (XLA laid the
    programs out otherwise). A step's buffers are near-linear in the batch between two near batches,
    not its fit: where the pool's regions or the no-split rule decide, StepPlan.fits of this plan
    says where the edge falls between them without a compile. For aiming only, never reported."""
    if (len(a.step_allocations) != len(b.step_allocations) or len(a.batch_sizes) != len(b.batch_sizes)
            or a.batch_size == b.batch_size):
        return None
    t = (batch - a.batch_size) / (b.batch_size - a.batch_size)
    allocations = tuple(sorted((max(1, round(x + (y - x) * t)) for x, y in zip(a.step_allocations, b.step_allocations)),
                               reverse=True))
    inputs = tuple(size // a.batch_size * batch for size in a.batch_sizes)
    return replace(a, batch_size=batch, step_allocations=allocations, step_profiles=(),
                   step_bytes=sum(rounded(x) for x in allocations),
                   worst_take_bytes=sum(worst_take(x) for x in allocations), batch_sizes=inputs, batch_bytes=sum(inputs),
                   notes=(f"between the plans at {a.batch_size:,} and {b.batch_size:,}",))


def edge_between(plans: dict[int, StepPlan], lo: int, hi: int, fits) -> int | None:
    """The largest batch from lo (fits) to below hi (does not) whose plan between the two fits
    (planned_between); None where the two cannot be drawn between."""
    low, high = plans[lo], plans[hi]
    if planned_between(low, high, lo) is None:
        return None
    ok, bad = lo, hi
    while bad - ok > 1:
        middle = (ok + bad) // 2
        if fits(planned_between(low, high, middle)):
            ok = middle
        else:
            bad = middle
    return ok
