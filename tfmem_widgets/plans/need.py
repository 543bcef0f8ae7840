"""An OOM in a Keras fit told in terms of its step: what the step needs at the fit's batch and the
largest batch whose step fits by its planned bytes, from XLA's plans of it (``plan()``), made in this
process after the OOM. That batch is an upper bound (a fit can need more than its planned step near the
edge: the pool's regions, the fit's own transients, a graph step's other kernels), so the report says a
probe confirms it.

The fit is read from its frames while TensorFlow waits on the refused request (``readings/fit_context.py``).
A plan compiles the step from specs and allocates nothing on the device; with XLA's GPU autotuner on,
the compiler tries kernels on scratch buffers (the plan notes it). After an XLA program's own OOM
nothing is planned here: the allocator is left inconsistent (``oom/report.py``), and the program's
one buffer of temporaries already says the step's need (``xla_request_need``).

``early_need`` plans while the cell still waits, at an XLA fit's first refusal (``oom/refusals.py``).
A GPU model's step is planned on the CPU, from a copy of the model (its config, its compile config,
variables made on the CPU), never on the refused card, where the plan's autotuner would be refused as the
fit's is. The CPU program of a GPU model is an estimate, larger than the GPU's for the models tried, so
the batch it names is on the safe side. ``step_need`` plans a GPU model the same way after its OOM.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

from ..errors import ArgumentError
from ..readings.fit_context import FitContext
from ..text import marked
from ..units import format_bytes
from .copy import model_copy
from .fit import held_beside
from .plan import device_of  # a model on any device but a CPU is planned from its CPU copy (from_cpu_copy)
from .replicas import replicas_text


@dataclass(frozen=True)
class StepNeed:
    """What the failing step needs and the batch that fits, in terms of the step (plans/need.py).

    source: 'plan' (XLA's buffer assignment of the step, planned at the fit's batch and below), 'cpu
    plan' (the same, of a CPU copy of a GPU model, never planned on the refused card: an estimate), or
    'xla request' (an XLA program asks for its temporaries as one buffer: in use + that request is
    the least the step needs; no plan is made in its process after it, and no batch is guessed: a
    scaled one was far off in lab mode, where the fit's data, regions and the step's fixed bytes
    weigh).
    """

    batch_size: int  # the fit's batch
    peak_bytes: int | None = None  # the step's peak at that batch, from an empty device
    resident_bytes: int | None = None  # the model's variables (weights, optimizer state)
    limit_bytes: int | None = None
    fits_batch: int | None = None  # the largest batch planned to fit at the limit in a fresh process
    fails_batch: int | None = None  # the smallest planned not to, above it
    plans: int = 0
    seconds: float = 0.0
    estimate: bool = False  # the fit runs a graph step: the plans are of the same step under XLA
    source: str = "plan"
    note: str = ""  # what stopped the plans early, or why there are none
    least_limit_bytes: int | None = None  # the least limit the step fits at its batch, with the fit's data and
    # its buffers placed as the allocator places them (StepPlan.least_limit_bytes); None: not planned
    phase: str = "train"  # "validation": the OOM came in the fit's validation, whose step is not planned
    plan: object | None = field(default=None, repr=False, compare=False)  # the StepPlan at the fit's batch (its plot)

    @classmethod
    def of_validation(cls, batch_size: int, data_bytes: int) -> StepNeed:
        held = f"; its arrays, {format_bytes(data_bytes)}, are held on the device with the fit's" if data_bytes else ""
        return cls(batch_size, phase="validation", source="validation", note=(
            f"the step: the fit's validation (the evaluate Keras runs at an epoch's end) at its batch of {batch_size:,}"
            f", not the train step{held}; the train step's plans do not apply, so none was made"))

    def lines(self, limit_text: str, varies: bool = False) -> list[str]:
        """The need in words. varies: the OOM was a compiled step's on a CPU, where the plans are XLA's for this
        processor and in use holds the kernels' temporaries: their figures are marked " (this CPU)"."""
        def m(figure: str) -> str:
            return marked(figure, varies)

        out = []
        if self.peak_bytes is not None:
            how = ("XLA's CPU program of a copy of the model: an estimate of its GPU program"
                   if self.source == "cpu plan" else replicas_text(self.plan) if self.source == "replica plan" else
                   "XLA's plan of this step; an estimate, as this fit runs the step as a graph, jit_compile=False"
                   if self.estimate else "XLA's plan of this step" if self.source == "plan" else
                   "in use + the XLA program's one buffer of temporaries")
            parts = (f"; resident {format_bytes(self.resident_bytes)}" if self.resident_bytes is not None else "")
            least = "at least " if self.source == "xla request" else ""
            out.append(f"the step: at batch {self.batch_size:,} it needs {least}{m(format_bytes(self.peak_bytes))} at "
                       f"its peak ({how}{parts}) against the {limit_text} limit"
                       + ("" if self.plan is None else "; tfmem_widgets.last_oom().need.plan.plot() draws "
                          + ("each replica's shares" if self.source == "replica plan" else "its program")))
        if self.fits_batch is not None:
            above = f"; {m(f'{self.fails_batch:,}')} does not" if self.fails_batch is not None else ""
            replicas = self.source == "replica plan"
            what = ("the replicas' planned shares reach the limit" if replicas else
                    "the planned step, with the fit's data and input pipeline, reaches the limit")
            out.append(f"what fits: at most batch {m(f'{self.fits_batch:,}')}, where {what} ({m(str(self.plans))} plans "
                       f"in {m(f'{self.seconds:.1f} s')}{above}); a fit "
                       "can take more than its plan (its first step, where the pool's regions fall): a probe confirms "
                       + ("it (%%tfmem batch: over replicas the probes decide)" if replicas else "it (%%tfmem batch --plan)"))
        elif self.source == "xla request":
            out.append("what fits: plan the step in a new process (tfmem_widgets.plan, or %%tfmem batch --plan for "
                       "the batch): after an XLA program's OOM this one is not planned")
        elif self.source in ("plan", "cpu plan", "replica plan") and self.peak_bytes is not None and \
                self.fails_batch is not None and (self.source != "replica plan" or not self.note):
            out.append(f"what fits: no batch planned fits this limit (down to {m(f'{self.fails_batch:,}')})")
        if self.note:
            out.append(self.note)
        return out



