"""An OOM in a Keras fit told in terms of its step: what the step needs at the fit's batch and the
largest batch whose step fits by its planned bytes, from XLA's plans of it (``plan()``), made in this
process after the OOM. That batch is an upper bound: in lab mode a fit needed more than its planned
step near the edge (the pool's regions, the fit's own transients; a graph step runs other kernels
than XLA's program of it), so the report says a probe confirms it.

The fit is read from its frames while TensorFlow waits on the refused request (``oom/fit_context.py``).
A plan compiles the step from specs and allocates nothing on the device; with XLA's GPU autotuner on,
the compiler tries kernels on scratch buffers (the plan notes it). After an XLA program's own OOM
nothing is planned here: the allocator is left inconsistent (``oom/report.py``), and the program's
one buffer of temporaries already says the step's need (``xla_request_need``).
"""

from __future__ import annotations

import time

from ..errors import SetupError
from ..oom.fit_context import FitContext
from ..oom.report import StepNeed

NEED_SECONDS = 60.0  # plans after an OOM stop after this long, with what is known by then
# Keras' input pipeline ends in prefetch(AUTOTUNE): in lab mode (2 cores) a fit held 4 batches ahead
# (7.99 MiB of 1.96 MiB batches, a trace at the step's peak). The fresh pool a batch is judged in holds
# that many, besides the arrays fit was given (one tensor each, from_tensors in Keras' array adapter).
PIPELINE_BATCHES = 4


def step_need(fit: FitContext, limit_bytes: int | None, *, seconds: float | None = None) -> StepNeed:
    """The planned peak of the fit's step at its batch, and the largest batch whose plan fits
    `limit_bytes` (the device's limit when None) in a fresh process."""
    from .plan import plan
    from .plan_search import largest_below

    seconds = NEED_SECONDS if seconds is None else seconds
    if fit.replicas != 1:
        return StepNeed(fit.batch_size, note=f"a fit on {fit.replicas} replicas: plans are of one device's step; "
                        "plan one replica's batch with tfmem_widgets.plan")
    started = time.perf_counter()
    try:
        failing = plan(fit.model, fit.sample, fit.batch_size)
    except SetupError as exc:
        return StepNeed(fit.batch_size, note=f"the step could not be planned: {str(exc).removeprefix('plan: ')}")
    limit = failing.limit_bytes if limit_bytes is None else limit_bytes
    if limit is None:
        return StepNeed(fit.batch_size, failing.peak_bytes, failing.resident_bytes, plans=1,
                        seconds=time.perf_counter() - started, estimate=failing.estimate,
                        note="the device's limit is not known: no batch can be said to fit")
    left = max(0.0, seconds - (time.perf_counter() - started))

    def held(planned) -> tuple[int, ...]:
        return (*fit.data_sizes, *(planned.batch_sizes * PIPELINE_BATCHES))

    # By bytes alone: where the pool's regions fall, the fit's own transients and (for a graph step) the
    # kernels it runs instead of XLA's are not planned, so the batch is the most that can fit.
    found = largest_below(fit.model, fit.sample, failing, limit, seconds=left, held=held, regions=False)
    stopped = next((n for n in found.notes if n.startswith("stopped")), "")
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
    return StepNeed(fit.batch_size, failing.peak_bytes, failing.resident_bytes, limit, found.batch, found.failure,
                    plans=len(found.plans), seconds=time.perf_counter() - started, estimate=failing.estimate,
                    note=note)

