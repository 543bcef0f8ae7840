"""Capture TensorFlow's allocator events for a block of code, and the OOM dump if one happens.

``with trace() as t:`` runs the block under TensorFlow's profiler, reads the allocation
events from the xplane.pb it writes, and keeps TensorFlow's own dump of the allocator when
an allocation fails (the binary MemoryDump through TF_BFC_MEMORY_DUMP, and the text dump the
allocator logs to file descriptor 2, captured for the block and still shown). The result
rebuilds the allocator's chunks at any moment (``t.map(at=...)``).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from .allocator_map import AllocatorMap, Chunk
from .dumps import load_memory_dump, parse_bfc_dump
from ..errors import SetupError, TraceDataError
from .replay import Replay, fragmentation_series
from ..tf.runtime import (
    FORCE_GROWTH_ENV,
    GPU_ALLOCATOR_ENV,
    LAB_ALLOCATOR_NAME,
    lab_limit_bytes,
    logical_devices,
    physical_gpus,
    runtime_started,
    setup_env,
    tensorflow,
)
from ..units import format_bytes
from .capture import StderrCapture
from .events import AllocatorEvents
from ..oom.message import OomInfo, oom_info
from .profiler import TRACE_LOCK as _active, profiler_options, running_recorder
from .xspace import read_xplane_file

from ..oom.watch import DUMP_ENV


def _allocator_growth() -> dict[str, bool]:
    """Whether each allocator grows its pool (lab mode always does)."""
    growth = {LAB_ALLOCATOR_NAME: True}
    forced = setup_env().get(FORCE_GROWTH_ENV) == "true"
    gpus = {g.index: g for g in physical_gpus()}
    for device in logical_devices(list(gpus.values())):
        if device.device_type == "GPU":
            gpu = gpus[device.physical_index]
            grows = forced or (gpu.growth and gpu.logical_limits_mb is None)
            growth[f"GPU_{device.name.split(':')[1]}_bfc"] = grows
    return growth


class Trace:
    """The allocator events of a block, per allocator, and what happened at its end."""

    def __init__(self, events: dict[str, AllocatorEvents], fresh: bool, growth: dict[str, bool],
                 oom: OomInfo | None = None, dumps: dict[str, AllocatorMap] | None = None,
                 text_dump: AllocatorMap | None = None, logdir: str | None = None, log: str = "",
                 notes: tuple[str, ...] = ()):
        self._fill(events, fresh, growth, oom, dumps, text_dump, logdir, log, notes)

    @classmethod
    def _running(cls) -> "Trace":
        """The Trace a `with trace() as t:` block gives: empty until the block ends."""
        t = cls.__new__(cls)
        t._events = None
        return t

    def _fill(self, events, fresh, growth, oom=None, dumps=None, text_dump=None, logdir=None, log="", notes=()):
        self._events = events
        self.fresh = fresh  # traced from the runtime's start: every allocator's first allocation
        self._growth = growth
        self.oom = oom
        self.dumps = dumps or {}
        self.text_dump = text_dump
        self.logdir = logdir  # where the profiler's files were kept, if asked to keep them
        self.log = log  # what TensorFlow wrote to file descriptor 2 during the block
        self.notes = tuple(notes)  # what the trace had to leave out, and why
        self._replays: dict[str, Replay] = {}
        self.loaded = False

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_replays"] = {}  # a cache, rebuilt on demand
        return state

    @property
    def done(self) -> bool:
        """Whether the block has ended (a running block's Trace is filled in when it does)."""
        return self._events is not None

    def _check_done(self) -> None:
        if self._events is None:
            raise SetupError("the trace has no result until its block has ended.")

    # -- which allocator ---------------------------------------------------------------
    @property
    def allocators(self) -> list[str]:
        self._check_done()
        return sorted(self._events, key=lambda n: (not n.startswith("GPU"), n))

    @property
    def growth(self) -> dict[str, bool]:
        """Whether each allocator grew its pool on demand (lab mode always does)."""
        self._check_done()
        return dict(self._growth)

    def event_items(self):
        """(allocator, its events) for every allocator, as recorded."""
        self._check_done()
        return self._events.items()

    def allocator_name(self, allocator: str | None = None) -> str:
        """The allocator a call means: the one named, else the OOM's, else the first (GPUs first)."""
        return self._name(allocator)

    def is_fresh(self, allocator: str | None = None) -> bool:
        """Traced from the allocator's first allocation: its whole pool is known."""
        return self._is_fresh(self._name(allocator))

    def replay(self, allocator: str | None = None, index: int = -1) -> Replay:
        """The allocator rebuilt after event `index` (-1: the last)."""
        name = self._name(allocator)
        events = self._events[name]
        if not -len(events) <= index < len(events):
            raise SetupError(f"index={index} is outside this trace: {name} has events 0 to {len(events) - 1}.")
        return self._replay(name, index % len(events))

    def _dump_of(self, name: str) -> AllocatorMap | None:
        if name in self.dumps:
            return self.dumps[name]
        if self.text_dump is not None and self.text_dump.allocator == name:
            return self.text_dump
        return None

    def _name(self, allocator: str | None, dump_ok: bool = False) -> str:
        self._check_done()
        if dump_ok:
            # An OOM whose failed request was the allocator's only move in the block (a GPU with a
            # single too-large tensor): no events, but TensorFlow's dump of it.
            if allocator is None and self.oom is not None and self._dump_of(self.oom.allocator) is not None:
                return self.oom.allocator
            if allocator is not None and allocator not in self._events and self._dump_of(allocator) is not None:
                return allocator
            if allocator is None and not self._events and (self.dumps or self.text_dump is not None):
                return next(iter(self.dumps)) if self.dumps else self.text_dump.allocator
        if not self._events:
            raise TraceDataError(
                "the trace holds no allocator events: nothing in the block allocated through a BFC "
                "allocator (on the CPU that needs lab mode: %tfmem setup --lab N before any TensorFlow "
                "work; with TF_GPU_ALLOCATOR=cuda_malloc_async the GPU has no BFC chunks)."
            )
        if allocator is None:
            if self.oom and self.oom.allocator in self._events:
                return self.oom.allocator
            return self.allocators[0]
        if allocator not in self._events:
            raise SetupError(f"no events of allocator {allocator!r} in this trace; it has {', '.join(self.allocators)}.")
        return allocator

    def events(self, allocator: str | None = None) -> AllocatorEvents:
        return self._events[self._name(allocator)]

    def _is_fresh(self, name: str) -> bool:
        events = self._events[name]
        return self.fresh and events.in_use_before() == 0

    def _replay(self, name: str, index: int) -> Replay:
        replay = self._replays.get(name)
        if replay is None or replay.position > index:
            replay = Replay(self._events[name], fresh=self._is_fresh(name), growth=self._growth.get(name, True))
            self._replays[name] = replay
        return replay.run_to(index)

    # -- maps ----------------------------------------------------------------------------
    def map(self, at: int | str | None = None, allocator: str | None = None) -> AllocatorMap:
        """The allocator's chunks after event `at` ('peak' for the moment of peak).

        at=None: the state when the block ended or failed; after an OOM that is TensorFlow's own
        dump of the allocator at the failed allocation (``dump_index``), its chunks annotated
        with the ops the trace saw.
        """
        import numbers

        whole = isinstance(at, numbers.Integral) and not isinstance(at, bool)
        if not (at is None or whole or (isinstance(at, str) and at == "peak")):
            raise SetupError(f"at must be an event's index (an int), 'peak' or None, got {at!r}.")
        name = self._name(allocator, dump_ok=at is None)
        if name not in self._events:
            dump = self._dump_of(name)
            return AllocatorMap(
                allocator=name, chunks=dump.chunks, regions=dump.regions, source=dump.source,
                complete=dump.complete, limit_bytes=dump.limit_bytes,
                reported_fragmentation=dump.reported_fragmentation,
                failed_request_bytes=self.oom.request_bytes if self.oom and self.oom.allocator == name
                else dump.failed_request_bytes,
                notes=dump.notes + ("the block made no allocation in this allocator before the failed one: "
                                    "TensorFlow's dump as it is, without the trace's ops",),
            )
        events = self._events[name]
        if at == "peak":
            at = self.peak_index(name)
        if at is None:
            index = len(events) - 1
            if name in self.dumps:
                return self._annotated_dump(name, self.dumps[name])
            if self.text_dump is not None and self.text_dump.allocator == name:
                return self._annotated_dump(name, self.text_dump)
        else:
            index = int(at)
            if not -len(events) <= index < len(events):
                raise SetupError(f"at={at} is outside this trace: {name} has events 0 to {len(events) - 1}.")
            index %= len(events)
        notes = () if self._is_fresh(name) else (
            "traced after earlier work: chunks from before the trace are counted, not drawn",)
        return self._replay(name, index).snapshot(notes)

    def dump_index(self, allocator: str | None = None) -> int:
        """The event after which TensorFlow's dump was taken: the failed allocation comes after
        it, but Python may free tensors while the error unwinds, so it need not be the last
        event. It is the last event whose in-use figure equals the dump's."""
        name = self._name(allocator)
        events = self._events[name]
        dump = self._dump_of(name)
        if dump is None:
            return len(events) - 1
        in_use = sum(c.size for c in dump.chunks if c.in_use)
        matches = np.nonzero(events.in_use == in_use)[0]
        return int(matches[-1]) if len(matches) else len(events) - 1

    def _annotated_dump(self, name: str, dump: AllocatorMap) -> AllocatorMap:
        index = self.dump_index(name)
        replay = self._replay(name, index)
        events = self._events[name]
        chunks = []
        for chunk in dump.chunks:
            known = replay.in_use.get(chunk.address) if chunk.in_use else None
            if known is not None and known[0] == chunk.size:
                k = known[1]
                chunk = Chunk(chunk.address, chunk.size, True, chunk.requested, events.text(events.op, k) or chunk.op,
                              events.text(events.shape, k), k)
            chunks.append(chunk)
        regions = dump.regions
        notes = dump.notes
        if dump.source == "dump" and self._is_fresh(name) and not replay.inconsistencies:
            regions, notes = tuple(replay.regions), ()  # the trace knows the regions exactly
        return AllocatorMap(
            allocator=name, chunks=tuple(chunks), regions=regions, source=dump.source, complete=True,
            limit_bytes=dump.limit_bytes or events.limit_bytes, event_index=index,
            reported_fragmentation=dump.reported_fragmentation,
            failed_request_bytes=self.oom.request_bytes if self.oom and self.oom.allocator == name
            else dump.failed_request_bytes,
            notes=notes,
        )

    # -- moments and series --------------------------------------------------------------
    def peak_index(self, allocator: str | None = None) -> int:
        """The event after which the allocator held the most (the first such event)."""
        return int(np.argmax(self.events(allocator).in_use))

    def peak_by_op(self, allocator: str | None = None) -> dict[str, int]:
        """What the allocator held at its peak, per op."""
        return self.map("peak", allocator).by_op()

    def by_layer(self, at: int | str | None = "peak", allocator: str | None = None, namespace: dict | None = None):
        """In-use bytes per Keras layer and phase at a moment (the peak by default): each chunk
        named by its op, memory from before the trace as its own key."""
        return self.map(at, allocator).by_layer(namespace=namespace, live=not self.loaded)

    def fragmentation_series(self, allocator: str | None = None) -> np.ndarray:
        """The rebuilt fragmentation after every event (a trace from the first allocation)."""
        name = self._name(allocator)
        if not self._is_fresh(name):
            raise SetupError(
                f"{name} was traced after earlier work: its pool's layout before the trace is unknown, "
                "so fragmentation can only be TensorFlow's own figure (events(...).fragmentation)."
            )
        return fragmentation_series(self._events[name], self._growth.get(name, True))

    # -- pictures (matplotlib) -----------------------------------------------------------
    def plot_map(self, allocator: str | None = None, ax=None):
        """Address against time, each chunk coloured by its op (see plots.plot_map)."""
        from ..views.plots import plot_map

        return plot_map(self, allocator, ax)

    def plot_timeline(self, allocator: str | None = None, ax=None):
        from ..views.plots import plot_timeline

        return plot_timeline(self, allocator, ax)

    def plot_snapshot(self, at=None, allocator: str | None = None, ax=None):
        from ..views.plots import plot_snapshot

        return plot_snapshot(self, at, allocator, ax)

    # -- text ----------------------------------------------------------------------------
    def __repr__(self) -> str:
        if self._events is None:
            return "<tfmem trace: running>"
        lines = []
        if not self._events:
            lines.append("tfmem trace: no allocator events (nothing allocated through a BFC allocator)")
        for name in self.allocators:
            e = self._events[name]
            peak = self.peak_index(name)
            top = list(self.peak_by_op(name).items())[:3]
            lines.append(
                f"tfmem trace {name}: {len(e)} events, in use {format_bytes(e.in_use_before())} -> "
                f"{format_bytes(int(e.in_use[-1]))}, peak {format_bytes(int(e.in_use[peak]))} at event {peak} "
                f"({', '.join(f'{op} {format_bytes(b)}' for op, b in top)})"
            )
            if not self._is_fresh(name):
                lines.append(f"  traced after earlier work: {format_bytes(e.in_use_before())} from before the trace")
        if self.oom:
            lines.append(f"OOM in {self.oom.allocator}: {self.oom.message}")
            if self.oom.allocator in self._events or self._dump_of(self.oom.allocator) is not None:
                lines.append(repr(self.map(allocator=self.oom.allocator)))
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    # -- export --------------------------------------------------------------------------

    def to_json(self, path: str | Path) -> None:
        """Everything, losslessly: events, dumps, OOM; Trace.load gives the same maps back.

        The file carries a checksum of its contents, so a damaged or edited file is refused."""
        from .files import save

        save(self, path)

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """A trace saved with to_json; a damaged, cut or edited file is refused in one line."""
        from .files import load

        loaded = load(path, cls)
        loaded.loaded = True  # from a file: this process's variables say nothing of its chunks
        return loaded

    def to_csv(self, path: str | Path) -> None:
        """One row per event: allocator, time, alloc/free, address, bytes, op, TensorFlow's figures."""
        from .files import save_csv

        save_csv(self, path)


# The dump prefix a running trace set in the environment (so a child process can leave it out).
_owned_dump_prefix: str | None = None


def tracing() -> bool:
    """Whether a trace is running in this process (TensorFlow runs one profiler per process)."""
    return _active.locked()


def owned_dump_prefix() -> str | None:
    """TF_BFC_MEMORY_DUMP as a running trace set it, or None (a user's own value is theirs)."""
    return _owned_dump_prefix


def _profiler_stop_quietly() -> None:
    try:
        tensorflow().profiler.experimental.stop()
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
            raise SetupError(f"keep must be a folder's path, got {keep!r}.")
        if keep is not None and not str(keep).strip():
            raise SetupError("keep must name a folder, got an empty path.")
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

    @property
    def running(self) -> bool:
        """Entered and not yet left."""
        return self._held

    # -- entering: each step undone if a later one fails (or Ctrl-C comes) ----------------
    def __enter__(self) -> Trace:
        if self._held or self.result is not None:
            raise SetupError("this trace() block has already run; make a new one for each block.")
        if not _active.acquire(blocking=False):
            raise SetupError("a trace is already running: traces cannot nest (TensorFlow runs one profiler per process).")
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
        global _owned_dump_prefix
        env = setup_env()
        if env.get(GPU_ALLOCATOR_ENV) == "cuda_malloc_async" and lab_limit_bytes() is None:
            raise SetupError(
                "TF_GPU_ALLOCATOR=cuda_malloc_async: GPU memory is CUDA's pool, not TensorFlow's BFC "
                "allocator, so there are no chunks to trace; %%tfmem measures it."
            )
        self._fresh = not runtime_started()
        self._growth = _allocator_growth()
        self._logdir = self._make_logdir()
        self._made_logdir = True
        from ..oom.watch import owned_prefix

        user_prefix = os.environ.get(DUMP_ENV)
        if user_prefix and user_prefix != owned_prefix():  # the OOM watcher's place is not the user's
            # The user's own dump place: leave it, and read only the dumps written during the block.
            self._dump_prefix = user_prefix
            self._dumps_before = set(glob.glob(glob.escape(user_prefix) + "_*"))
        else:
            self._dump_prefix = os.path.join(self._logdir, "bfc_dump")
            self._dumps_before = set()
            self._previous_dump_env = os.environ.get(DUMP_ENV)
            self._dump_env_set = True
            os.environ[DUMP_ENV] = self._dump_prefix
            _owned_dump_prefix = self._dump_prefix
        self._stderr = StderrCapture()
        self._stderr.start()
        self._paused_recorder = running_recorder()
        if self._paused_recorder is not None:
            self._paused_recorder.pause()  # one profiler per process: the trace's, until it ends
        self._profiling = True
        try:
            tensorflow().profiler.experimental.start(self._logdir, options=profiler_options())
        except Exception as exc:
            self._profiling = False  # not ours to stop: another profiler may be running
            raise SetupError(f"TensorFlow's profiler did not start ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}); is another profiler running?") from None

    def _make_logdir(self) -> str:
        if self.keep is None:
            return tempfile.mkdtemp(prefix="tfmem-trace-")
        try:
            self.keep.mkdir(parents=True, exist_ok=True)
            # A folder of this trace's own: an earlier trace's files in `keep` are never read.
            return tempfile.mkdtemp(prefix=time.strftime("trace-%Y%m%d-%H%M%S-"), dir=self.keep)
        except OSError as exc:
            raise SetupError(
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
                tensorflow().profiler.experimental.stop()
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
        for path in sorted(set(glob.glob(glob.escape(self._dump_prefix) + "_*")) - self._dumps_before):
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
        if "Next region of size" in logged:
            try:
                text_dump = parse_bfc_dump(logged)
            except TraceDataError:
                text_dump = None  # the binary dump is the exact record; the log is a fallback
        oom = oom_info(exc, logged) if exc is not None else None
        self.result._fill(events, self._fresh, self._growth, oom, dumps, text_dump,
                          logdir=self._logdir if self.keep is not None else None, log=logged, notes=tuple(notes))
        return self.result

    def _restore_env(self) -> None:
        global _owned_dump_prefix
        if self._dump_env_set:
            if self._previous_dump_env is None:
                os.environ.pop(DUMP_ENV, None)
            else:
                os.environ[DUMP_ENV] = self._previous_dump_env
            self._dump_env_set = False
            _owned_dump_prefix = None

    def _release(self) -> None:
        """Undo whatever is still held, in reverse order; safe to call on any path, twice."""
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
