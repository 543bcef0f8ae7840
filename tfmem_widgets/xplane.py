"""TensorFlow's allocator events, read straight from the profiler's xplane.pb.

The profiler records every allocation and deallocation of every BFC allocator as
``MemoryAllocation`` / ``MemoryDeallocation`` events in the ``/host:CPU`` plane (GPU
allocators included), each with the chunk's address and size, the op, and the
allocator's own figures after the event. The protobuf module ships inside TensorFlow:
no TensorBoard or XProf needed.
"""

from __future__ import annotations

from array import array
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
_WANTED = set(_INT_STATS) | set(_TEXT_STATS) | {"allocator_name", "fragmentation", "data_type"}
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
    """All allocator events in an XSpace, by allocator name (e.g. 'GPU_0_bfc')."""
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
        stat_ids = {mid: name for mid, name in stat_names.items() if name in _WANTED}
        for line in plane.lines:
            base_ps = line.timestamp_ns * 1000
            for event in line.events:
                kind = kinds.get(event.metadata_id)
                if kind is None:
                    continue
                values = {}
                for stat in event.stats:
                    name = stat_ids.get(stat.metadata_id)
                    if name is None:
                        continue
                    which = stat.WhichOneof("value")
                    if which == "ref_value":
                        values[name] = stat_names.get(stat.ref_value, "")
                    elif which is not None:
                        values[name] = getattr(stat, which)
                allocator = values.get("allocator_name")
                if allocator is None or "addr" not in values:
                    continue
                columns = columns_by_allocator.get(allocator)
                if columns is None:
                    columns = columns_by_allocator[allocator] = {
                        name: array(code) for name, code in _COLUMN_TYPES.items()
                    }
                columns["time_ns"].append((base_ps + event.offset_ps) // 1000)
                columns["kind"].append(kind)
                columns["address"].append(values["addr"] & 0xFFFFFFFFFFFFFFFF)  # stored as int64
                columns["size"].append(values.get("allocation_bytes", 0))
                columns["requested"].append(values.get("requested_bytes", 0))
                columns["in_use"].append(values.get("bytes_allocated", 0))
                columns["peak"].append(values.get("peak_bytes_in_use", 0))
                columns["available"].append(values.get("bytes_available", 0))
                columns["fragmentation"].append(float(values.get("fragmentation", 0.0)))
                columns["op"].append(intern(values.get("tf_op", "")))
                columns["shape"].append(intern(values.get("shape", "")))
                columns["region"].append(intern(values.get("region_type", "")))
                columns["data_type"].append(int(values.get("data_type", 0)))
    result = {}
    for allocator, columns in sorted(columns_by_allocator.items()):
        arrays = {name: np.frombuffer(columns[name], dtype=_NUMPY_TYPES[name]).copy() for name in columns}
        del columns
        order = _order_ties(arrays["time_ns"], arrays["kind"], arrays["size"], arrays["in_use"])
        arrays = {name: values[order] for name, values in arrays.items()}
        result[allocator] = AllocatorEvents(allocator=allocator, texts=texts, **arrays)
    return result
