"""The allocator-event record, one home for its schema: the columns, their types, and where
each profiler stat lands. The xplane readers fill it; traces save, load and replay it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

ALLOC, FREE = 1, -1
EVENT_KINDS = {"MemoryAllocation": ALLOC, "MemoryDeallocation": FREE}
# Per-event integer figures, in the order of the columns of AllocatorEvents.
INT_STATS = (
    "addr",
    "allocation_bytes",
    "requested_bytes",
    "bytes_allocated",
    "peak_bytes_in_use",
    "bytes_available",
)
TEXT_STATS = ("tf_op", "shape", "region_type")
# Where each stat goes in a decoded row: integers, then fragmentation, then interned texts.
SLOTS = {name: k for k, name in enumerate(INT_STATS + ("data_type",))}
FIRST_TEXT_SLOT = len(SLOTS)
FRAGMENTATION_SLOT = SLOTS["fragmentation"] = FIRST_TEXT_SLOT
SLOTS.update({name: FIRST_TEXT_SLOT + 1 + k for k, name in enumerate(TEXT_STATS)})
ALLOCATOR_SLOT = SLOTS["allocator_name"] = FIRST_TEXT_SLOT + 1 + len(TEXT_STATS)
# The columns of AllocatorEvents, with their array type codes (array module / numpy).
COLUMN_TYPES = {
    "time_ns": "q", "kind": "b", "address": "Q", "size": "q", "requested": "q", "in_use": "q",
    "peak": "q", "available": "q", "fragmentation": "d", "op": "i", "shape": "i", "region": "i",
    "data_type": "h",
}
COLUMNS = tuple(COLUMN_TYPES)
# The profiler stat behind each column (time and kind come from the event itself).
STAT_OF_COLUMN = {
    "address": "addr", "size": "allocation_bytes", "requested": "requested_bytes", "in_use": "bytes_allocated",
    "peak": "peak_bytes_in_use", "available": "bytes_available", "fragmentation": "fragmentation",
    "op": "tf_op", "shape": "shape", "region": "region_type", "data_type": "data_type",
}
_NUMPY = {"q": np.int64, "b": np.int8, "Q": np.uint64, "d": np.float64, "i": np.int32, "h": np.int16}
NUMPY_TYPES = {name: _NUMPY[code] for name, code in COLUMN_TYPES.items()}


@dataclass
class AllocatorEvents:
    """Every event of one allocator, in time order, as columns.

    kind: +1 allocation, -1 deallocation. size: the chunk's bytes (what the allocator
    counts). in_use/peak/available: TensorFlow's own figures after the event.
    fragmentation: TensorFlow's figure after the event (1 - largest free chunk / free).
    op, shape, region: indices into `texts` (0 is '').
    """

    allocator: str
    time_ns: np.ndarray
    kind: np.ndarray
    address: np.ndarray
    size: np.ndarray
    requested: np.ndarray
    in_use: np.ndarray
    peak: np.ndarray
    available: np.ndarray
    fragmentation: np.ndarray
    op: np.ndarray
    shape: np.ndarray
    region: np.ndarray
    data_type: np.ndarray
    texts: list[str] = field(default_factory=lambda: [""])

    def __len__(self) -> int:
        return len(self.kind)

    @property
    def limit_bytes(self) -> int | None:
        """The allocator's limit: in use + available is constant and equals it."""
        if not len(self):
            return None
        return int(self.in_use[0] + self.available[0])

    def in_use_before(self) -> int:
        """The allocator's in-use bytes just before the first event."""
        return int(self.in_use[0] - self.kind[0] * self.size[0]) if len(self) else 0

    def text(self, column: np.ndarray, index: int) -> str:
        return self.texts[int(column[index])]

    def held_bytes(self, min_bytes: int = 0, scratch: bool = True,
                   ops: Callable[[str], bool] | None = None) -> np.ndarray:
        """The bytes tensors held after each event, as they asked for them (not whole chunks),
        counted from 0 before the first event: ``.max()`` is the block's peak, ``[-1]`` its net.

        min_bytes: leave out tensors smaller than this (TensorFlow's own shapes and scalars).
        scratch=False: leave out kernels' scratch (see ``scratch_mask``), whose sizes depend on
        the kernel the processor or GPU gets, not on the program: without it the figures are
        the same on every machine.
        ops: count only tensors made by ops whose name passes this test, e.g.
        ``lambda op: "replica_1/" in op`` for one replica of a strategy on a shared allocator.
        """
        counted = self.requested >= min_bytes
        if scratch and ops is None:
            return np.cumsum(np.where(counted, self.kind.astype(np.int64) * self.requested, 0))
        if not scratch:
            counted &= ~self.scratch_mask()
        chosen = {k: ops(text) for k, text in enumerate(self.texts)} if ops is not None else None
        alive: dict[int, bool] = {}  # address -> whether its allocation is counted
        keep = []
        for kind, address, op, count in zip(self.kind.tolist(), self.address.tolist(), self.op.tolist(),
                                            counted.tolist()):
            if kind > 0:
                alive[address] = keep_it = count and (chosen is None or chosen[op])
            else:  # a free counts as its allocation did; one from before the trace by its size alone
                keep_it = alive.pop(address, count and chosen is None)
            keep.append(keep_it)
        return np.cumsum(np.where(np.array(keep, dtype=bool), self.kind.astype(np.int64) * self.requested, 0))

    def scratch_mask(self) -> np.ndarray:
        """Which allocations are a kernel's scratch: 'temp' allocations (TensorFlow's name for
        memory an op asks for besides its outputs) freed before any other op allocates, that is,
        inside the op that made them. A temp an op hands on as its output outlives the op and
        is not scratch. Allocations only; frees are False."""
        temp = self.texts.index("temp") if "temp" in self.texts else -1
        mask = np.zeros(len(self), dtype=bool)
        if temp < 0:
            return mask
        open_temps: dict[int, tuple[int, int]] = {}  # address -> (event, op) of a temp not yet freed
        for i, (kind, address, op, region) in enumerate(zip(self.kind.tolist(), self.address.tolist(),
                                                            self.op.tolist(), self.region.tolist())):
            if kind > 0:
                for stale in [a for a, (_, other) in open_temps.items() if other != op]:
                    del open_temps[stale]  # another op allocates: that temp outlived its op
                if region == temp:
                    open_temps[address] = (i, op)
            elif address in open_temps:
                mask[open_temps.pop(address)[0]] = True
        return mask

    def slice(self, stop: int) -> AllocatorEvents:
        """The first `stop` events."""
        columns = {name: getattr(self, name)[:stop] for name in COLUMNS}
        return AllocatorEvents(self.allocator, texts=self.texts, **columns)


