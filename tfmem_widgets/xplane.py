"""TensorFlow's allocator events, read straight from the profiler's xplane.pb.

The profiler records every allocation and deallocation of every BFC allocator as
``MemoryAllocation`` / ``MemoryDeallocation`` events in the ``/host:CPU`` plane (GPU
allocators included), each with the chunk's address and size, the op, and the
allocator's own figures after the event. The protobuf module ships inside TensorFlow:
no TensorBoard or XProf needed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import SetupError

ALLOC, FREE = 1, -1
_EVENT_KINDS = {"MemoryAllocation": ALLOC, "MemoryDeallocation": FREE}
# Per-event integer figures, in the order of the columns of AllocatorEvents.
_INT_STATS = (
    "addr",
    "allocation_bytes",
    "requested_bytes",
    "bytes_allocated",
    "peak_bytes_in_use",
    "bytes_available",
)
_TEXT_STATS = ("tf_op", "shape", "region_type")
# Where each stat goes in a row: integers, then fragmentation, then interned texts.
_SLOTS = {name: k for k, name in enumerate(_INT_STATS + ("data_type",))}
_FIRST_TEXT_SLOT = len(_SLOTS)
_FRAGMENTATION_SLOT = _SLOTS["fragmentation"] = _FIRST_TEXT_SLOT
_SLOTS.update({name: _FIRST_TEXT_SLOT + 1 + k for k, name in enumerate(_TEXT_STATS)})
_ALLOCATOR_SLOT = _SLOTS["allocator_name"] = _FIRST_TEXT_SLOT + 1 + len(_TEXT_STATS)
_COLUMN_TYPES = {
    "time_ns": "q", "kind": "b", "address": "Q", "size": "q", "requested": "q", "in_use": "q",
    "peak": "q", "available": "q", "fragmentation": "d", "op": "i", "shape": "i", "region": "i",
    "data_type": "h",
}
_NUMPY_TYPES = {"q": np.int64, "b": np.int8, "Q": np.uint64, "d": np.float64, "i": np.int32, "h": np.int16}
_NUMPY_TYPES = {name: _NUMPY_TYPES[code] for name, code in _COLUMN_TYPES.items()}


class TraceDataError(SetupError):
    """A trace file or dump that cannot be read; the message says which and why."""


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

    def slice(self, stop: int) -> "AllocatorEvents":
        """The first `stop` events."""
        columns = {
            name: getattr(self, name)[:stop]
            for name in ("time_ns", "kind", "address", "size", "requested", "in_use", "peak",
                         "available", "fragmentation", "op", "shape", "region", "data_type")
        }
        return AllocatorEvents(self.allocator, texts=self.texts, **columns)


def _order_ties(time_ns: np.ndarray, kind: np.ndarray, size: np.ndarray, in_use: np.ndarray) -> np.ndarray:
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


def read_xspace(data: bytes, source: str = "xplane.pb") -> dict[str, AllocatorEvents]:
    """All allocator events in an XSpace, by allocator name (e.g. 'GPU_0_bfc').

    Decodes the memory events in bulk with numpy (see xplane_wire); a million events take
    seconds, not minutes.
    """
    from .xplane_wire import read_memory_columns

    columns_by_allocator, texts = read_memory_columns(data, source)
    return _finish(columns_by_allocator, texts)


def read_xplane_file(path) -> dict[str, AllocatorEvents]:
    """read_xspace for a file, holding its bytes only while protobuf parses them."""
    from .xplane_wire import read_memory_columns

    columns_by_allocator, texts = read_memory_columns(None, str(path))
    return _finish(columns_by_allocator, texts)


def read_xspace_reference(data: bytes, source: str = "xplane.pb") -> dict[str, AllocatorEvents]:
    """The same as read_xspace, decoded stat by stat through TensorFlow's own message
    classes: slow, plain, and the reference the fast reader is tested against."""
    from google.protobuf.message import DecodeError
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    try:
        space.ParseFromString(data)
    except DecodeError as exc:
        raise TraceDataError(f"{source} is not a readable profiler trace (truncated or corrupt: {exc}).") from None
    if not space.planes:
        raise TraceDataError(f"{source} holds no profiler planes: not a TensorFlow profiler trace.")
    # Columns as compact arrays (8 bytes a value), so a million events stay small.
    columns_by_allocator: dict[str, dict[str, array]] = {}
    texts = [""]
    text_index = {"": 0}

    def intern(value) -> int:
        index = text_index.get(value)
        if index is None:
            index = text_index[value] = len(texts)
            texts.append(value)
        return index

    for plane in space.planes:
        kinds = {mid: _EVENT_KINDS[m.name] for mid, m in plane.event_metadata.items() if m.name in _EVENT_KINDS}
        if not kinds:
            continue
        stat_names = {mid: m.name for mid, m in plane.stat_metadata.items()}
        # Each stat read by the one field that holds it (no WhichOneof / getattr per stat:
        # this loop runs for every event, a million of them in a long trace).
        slots = {mid: _SLOTS[name] for mid, name in stat_names.items() if name in _SLOTS}
        ref_text: dict[int, int] = {}  # stat metadata id -> index in texts, filled as met
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            for event in line.events:
                kind = kinds.get(event.metadata_id)
                if kind is None:
                    continue
                row = [0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 0, 0, None]
                for stat in event.stats:
                    slot = slots.get(stat.metadata_id)
                    if slot is None:
                        continue
                    if slot < _FIRST_TEXT_SLOT:
                        row[slot] = stat.int64_value or stat.uint64_value
                    elif slot == _FRAGMENTATION_SLOT:
                        row[slot] = stat.double_value or float(stat.int64_value)
                    elif stat.WhichOneof("value") == "str_value":
                        row[slot] = intern(stat.str_value)
                    else:
                        ref = stat.ref_value
                        text = ref_text.get(ref)
                        if text is None:
                            text = ref_text[ref] = intern(stat_names.get(ref, ""))
                        row[slot] = text
                allocator = row[_ALLOCATOR_SLOT]
                if allocator is None:
                    continue
                columns = columns_by_allocator.get(allocator)
                if columns is None:
                    columns = columns_by_allocator[allocator] = {
                        name: array(code) for name, code in _COLUMN_TYPES.items()
                    }
                columns["time_ns"].append((base_ps + event.offset_ps) // 1000)
                columns["kind"].append(kind)
                columns["address"].append(row[0] & 0xFFFFFFFFFFFFFFFF)  # stored as int64
                columns["size"].append(row[1])
                columns["requested"].append(row[2])
                columns["in_use"].append(row[3])
                columns["peak"].append(row[4])
                columns["available"].append(row[5])
                columns["data_type"].append(row[6])
                columns["fragmentation"].append(row[7])
                columns["op"].append(row[8])
                columns["shape"].append(row[9])
                columns["region"].append(row[10])
    return _finish(
        {texts[k]: {name: np.frombuffer(col, dtype=_NUMPY_TYPES[name]).copy() for name, col in cols.items()}
         for k, cols in columns_by_allocator.items()},
        texts,
    )


def _finish(columns_by_allocator: dict[str, dict[str, np.ndarray]], texts: list[str]) -> dict[str, AllocatorEvents]:
    """Columns per allocator -> AllocatorEvents in time order."""
    result = {}
    for allocator in sorted(columns_by_allocator):
        arrays = columns_by_allocator[allocator]
        order = _order_ties(arrays["time_ns"], arrays["kind"], arrays["size"], arrays["in_use"])
        arrays = {name: values[order] for name, values in arrays.items()}
        result[allocator] = AllocatorEvents(allocator=allocator, texts=texts, **arrays)
    return result
