"""The state of one BFC allocator at one moment: its regions and their chunks, by address."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from ..tf.allocator import fragmentation
from ..units import format_bytes
from ..views.pool import address_clusters, occupancy, op_label


@dataclass(frozen=True)
class Chunk:
    """A piece of a region: in use (handed to a tensor) or free (a hole)."""

    address: int
    size: int
    in_use: bool
    requested: int | None = None  # the bytes the tensor asked for (the rest is rounding)
    op: str = ""
    shape: str = ""
    since: int | None = None  # index of the event that allocated it, where known


@dataclass(frozen=True)
class Region:
    """Memory the allocator took from the system in one piece; chunks never span two."""

    address: int
    size: int


BEFORE_TRACE = "(before the trace)"


@dataclass
class AllocatorMap:
    """An allocator's chunks at one moment, sorted by address.

    source: 'trace' (rebuilt from the profiler's events), 'dump' (TensorFlow's binary
    MemoryDump) or 'text dump' (the allocator's log). complete: the whole pool's layout is
    known; when a trace began after earlier work, the chunks from before it are not in its
    events and are counted, never drawn: before_trace_bytes is their exact total.
    """

    allocator: str
    chunks: tuple[Chunk, ...]
    regions: tuple[Region, ...]
    source: str
    complete: bool = True
    before_trace_bytes: int = 0
    limit_bytes: int | None = None
    event_index: int | None = None  # the moment: after this event (trace maps)
    reported_fragmentation: float | None = None  # TensorFlow's own figure, where it gave one
    failed_request_bytes: int | None = None  # an OOM's request (rounded), where known
    notes: tuple[str, ...] = field(default=())

    # -- figures -----------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def in_use_bytes(self) -> int:
        return sum(c.size for c in self.chunks if c.in_use) + self.before_trace_bytes

    @property
    def free_bytes(self) -> int:
        """Free bytes in the pool (in the known part of it, if the map is not complete)."""
        return sum(c.size for c in self.chunks if not c.in_use)

    @property
    def largest_free_bytes(self) -> int:
        return max((c.size for c in self.chunks if not c.in_use), default=0)

    @property
    def fragmentation(self) -> float | None:
        """TensorFlow's definition: 1 - largest free chunk / all free bytes in the pool.

        From the chunks where the layout is complete; otherwise TensorFlow's own figure.
        """
        if not self.complete:
            return self.reported_fragmentation
        return fragmentation(self.free_bytes, self.largest_free_bytes)

    def by_op(self) -> dict[str, int]:
        """In-use bytes per op, largest first (memory from before the trace included)."""
        totals: dict[str, int] = defaultdict(int)
        for chunk in self.chunks:
            if chunk.in_use:
                totals[op_label(chunk.op)] += chunk.size
        if self.before_trace_bytes:
            totals[BEFORE_TRACE] += self.before_trace_bytes
        return dict(sorted(totals.items(), key=lambda kv: (-kv[1], kv[0])))

    def by_layer(self, namespace: dict | None = None, live: bool = True):
        """In-use bytes per Keras layer and phase (anatomy.LayerAnatomy): chunks named by their
        op, and, for a map of this process (live), Keras variables found by their address."""
        from ..readings.layers import anatomy

        return anatomy(self, namespace=namespace, live=live)

    def bands(self) -> tuple[list, bool]:
        """(rows to draw, exact): the regions, or stretches of the chunks' addresses when the
        map does not know its regions (a trace that began after earlier work)."""
        if self.regions:
            return list(self.regions), True
        return address_clusters((c.address, c.size) for c in self.chunks), False

    def chunk_at(self, address: int) -> Chunk | None:
        for chunk in self.chunks:
            if chunk.address <= address < chunk.address + chunk.size:
                return chunk
        return None

    def occupancy(self, width: int = 64) -> str:
        """A one-line picture of the pool, TensorFlow's style: '*' in use, '_' free."""
        return occupancy(self, width)

    def _partial_lines(self) -> list[str]:
        """What a trace that began after earlier work knows: the chunks it saw made and freed,
        the total from before it, TensorFlow's own figures; nothing about regions or holes."""
        traced = [c for c in self.chunks if c.in_use]
        seen_free = [c for c in self.chunks if not c.in_use]
        lines = [
            f"AllocatorMap {self.allocator} ({self.source}, partial): regions and holes unknown",
            f"  in use {format_bytes(self.in_use_bytes)}: {format_bytes(sum(c.size for c in traced))} in "
            f"{len(traced)} chunk(s) made during the trace + {format_bytes(self.before_trace_bytes)} from before it",
        ]
        if seen_free:
            lines.append(f"  freed during the trace and still free: {len(seen_free)} chunk(s), "
                         f"{format_bytes(sum(c.size for c in seen_free))}")
        figures = []
        if self.limit_bytes is not None:
            figures.append(f"limit {format_bytes(self.limit_bytes)}")
        if self.reported_fragmentation is not None:
            figures.append(f"TensorFlow's own fragmentation figure {self.reported_fragmentation:.4f}")
        if figures:
            lines.append("  " + "; ".join(figures))
        return lines + [f"  note: {n}" for n in self.notes]

    def __repr__(self) -> str:
        if not self.complete and not self.regions:
            return "\n".join(self._partial_lines())
        frag = self.fragmentation
        frag_text = "-" if frag is None else ("n/a (no free bytes)" if frag != frag else f"{frag:.4f}")
        lines = [
            f"AllocatorMap {self.allocator} ({self.source}{'' if self.complete else ', partial'}): "
            f"{len(self.regions)} region(s), {len(self.chunks)} chunk(s)",
            f"  in use {format_bytes(self.in_use_bytes)}, free {format_bytes(self.free_bytes)}, "
            f"largest free {format_bytes(self.largest_free_bytes)}, fragmentation {frag_text}",
        ]
        if self.limit_bytes is not None:
            lines[-1] += f", pool {format_bytes(self.pool_bytes)} of {format_bytes(self.limit_bytes)} limit"
        if self.before_trace_bytes:
            lines.append(f"  from before the trace: {format_bytes(self.before_trace_bytes)} in use (layout not in the trace)")
        if self.failed_request_bytes is not None:
            lines.append(
                f"  failed request: {format_bytes(self.failed_request_bytes)} > largest free chunk "
                f"{format_bytes(self.largest_free_bytes)}"
            )
        picture = self.occupancy()
        if picture:
            lines.append(f"  [{picture}]")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    def to_dict(self) -> dict:
        return {
            "allocator": self.allocator,
            "source": self.source,
            "complete": self.complete,
            "before_trace_bytes": self.before_trace_bytes,
            "limit_bytes": self.limit_bytes,
            "event_index": self.event_index,
            "reported_fragmentation": self.reported_fragmentation,
            "failed_request_bytes": self.failed_request_bytes,
            "notes": list(self.notes),
            "regions": [[r.address, r.size] for r in self.regions],
            "chunks": [
                [c.address, c.size, c.in_use, c.requested, c.op, c.shape, c.since] for c in self.chunks
            ],
        }

    @classmethod
    def from_dict(cls, data: dict) -> AllocatorMap:
        return cls(
            allocator=data["allocator"],
            chunks=tuple(Chunk(a, s, bool(u), r, o, sh, si) for a, s, u, r, o, sh, si in data["chunks"]),
            regions=tuple(Region(a, s) for a, s in data["regions"]),
            source=data["source"],
            complete=data["complete"],
            before_trace_bytes=data["before_trace_bytes"],
            limit_bytes=data["limit_bytes"],
            event_index=data["event_index"],
            reported_fragmentation=data["reported_fragmentation"],
            failed_request_bytes=data["failed_request_bytes"],
            notes=tuple(data["notes"]),
        )
