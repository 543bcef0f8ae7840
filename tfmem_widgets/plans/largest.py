"""What fits, from plans: the largest batch whose planned step fits the limit, in a few compiles.

A step's bytes are close to linear in the batch, but not quite (the largest moment's live set
changes: a Dense model's step grows 6.3 KB a row at 64-256 rows and 12.4 KB at 4,096), so a line
through small batches misaims. One plan says more than its bytes: its buffers' shapes say which grow
with the batch (``planned_by_shapes``: each buffer with an axis of the batch scaled, the heap
simulator's trace replayed), and that is XLA's plan at another batch while the program keeps its
layout. So the first plan, at a prime number of rows (its batch axis told from a layer's width),
aims the second at the edge, and the answer's own shapes say whether a step past it fits: in lab
mode 2-3 compiles where lines through plans took 10. Where XLA lays a larger program out otherwise (a
Dense step on the CPU took 26% more from 4,000 to 4,100 rows), the failing plan's shapes aim below
it, and once two plans of the same layout bracket the edge, the plans between them
(``planned_between``) say where it falls. A batch fits when its plan does (``StepPlan.fits``: the
peak within the limit and, where the pool grows, each of the step's allocations finding room).

A batch search runs this in a fresh process and confirms its answer by probes (search/plan_first.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ..errors import ArgumentError
from .hlo import told_apart, widths_of
from .plan import StepPlan, plan, slots_shared_by_fit
from .scaled import clear_of_widths, edge_between, edge_by_shapes, planned_between


@dataclass
class PlanSearch:
    """The plans of a search and the largest batch that fits by them."""

    batch: int | None  # the largest batch planned to fit (None: not even `low`)
    failure: int | None  # the smallest batch planned not to fit above it
    plans: list[StepPlan] = field(default_factory=list)
    seconds: float = 0.0
    jit_compile: bool | None = None
    limit_bytes: int | None = None
    limit_source: str = ""
    notes: list[str] = field(default_factory=list)
    # `failure`'s plan, where its bytes alone (the step's peak with what the process holds besides) exceed the
    # limit and the program compiles the same in any process (no autotuner): a step never takes less than its
    # plan, so that batch cannot train, probe or not. None where the pool's regions or an autotuner decide.
    proven_failure: int | None = None
    proven_bytes: int | None = None


# The first plan's batch (or `low`, where that is more): a prime, so its batch axis is told from a layer's width
# in its shapes (hlo.batch_profile; at 512 rows a Dense layer's activations are shaped as its 512-by-1024 kernel).
FIRST_PLAN = 509


def largest_planned_batch(model, sample, limit_bytes: int | None = None, *, low: int = 1, high: int = 65536,
                          resolution: float = 0.02, max_plans: int = 14, held=lambda plan: (),
                          closing_plan: bool = True, fit_start=None, closing=None,
                          fit_builds_slots: bool = False) -> PlanSearch:
    """The largest batch from `low` to `high` whose planned step fits `limit_bytes` (None: the
    device's limit), to within `resolution` (a fraction of the batch). held(plan): what the process
    holds besides the step at that plan's batch (the fit's data where it sits on the device).
    The first plan is at FIRST_PLAN rows (`low` where more, or where that one does not fit); a batch
    below a plan that fits is taken to fit (a step's bytes grow with the batch).
    Each plan is aimed by the shapes of the largest that fits (``_aim_by_shapes``), else by the
    plans between the two that bracket the edge, else by lines through plans.
    closing_plan=False: no plan past the answer where its own shapes, or the plans between the two that
    bracket the edge, say it fails there (a probe past the answer, run beside the answer's, is the
    check): `failure` is then the bracket's upper plan (None where none was planned above), and a note
    says so. The answer is always a plan's: across brackets of up to twice the batch the plans between
    missed the real plans' edge by 1-10% in lab mode at limits of 96-256 MB, and a plan's shapes miss
    where the layout changes, so they aim the next plan, never answer. fit_start: the pool a fresh
    process's fit meets at its first step (search/fit_start.py), carried by each plan: fits() replays it.
    closing(batch): called before the plan at `batch` compiles where, if it fits, the search ends at it (a
    plan above it failed within its step, not proven to fail by its bytes alone): a caller may begin that
    batch's probes, and the one past it, meanwhile.
    fit_builds_slots: the fit each plan stands for builds the optimizer's slots itself (a fresh process's,
    where build_model() left them unbuilt): its first step as plan.slots_shared_by_fit says."""
    started = time.perf_counter()
    plans: dict[int, StepPlan] = {}
    notes: list[str] = []

    def at(batch: int) -> StepPlan | None:
        if batch not in plans:
            try:
                planned = plan(model, sample, batch)
                shared = slots_shared_by_fit(model, planned) if fit_builds_slots else ()
                plans[batch] = replace(planned, fit_start=fit_start, shared_slots=shared)
            except ArgumentError as exc:  # XLA could not compile it (an autotuner without room): not fitting
                notes.append(f"batch {batch:,}: {str(exc).removeprefix('plan: ')}")
                return None
        return plans[batch]

    start = min(high, max(low, FIRST_PLAN))
    widths = widths_of(model)  # the weights' (an optimizer's slots, built by the first plan, are shaped as they are)
    start = next((b for b in range(start, min(high, start + 64) + 1) if told_apart(b, widths)), start)
    first = at(start)
    refused = None  # the first plan's batch where XLA could not compile it: not fitting, an upper bound
    if first is None and start > low:
        refused, start, first = start, low, at(low)
    if first is None:
        raise ArgumentError(notes[-1] if notes else "plan: the step could not be planned.")
    limit = first.limit_bytes if limit_bytes is None else limit_bytes
    if limit is None:
        raise ArgumentError("the device's limit is not known: pass limit_bytes.")

    def fits(batch: int) -> bool:
        planned = at(batch)
        return planned is not None and planned.fits(limit, held(planned))

    def step(batch: int) -> int:
        return max(1, math.ceil(batch * resolution))

    needs = _least_limits(held)
    lo, hi = (start, refused) if fits(start) else (None, start)
    if lo is None and start > low:
        lo, hi = (low, start) if fits(low) else (None, low)

    def judge(planned: StepPlan) -> bool:
        return planned.fits(limit, held(planned))

    def cleared(aim: int | None) -> int | None:
        """The aim, or just below it where its plan could not tell its batch axis (its shapes would aim
        nothing)."""
        if aim is None or aim >= high:
            return aim
        better = clear_of_widths(aim, widths, lo + 1)
        return better if better not in plans else aim

    def next_aim() -> int | None:
        """The next batch to plan; None where the search stops (a note says why, where it is not the end)."""
        shaped = _aim_by_shapes(plans, lo, hi, high, step(lo), judge)
        past = min(high, lo + step(lo))
        if shaped == CLOSED:  # lo's own buffers, scaled to a step past it, do not fit
            if not closing_plan:
                notes.append(f"the plan at {lo:,}, its buffers scaled to {past:,} rows, does not fit: not planned "
                             "there, the probe past the answer is the check")
                return None
            return past if past not in plans else None
        if shaped is not None:
            return shaped
        if hi is None:
            return _aim_from_resident(plans[lo], limit, high, needs) if len(plans) == 1 else \
                _next_aim(plans, lo, hi, limit, high, need=needs)
        # (within twice lo only, where they put the edge as closing plans did in the benchmark on the H100 and
        # in lab mode; at other limits they missed by a few percent: the probe past the answer is the check)
        between = planned_between(plans[lo], plans[hi], past) if hi in plans and hi <= 2 * lo and not closing_plan \
            else None
        if between is not None and not judge(between):
            notes.append(f"the plans between {lo:,} and {hi:,} put the edge below {past:,}: not planned there, "
                         "the probe past the answer is the check")
            return None
        aim = _aim_between(plans, lo, hi, resolution, judge)
        return aim if aim is not None else _next_aim(plans, lo, hi, limit, high, need=needs)

    aim = None
    if lo is not None and (lo < high if hi is None else hi - lo > step(lo)):
        aim = cleared(next_aim())
    def proven(planned: StepPlan | None) -> int | None:
        """A failing plan's bytes alone (the step's peak with what the process holds besides), where they
        exceed the limit and the program compiles the same in any process (no autotuner): a step never
        takes less than its plan, so that batch cannot train, probe or not. None where the pool's
        regions or an autotuner decide."""
        if planned is None or not planned.same_program_anywhere or planned.estimate:
            return None
        need = planned.peak_bytes + sum(held(planned))
        return need if need > limit else None

    while aim is not None and len(plans) < max_plans:
        if closing is not None and hi is not None and aim < high and hi - aim <= step(aim) and \
                proven(plans.get(hi)) is None:
            closing(aim)  # if it fits, it is the answer (and the batch past it is to be probed: not proven)
        if fits(aim):
            lo = aim
            if aim >= high:
                break
        else:
            hi = aim
        if hi is not None and hi - lo <= step(lo):
            break
        aim = cleared(next_aim())
    seconds = time.perf_counter() - started
    found = PlanSearch(lo, hi, sorted(plans.values(), key=lambda p: p.batch_size), seconds,
                       first.jit_compile, limit, first.limit_source if limit_bytes is None else "given", notes)
    need = proven(plans.get(hi)) if hi is not None else None
    if need is not None:
        found.proven_failure, found.proven_bytes = hi, need
    return found


def _aim_from_resident(first: StepPlan, limit: int, high: int, need) -> int:
    """After one plan, which fits: where the line from the model's resident bytes at batch 0 through the
    plan's least limit meets `limit`, at least twice its batch. The line's slope carries the step's
    fixed bytes, so it aims short where those rule; the lines through two plans aim on from there."""
    rise = need(first) - first.resident_bytes
    batch = first.batch_size
    aim = batch * (limit - first.resident_bytes) // rise if rise > 0 else 16 * batch
    return min(high, max(2 * batch, int(aim)))


CLOSED = -1  # _aim_by_shapes: the plan at lo, scaled a step past it, does not fit


def _aim_by_shapes(plans: dict[int, StepPlan], lo: int, hi: int | None, high: int, step: int, fits) -> int | None:
    """The next batch to plan by the shapes of the plan at lo (fits): the largest batch its buffers,
    scaled, say fits, below hi. CLOSED where that is less than lo's step past it. Where hi's plan fails
    although lo's shapes say it fits (XLA laid the larger program out otherwise), by hi's shapes: the
    largest batch between the two that fits in hi's layout (it fits in either). None where neither
    tells (no profile, an aim planned already, nothing past lo's step)."""
    top = high if hi is None else hi - 1
    edge = edge_by_shapes(plans[lo], fits, lo, top) if lo < top else lo
    if edge is not None and edge < lo + step:
        return CLOSED
    if hi is None and edge == top and top > 16 * lo:
        # nothing fails by lo's shapes: sixteen times lo at most (where a GPU pads the batch of a
        # half-precision product to a multiple of 8, a 509-row plan's activations read as fixed)
        return 16 * lo if 16 * lo not in plans else None
    if edge is None or (hi is not None and edge >= top):
        edge = edge_by_shapes(plans[hi], fits, lo + 1, top) if hi in plans and lo + 1 <= top else None
        if edge is None or edge < lo + step:
            return None
    return edge if edge not in plans else None


def largest_below(model, sample, above: StepPlan, limit_bytes: int, *, resolution: float = 0.02,
                  max_plans: int = 10, seconds: float | None = None, held=lambda plan: (),
                  regions: bool | None = None, planner=plan) -> PlanSearch:
    """The largest batch below `above` (a plan at a batch that does not fit) whose plan fits
    `limit_bytes`, to within `resolution`; each aim is by the shapes of `above` (planned_by_shapes:
    the largest batch they say fits), then of the plans made, else where the line through the
    model's resident bytes (at batch 0) and a failing plan's peak meets the limit. `seconds` bounds the search:
    what is known by then is returned (each plan is a compile: about a second in lab mode, 10-30 s
    on a GPU). held(plan): what the process holds besides the step at that plan's batch (a fit's data);
    regions: as StepPlan.fits; planner: plan, or one that plans elsewhere (plans/need.py's CPU copy)."""
    started = time.perf_counter()
    plans: dict[int, StepPlan] = {above.batch_size: above}
    notes: list[str] = []

    def fits(batch: int) -> bool:
        if batch not in plans:
            try:
                plans[batch] = planner(model, sample, batch)
            except ArgumentError as exc:
                notes.append(f"batch {batch:,}: {str(exc).removeprefix('plan: ')}")
                return False
        return plans[batch].fits(limit_bytes, held(plans[batch]), regions)

    needs = _least_limits(held, regions)

    def judge(planned: StepPlan) -> bool:
        return planned.fits(limit_bytes, held(planned), regions)

    widths = widths_of(model)
    lo, hi = None, above.batch_size
    if above.fits(limit_bytes, held(above), regions):
        lo, hi = above.batch_size, None
    while hi is not None and hi > 1 and len(plans) <= max_plans:
        if seconds is not None and time.perf_counter() - started >= seconds:
            notes.append(f"stopped after {seconds:.0f} s of plans")
            break
        shaped = None
        if lo is None:  # the largest batch below hi that fits by hi's own shapes (exact in its layout)
            shaped = edge_by_shapes(plans[hi], judge, 1, hi - 1)
        elif hi - lo > max(1, math.ceil(lo * resolution)):
            step = max(1, math.ceil(lo * resolution))
            shaped = _aim_by_shapes(plans, lo, hi, hi - 1, step, judge)
            shaped = lo + step if shaped == CLOSED else shaped  # a closing plan a step past lo
        if shaped:  # just below, where its plan could not tell its batch axis from the model's widths
            shaped = clear_of_widths(shaped, widths, (lo or 0) + 1)
        shaped = shaped if shaped and shaped not in plans else None
        if shaped is not None:
            aim = shaped
        elif lo is None:
            top = plans[hi]
            per_row = (top.peak_bytes - top.resident_bytes) / top.batch_size
            room = limit_bytes - top.resident_bytes - sum(held(top))
            aim = int(room / per_row) if per_row > 0 else hi // 2
            # Below hi by a little at first; by a quarter at least once the line has missed (the step's
            # fixed bytes, the pool's regions make it aim high), so a batch that fits is found in few plans.
            step = max(1, hi // 64 if hi == above.batch_size else hi // 4)
            aim = max(1, min(aim, hi - step))
        else:
            if hi - lo <= max(1, math.ceil(lo * resolution)):
                break
            aim = _aim_between(plans, lo, hi, resolution, lambda p: p.fits(limit_bytes, held(p), regions))
            if aim is None:
                aim = _next_aim(plans, lo, hi, limit_bytes, hi, need=needs)
        if fits(aim):
            lo = aim
        else:
            hi = aim
    return PlanSearch(lo, hi, sorted(plans.values(), key=lambda p: p.batch_size), time.perf_counter() - started,
                      above.jit_compile, limit_bytes, "given", notes)


def _aim_between(plans: dict[int, StepPlan], lo: int, hi: int | None, resolution: float, fits) -> int | None:
    """The next batch to plan between lo (fits) and hi (does not), by the plans between them
    (planned_between): the largest whose plan between them fits, or where that is within the
    resolution of lo, lo's step past it (to close the search: it fails as the plans between say, or
    the edge lies higher). None where the two cannot be drawn between, or the aim is planned already."""
    if lo not in plans or hi not in plans:  # (no bound above yet, or a batch XLA could not compile)
        return None
    ok = edge_between(plans, lo, hi, fits)
    if ok is None:
        return None
    # At least lo's step above lo, and a quarter of the gap below hi: where the plans between are
    # optimistic (a layout that changes between the two), each compile still closes the gap by a quarter.
    aim = min(max(ok, lo + max(1, math.ceil(lo * resolution))), hi - max(1, (hi - lo) // 4))
    return aim if lo < aim and aim not in plans else None


def _least_limits(held, regions: bool | None = None):
    """need(plan) for _next_aim: each plan's least limit (StepPlan.least_limit_bytes), worked out once
    per plan (a search asks for the two nearest the edge at every aim)."""
    known: dict[int, int] = {}

    def need(planned: StepPlan) -> int:
        if planned.batch_size not in known:
            known[planned.batch_size] = planned.least_limit_bytes(held(planned), regions)
        return known[planned.batch_size]

    return need


def _next_aim(plans: dict[int, StepPlan], lo: int, hi: int | None, limit: int, high: int,
              need=lambda planned: planned.peak_bytes) -> int:
    """Where the line through the plans nearest the limit meets it, kept inside (lo, hi); the middle
    when the line lands on an end. need(plan): the bytes the line runs through, the plan's peak, or
    the least limit under which it fits (StepPlan.least_limit_bytes: where a pool's regions or the
    no-split rule decide, a step within the limit by its bytes can still not fit, and a line through
    the peaks aims above the edge again and again)."""
    known = [p for p in plans.values() if p.batch_size in (lo, hi)] if hi is not None else \
        sorted(plans.values(), key=lambda p: p.batch_size)[-2:]
    guess = None
    if len(known) == 2 and known[1].batch_size != known[0].batch_size:
        (b0, y0), (b1, y1) = [(p.batch_size, need(p)) for p in known]
        slope = (y1 - y0) / (b1 - b0)
        if slope > 0:
            guess = int(b0 + (limit - y0) / slope)
    if hi is None:
        grown = 16 * lo
        guess = grown if guess is None else min(max(guess, lo + max(1, lo // 4)), grown)
        return min(high, max(guess, lo + 1))
    middle = (lo + hi) // 2
    if guess is None or not lo < guess < hi or guess in plans:
        return middle
    # Near the edge keep a step of at least a quarter of the gap from either end, so it closes in.
    quarter = max(1, (hi - lo) // 4)
    return min(max(guess, lo + quarter), hi - quarter) if hi - lo > 2 else middle
