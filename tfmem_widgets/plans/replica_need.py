"""An OOM in a Keras fit under MirroredStrategy told in terms of its replicas: the plan of each replica's share
at the fit's global batch (``plan()``, plans/replicas.py) and the largest global batch whose plan fits the limit.

The plans are ``plan()``'s of the fit's own model and data (the arrays' shapes, ``FitContext.data``), made in
this process after the OOM: each copies the model onto the first replica's device without the strategy, plans one
replica's step and gives the copy back. On a GPU that copy is made beside what the fit still holds; where it is
refused, the need says so and how to plan in a new process. The replicas' plans are estimates (a graph step
each, the all-reduce's buffers assumed), so the batch is searched to 2% and a probe confirms it.
"""

from __future__ import annotations

import time

from ..errors import ArgumentError
from .need import StepNeed

RESOLUTION = 0.02  # the search stops where the failing batch is within 2% above the fitting one


def replica_need(fit, limit_bytes: int | None, *, seconds: float) -> StepNeed:
    """The replicas' planned peak at the fit's global batch and the largest global batch whose plan fits
    `limit_bytes` (the plan's own limit where None: the busiest replica's device's, or the shared pool's)."""
    import tensorflow as tf

    from .plan import plan

    sample = fit.data if fit.data is not None else fit.sample
    started = time.perf_counter()
    plans: dict[int, object] = {}

    def planned(batch: int):
        if batch not in plans:
            plans[batch] = plan(fit.model, sample, batch)
        return plans[batch]

    try:
        failing = planned(fit.batch_size)
    except ArgumentError as exc:
        return StepNeed(fit.batch_size, note=f"the replicas could not be planned: {str(exc).removeprefix('plan: ')}")
    except tf.errors.ResourceExhaustedError:
        return StepNeed(fit.batch_size, source="replica plan", note=(
            f"the replicas' plan copies the model onto the first replica's device, and beside what the fit still "
            f"holds that copy was refused: plan it in a new process (%%tfmem fresh, then tfmem_widgets.plan(model, "
            f"(x, y), {fit.batch_size:,}))"))
    limit = failing.limit_bytes if limit_bytes is None else limit_bytes
    need = StepNeed(fit.batch_size, failing.peak_bytes, _resident(failing), limit, plans=1, estimate=True,
                    source="replica plan", plan=failing)
    if limit is None:
        return _done(need, plans, started, note="the devices' limit is not known: no batch can be said to fit")
    if failing.fits(limit):
        return _done(need, plans, started, fits=fit.batch_size, note=(
            "the replicas' plan fits a fresh process at this batch: what this process held before the fit did not, "
            "or the step took more than its plan (a graph step on each replica)"))
    n = fit.replicas  # (global batches that divide by the replicas: Keras' fit refuses others, ReplicaPlan.uneven)
    try:
        fits, fails = _search(lambda rows: planned(rows * n), limit, 1, -(-fit.batch_size // n), failing.peak_bytes,
                              started + seconds)
        fits, fails = (fits and fits * n), fails * n
    except tf.errors.ResourceExhaustedError:
        fits, fails = None, None
    stopped = "" if fails is None or fits is None or fails - fits <= max(1, fits * RESOLUTION) else (
        f"the plans stopped after {seconds:.0f} s: the edge lies between {fits:,} and {fails:,}")
    return _done(need, plans, started, fits=fits, fails=fails, note=stopped)


def _search(planned, limit: int, low: int, high: int, high_peak: int, deadline: float) -> tuple[int | None, int]:
    """(the most rows per replica planned to fit, the fewest planned not to above it) between `low` and `high`
    (which does not fit), planned(rows) the replicas' plan at that many rows each: aimed along the line through
    the two nearest plans, each aim followed by a plan 2% past it on the other side, so a nearly straight line is
    bracketed in a few plans."""
    at_low = planned(low)
    if not at_low.fits(limit):
        return None, low
    ends = {True: (low, at_low.peak_bytes), False: (high, high_peak)}  # fits -> (batch, planned peak)

    def close() -> bool:
        return ends[False][0] - ends[True][0] <= max(1, int(ends[True][0] * RESOLUTION))

    while not close() and time.perf_counter() < deadline:
        (lo, lo_peak), (hi, hi_peak) = ends[True], ends[False]
        per_row = (hi_peak - lo_peak) / (hi - lo)
        aim = lo + int((limit - lo_peak) / per_row) if per_row > 0 else (lo + hi) // 2
        for _ in range(2):
            aim = min(max(aim, ends[True][0] + 1), ends[False][0] - 1)
            at = planned(aim)
            side = bool(at.fits(limit))
            ends[side] = (aim, at.peak_bytes)
            if close() or time.perf_counter() >= deadline:
                break
            step = max(1, int(aim * RESOLUTION))
            aim = aim + step if side else aim - step  # (the other side of the edge, if the line aimed well)
    return ends[True][0], ends[False][0]


def _resident(planned) -> int:
    """The variables the limit is judged with: every replica's in a shared pool, else the busiest's."""
    if planned.shared_pool:
        return sum(r.resident_bytes for r in planned.replicas)
    return planned.busiest.resident_bytes


def _done(need: StepNeed, plans: dict, started: float, *, fits: int | None = None, fails: int | None = None,
          note: str = "") -> StepNeed:
    from dataclasses import replace

    return replace(need, fits_batch=fits, fails_batch=fails, plans=len(plans), seconds=time.perf_counter() - started,
                   note=note)
