"""What will fit: the largest batch a Keras model trains with, found in fresh processes.

``max_batch_size(build_model, make_batch)`` builds the model the user's way in a new process per
probe (a pool does not come back within a process: nothing at del or gc, wholly empty GPU regions only
when a request fails; so a probe after an OOM would measure a used pool), runs a few train steps on
one batch, and records the allocator's exact highest in-use figure, or the OOM. The functions travel
by value (cloudpickle), so functions defined in a notebook work.

The search grows the batch until one fails, each probe aimed at the edge a straight line through
the peaks of the batches that trained predicts (peak = fixed + per example x batch; at least 1.25
and at most 16 times the last), then halves the interval between the largest batch that trained
and the smallest that failed above it (near the limit the peaks flatten and the line misaims). It
stops when the edge is within `resolution` (a fraction of the batch), then probes once past the
edge: near it fitting need not be monotone (regions and chunk rounding); a batch that trains above
a failure, or one that trained in one process and failed in another, is reported, and the recommended
batch stays below every failure.

Each probe runs `model.fit` over `steps` copies of the batch, as the user trains (`train_on_batch`
holds less: Keras' input pipeline holds a batch on the device too).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ArgumentError, StateError
from ..text import LinesText, RunNote
from ..units import format_bytes
from .arguments import check_count, check_fraction, where_words
from .by_plans import batch_by_plans, need_by_plans
from .next_probe import next_batch, on_replicas, settle_recommended
from .probe import Probe, TooFewRows, first_line
from .progress import progress_for
from .search_text import search_lines
from .warm import probing, room_for_two


@dataclass(repr=False)
class BatchSearch(LinesText):
    """The probes of a search and what they show. See max_batch_size."""

    probes: list[Probe]
    low: int
    high: int
    steps: int
    margin: float
    resolution: float
    limit_bytes: int | None = None
    limit_source: str = "unknown"
    where: str = ""
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)
    lab: bool = False  # the probes ran in lab mode (CPU kernels), not on a GPU
    plans: list = field(default_factory=list)  # the StepPlans a plan search made (method="plan")
    plan_seconds: float = 0.0  # the plan search's process, start to end
    planned_failure: int | None = None  # a batch past the answer its plan says cannot train (its bytes, an abort)
    plan_answer: int | None = None  # the largest batch the plans fit (the plan search's answer, probed first)
    overlap_seconds: float = 0.0  # of the probes' seconds, what two side by side spent at the same time
    beside_plans_seconds: float = 0.0  # of the probes' seconds, what they spent while the plans were still made
    margin_probes: int = 0  # of the probes, those a margin added after the edge was known (search/next_probe.py)
    data_share: float = 0.0  # a plan search's: the part of a batch's bytes the fit's data holds besides the step
    plans_tried: bool = False  # a probe search's plans were asked for (search/plan_first.plans_after)
    plans_after_seconds: float = 0.0  # their process, start to end (not in `seconds`: the search had ended)
    plans_estimate: bool = False  # the plans are of the step under XLA, where the model's step runs without it
    _run: tuple | None = field(default=None, repr=False, compare=False)  # (functions, setup, env, timeout)

    def probe(self, *batches: int) -> list[Probe]:
        """More probes of the same functions and setup, each in a fresh process (a batch near the
        edge, say); they join `probes`, so `largest`, `edge`, the plot and the warnings follow."""
        if self._run is None:
            raise StateError("this search has no functions to probe with: make it with max_batch_size.")
        batches = [check_count("batch", b, 1) for b in batches]
        with self._probing() as probe_one:  # (no process started to wait after the last)
            return [probe_one(batch, ahead=i < len(batches) - 1) for i, batch in enumerate(batches)]

    def _probing(self, pairs: bool = False):
        """While the functions' file exists: probe_one(batch), one probe added to `probes` (warm.probing)."""
        return probing(self, pairs)

    # -- what the probes show ------------------------------------------------------------
    @property
    def fitted(self) -> list[Probe]:
        return sorted((p for p in self.probes if p.fits), key=lambda p: p.batch)

    @property
    def failed(self) -> list[Probe]:
        return sorted((p for p in self.probes if not p.fits), key=lambda p: p.batch)

    @property
    def replicas(self) -> int:
        """The model's strategy's replicas, as its probes read them (1: one device): every batch probed divides by
        them (search/next_probe.on_replicas)."""
        return max((p.replicas for p in self.probes), default=1)

    @property
    def largest(self) -> int | None:
        """The largest batch that trained."""
        fitted = self.fitted
        return fitted[-1].batch if fitted else None

    @property
    def first_failure(self) -> int | None:
        """The smallest batch above `largest` that ran out of memory or was planned not to fit (None: none)."""
        return min((b for b in self._failures() if b > (self.largest or 0)), default=None)

    def _failures(self) -> list[int]:  # the probes that ran out of memory, and planned_failure
        return [p.batch for p in self.failed] + ([self.planned_failure] if self.planned_failure else [])

    @property
    def edge(self) -> tuple[int | None, int | None]:
        """(the largest batch that trained below every failure, the smallest failure): where
        fitting was lost first. Equal to (largest, first_failure) when fitting is monotone."""
        lowest = min(self._failures(), default=None)
        below = [p.batch for p in self.fitted if lowest is None or p.batch < lowest]
        return (max(below) if below else None), lowest

    @property
    def monotone(self) -> bool:
        """False when a batch trained although a smaller one, or the same one in another process, ran
        out of memory."""
        return not self.not_monotone

    @property
    def not_monotone(self) -> list[tuple[int, int]]:
        """(failed batch, the largest batch at or above it that trained) pairs, each failed batch once:
        the two equal where that batch trained in another fresh process and no larger one trained."""
        fitted = [p.batch for p in self.fitted]
        failed = sorted({f.batch for f in self.failed})
        return [(f, max(b for b in fitted if b >= f)) for f in failed if any(b >= f for b in fitted)]

    def peak_model(self) -> tuple[float, float] | None:
        """(fixed bytes, bytes per example) of a straight line through the peaks of the batches
        that trained (least squares); None with fewer than two."""
        points = [(p.batch, p.peak_bytes) for p in self.fitted]
        if len({b for b, _ in points}) < 2:
            return None
        n = len(points)
        mean_b = sum(b for b, _ in points) / n
        mean_p = sum(p for _, p in points) / n
        spread = sum((b - mean_b) ** 2 for b, _ in points)
        if spread == 0:
            return None
        slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / spread
        if slope <= 0:
            return None
        return mean_p - slope * mean_b, slope

    def no_line_reason(self) -> str | None:
        """Why no line can be read through the peaks (None: one can)."""
        if self.peak_model() is not None:
            return None
        trained = sorted({p.batch: p.peak_bytes for p in self.fitted}.items())
        if len(trained) < 2:
            return "The search has fewer than two batches that trained: no line to read other limits from."
        shown = ", ".join(f"{b:,} at {format_bytes(peak)}" for b, peak in trained[:4])
        return (f"The peaks of the batches that trained do not rise with the batch ({shown}): at such small "
                "batches the pool's regions and the kernels' scratch rule the peak, not the batch, so no line can be "
                "read to other limits; search from a larger batch (low) for one.")

    def needs_bytes(self, batch: int) -> int | None:
        """The limit `batch` needs: by the search's plans (each placed in the pool as a fresh fit's:
        search/by_plans.py; a probe search makes them now, once), else, where none can be made, the peak the
        line through the probes' peaks predicts (None without a line)."""
        self._plan_away()
        if self.plans:
            return need_by_plans(self.plans, self.data_share, batch)
        model = self.peak_model()
        return None if model is None else int(model[0] + model[1] * batch)

    def batch_for(self, limit_bytes: int) -> int | None:
        """The largest batch that fits `limit_bytes`: by the search's plans (each placed in a fresh pool under
        that limit: search/by_plans.py; a probe search asked away from its edge makes them now, once), else, where
        none can be made, by the line through the peaks (None without one), bounded
        by what was measured: at the search's own limit the largest batch below every failure; under
        it, never more (what failed there fails under less); above it, never less."""
        measured, failure = self.edge
        if self.will_plan(limit_bytes):
            self._plan_away()
        line = batch_by_plans(self.plans, self.data_share, limit_bytes) if self.plans else self._line_batch(limit_bytes)
        if line is None or self.limit_bytes is None or measured is None:
            return line
        if limit_bytes >= self.limit_bytes:
            return measured if (limit_bytes == self.limit_bytes and failure is not None) else max(line, measured)
        return min(line, measured) if failure is not None else line

    def will_plan(self, limit_bytes: int | None = None) -> bool:
        """Whether asking what fits at `limit_bytes` (None: what a batch needs) starts the one planning
        process first (a probe search away from its edge: _plan_away)."""
        if self.plans or self.plans_tried or self._run is None:
            return False
        return limit_bytes is None or limit_bytes != self.limit_bytes or self.edge[1] is None

    def _plan_away(self) -> None:
        """A probe search asked what fits away from its edge plans its step then, once (one fresh process:
        search/plan_first.plans_after); a line through peaks at the edge misses far from it."""
        if self.will_plan():
            from .plan_first import plans_after

            plans_after(self)

    def within_margin_bytes(self, limit_bytes: int) -> int:
        """The part of a limit a batch may use with the search's margin kept free."""
        return int(limit_bytes * (1 - self.margin))

    def limit_needed_bytes(self, batch: int) -> int | None:
        """The limit `batch` needs with the margin kept free: from its own measured peak where a probe
        trained at it, else as needs_bytes says (None without an answer)."""
        measured = self.measured_peak(batch)
        need = measured if measured is not None else self.needs_bytes(batch)
        return None if need is None else int(need / (1 - self.margin))

    def measured_peak(self, batch: int) -> int | None:
        """The highest peak the probes measured at `batch` where one trained there (None otherwise)."""
        return max((p.peak_bytes for p in self.fitted if p.batch == batch and p.peak_bytes), default=None)

    def _largest_measured_within(self, budget: float) -> int | None:
        """The largest batch probes trained at whose peak stayed within `budget` in every probe there, and
        at least the margin below every failure (margin: a fraction of the batch too): a step's peak at one
        batch differs between processes, and near the edge fitting is not monotone."""
        lowest = min(self._failures(), default=None)
        top = None if lowest is None else lowest * (1 - self.margin)
        over = {p.batch for p in self.fitted if p.peak_bytes > budget}
        within = [p.batch for p in self.fitted if p.peak_bytes and p.peak_bytes <= budget and p.batch not in over
                  and (top is None or p.batch <= top)]
        return max(within) if within else None

    def trained_at(self, batch: int) -> int:
        """How many probes trained at `batch`."""
        return sum(1 for p in self.fitted if p.batch == batch)

    def within_margin(self, limit_bytes: int) -> tuple[int | None, bool]:
        """The batch to use at `limit_bytes` with the margin kept free, by the rule `recommended`
        follows: up to the search's own limit, the largest batch the probes measured whose peaks left the
        margin free, the margin below every failure (measured: True); above it, where nothing was measured, the
        line's batch for the limit less the margin, never less than the recommended one (False)."""
        budget = self.within_margin_bytes(limit_bytes)
        if self.limit_bytes is None or limit_bytes <= self.limit_bytes:
            return self._largest_measured_within(budget), True
        line = self.batch_for(budget)
        return (None if line is None else max(line, self.recommended or 0)), False

    def _line_batch(self, limit_bytes: int) -> int | None:
        """Where the line through the peaks meets `limit_bytes` (what the search aims at)."""
        model = self.peak_model()
        if model is None:
            return None
        return on_replicas(self, max(0, int((limit_bytes - model[0]) // model[1])))  # (a batch the fit can start)

    @property
    def recommended(self) -> int | None:
        """The largest batch that trained below every failure; with a margin, the largest batch the
        probes measured (each trained) whose peaks left `margin` of the limit free, `margin` below every
        failure (a fraction of the batch). Measured, not read off the line (near the edge the line misses).
        The search aims a probe at the margin and probes the batch it recommends twice
        (search/next_probe.settle_recommended)."""
        largest = self.edge[0]
        if largest is None or self.margin == 0:
            return largest
        if self.limit_bytes is None:
            return on_replicas(self, max(self.low, int(largest * (1 - self.margin))))
        return self._largest_measured_within(self.within_margin_bytes(self.limit_bytes))

    @property
    def seconds(self) -> float:
        return self.plan_seconds + sum(p.seconds for p in self.probes) - self.overlap_seconds - self.beside_plans_seconds

    # -- text -------------------------------------------------------------------------------
    def lines(self) -> list[str]:
        """The search in words; in lab mode what varies with the CPU is marked (search/search_text.py)."""
        return search_lines(self)

    # -- picture -----------------------------------------------------------------------------
    def plot(self, ax=None, pick: int | None = None):
        """Peak against batch: the batches that trained, the failures (at the limit, red x),
        the limit, the line through the peaks, and, with `pick`, the limit that batch needs."""
        from .picture import plot_search

        return plot_search(self, ax, pick)


# -- the search ----------------------------------------------------------------------------

def max_batch_size(build_model: Callable[[], Any], make_batch: Callable[[int], Any], *,
                   setup: Mapping[str, Any] | None = None, low: int = 1, high: int = 65536, steps: int = 2,
                   margin: float = 0.0, resolution: float = 0.02, probe_timeout: float = 600,
                   max_probes: int = 16, progress: str | bool | None = None,
                   env: Mapping[str, str] | None = None, method: str = "auto") -> BatchSearch:
    """The largest batch `build_model()`'s model trains with, each probe in a fresh process (its imports
    done ahead of its batch: search/warm.py).

    build_model: returns a compiled Keras model (XLA as you compile it).
    make_batch:  make_batch(n) returns one batch (x, y) of exactly n examples.
    setup:       tfmem_widgets.setup() options for every probe's process, e.g. {"lab_mb": 256}
                 (lab mode: CPU kernels) or {"limit_mb": 16000} (as if on a card of 16 GB).
    low, high:   the batches searched between; steps: train steps a probe runs.
    margin:      the fraction of the limit `recommended` leaves free by its measured peaks, and of the batch
                 below every failure; with one, once the edge is known, up to 5 probes more (counted in
                 max_probes) settle the recommended batch.
    resolution:  the search stops when the edge is known within this fraction of the batch.
    probe_timeout: seconds before a probe, and every process it started, is stopped.
    progress:    None: a bar in a notebook (with the extension loaded), a line per probe elsewhere; "lines";
                 False: silent; or an object with probing(count, batch), probed(count, probe), done(search).
    env:         environment variables for every probe, e.g. {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
                 (on a GPU, XLA's autotuner makes a step past the edge wait for minutes instead of raising).
    method:      "plan": plan the step at a few batches in one fresh process (XLA's buffer assignment), then
                 confirm the answer with a probe at it and one just past it; "probe": probes only; "auto"
                 (default): plans where the model's step is an XLA program (jit_compile), probes otherwise.

    Ctrl-C stops the probe in flight and returns what the probes so far show.
    """
    search, max_probes = _new_search(build_model, make_batch, setup, env, low=low, high=high, steps=steps,
                                     max_probes=max_probes, margin=margin, resolution=resolution,
                                     probe_timeout=probe_timeout, method=method, progress=progress)
    bar = progress_for(progress, max_probes)
    past: list[int] = []
    _, setup, env, _ = search._run
    pairs = method != "probe" and room_for_two(setup, env, now=False) is not None
    with search._probing(pairs) as probe_one:
        batch = _search(search, probe_one, bar, method, max_probes, past)
        if batch is not None and not search.interrupted and len(search.probes) >= max_probes:
            within = search.first_failure is not None and search.largest is not None and \
                search.first_failure - search.largest <= max(search.replicas, math.ceil(search.largest * search.resolution))
            search.notes.append(RunNote(f"stopped at max_probes={max_probes} " + (
                "before the probe past the edge" if within else "before the edge was within the resolution")))
    if search.largest is not None and not search.failed and search.largest < search.high and not search.interrupted:
        search.notes.append(RunNote("no probe ran out of memory"))
    if past and any(p.batch == past[0] for p in search.fitted):
        search.notes.append(RunNote(f"the probe past the edge ({past[0]:,}) trained: fitting is not monotone here; above "
                                    "it was not searched, and the recommended batch stays below every failure"))
    bar.done(search)
    return search


def _new_search(build_model, make_batch, setup, env, *, low, high, steps, max_probes, margin, resolution,
                probe_timeout, method, progress) -> tuple[BatchSearch, int]:
    """A search with no probe yet, and max_probes, every argument checked (one line for the first that is wrong)."""
    from ..fresh.run import check_request, check_timeout

    if not callable(build_model) or not callable(make_batch):
        bad = "build_model" if not callable(build_model) else "make_batch"
        raise ArgumentError(f"max_batch_size: {bad} must be a function, got {type(locals()[bad]).__name__}.")
    low, high = check_count("low", low, 1), check_count("high", high, 1)
    if low > high:
        raise ArgumentError(f"max_batch_size: low ({low:,}) is above high ({high:,}): give low <= high.")
    steps = check_count("steps", steps, 1)
    max_probes = check_count("max_probes", max_probes, 2)
    margin = check_fraction("margin", margin, 1)
    resolution = check_fraction("resolution", resolution, 0.5)
    if resolution == 0:
        raise ArgumentError("max_batch_size: resolution must be above 0 (a fraction of the batch, e.g. 0.01).")
    timeout = check_timeout(probe_timeout)
    setup = check_request(setup, env)  # checked once here; each probe's process applies it to its machine
    env = {str(k): str(v) for k, v in (env or {}).items()}
    if method not in ("auto", "plan", "probe"):
        raise ArgumentError(f"max_batch_size: method must be 'auto', 'plan' or 'probe', got {method!r}.")
    if progress not in (None, False, "lines", "bar") and not all(
            callable(getattr(progress, name, None)) for name in ("probing", "probed", "done")):
        raise ArgumentError(f"max_batch_size: progress must be None, False, 'lines', 'bar' or an object with "
                            f"probing(), probed() and done(), got {progress!r}.")
    try:
        import cloudpickle

        functions = cloudpickle.dumps((build_model, make_batch))
    except Exception as exc:
        raise ArgumentError(f"max_batch_size: build_model and make_batch cannot be sent to a fresh process "
                            f"({type(exc).__name__}: {first_line(exc)}); define them at the top level of a cell "
                            "or a module.") from None
    search = BatchSearch([], low, high, steps, margin, resolution, where=where_words(setup),
                         lab=bool((setup or {}).get("lab_mb")), _run=(functions, setup, env, timeout))
    return search, max_probes


def _search(search: BatchSearch, probe_one, bar, method: str, max_probes: int, past: list[int]) -> int | None:
    """The plans (unless method is 'probe'), then probes until the edge is known (and the margin's probes);
    the batch it would have probed next (None: none). Ctrl-C keeps what the probes so far show."""
    low = search.low
    batch: int | None = low
    settling = False
    try:
        probe_past = True
        if method != "probe":
            from .plan_first import BETWEEN, DONE, UP, plan_first

            then = plan_first(search, probe_one, bar, auto=method == "auto", max_probes=max_probes)
            probe_past = then != BETWEEN  # BETWEEN: a failure above the edge is known already
            batch = None if then == DONE else next_batch(search, past, probe_past) if then in (UP, BETWEEN) \
                else low
        while batch is not None and len(search.probes) < max_probes:
            bar.probing(len(search.probes) + 1, batch)
            try:
                probe = probe_one(batch)
            except TooFewRows as few:
                batch = _from_replicas(search, batch, few)
                continue
            bar.probed(len(search.probes), probe)
            if not probe.fits and (probe.stage == "build" or (batch == low and search.largest is None)):
                what = ("the model alone does not fit: build_model() ran out of memory" if probe.stage == "build"
                        else f"a batch of {low:,} does not fit")
                raise ArgumentError(f"max_batch_size: {what} ({probe.verdict or 'out of memory'}"
                                    f"{', request ' + format_bytes(probe.request_bytes) if probe.request_bytes else ''}"
                                    f"; {search.where}): raise the limit or make the model smaller.")
            batch = next_batch(search, past, probe_past)
        if search.margin and batch is None:
            settling = True
            settle_recommended(search, probe_one, bar, max_probes)
    except KeyboardInterrupt:
        search.interrupted = True
        if settling:
            rec = search.recommended
            search.notes.append(RunNote("interrupted while probing for the margin, after the edge was known: "
                                        + (f"the recommended batch was measured by {search.trained_at(rec)} probe(s)"
                                           if rec is not None else "no batch is recommended")))
    return batch


def _from_replicas(search: BatchSearch, batch: int, few: TooFewRows) -> int:
    """The batch a search goes on from where the probe of `batch` gave a replica no row or did not divide by the
    replicas: the next multiple of them, where nothing was probed yet and `high` allows it (the search's `low`
    from then); else the probe's line, raised."""
    start = -(-batch // few.replicas) * few.replicas
    if search.probes or batch != search.low or start > search.high:
        raise few
    search.low = start
    search.notes.append(RunNote(f"the model's strategy runs {few.replicas} replicas, and Keras' fit takes a global "
                                f"batch that divides by them: the search began at {start:,}, not {batch:,}, and "
                                f"probed multiples of {few.replicas}"))
    return start