NEED_SECONDS = 60.0  # plans after an OOM stop after this long, with what is known by then


EARLY_SECONDS = 15.0  # an early plan's search stops after this long: the cell is told within 30 s of its refusal


def cpu_copy(model):
    """The model rebuilt on the CPU for planning (plans/copy.py); ArgumentError where Keras cannot rebuild it."""
    return model_copy(model)


def early_need(fit: FitContext, *, seconds: float = EARLY_SECONDS) -> StepNeed:
    """What the fit's step needs and the batch that fits, planned while the fit still waits on a
    refused request: on the device its variables live on when that is a CPU (lab mode), else from a
    CPU copy of the model (an estimate of the GPU's program), against that device's limit."""
    from ..tf.limits import limit_of

    return step_need(fit, limit_of(device_of(fit.model)).bytes, seconds=seconds)


def from_cpu_copy(fit: FitContext, device: str, limit_bytes: int | None, *, seconds: float) -> StepNeed:
    """What the step of a model on `device` (a GPU) needs, planned by XLA's CPU compiler from a copy
    of the model (``cpu_copy``) and judged as `device`'s pool would hold it, against `limit_bytes`
    (None: the device's limit): never compiled on the device, whose autotuner a full limit refuses."""
    from dataclasses import replace

    import tensorflow as tf

    from ..tf.allocator import allocator_of_device
    from ..tf.limits import allocator_growth, limit_of
    from .plan import plan

    limit = limit_of(device).bytes if limit_bytes is None else limit_bytes
    started = time.perf_counter()
    try:
        copy = cpu_copy(fit.model)
    except ArgumentError as exc:
        return StepNeed(fit.batch_size, limit_bytes=limit, note=str(exc).removeprefix("plan: "))
    growth = allocator_growth().get(allocator_of_device(device), True)

    def on_the_device(model, sample, batch: int):  # the CPU's plan, judged as the GPU's pool would hold it
        return replace(plan(model, sample, batch, build=True, place=False), device=device, limit_bytes=limit, growth=growth)

    with tf.device("/CPU:0"):
        need = step_need(replace(fit, model=copy), limit, seconds=max(1.0, seconds - (time.perf_counter() - started)),
                         planner=on_the_device)
    return replace(need, source="cpu plan", seconds=time.perf_counter() - started)