def order_ties(time_ns: np.ndarray, kind: np.ndarray, size: np.ndarray, in_use: np.ndarray) -> np.ndarray:
    """The order of events in time; events of several threads may share a timestamp, and
    within such a group they are ordered so that each in-use figure follows from the one
    before, as it did in the allocator."""
    order = np.argsort(time_ns, kind="stable")
    before = in_use[order] - kind[order].astype(np.int64) * size[order]
    broken = np.nonzero(before[1:] != in_use[order][:-1])[0] + 1
    if not len(broken):
        return order
    order = order.tolist()
    times = time_ns.tolist()
    done_until = 0
    for i in broken.tolist():
        if i < done_until:
            continue
        start = i
        while start > 0 and times[order[start - 1]] == times[order[i]]:
            start -= 1
        stop = i
        while stop < len(order) and times[order[stop]] == times[order[i]]:
            stop += 1
        group = order[start:stop]
        current = int(in_use[order[start - 1]]) if start else int(in_use[group[0]] - kind[group[0]] * size[group[0]])
        ordered = []
        while group:
            pick = next((k for k, e in enumerate(group) if in_use[e] - kind[e] * size[e] == current), 0)
            event = group.pop(pick)
            ordered.append(event)
            current = int(in_use[event])
        order[start:stop] = ordered
        done_until = stop
    return np.array(order, dtype=np.int64)


def events_from_columns(columns_by_allocator: dict[str, dict[str, np.ndarray]], texts: list[str]) -> dict[str, AllocatorEvents]:
    """Columns per allocator -> AllocatorEvents in time order."""
    result = {}
    for allocator in sorted(columns_by_allocator):
        arrays = columns_by_allocator[allocator]
        order = order_ties(arrays["time_ns"], arrays["kind"], arrays["size"], arrays["in_use"])
        arrays = {name: values[order] for name, values in arrays.items()}
        result[allocator] = AllocatorEvents(allocator=allocator, texts=texts, **arrays)
    return result
