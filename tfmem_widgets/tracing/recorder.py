"""A recorder for the next OOM: the profiler on, with only what allocator events need, so an
OOM's dump can name every chunk's op, layer and phase.

TensorFlow's allocator events are host events (TraceMe at level 2, recorded on the /host:CPU
plane even for a GPU's allocator), so the profiler runs with the host tracer alone: no device
tracer (CUPTI on a GPU), no Python tracer. The profiler keeps its events in memory until it
stops, so the recorder works in windows: every `window` seconds its own thread stops it, folds
the window's allocations into a table (each address's last allocation: time, size, op) and
starts it again, so the cost of collecting lands beside the user's work, not in a cell's time.
At an OOM the window is ended at once and the report reads that table.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
import time

from ..errors import ArgumentError, StateError
from .profiler import TRACE_LOCK, profiler_options, profiler_start, profiler_stop, running_recorder, set_recorder

_SLACK_NS = 50_000_000  # the profiler's start and the wall clock, matched to 50 ms

def check_window(window) -> float:
    """A window's length: seconds between 1 and 3600 (the magic's --window and the API)."""
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not (1 <= window <= 3600):
        raise ArgumentError(f"record: window is seconds between 1 and 3600, got {window!r}.")
    return float(window)


class Recorder:
    """``tfmem_widgets.record()`` starts one; ``stop()`` ends it. One per process."""

    def __init__(self, window: float = 10.0):
        self.window = check_window(window)
        self.live: dict[str, dict[int, tuple]] = {}  # allocator -> address -> (time, size, op)
        self.windows = 0
        self.events = 0
        self.notes: list[str] = []
        self._lock = threading.RLock()
        self._logdir: str | None = None
        self._profiling = False
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._paused = False

    # -- the profiler's windows ------------------------------------------------------------
    def _start_window(self) -> None:
        self._logdir = tempfile.mkdtemp(prefix="tfmem-record-")
        self._window_start_ns = time.time_ns()  # the profiler's times count from its start
        try:
            profiler_start(self._logdir, options=profiler_options())
        except BaseException as exc:
            if not isinstance(exc, Exception):  # Ctrl-C: the profiler may have started just before it
                try:
                    profiler_stop()
                except Exception:
                    pass
            shutil.rmtree(self._logdir, ignore_errors=True)
            self._logdir = None
            if not isinstance(exc, Exception):
                raise
            raise StateError(f"the recorder could not start TensorFlow's profiler ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); is another profiler or trace running?"
                             ) from None
        self._profiling = True

    def _end_window(self, until_ns: int | None = None) -> None:
        """Stop the profiler and fold what it recorded into the table."""
        import glob
        import os

        from .xspace import read_xplane_file

        if not self._profiling:
            return
        try:  # an interrupt before this returns changes nothing: the window goes on
            profiler_stop()
        except Exception as exc:
            self.notes.append(f"a window was lost: the profiler was stopped elsewhere ({type(exc).__name__})")
        self._profiling = False
        logdir, self._logdir = self._logdir, None
        try:  # an interrupt from here on (Ctrl-C while an OOM report rolls the window) leaves no folder
            try:
                for path in glob.glob(os.path.join(glob.escape(logdir), "plugins", "profile", "*", "*.xplane.pb")):
                    for name, events in read_xplane_file(path).items():
                        self._fold(name, events, until_ns)
            except Exception as exc:  # a window that cannot be read costs its names, never the user's cell
                self.notes.append(f"a window could not be read ({type(exc).__name__}: {exc})")
        finally:
            if logdir is not None:
                shutil.rmtree(logdir, ignore_errors=True)
        self.windows += 1

    def _fold(self, name: str, events, until_ns: int | None = None) -> None:
        """Keep, per address, its last allocation (wall-clock time, size, op), in bulk. until_ns:
        an OOM's moment; the window's later allocations are left out (an OOM's dump is of the
        moment it failed, and a hole its step freed may be taken again at once)."""
        import numpy as np

        table = self.live.setdefault(name, {})
        allocs = events.kind > 0
        times = events.time_ns[allocs] + self._window_start_ns
        keep = times <= until_ns if until_ns is not None else np.ones(len(times), dtype=bool)
        addresses = events.address[allocs][keep]
        if len(addresses):
            # the last allocation at each address: the first one in the reversed order
            unique, first = np.unique(addresses[::-1], return_index=True)
            last = len(addresses) - 1 - first
            chosen_times = times[keep][last].tolist()
            sizes = events.size[allocs][keep][last].tolist()
            ops = events.op[allocs][keep][last].tolist()
            texts = events.texts
            table.update(zip(unique.tolist(), zip(chosen_times, sizes, (texts[o] for o in ops))))
        self.events += len(events)

    def pause(self) -> None:
        """A trace takes the profiler: the window ends until resume()."""
        with self._lock:
            self._end_window()
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            if self._paused and not self._stop_event.is_set():
                self._paused = False
                self._start_window()

    def roll(self, until_ns: int | None = None) -> None:
        """End the current window and start the next (the cell's end, the timer, an OOM)."""
        with self._lock:
            if not self._profiling or self._paused:
                return
            try:
                self._end_window(until_ns)
            finally:  # interrupted or not, a running recorder records: the next window starts
                if not self._stop_event.is_set() and not self._profiling:
                    self._start_window()

    def _run(self) -> None:
        while not self._stop_event.wait(self.window):
            try:
                self.roll()
            except Exception as exc:
                self.notes.append(f"the recorder stopped: {exc}")
                return

    # -- life ------------------------------------------------------------------------------
    def start(self) -> Recorder:
        if TRACE_LOCK.locked():
            raise StateError("a trace is running: the recorder starts after it (one profiler per process).")
        with self._lock:
            self._start_window()
        self._thread = threading.Thread(target=self._run, name="tfmem-recorder", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop_event.set()
        try:
            if self._thread is not None and self._thread is not threading.current_thread():
                self._thread.join()
        finally:  # Ctrl-C while waiting for the thread: the profiler is stopped all the same
            with self._lock:
                self._end_window()
            if running_recorder() is self:  # the profiler is free again: the user's sessions too
                set_recorder(None)

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._stop_event.is_set()

    def op_of(self, allocator: str, address: int, size: int, at_ns: int | None = None) -> str | None:
        """The op that made the chunk of this address and size in use at `at_ns` (an OOM's dump:
        wall-clock nanoseconds; the window's clock matched to it within _SLACK_NS), where a
        window saw it made: the last allocation at the address before that moment."""
        entry = self.live.get(allocator, {}).get(address)
        if entry is None:
            return None
        t, chunk_size, op = entry
        if at_ns is not None and t > at_ns + _SLACK_NS:
            return None  # taken again after that moment
        return op if chunk_size == size else None

    def __repr__(self) -> str:
        state = "recording" if self.running else "stopped"
        known = sum(len(t) for t in self.live.values())
        return (f"tfmem recorder ({state}): {self.windows} window(s) of up to {self.window:g} s, "
                f"{self.events} allocator events read, the op of {known} address(es) known")

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


_current_lock = threading.Lock()
_stop_at_exit = False


def record(window: float = 10.0) -> Recorder:
    """Start recording allocator events (host tracer only) so that the next OOM names each
    chunk's op, layer and phase. Returns the running Recorder; ``stop()`` ends it."""
    with _current_lock:
        running = running_recorder()
        if running is not None and running.running:
            return running
        recorder = Recorder(window)
        recorder.start()
        set_recorder(recorder)
        global _stop_at_exit
        if not _stop_at_exit:  # a window rolling in TensorFlow's code when the interpreter ends aborts it
            import atexit

            atexit.register(stop)
            _stop_at_exit = True
        return recorder


def stop() -> Recorder | None:
    """Stop the recorder (if one runs) and return it."""
    with _current_lock:
        recorder = running_recorder()
    if recorder is not None:
        recorder.stop()  # it lets the profiler go only once it is stopped: never one left with no owner
    return recorder


def current() -> Recorder | None:
    recorder = running_recorder()
    return recorder if recorder is not None and recorder.running else None


def name_chunks(amap, at_ns: int | None = None):
    """The map with each in-use chunk's op filled from the recorder's table (exact address and
    size, as of `at_ns`), and the recorder's window rolled first so the failing cell's events
    are in."""
    from dataclasses import replace

    recorder = current()
    if recorder is None:
        return amap, False
    recorder.roll(None if at_ns is None else at_ns + _SLACK_NS)
    chunks = []
    for c in amap.chunks:
        op = recorder.op_of(amap.allocator, c.address, c.size, at_ns) if c.in_use and not c.op else None
        chunks.append(replace(c, op=op) if op else c)
    return replace(amap, chunks=tuple(chunks)), True
