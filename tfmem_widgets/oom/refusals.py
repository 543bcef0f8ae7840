"""Refusals said while a cell waits.

TensorFlow's allocator waits 10 s after refusing a request before it gives up, and writes a dump
each time. An XLA fit's GEMM autotuner (compiling, before the first step) can be refused scratch over
and over, 10 s each, for minutes, with nothing raised. A cell that is refused is told so as it happens,
not minutes later: a thread polls the dump place while the cell runs.

At the first refusal of a fit whose step is an XLA program, the step is planned while the cell waits
(``plans/need.early_need``, on a thread of its own) and the cell is told what the step
needs and the batch that fits, before the autotuner's minutes; the cell's report keeps that need. A fit
that is never refused costs nothing: nothing is planned.
"""

from __future__ import annotations

import os
import threading

from ..frontend import frontend
from ..tf.dump_place import dump_files

REFUSAL_POLL_S = 1.0
HINT_AFTER_S = 30.0  # a plain OOM raises 10 s after its refusal; refused for longer is something else, said every 30 s
AUTOTUNE_HINT = ("this Keras fit's step is an XLA program (jit_compile, Keras' default on a GPU): its compiler's "
                 "GEMM autotuner is trying kernels whose scratch memory does not fit, 10 s a refusal, for minutes; "
                 "interrupt the cell, then set XLA_FLAGS=--xla_gpu_autotune_level=0 before TensorFlow starts "
                 "(measured on an H200: the same fit then trained), lower the batch, or compile with "
                 "jit_compile=False")
_refusals = None


class _RefusalWatch(threading.Thread):
    """Polls the dump place while a cell runs; says each new refusal once, with its figures."""

    def __init__(self, prefix: str, existing: set[str]):
        super().__init__(name="tfmem-refusals", daemon=True)
        self.prefix, self.seen = prefix, set(existing)
        self.stop_event = threading.Event()
        self.refusals = 0  # dumps TensorFlow wrote: one when it refuses, one when its 10 s retry fails
        self.times: list[float] = []
        self.said_after = 0  # the "still refused" lines said so far, one per HINT_AFTER_S
        self.first: str | None = None  # the first refusal's figures
        self.said_first = False
        self.on_gpu = False  # the refused allocator is a GPU's (the autotuner's hint is said only there)
        self.main_thread = threading.get_ident()  # the cell's thread
        self.fit = None  # the Keras fit the cell was in at its first refusal (readings/fit_context.py)
        self.need = None  # what its XLA step needs, planned while the cell waited (early_need)
        self.planning: threading.Thread | None = None

    def run(self) -> None:
        while not self.stop_event.wait(REFUSAL_POLL_S):
            self.poll()

    def poll(self, final: bool = False) -> None:
        """Note new refusals; during an XLA fit say a wait that goes on; at the cell's end (final)
        say the first refusal if nothing was said."""
        import sys
        import time

        new = sorted(set(dump_files(self.prefix)) - self.seen)
        if not new and not (final and self.first is not None and not self.said_first):
            return
        self.seen.update(new)
        self.refusals += len(new)
        now = time.time()
        self.times.append(now)
        waited = now - self.times[0]
        if self.first is None:
            self.first = _refusal_figures(new[-1])
            self.on_gpu = "GPU" in os.path.basename(new[-1])  # (a lab's XLA on the CPU has no GEMM autotuner)
        if self.fit is None and not final:  # read while TensorFlow waits: once raised, Keras cuts its frames
            from ..readings.fit_context import fit_context_of_thread

            self.fit = fit_context_of_thread(self.main_thread)
            if self.fit is not None and self.fit.phase == "train" and getattr(self.fit.model, "jit_compile", None) is True:
                self.planning = threading.Thread(target=self._plan_early, name="tfmem-early-plan", daemon=True)
                self.planning.start()
        if final or frontend().fresh_child:  # a fresh child's stderr is shown only when it ends
            return  # a refusal the cell got over (or raised on) is the report's, or nothing to say
        if waited >= HINT_AFTER_S * (self.said_after + 1) and _xla_fit_running(self.main_thread):
            # A plain OOM raises 10 s after its refusal; an XLA fit's compiler is refused for minutes:
            # that wait is said while it lasts.
            self.said_after += 1
            line = (f"tfmem: still refused ({self.refusals} dumps in {waited:.0f} s, nothing raised yet; "
                    f"first: {self.first})")
            if self.said_after == 1 and self.on_gpu:
                line += f"; {AUTOTUNE_HINT}"
        else:
            return
        self.said_first = True
        print(line, file=sys.stderr, flush=True)

    def _plan_early(self) -> None:
        """Plan the refused XLA step now and say what it needs and what fits, while the cell waits."""
        import sys
        import time

        from ..plans.need import early_need
        from ..units import format_bytes

        started = time.time()
        try:
            need = early_need(self.fit)
        except Exception as exc:  # the user's model: never fail the cell
            from ..plans.need import StepNeed

            need = StepNeed(self.fit.batch_size, note=f"the step could not be planned ({type(exc).__name__})")
        self.need = need
        if frontend().fresh_child or self.stop_event.is_set() or need.peak_bytes is None:
            return
        limit = format_bytes(need.limit_bytes) if need.limit_bytes else "device's"
        lines = [f"tfmem: this fit's XLA step was refused memory; planned in {time.time() - started:.0f} s while it "
                 "waits:", *(f"  {line}" for line in need.lines(limit))]
        if need.fits_batch is not None and need.fits_batch < need.batch_size:
            lines.append(f"  interrupt the cell and fit with batch_size={need.fits_batch:,} (or less): at this batch "
                         "its compiler may go on being refused for minutes before anything is raised" if self.on_gpu else
                         f"  fit with batch_size={need.fits_batch:,} (or less), after a restart: in lab mode this OOM "
                         "raises in seconds, and the process dies at its next step")
        print("\n".join(lines), file=sys.stderr, flush=True)

    def stop(self) -> None:
        """Stop polling; a refusal not yet said is said now (a request beyond the limit can fail
        and be caught within the poll's second: the cell's output is the same either way)."""
        self.stop_event.set()
        if self is not threading.current_thread():
            self.join(timeout=5)
        self.poll(final=True)
        if self.planning is not None:  # its plans end within EARLY_SECONDS: the report keeps its need
            self.planning.join(timeout=60)


