"""The profiler's XSpace read line by line: each line's events joined into one buffer a batch at
a time, and from it both the memory events (decoded by wire.py) and the activities around them
(for attribution.py). The XSpace is parsed by protobuf with each line's events left as raw bytes:
a copy of TensorFlow's own xplane.proto schema in which XLine.events is ``bytes``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ..errors import TraceDataError
from .events import EVENT_KINDS, SLOTS
from .wire import (
    _EVENT_DURATION_PS,
    _EVENT_METADATA_ID,
    _EVENT_OFFSET_PS,
    _PADDING,
    _WIRE_VARINT,
    _decode_group,
    _fields,
    _leading_fields,
    parse_message,
)

_CHUNK_EVENTS = 1 << 16  # events split out of the trace per batch: bounds the extra memory
_GROUP_EVENTS = 1 << 12  # memory events decoded together, at first
_MAX_GROUP_EVENTS = 1 << 14
_JOIN_EVENTS = 1 << 14  # short lines joined into one batch up to this many events (the memory of a long line's)
_MAX_STAMP = (1 << 64) // 1000 - 1  # a line's timestamp_ns whose picoseconds fit 64 bits
# Events that are no activity: memory events, and the thread pool's own markers.
NOT_ACTIVITIES = ("MemoryAllocation", "MemoryDeallocation", "ThreadpoolListener")


@functools.lru_cache(maxsize=1)
def _lean_xspace_class():
    """XSpace with XLine.events as raw bytes, built from TensorFlow's own schema."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    proto = descriptor_pb2.FileDescriptorProto()
    xplane_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix = f".{proto.package}."
    proto.name, proto.package = "tfmem_lean_xplane.proto", "tfmem_lean"

    def rename(message):
        for f in message.field:
            if f.type_name.startswith(old_prefix):
                f.type_name = ".tfmem_lean." + f.type_name[len(old_prefix):]
        for nested in message.nested_type:
            rename(nested)

    for message in proto.message_type:
        rename(message)
        if message.name == "XLine":
            for f in message.field:
                if f.name == "events":
                    f.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
                    f.ClearField("type_name")
        if message.name == "XPlane":
            # The metadata maps as the lists of entries they are on the wire: iterated in C, where
            # a map's items() are walked one Python call per entry.
            for nested in message.nested_type:
                if nested.options.map_entry:
                    nested.options.map_entry = False
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tfmem_lean.XSpace"))


def read_memory_columns(data: bytes | None, source: str):
    """Columns of every memory event, per allocator (keyed by the allocator's name), the interned
    texts their op/shape/region columns index, the function that interns a new text, and, by the
    number memory events carry for their line, the activities of each line of a plane that holds
    memory events (see _line_activities; attribution names allocations by them).
    data=None reads the file `source` (and lets its bytes go as soon as protobuf has parsed them).

    Each line's events are joined into one buffer once, a batch at a time, and both the memory
    events and the activities are read from it."""
    space = parse_message(_lean_xspace_class()(), source, "profiler trace", data)
    if not space.planes:
        raise TraceDataError(f"{source} holds no profiler planes: not a TensorFlow profiler trace.")
    intern = _interner()
    texts = intern.texts
    parts: dict[str, list[dict[str, np.ndarray]]] = {}
    lines = []  # each line's activities, by the number memory events carry
    try:
        for plane in space.planes:
            read = _plane_info(plane)
            if read is None:
                continue
            info, activity_names = read
            first_line = len(lines)
            spans = _decode_lines(plane.lines, first_line, info, intern, parts)
            lines += [_line_activities(spans.get(number, []), activity_names)
                      for number in range(first_line, first_line + len(plane.lines))]
        columns = {
            texts[allocator]: {name: np.concatenate([p[name] for p in pieces]) for name in pieces[0]}
            for allocator, pieces in ((k, v) for k, v in parts.items())
        }
    except ValueError as exc:
        raise TraceDataError(f"{source} has a damaged event ({exc}).") from None
    return columns, texts, intern, lines


def _interner():
    """A function that gives each text its index in intern.texts ('' is 0), adding a new one."""
    texts = [""]
    text_index = {"": 0}

    def intern(value: str) -> int:
        index = text_index.get(value)
        if index is None:
            index = text_index[value] = len(texts)
            texts.append(value)
        return index

    intern.texts = texts  # attribution reads a text back by its index
    return intern


