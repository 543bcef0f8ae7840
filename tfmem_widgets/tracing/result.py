"""A trace's result: the allocator events of a block, per allocator, and what happened at its end.

``Trace`` rebuilds an allocator's chunks at any moment (``t.map(at=...)``), reads the pool at its
peak by op and by Keras layer, and after an OOM annotates TensorFlow's own dump with the ops the
trace saw; it saves to a file and loads back the same.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import ArgumentError, StateError, TraceDataError
from ..tf.messages import OomInfo
from ..units import format_bytes
from .allocator_map import AllocatorMap, Chunk
from .events import AllocatorEvents
from .replay import Replay, fragmentation_series


class Trace:
    """The allocator events of a block, per allocator, and what happened at its end."""

    def __init__(self, events: dict[str, AllocatorEvents], fresh: bool, growth: dict[str, bool],
                 oom: OomInfo | None = None, dumps: dict[str, AllocatorMap] | None = None,
                 text_dump: AllocatorMap | None = None, logdir: str | None = None, log: str = "",
                 notes: tuple[str, ...] = ()):
        self._fill(events, fresh, growth, oom, dumps, text_dump, logdir, log, notes)

    @classmethod
    def _running(cls) -> Trace:
        """The Trace a `with trace() as t:` block gives: empty until the block ends."""
        t = cls.__new__(cls)
        t._events = None
        return t

    def _fill(self, events, fresh, growth, oom=None, dumps=None, text_dump=None, logdir=None, log="", notes=()):
        self._events = events
        self.fresh = fresh  # traced from the runtime's start: every allocator's first allocation
        self._growth = growth
        self.oom = oom
        self._oom_report = None  # the block's OOM explained (an OomReport): oom/traced.py, explain_oom(trace)
        self.dumps = dumps or {}
        self.text_dump = text_dump
        self.logdir = logdir  # where the profiler's files were kept, if asked to keep them
        self.log = log  # what TensorFlow wrote to file descriptor 2 during the block
        self.notes = tuple(notes)  # what the trace had to leave out, and why
        self._replays: dict[str, Replay] = {}
        self.loaded = False
        self.fits = []  # the Keras fits the block ran: (model's weak reference, batch size, specs)
        self._programs_planned = False

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_replays"] = {}  # a cache, rebuilt on demand
        state["fits"] = []  # weak references to this process's models
        return state

    def _plan_programs(self) -> None:
        """Once: the XLA programs of the fits the block ran, planned (``plans/plan.py``) so that
        their buffers of temporaries are read by layer and phase (readings/layers.py). A plan compiles the
        step again; a model gone, or one whose step runs as a graph, is not planned."""
        if getattr(self, "_programs_planned", False):
            return
        from ..plans.plan import plan

        self._programs_planned = True
        notes = []
        for model_ref, batch, sample in getattr(self, "fits", []):
            model = model_ref()
            if model is None or getattr(model, "jit_compile", None) is not True:
                continue
            try:
                plan(model, sample, batch, build=True, place=False)
            except Exception as exc:  # the user's model: the buffer stays named by its program
                notes.append(f"the fit's XLA program at batch {batch:,} could not be planned "
                             f"({type(exc).__name__}): its buffer is named by the program alone")
        self.notes = (*self.notes, *notes)
        from ..readings.layers import name_compile_scratch

        if any([name_compile_scratch(events) for events in (self._events or {}).values()]):
            self._replays = {}  # the maps are rebuilt with the new names

    @property
    def done(self) -> bool:
        """Whether the block has ended (a running block's Trace is filled in when it does)."""
        return self._events is not None

    def _check_done(self) -> None:
        if self._events is None:
            raise StateError("the trace has no result until its block has ended.")

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
            raise ArgumentError(f"index={index} is outside this trace: {name} has events 0 to {len(events) - 1}.")
        return self._replay(name, index % len(events))

    def pool_bytes_after_each_event(self, allocator: str | None = None) -> np.ndarray | None:
        """The pool's size (its regions) after each event, rebuilt; None where the trace began after earlier
        work (its regions are not known)."""
        name = self._name(allocator)
        if not self._is_fresh(name):
            return None
        events = self._events[name]
        replay = Replay(events, fresh=True, growth=self._growth.get(name, True))
        pool = np.empty(len(events))
        for i in range(len(events)):
            replay.step()
            pool[i] = replay.pool_bytes
        return pool

    def oom_report(self):
        """The block's OOM explained (an OomReport: verdict, fixes, layers) where it has been: at the block's
        end in the process that ran it, or by explain_oom(trace) (a loaded trace); None otherwise."""
        return self._oom_report

    def keep_oom_report(self, report) -> None:
        """The report of the block's OOM, kept with the trace (its text shows the verdict and fixes)."""
        self._oom_report = report

    def knows(self, allocator: str) -> bool:
        """Whether the trace holds events or a dump of this allocator (so a map of it)."""
        return allocator in self._events or self._dump_of(allocator) is not None

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
            raise ArgumentError(f"no events of allocator {allocator!r} in this trace; it has {', '.join(self.allocators)}.")
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
            raise ArgumentError(f"at must be an event's index (an int), 'peak' or None, got {at!r}.")
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
                raise ArgumentError(f"at={at} is outside this trace: {name} has events 0 to {len(events) - 1}.")
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
        self._plan_programs()
        return self.map(at, allocator).by_layer(namespace=namespace, live=not self.loaded)

    def fragmentation_series(self, allocator: str | None = None) -> np.ndarray:
        """The rebuilt fragmentation after every event (a trace from the first allocation)."""
        name = self._name(allocator)
        if not self._is_fresh(name):
            raise StateError(
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
            if self.knows(self.oom.allocator):
                lines.append(repr(self.map(allocator=self.oom.allocator)))
            report = self._oom_report
            if report is not None and report.map is not None:
                lines.append(f"  verdict: {report.verdict}")
                lines += [f"    {r}" for r in report.reasons()]
                fixes = report.fixes()
                if fixes:
                    lines.append("  fixes:")
                    lines += [f"    - {f}" for f in fixes]
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
    def load(cls, path: str | Path) -> Trace:
        """A trace saved with to_json; a damaged, cut or edited file is refused in one line."""
        from .files import load

        loaded = load(path, cls)
        loaded.loaded = True  # from a file: this process's variables say nothing of its chunks
        return loaded

    def to_csv(self, path: str | Path) -> None:
        """One row per event: allocator, time, alloc/free, address, bytes, op, TensorFlow's figures."""
        from .files import save_csv

        save_csv(self, path)
