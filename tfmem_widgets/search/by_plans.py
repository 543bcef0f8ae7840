"""What a plan search's plans say away from its edge: the limit a batch needs and the largest batch a
limit holds, each plan placed in the pool as the probes' fits place it (the fit's data beside the step).

The plans were compiled at a few batches; between and beyond them a plan is drawn through the two nearest
(plans/scaled.py: each allocation on the line through its bytes in the two), or scaled by its own shapes
where the two were laid out otherwise. The pool's regions and the no-split rule are then worked out for
that plan at the limit asked (StepPlan.fits), which a straight line through peaks cannot know.
"""

from __future__ import annotations

from ..plans.scaled import planned_between, planned_by_shapes

TOP_BATCH = 1 << 22  # the largest batch a limit is searched up to


def plan_at(plans: list, batch: int):
    """The plan at `batch`: the one compiled there, else drawn through the two nearest (one on each side
    where there are), else scaled from the nearest; None without plans."""
    by_batch = {p.batch_size: p for p in plans}
    if not by_batch:
        return None
    if batch in by_batch:
        return by_batch[batch]
    below = [b for b in by_batch if b < batch]
    above = [b for b in by_batch if b > batch]
    pair = ([max(below), min(above)] if below and above else
            sorted(by_batch, key=lambda b: abs(b - batch))[:2])
    drawn = planned_between(by_batch[pair[0]], by_batch[pair[-1]], batch) if len(pair) == 2 else None
    return drawn or planned_by_shapes(by_batch[pair[0]], batch)


def held_beside(planned, share: float) -> tuple[int, ...]:
    """What the fit holds on the device beside the plan's step: its data's share of each input."""
    return tuple(int(size * share) for size in planned.batch_sizes) if share else ()


def need_by_plans(plans: list, share: float, batch: int) -> int | None:
    """The least limit `batch` trains under by the plans (a MiB's precision), None where none can be drawn."""
    planned = plan_at(plans, batch)
    return None if planned is None else planned.least_limit_bytes(held_beside(planned, share))


def batch_by_plans(plans: list, share: float, limit_bytes: int) -> int | None:
    """The largest batch the plans fit under `limit_bytes` (0: not one row), None where none can be drawn."""
    def fits(batch: int) -> bool | None:
        planned = plan_at(plans, batch)
        return None if planned is None else planned.fits(limit_bytes, held_beside(planned, share))

    first = fits(1)
    if first is None:
        return None
    if not first:
        return 0
    ok, bad = 1, 2
    while bad <= TOP_BATCH and fits(bad):
        ok, bad = bad, bad * 2
    if bad > TOP_BATCH:
        return ok
    while bad - ok > 1:
        middle = (ok + bad) // 2
        if fits(middle):
            ok = middle
        else:
            bad = middle
    return ok