def _plane_info(plane):
    """What decoding a plane's events needs from its metadata, and {metadata id: name} of its
    activities; None for a plane without memory events."""
    # One pass over the event metadata (a plane has hundreds): memory events and activities.
    kinds, activity_names = {}, {}
    event_names = {entry.key: entry.value.name for entry in plane.event_metadata}  # (the last of an id, as a map)
    for mid, name in event_names.items():
        if name in EVENT_KINDS:
            kinds[mid] = EVENT_KINDS[name]
        if not name.startswith(NOT_ACTIVITIES):
            activity_names[mid] = name
    if not kinds:
        return None
    stat_names = {entry.key: entry.value.name for entry in plane.stat_metadata}
    memory_ids = np.array(sorted(kinds), dtype=np.uint64)
    slot_table = _slot_table({mid: SLOTS[name] for mid, name in stat_names.items() if name in SLOTS})
    info = _PlaneInfo(
        memory_ids=memory_ids,
        kind_of_id=np.array([kinds[int(i)] for i in memory_ids], dtype=np.int8),
        slot_table=slot_table,
        stat_names=stat_names,
        activity_ids=np.array(sorted(activity_names), dtype=np.uint64),
        ref_texts=np.full(max(stat_names, default=0) + 1, -1, dtype=np.int64),
        unused_ids=np.isin(np.arange(256), np.flatnonzero(slot_table[:0x80] < 0)),
        slot_of_byte=np.concatenate([slot_table[:256], np.full(max(0, 256 - len(slot_table)), -1, np.int8)]),
        kind_table=_id_table(kinds),
        activity_table=_id_table(dict.fromkeys(activity_names, 1)),
    )
    return info, activity_names


def _decode_lines(plane_lines, first_line, info, intern, parts) -> dict:
    """A plane's lines decoded a batch at a time (their memory events into parts); returns each line's
    activities by its number, counted from first_line."""
    # Short lines are joined into one batch (a trace has dozens of lines of a few events: one
    # batch each would cost more than their events), up to _JOIN_EVENTS events; a longer line
    # is a batch of its own, cut into batches of _CHUNK_EVENTS.
    spans = {}  # line number -> its activities, a batch at a time
    pending, pending_events = [], 0
    for number, line in enumerate(plane_lines, first_line):
        events = line.events
        if pending and pending_events + len(events) > _JOIN_EVENTS:
            _decode_batch(pending, info, intern, parts, spans)
            pending, pending_events = [], 0
        if len(events) <= _JOIN_EVENTS:
            pending.append((number, line.timestamp_ns, events))
            pending_events += len(events)
            continue
        for first in range(0, len(events), _CHUNK_EVENTS):
            batch = events[first:first + _CHUNK_EVENTS]
            _decode_batch([(number, line.timestamp_ns, batch)], info, intern, parts, spans)
    if pending:
        _decode_batch(pending, info, intern, parts, spans)
    return spans


class _PlaneInfo(NamedTuple):
    memory_ids: np.ndarray  # the metadata ids of memory events, sorted
    kind_of_id: np.ndarray  # ALLOC or FREE, for each of memory_ids
    slot_table: np.ndarray  # by stat metadata id: its slot in a row (events.SLOTS), -1 for none
    stat_names: dict  # stat metadata id -> name
    activity_ids: np.ndarray  # the metadata ids of activities, sorted
    ref_texts: np.ndarray  # by stat metadata id: its name's interned text once met, -1 before
    unused_ids: np.ndarray  # by a byte: whether it is the one-byte id of a stat no column takes
    slot_of_byte: np.ndarray  # by a byte: slot_table's entry for that id, -1 past its end
    kind_table: np.ndarray | None  # by event metadata id: ALLOC, FREE or 0 (see _id_table)
    activity_table: np.ndarray | None  # by event metadata id: 1 for an activity, else 0


# Metadata ids up to this are looked up in a table; a plane with larger ones (not the profiler's:
# its ids count up from 1) is looked up with np.isin.
_MAX_TABLE_ID = 1 << 20


def _id_table(value_of: dict) -> np.ndarray | None:
    """By metadata id, its value in value_of, 0 for the others; one entry more, 0, stands for every
    id past the last (see _looked_up). None where the ids are too large for a table, or negative."""
    if max(value_of, default=0) > _MAX_TABLE_ID or min(value_of, default=0) < 0:
        return None
    table = np.zeros(max(value_of, default=0) + 2, dtype=np.int8)
    table[np.fromiter(value_of, dtype=np.int64, count=len(value_of))] = np.fromiter(
        value_of.values(), dtype=np.int8, count=len(value_of))
    return table


