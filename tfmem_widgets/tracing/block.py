"""Capture TensorFlow's allocator events for a block of code, and the OOM dump if one happens.

``with trace() as t:`` runs the block under TensorFlow's profiler, reads the allocation
events from the xplane.pb it writes, and keeps TensorFlow's own dump of the allocator when
an allocation fails (the binary MemoryDump through TF_BFC_MEMORY_DUMP, and the text dump the
allocator logs to file descriptor 2, captured for the block and still shown). Every step is
undone on every exit; the result is a ``Trace`` (tracing/result.py).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..errors import ArgumentError, StateError, TraceDataError
from ..readings.fit_context import FitSpotter
from ..tf import dump_place
from ..tf.allocator import has_text_dump
from ..tf.dump_place import DUMP_ENV
from ..tf.lab import lab_limit_bytes
from ..tf.limits import allocator_growth
from ..tf.messages import oom_info
from ..tf.options import GPU_ALLOCATOR_ENV
from ..tf.runtime import runtime_started, setup_env
from .allocator_map import AllocatorMap
from .capture import StderrCapture
from .dumps import load_memory_dump, parse_bfc_dump
from .events import AllocatorEvents
from .profiler import TRACE_LOCK as _active
from .profiler import profiler_options, profiler_start, profiler_stop, running_recorder
from .result import Trace
from .xspace import read_xplane_file


def tracing() -> bool:
    """Whether a trace is running in this process (TensorFlow runs one profiler per process)."""
    return _active.locked()


def _profiler_stop_quietly() -> None:
    try:
        profiler_stop()
    except Exception:
        pass


class trace:
    """``with trace() as t:`` records every allocator event of the block.

    keep: a folder to keep the profiler's files in; each trace makes a new folder of its own
    inside it (``t.logdir``) and reads only what it made (the files are deleted otherwise).
    TF_BFC_MEMORY_DUMP set by the user is left as it is: TensorFlow's dumps land where they
    asked, and the trace reads the ones written during the block.
    An exception in the block (an OOM, Ctrl-C) stops the profiler, keeps what was captured
    in ``t`` and propagates.

    >>> with tfmem_widgets.trace() as t:     # t is the Trace, filled in when the block ends
    ...     model.fit(x, y, epochs=1)
    >>> t.map("peak").by_op()
    """

    def __init__(self, keep: str | Path | None = None):
        if keep is not None and not isinstance(keep, (str, os.PathLike)):
            raise ArgumentError(f"keep must be a folder's path, got {keep!r}.")
        if keep is not None and not str(keep).strip():
            raise ArgumentError("keep must name a folder, got an empty path.")
        self.keep = None if keep is None else Path(keep).expanduser()
        self.result: Trace | None = None
        self._held = False  # the one-trace lock
        self._logdir: str | None = None
        self._made_logdir = False
        self._dump_env_set = False
        self._previous_dump_env: str | None = None
        self._stderr: StderrCapture | None = None
        self._profiling = False
        self._paused_recorder = None
        self._spotter: FitSpotter | None = None

    @property
    def running(self) -> bool:
        """Entered and not yet left."""
        return self._held

    # -- entering: each step undone if a later one fails (or Ctrl-C comes) ----------------
    def __enter__(self) -> Trace:
        if self._held or self.result is not None:
            raise StateError("this trace() block has already run; make a new one for each block.")
        if not _active.acquire(blocking=False):
            raise StateError("a trace is already running: traces cannot nest (TensorFlow runs one profiler per process).")
        self._held = True
        try:
            self.result = Trace._running()
            self._start()
        except BaseException:
            self.result = None
            self._release()
            raise
        return self.result

    def _start(self) -> None:
        env = setup_env()
        if env.get(GPU_ALLOCATOR_ENV) == "cuda_malloc_async" and lab_limit_bytes() is None:
            raise StateError(
                "TF_GPU_ALLOCATOR=cuda_malloc_async: GPU memory is CUDA's pool, not TensorFlow's BFC "
                "allocator, so there are no chunks to trace; %%tfmem measures it."
            )
        self._fresh = not runtime_started()
        self._growth = allocator_growth()
        self._logdir = self._make_logdir()
        self._made_logdir = True
        user_prefix = dump_place.user_prefix()  # the OOM watcher's place is not the user's
        if user_prefix:
            # The user's own dump place: leave it, and read only the dumps written during the block.
            self._dump_prefix = user_prefix
            self._dumps_before = set(dump_place.dump_files(user_prefix))
        else:
            self._dump_prefix = os.path.join(self._logdir, "bfc_dump")
            self._dumps_before = set()
            self._previous_dump_env = os.environ.get(DUMP_ENV)
            self._dump_env_set = True
            os.environ[DUMP_ENV] = self._dump_prefix
            dump_place.claim(self._dump_prefix, "a trace")
        self._stderr = StderrCapture()
        self._stderr.start()
        self._paused_recorder = running_recorder()
        if self._paused_recorder is not None:
            self._paused_recorder.pause()  # one profiler per process: the trace's, until it ends
        self._profiling = True
        self._spotter = FitSpotter()  # the Keras fits of the block: their XLA programs are planned when read
        self._spotter.start()
        try:
            profiler_start(self._logdir, options=profiler_options())
        except Exception as exc:
            self._profiling = False  # not ours to stop: another profiler may be running
            raise StateError(f"TensorFlow's profiler did not start ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); is another profiler running?") from None

    def _make_logdir(self) -> str:
        if self.keep is None:
            return tempfile.mkdtemp(prefix="tfmem-trace-")
        try:
            self.keep.mkdir(parents=True, exist_ok=True)
            # A folder of this trace's own: an earlier trace's files in `keep` are never read.
            return tempfile.mkdtemp(prefix=time.strftime("trace-%Y%m%d-%H%M%S-"), dir=self.keep)
        except OSError as exc:
            raise ArgumentError(
                f"cannot keep the trace in {str(self.keep)!r}: {exc.strerror or exc}; name a folder you can write to."
            ) from None

    # -- leaving ------------------------------------------------------------------------
    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self._held:
            return False
        try:
            self._finish(exc)
        finally:
            self._release()
        return False

    def _finish(self, exc: BaseException | None) -> Trace:
        """Stop, read what the block left, and fill in the block's Trace."""
        notes = []
        if self._profiling:
            try:
                profiler_stop()
            except Exception as stop_error:
                notes.append(
                    "TensorFlow's profiler was stopped inside the block (tf.profiler.experimental.stop()): "
                    "events after that are missing" if "No profiler is running" in str(stop_error)
                    else f"TensorFlow's profiler did not stop cleanly ({type(stop_error).__name__})"
                )
            self._profiling = False
        logged = self._stderr.stop()
        self._restore_env()
        files = sorted(glob.glob(os.path.join(glob.escape(self._logdir), "plugins", "profile", "*", "*.xplane.pb")))
        if not files and notes and exc is None:
            raise TraceDataError(f"no trace was written: {notes[0]}; leave the profiler to %%tfmem trace.")
        events: dict[str, AllocatorEvents] = {}
        try:
            for path in files:
                events.update(read_xplane_file(path))
        except TraceDataError as error:
            if exc is None:
                raise
            # The block's own exception (an OOM) is what the user must see: the trace keeps the dumps
            # and says what it could not read, instead of replacing that exception.
            events = {}
            notes.append(f"the profiler's events could not be read: {error}")
        dumps = {}
        for path in [p for p in dump_place.dump_files(self._dump_prefix) if p not in self._dumps_before]:
            try:
                dump = load_memory_dump(path)
            except TraceDataError as error:
                notes.append(f"a dump was left out: {error}")
                continue
            if not _dump_fits_events(dump, events):
                notes.append(f"{path} was left out: its allocator's state matches no moment of this trace "
                             "(written by another process)")
                continue
            dumps[dump.allocator] = dump  # several per OOM, one per retry: the last wins
        text_dump = None
        if has_text_dump(logged):
            try:
                text_dump = parse_bfc_dump(logged)
            except TraceDataError:
                text_dump = None  # the binary dump is the exact record; the log is a fallback
        oom = oom_info(exc, logged) if exc is not None else None
        self.result._fill(events, self._fresh, self._growth, oom, dumps, text_dump,
                          logdir=self._logdir if self.keep is not None else None, log=logged, notes=tuple(notes))
        self.result.fits = self._stop_spotter()
        if oom is not None:
            self.result.keep_oom_report(self.explain(exc, self.result))
        return self.result

    def explain(self, exc: BaseException, result: Trace):
        """The report of the block's OOM, kept on the Trace (oom/traced.py explains it; here: None)."""
        return None

    def _restore_env(self) -> None:
        if self._dump_env_set:
            if self._previous_dump_env is None:
                os.environ.pop(DUMP_ENV, None)
            else:
                os.environ[DUMP_ENV] = self._previous_dump_env
            self._dump_env_set = False
            dump_place.release(self._dump_prefix)

    def _stop_spotter(self) -> list:
        spotter, self._spotter = self._spotter, None
        return [] if spotter is None else spotter.stop()

    def _release(self) -> None:
        """Undo whatever is still held, in reverse order; safe to call on any path, twice."""
        self._stop_spotter()
        try:
            if self._profiling:
                self._profiling = False
                _profiler_stop_quietly()
        finally:
            try:
                if self._stderr is not None:
                    self._stderr.stop()
            finally:
                try:
                    self._restore_env()
                finally:
                    try:
                        if self._made_logdir and self.keep is None and self._logdir is not None:
                            shutil.rmtree(self._logdir, ignore_errors=True)
                        elif self._made_logdir and not (self.result is not None and self.result.done) \
                                and self._logdir is not None:
                            # A refused kept trace leaves nothing; one that wrote files (a failure while
                            # reading them) leaves them for the user.
                            try:
                                os.rmdir(self._logdir)
                            except OSError:
                                pass
                        self._made_logdir = False
                    finally:
                        try:
                            if self._paused_recorder is not None:
                                recorder, self._paused_recorder = self._paused_recorder, None
                                recorder.resume()
                        finally:
                            if self._held:
                                self._held = False
                                _active.release()

    def __repr__(self) -> str:
        return repr(self.result) if self.result is not None else "<tfmem trace: running>"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def _dump_fits_events(dump: AllocatorMap, events: dict[str, AllocatorEvents]) -> bool:
    """Whether a dump's in-use total is one the trace's allocator had at some moment."""
    allocator_events = events.get(dump.allocator)
    if allocator_events is None or not len(allocator_events):
        return True  # nothing to check it against
    in_use = sum(c.size for c in dump.chunks if c.in_use)
    return bool(in_use == allocator_events.in_use_before() or np.any(allocator_events.in_use == in_use))