def _xla_fit_running(thread_id: int) -> bool:
    """Whether the cell's thread is inside a Keras fit (or evaluate, predict) of a model whose step
    is an XLA program: read from its Python frames, never from TensorFlow."""
    import sys

    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name in ("fit", "evaluate", "predict") else None
        if owner is not None and getattr(owner, "jit_compile", False) is True:
            return True
        frame = frame.f_back
    return False


def _refusal_figures(path: str) -> str:
    from ..errors import TraceDataError
    from ..tracing.dumps import load_memory_dump
    from ..units import format_bytes

    try:
        dump = load_memory_dump(path)
    except (TraceDataError, OSError):
        return os.path.basename(path)
    return (f"{dump.allocator}: {format_bytes(dump.in_use_bytes)} in use in a {format_bytes(dump.pool_bytes)} pool, "
            f"largest free chunk {format_bytes(dump.largest_free_bytes)}")


def start(prefix: str | None, existing: set[str]) -> None:
    """Watch `prefix` for refusals while a cell runs (the dumps in `existing` are old)."""
    global _refusals
    stop()
    if prefix:
        _refusals = _RefusalWatch(prefix, existing)
        _refusals.start()


def current_fit():
    """The Keras fit the running cell was in at its first refusal (None: no refusal, or no fit)."""
    watch = _refusals
    return None if watch is None else watch.fit


def stop() -> tuple[int, object, object]:
    """End the cell's watch (its first refusal said now): the refusals it saw, the Keras fit the cell
    was in at the first (None: none seen) and what its XLA step needs, planned while it waited (None)."""
    global _refusals
    watch, _refusals = _refusals, None
    if watch is None:
        return 0, None, None
    watch.stop()
    return watch.refusals, watch.fit, watch.need
