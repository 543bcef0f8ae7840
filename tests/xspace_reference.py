"""The plain reference decoder of an XSpace: stat by stat through TensorFlow's own message
classes. Slow and simple; the package's fast reader (xplane_wire) is tested against it."""

from __future__ import annotations

from array import array

import numpy as np

from tfmem_widgets.errors import TraceDataError
from tfmem_widgets.tracing.events import (
    ALLOCATOR_SLOT,
    COLUMN_TYPES,
    EVENT_KINDS,
    FIRST_TEXT_SLOT,
    FRAGMENTATION_SLOT,
    NUMPY_TYPES,
    SLOTS,
    AllocatorEvents,
    events_from_columns,
)


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

    unnamed = []  # (columns, row, plane, line, time in ps) of allocations without an op
    for plane in space.planes:
        kinds = {mid: EVENT_KINDS[m.name] for mid, m in plane.event_metadata.items() if m.name in EVENT_KINDS}
        if not kinds:
            continue
        stat_names = {mid: m.name for mid, m in plane.stat_metadata.items()}
        # Each stat read by the one field that holds it (no WhichOneof / getattr per stat:
        # this loop runs for every event, a million of them in a long trace).
        slots = {mid: SLOTS[name] for mid, name in stat_names.items() if name in SLOTS}
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
                    if slot < FIRST_TEXT_SLOT:
                        row[slot] = stat.int64_value or stat.uint64_value
                    elif slot == FRAGMENTATION_SLOT:
                        row[slot] = stat.double_value or float(stat.int64_value)
                    elif stat.WhichOneof("value") == "str_value":
                        row[slot] = intern(stat.str_value)
                    else:
                        ref = stat.ref_value
                        text = ref_text.get(ref)
                        if text is None:
                            text = ref_text[ref] = intern(stat_names.get(ref, ""))
                        row[slot] = text
                allocator = row[ALLOCATOR_SLOT]
                if allocator is None:
                    continue
                columns = columns_by_allocator.get(allocator)
                if columns is None:
                    columns = columns_by_allocator[allocator] = {
                        name: array(code) for name, code in COLUMN_TYPES.items()
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
                if kind > 0 and not row[8]:
                    unnamed.append((columns, len(columns["op"]) - 1, plane, line, base_ps + event.offset_ps))
    _name_unnamed(unnamed, space, intern)
    return events_from_columns(
        {texts[k]: {name: np.frombuffer(col, dtype=NUMPY_TYPES[name]).copy() for name, col in cols.items()}
         for k, cols in columns_by_allocator.items()},
        texts,
    )




def _name_unnamed(unnamed, space, intern) -> None:
    """Each allocation without an op named by the activities around it, event by event: those
    covering it on its own line, and the tf.functions running then on any line."""
    from tfmem_widgets.tracing.attribution import FUNCTION, NOT_ACTIVITIES, context_label

    if not unnamed:
        return

    def spans(plane, line, only=lambda name: True):
        names = {mid: m.name for mid, m in plane.event_metadata.items()}
        base = line.timestamp_ns * 1000
        return [(base + e.offset_ps, base + e.offset_ps + e.duration_ps, names[e.metadata_id])
                for e in line.events if e.duration_ps > 0 and not names[e.metadata_id].startswith(NOT_ACTIVITIES)
                and only(names[e.metadata_id])]

    def innermost_last(span):  # by begin; of two that begin together, the longer (outer) first
        return span[0], -span[1], span[2]

    functions = sorted((s for plane in space.planes for line in plane.lines
                        for s in spans(plane, line, lambda name: FUNCTION.search(name) is not None)), key=innermost_last)
    for columns, row, plane, line, t in unnamed:
        own = sorted(spans(plane, line), key=innermost_last)
        enclosing = [name for begin, end, name in own if begin <= t <= end]
        running = [name for begin, end, name in functions if begin <= t <= end]
        columns["op"][row] = intern(context_label(enclosing, running))