def step_need(fit: FitContext, limit_bytes: int | None, *, seconds: float | None = None, planner=None) -> StepNeed:
    """The planned peak of the fit's step at its batch, and the largest batch whose plan fits
    `limit_bytes` (the device's limit when None) in a fresh process. planner: plan (None; a model
    whose variables live on a GPU is planned from its CPU copy, ``from_cpu_copy``), or one that
    plans elsewhere."""
    from .largest import largest_below
    from .plan import plan

    plan = planner or functools.partial(plan, build=True, place=False)  # the fit's own data builds as fit would

    seconds = NEED_SECONDS if seconds is None else seconds
    if fit.replicas != 1:  # (a MirroredStrategy fit: each replica's share planned, replica_need)
        return replica_need(fit, limit_bytes, seconds=seconds)
    if planner is None and not (device := device_of(fit.model)).startswith("CPU"):
        return from_cpu_copy(fit, device, limit_bytes, seconds=seconds)  # never on the refused card
    started = time.perf_counter()
    try:
        failing = plan(fit.model, fit.sample, fit.batch_size)
    except ArgumentError as exc:
        return StepNeed(fit.batch_size, note=f"the step could not be planned: {str(exc).removeprefix('plan: ')}")
    limit = failing.limit_bytes if limit_bytes is None else limit_bytes
    if limit is None:
        return StepNeed(fit.batch_size, failing.peak_bytes, failing.resident_bytes, plans=1, plan=failing,
                        seconds=time.perf_counter() - started, estimate=failing.estimate,
                        note="the device's limit is not known: no batch can be said to fit")
    left = max(0.0, seconds - (time.perf_counter() - started))

    def held(planned) -> tuple[int, ...]:
        return held_beside(planned, fit.data_sizes)

    # An XLA step asks for its temporaries as one buffer: it fits where the pool a fresh process grows
    # has room for it (StepPlan.fits). A graph step asks for each tensor apart, with other kernels
    # than XLA's: by bytes alone, the most that can fit.
    found = largest_below(fit.model, fit.sample, failing, limit, seconds=left, held=held,
                          regions=False if failing.estimate else None, planner=plan)
    stopped = next((n for n in found.notes if n.startswith("stopped")), "")
    if found.batch is not None and found.failure is not None and found.failure - found.batch <= max(1, found.batch // 50):
        stopped = ""  # the edge was found to the search's resolution (2%) before the time ran out
    note = ""
    if stopped:
        note = (f"the plans {stopped}: the edge lies between {found.batch or 0:,} and {found.failure:,}; "
                "%%tfmem batch --plan finds it")
    elif found.batch is not None and found.batch >= fit.batch_size:
        note = ("XLA's plan of this step fits the limit at this batch: the graph step this fit runs needs more "
                "than XLA's program of it (jit_compile=True would run the planned program)" if failing.estimate
                else "the plan fits a fresh process at this batch: what this process held before the fit did not")
    elif found.notes:
        note = "; ".join(found.notes)
    least = failing.least_limit_bytes(held(failing), regions=False if failing.estimate else None)
    return StepNeed(fit.batch_size, failing.peak_bytes, failing.resident_bytes, limit, found.batch, found.failure,
                    plans=len(found.plans), seconds=time.perf_counter() - started, estimate=failing.estimate,
                    note=note, least_limit_bytes=least, plan=failing)


# -- A fit under MirroredStrategy ------------------------------------------------------------------------
# An OOM in a Keras fit under MirroredStrategy told in terms of its replicas: the plan of each replica's share
# at the fit's global batch (``plan()``, plans/replicas.py) and the largest global batch whose plan fits the limit.
#
# The plans are ``plan()``'s of the fit's own model and data (the arrays' shapes, ``FitContext.data``), made in
# this process after the OOM: each copies the model onto the first replica's device without the strategy, plans one
# replica's step and gives the copy back. On a GPU that copy is made beside what the fit still holds; where it is
# refused, the need says so and how to plan in a new process. The replicas' plans are estimates (a graph step
# each, the all-reduce's buffers assumed), so the batch is searched to 2% and a probe confirms it.

REPLICAS_RESOLUTION = 0.02  # the search stops where the failing batch is within 2% above the fitting one


def replica_need(fit, limit_bytes: int | None, *, seconds: float, first=None) -> StepNeed:
    """The replicas' planned peak at the fit's global batch and the largest global batch whose plan fits
    `limit_bytes` (the plan's own limit where None: the busiest replica's device's, or the shared pool's).
    first: the ReplicaPlan at the fit's batch where made already (the guard's), not made again."""
    import tensorflow as tf

    from .plan import plan

    sample = fit.data if fit.data is not None else fit.sample
    started = time.perf_counter()
    plans: dict[int, object] = {} if first is None else {fit.batch_size: first}

    def planned(batch: int):
        if batch not in plans:  # (build: a model not built yet is planned from its copy, built as fit would build it)
            plans[batch] = plan(fit.model, sample, batch, build=True)
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
    ends = {False: (-(-fit.batch_size // n), failing.peak_bytes)}  # rows per replica -> (rows, planned peak)
    try:
        closed = _search(lambda rows: planned(rows * n), limit, ends, started + seconds)
        note = "" if closed else f"the plans stopped after {seconds:.0f} s"
    except (ArgumentError, tf.errors.ResourceExhaustedError) as exc:  # (a plan below refused: what was found stands)
        closed, note = False, f"the plans stopped at {type(exc).__name__}: {str(exc).removeprefix('plan: ')[:200]}"
    fits, fails = (ends[True][0] * n if True in ends else None), ends[False][0] * n
    if note and fits is not None:
        note += f": the edge lies between {fits:,} and {fails:,}"
    return _done(need, plans, started, fits=fits, fails=fails, note=note)


def _search(planned, limit: int, ends: dict, deadline: float) -> bool:
    """Brackets the edge in rows per replica: `ends` holds False: (the fewest rows planned not to fit, their
    peak), and gains True: (the most planned to fit, their peak), each narrowed as plans are made (`planned(rows)`,
    the replicas' plan at that many rows each); whether the bracket closed to 2% (or one row) before `deadline`.
    Aimed along the line through the two ends, each aim followed by a plan 2% past it on the other side, so a
    nearly straight line is bracketed in a few plans."""
    at_low = planned(1)
    if not at_low.fits(limit):
        ends[False] = (1, at_low.peak_bytes)
        return True
    ends[True] = (1, at_low.peak_bytes)

    def close() -> bool:
        return ends[False][0] - ends[True][0] <= max(1, int(ends[True][0] * REPLICAS_RESOLUTION))

    while not close():
        if time.perf_counter() >= deadline:
            return False
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
            step = max(1, int(aim * REPLICAS_RESOLUTION))
            aim = aim + step if side else aim - step  # (the other side of the edge, if the line aimed well)
    return True


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