def _looked_up(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """table's value for each metadata id (uint64): the ids past the table read its last entry, 0."""
    return table[np.minimum(ids, np.uint64(len(table) - 1)).astype(np.intp)]


def _is_memory(info: _PlaneInfo, meta: np.ndarray) -> np.ndarray:
    if info.kind_table is None:
        return np.isin(meta, info.memory_ids)
    return _looked_up(info.kind_table, meta) != 0


def _is_activity(info: _PlaneInfo, meta: np.ndarray) -> np.ndarray:
    if info.activity_table is None:
        return np.isin(meta, info.activity_ids)
    return _looked_up(info.activity_table, meta) != 0


def _slot_table(slot_of: dict) -> np.ndarray:
    table = np.full(max(slot_of, default=0) + 1, -1, dtype=np.int8)
    for mid, slot in slot_of.items():
        table[mid] = slot
    return table


def _line_activities(spans, names):
    """A line's activities with a duration: (begins ps, ends ps, metadata ids) as arrays ordered
    innermost last (by begin, the longer first where two begin together), and {metadata id: name}."""
    if not spans:
        return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)), names
    begin, end, meta = (np.concatenate(column) for column in zip(*spans))
    step = np.diff(begin)
    if (step >= 0).all() and ((step > 0) | (np.diff(end) <= 0)).all():
        return (begin, end, meta), names  # the profiler wrote them in that order already
    order = np.lexsort((-end, begin))
    return (begin[order], end[order], meta[order]), names


def _decode_batch(pieces, info, intern, parts, spans) -> None:
    """Memory events of a batch of events into parts, their activities onto spans (by line number).
    pieces: (line number, the line's timestamp_ns, events) of the lines, or the part of a long line,
    the batch holds, in order."""
    buf, starts, ends, lengths, bounds = _joined(pieces)
    # An event's metadata id is its first field when it is set: memory events are those.
    has_id = (lengths > 0) & (buf[starts] == (_EVENT_METADATA_ID << 3 | _WIRE_VARINT))
    try:
        meta, offset, duration, after = _ids_and_times(buf, starts, ends, has_id, info)
        is_memory = has_id & _is_memory(info, meta)  # (by the ids read here, as a memory event's are)
    except ValueError:
        if len(pieces) == 1:
            raise
        # A damaged event: the lines one at a time, so that the error is the first one line by line.
        for piece in pieces:
            _decode_batch([piece], info, intern, parts, spans)
        return
    if len(info.activity_ids):
        _add_activities(pieces, bounds, info, meta, offset, duration, spans)
    chosen = np.nonzero(is_memory)[0]
    del is_memory
    if not len(chosen):
        return
    if info.kind_table is None:
        kind = info.kind_of_id[np.searchsorted(info.memory_ids, meta[chosen])]
    else:
        kind = _looked_up(info.kind_table, meta[chosen])
    # Only the memory events' own fields are kept while their stats are decoded.
    cuts = np.searchsorted(chosen, bounds).tolist()
    starts, ends, offset, after = starts[chosen], ends[chosen], offset[chosen], after[chosen]
    del meta, duration, lengths, has_id, chosen
    _decode_memory(pieces, cuts, buf, starts, ends, offset, after, kind, info, intern, parts)


def _joined(pieces):
    """A batch's events joined into one buffer: the buffer, each event's start, end and length in it,
    and where each piece's events begin and end among the batch's events."""
    # Padding past the end of each piece lets a damaged varint be read without an index error
    # (and reads the same past a line's end as when the line is a batch of its own).
    if len(pieces) == 1:
        batch = [*pieces[0][2], _PADDING]
    else:
        batch = []
        for _, _, events in pieces:
            batch += events[:]  # (a slice is the quickest copy of protobuf's repeated field)
            batch.append(_PADDING)
    lengths = np.fromiter(map(len, batch), dtype=np.int64, count=len(batch))
    buf = np.frombuffer(b"".join(batch), dtype=np.uint8)
    del batch
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # The paddings left out of the events.
    counts = [len(events) for _, _, events in pieces]
    bounds = np.cumsum([0] + counts).tolist()
    if len(pieces) == 1:
        lengths, starts, ends = lengths[:-1], starts[:-1], ends[:-1]
    else:
        is_event = np.ones(len(lengths), dtype=bool)
        is_event[np.cumsum(counts) + np.arange(len(pieces))] = False
        lengths, starts, ends = lengths[is_event], starts[is_event], ends[is_event]
    return buf, starts, ends, lengths, bounds


def _ids_and_times(buf, starts, ends, has_id, info):
    """Each event's metadata id, offset and duration (ps), and where its fields after them begin.
    Raises ValueError at a damaged event."""
    meta, offset, duration, after, odd = _leading_fields(buf, starts, ends)
    # Activities: events with a duration and an activity's metadata id; those without their id
    # first, or laid out otherwise, read field by field.
    if len(info.activity_ids):
        odd = odd[~has_id[odd] | _is_activity(info, meta[odd])]
        if len(odd):
            meta, offset, duration = meta.copy(), offset.copy(), duration.copy()
            for alive, field, wire, _pos, value, _size in _fields(buf, starts[odd], ends[odd]):
                varint = wire == _WIRE_VARINT
                for number, column in ((_EVENT_METADATA_ID, meta), (_EVENT_OFFSET_PS, offset),
                                       (_EVENT_DURATION_PS, duration)):
                    pick = varint & (field == number)
                    column[odd[alive[pick]]] = value[pick]
    return meta, offset, duration, after


