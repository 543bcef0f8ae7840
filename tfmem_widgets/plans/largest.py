"""What fits, from plans: the largest batch whose planned step fits the limit, in a few compiles.

A step's bytes are close to linear in the batch but not quite (the largest moment's live set changes),
so a line through small batches misaims. One plan's buffer shapes say which grow with the batch
(``planned_by_shapes``): that is XLA's plan at another batch while the program keeps its layout. So
the first plan, at a prime number of rows (its batch axis told from a layer's width), aims the second
at the edge, and the answer's own shapes say whether a step past it fits. Where XLA lays a larger
program out otherwise, the failing plan's shapes aim below it, and once two plans of one layout
bracket the edge, the plans between them (``planned_between``) say where it falls. A batch fits when
its plan does (``StepPlan.fits``). A batch search runs this in a fresh process and confirms its
answer by probes (search/plan_first.py).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ..errors import ArgumentError
from .fit import slots_shared_by_fit
from .hlo import told_apart, widths_of
from .plan import StepPlan, plan
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
    # The first batch whose graph step makes a tensor of 2^31 elements (plans/aborts.py: the process aborts on a
    # GPU): nothing at or above it was planned, nor is it to be probed. None: no such batch up to `high`.
    aborts_from: int | None = None
    data_share: float = 0.0  # the part of a batch's bytes the fit's data holds on the device besides the step
    replicas: int = 1  # the model's strategy's replicas: above 1, it was not planned (a search plans one device)


# The first plan's batch (or `low`, where that is more): a prime, so its batch axis is told from a layer's width
# in its shapes (hlo.batch_profile; at 512 rows a Dense layer's activations are shaped as its 512-by-1024 kernel).
FIRST_PLAN = 509


@dataclass(frozen=True)
class FreshFit:
    """The fit each plan of a search stands for, besides its step: held(plan), the bytes the process holds
    at that plan's batch (the fit's data where it sits on the device); start, the pool it meets at its first
    step (search/fit_start.py; None: an empty one); builds_slots, it builds the optimizer's slots itself
    (a fresh process's, where build_model() left them unbuilt: fit.slots_shared_by_fit)."""

    held: Callable = lambda planned: ()
    start: object = None
    builds_slots: bool = False


class _Plans:
    """A search's plans by batch, each judged against the limit as the fit it stands for."""

    def __init__(self, model, sample, fit: FreshFit, resolution: float, high: int):
        self.model, self.sample, self.fit, self.resolution, self.high = model, sample, fit, resolution, high
        self.by_batch: dict[int, StepPlan] = {}
        self.notes: list[str] = []
        self.limit: int | None = None
        self.aborts_from: int | None = None
        self.widths = widths_of(model)  # the weights' (an optimizer's slots, built by the first plan, are shaped so)
        self.needs = _least_limits(fit.held)

    def at(self, batch: int) -> StepPlan | None:
        """The plan at `batch` (made once); None where XLA could not compile it (not fitting)."""
        if batch not in self.by_batch:
            try:
                planned = plan(self.model, self.sample, batch, build=True, place=False)
                shared = slots_shared_by_fit(self.model, planned) if self.fit.builds_slots else ()
            except ArgumentError as exc:  # (an autotuner without room)
                self.notes.append(f"batch {batch:,}: {str(exc).removeprefix('plan: ')}")
                return None
            self.by_batch[batch] = replace(planned, fit_start=self.fit.start, shared_slots=shared)
        return self.by_batch[batch]

    def judge(self, planned: StepPlan) -> bool:
        return planned.fits(self.limit, self.fit.held(planned))

    def fits(self, batch: int) -> bool:
        planned = self.at(batch)
        return planned is not None and self.judge(planned)

    def step(self, batch: int) -> int:
        return max(1, math.ceil(batch * self.resolution))

    def proven(self, planned: StepPlan | None) -> int | None:
        """A failing plan's bytes alone (its peak and what the process holds besides), where they exceed the
        limit and the program compiles the same in any process (no autotuner): a step never takes less than
        its plan, so that batch cannot train. None where the pool's regions or an autotuner decide."""
        if planned is None or not planned.same_program_anywhere or planned.estimate:
            return None
        need = planned.peak_bytes + sum(self.fit.held(planned))
        return need if need > self.limit else None

    def cleared(self, aim: int | None, lo: int) -> int | None:
        """The aim, or just below it where its plan could not tell its batch axis (its shapes would aim nothing)."""
        if aim is None or aim >= self.high:
            return aim
        better = clear_of_widths(aim, self.widths, lo + 1)
        return better if better not in self.by_batch else aim

    def next_aim(self, lo: int, hi: int | None, closing_plan: bool) -> int | None:
        """The next batch to plan; None where the search stops (a note says why, where it is not the end)."""
        plans, high = self.by_batch, self.high
        shaped = _aim_by_shapes(plans, lo, hi, high, self.step(lo), self.judge)
        past = min(high, lo + self.step(lo))
        if shaped == CLOSED:  # lo's own buffers, scaled to a step past it, do not fit
            if not closing_plan:
                self.notes.append(f"the plan at {lo:,}, its buffers scaled to {past:,} rows, does not fit: not planned "
                                  "there, the probe past the answer is the check")
                return None
            return past if past not in plans else None
        if shaped is not None:
            return shaped
        if hi is None:
            return _aim_from_resident(plans[lo], self.limit, high, self.needs) if len(plans) == 1 else \
                _next_aim(plans, lo, hi, self.limit, high, need=self.needs)
        # (within twice lo only: at other limits the plans between missed by a few percent; the probe past the
        # answer is the check)
        between = planned_between(plans[lo], plans[hi], past) if hi in plans and hi <= 2 * lo and not closing_plan \
            else None
        if between is not None and not self.judge(between):
            self.notes.append(f"the plans between {lo:,} and {hi:,} put the edge below {past:,}: not planned there, "
                              "the probe past the answer is the check")
            return None
        aim = _aim_between(plans, lo, hi, self.resolution, self.judge)
        return aim if aim is not None else _next_aim(plans, lo, hi, self.limit, high, need=self.needs)

    def first(self, low: int, high: int, limit_bytes: int | None) -> tuple[StepPlan, int | None, int | None]:
        """The first plan, the limit set from it, and the first bracket (lo, hi) of the edge."""
        start = min(high, max(low, FIRST_PLAN))
        start = next((b for b in range(start, min(high, start + 64) + 1) if told_apart(b, self.widths)), start)
        first = self.at(start)
        refused = None  # the first plan's batch where XLA could not compile it: not fitting, an upper bound
        if first is None and start > low:
            refused, start, first = start, low, self.at(low)
        if first is None:
            raise ArgumentError(self.notes[-1] if self.notes else "plan: the step could not be planned.")
        self.limit = first.limit_bytes if limit_bytes is None else limit_bytes
        if self.limit is None:
            raise ArgumentError("the device's limit is not known: pass limit_bytes.")
        below = first.largest_batch_before_abort
        if below is not None and below < self.high:  # no batch past it: the graph step would abort
            self.high, self.aborts_from = max(below, low), below + 1
            self.notes.append(f"from batch {below + 1:,} the step makes a tensor of 2^31 elements, which TensorFlow's "
                              "own GPU kernels cannot count (the process aborts): the search stays below it")
        lo, hi = (start, refused) if self.fits(start) else (None, start)
        if lo is None and start > low:
            lo, hi = (low, start) if self.fits(low) else (None, low)
        return first, lo, hi


def largest_planned_batch(model, sample, limit_bytes: int | None = None, *, low: int = 1, high: int = 65536,
                          resolution: float = 0.02, max_plans: int = 14, fit: FreshFit = FreshFit(),
                          closing_plan: bool = True, closing=None) -> PlanSearch:
    """The largest batch from `low` to `high` whose planned step fits `limit_bytes` (None: the device's
    limit), to within `resolution` (a fraction of the batch), each plan judged as `fit` (a FreshFit).
    The first plan is at FIRST_PLAN rows (`low` where more, or where that one does not fit); a batch
    below a plan that fits is taken to fit. Each next plan is aimed by the shapes of the largest that
    fits, else by the plans between the two that bracket the edge, else by lines through plans; the
    answer is always a plan's.
    closing_plan=False: no plan past the answer where its shapes, or the plans between, say it fails
    there (a probe past the answer is the check); `failure` is then the bracket's upper plan and a note
    says so. closing(batch): called before the plan at `batch` compiles where, if it fits, the search
    ends at it (a caller may begin that batch's probes, and the one past it, meanwhile)."""
    started = time.perf_counter()
    plans = _Plans(model, sample, fit, resolution, high)
    first, lo, hi = plans.first(low, high, limit_bytes)
    high = plans.high  # (below the first batch whose graph step aborts)
    step = plans.step
    aim = None
    if lo is not None and (lo < high if hi is None else hi - lo > step(lo)):
        aim = plans.cleared(plans.next_aim(lo, hi, closing_plan), lo)
    while aim is not None and len(plans.by_batch) < max_plans:
        past_aborts = plans.aborts_from is not None and aim + step(aim) >= plans.aborts_from
        if closing is not None and hi is not None and aim < high and hi - aim <= step(aim) and not past_aborts and \
                plans.proven(plans.by_batch.get(hi)) is None:
            closing(aim)  # if it fits, it is the answer (and the batch past it is to be probed: not proven)
        if plans.fits(aim):
            lo = aim
            if aim >= high:
                break
        else:
            hi = aim
        if hi is not None and hi - lo <= step(lo):
            break
        aim = plans.cleared(plans.next_aim(lo, hi, closing_plan), lo)
    found = PlanSearch(lo, hi, sorted(plans.by_batch.values(), key=lambda p: p.batch_size),
                       time.perf_counter() - started, first.jit_compile, plans.limit,
                       first.limit_source if limit_bytes is None else "given", plans.notes)
    need = plans.proven(plans.by_batch.get(hi)) if hi is not None else None
    if need is not None:
        found.proven_failure, found.proven_bytes = hi, need
    found.aborts_from = plans.aborts_from
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
                  regions: bool | None = None, planner=None) -> PlanSearch:
    """The largest batch below `above` (a plan at a batch that does not fit) whose plan fits
    `limit_bytes`, to within `resolution`; each aim is by the shapes of `above` (planned_by_shapes:
    the largest batch they say fits), then of the plans made, else where the line through the
    model's resident bytes (at batch 0) and a failing plan's peak meets the limit. `seconds` bounds the
    search: what is known by then is returned (each plan is a compile). held(plan): what the process holds
    besides the step at that plan's batch (a fit's data); regions: as StepPlan.fits; planner: plan, or one
    that plans elsewhere (plans/need.py's CPU copy); by default plan() with nothing placed in this process's pool."""
    started = time.perf_counter()
    planner = planner or functools.partial(plan, place=False)
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