def _add_activities(pieces, bounds, info, meta, offset, duration, spans) -> None:
    """The batch's activities (events with a duration and an activity's id) onto spans, by line number:
    (begins ps, ends ps, metadata ids)."""
    keep = np.nonzero((duration > 0) & _is_activity(info, meta))[0]
    cuts = np.searchsorted(keep, bounds).tolist()
    for (line_number, timestamp_ns, _), low, high in zip(pieces, cuts, cuts[1:]):
        if high > low:
            mine = keep[low:high]
            begin = int(timestamp_ns) * 1000 + offset[mine].astype(np.int64)
            spans.setdefault(line_number, []).append(
                (begin, begin + duration[mine].astype(np.int64), meta[mine].astype(np.int64)))


def _decode_memory(pieces, cuts, buf, starts, ends, offset, after, kind, info, intern, parts) -> None:
    """A batch's memory events (their fields picked out of the batch) decoded into parts, in groups;
    cuts: where each piece's events begin among them."""
    # A dozen arrays per stat live while a group is decoded: small groups keep that memory small
    # next to the trace itself. Groups grow with the events decoded so far (a sixteenth of them), so
    # that a long trace is not decoded a thousand events at a time.
    decoded = sum(len(piece["kind"]) for pieces_ in parts.values() for piece in pieces_)
    if len(pieces) > 1 and decoded + len(starts) <= 16 * _GROUP_EVENTS and _decode_across(
            pieces, cuts, buf, starts, ends, offset, after, kind, info, intern, parts):
        return
    for (line_number, timestamp_ns, _), low, high in zip(pieces, cuts, cuts[1:]):
        decoded = sum(len(piece["kind"]) for pieces_ in parts.values() for piece in pieces_)
        first = low
        while first < high:
            group = slice(first, min(first + min(max(_GROUP_EVENTS, decoded // 16), _MAX_GROUP_EVENTS), high))
            _decode_group(buf, starts[group], ends[group], offset[group], after[group], kind[group], timestamp_ns,
                          info, intern, parts, line_number)
            decoded += group.stop - group.start
            first = group.stop


def _decode_across(pieces, cuts, buf, starts, ends, offset, after, kind, info, intern, parts) -> bool:
    """_decode_batch's groups made of several lines' events, where each line's own groups would all
    be of _GROUP_EVENTS (fewer than 16 times as many events decoded so far): a line of a few events
    then costs no group of its own. A group holds whole segments, the groups each line would have
    been decoded in on its own, up to _GROUP_EVENTS events. False (nothing done) where a line's
    timestamp is no time in nanoseconds from 1970 to 2554 (the lines are then decoded one by one)."""
    stamps = [timestamp_ns for _, timestamp_ns, _ in pieces]
    if not all(0 <= t <= _MAX_STAMP for t in stamps):
        return False
    segments = []  # (first event, end, piece) of each line's own groups, in order
    for k, (low, high) in enumerate(zip(cuts, cuts[1:])):
        segments += [(first, min(first + _GROUP_EVENTS, high), k) for first in range(low, high, _GROUP_EVENTS)]
    groups, current = [], []
    for segment in segments:
        if current and segment[1] - current[0][0] > _GROUP_EVENTS:
            groups.append(current)
            current = []
        current.append(segment)
    if current:
        groups.append(current)
    for held in groups:
        if len(held) == 1:  # a line's own group, as it would be on its own
            _decode_one(held[0], pieces, buf, starts, ends, offset, after, kind, info, intern, parts)
            continue
        group = slice(held[0][0], held[-1][1])
        sizes = [end - first for first, end, _ in held]
        pick = np.repeat(np.arange(len(held)), sizes)  # each event's segment in the group
        held_pieces = [pieces[k] for _, _, k in held]
        try:
            _decode_group(buf, starts[group], ends[group], offset[group], after[group], kind[group],
                          np.array([t for _, t, _ in held_pieces], dtype=np.uint64)[pick], info, intern, parts,
                          np.array([number for number, _, _ in held_pieces], dtype=np.int64)[pick])
        except ValueError:
            # A damaged event: the segments one at a time, so that the error is the first line by line.
            for one in held:
                _decode_one(one, pieces, buf, starts, ends, offset, after, kind, info, intern, parts)
            raise
    return True


def _decode_one(segment, pieces, buf, starts, ends, offset, after, kind, info, intern, parts) -> None:
    """One line's own group (a segment of _decode_across)."""
    first, end, k = segment
    group = slice(first, end)
    line_number, timestamp_ns, _ = pieces[k]
    _decode_group(buf, starts[group], ends[group], offset[group], after[group], kind[group], timestamp_ns, info,
                  intern, parts, line_number)
