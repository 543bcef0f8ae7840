"""Bulk decoding of the profiler's memory events, with numpy instead of one object per field.

A long trace holds millions of profiler events and a dozen figures on each memory event, too many
to read one protobuf object at a time. Here the protobuf wire format of the events lines.py leaves
as raw bytes is decoded for all memory events at once, field by field, as numpy arrays. The plain
decoder in the tests (xspace_reference.py) gives the same columns.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import TraceDataError
from .events import (
    ALLOCATOR_SLOT,
    FIRST_TEXT_SLOT,
    FRAGMENTATION_SLOT,
    NUMPY_TYPES,
    SLOTS,
    STAT_OF_COLUMN,
)

_PADDING = b"\0" * 16
_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_FIXED32 = 0, 1, 2, 5
# XEvent fields and XStat fields (tsl/profiler/protobuf/xplane.proto).
_EVENT_METADATA_ID, _EVENT_OFFSET_PS, _EVENT_DURATION_PS, _EVENT_STATS = 1, 2, 3, 4
_STAT_METADATA_ID, _STAT_DOUBLE, _STAT_UINT64, _STAT_INT64, _STAT_STR, _STAT_REF = 1, 2, 3, 4, 5, 7
_HIGH_BITS = np.uint64(0x8080808080808080)
_LOW_BITS = np.uint64(0x7F7F7F7F7F7F7F7F)
_ONE = np.uint64(1)
# Masks that pack the 7-bit groups of eight bytes: pairs into 14 bits, then 28, then 56.
_PACK = tuple((np.uint64(keep), np.uint64(high), np.uint64(shift)) for keep, high, shift in (
    (0x007F007F007F007F, 0x7F007F007F007F00, 1),
    (0x00003FFF00003FFF, 0x3FFF00003FFF0000, 2),
    (0x000000000FFFFFFF, 0x0FFFFFFF00000000, 4),
))


def parse_message(message, source, what: str, data: bytes | None = None):
    """`message` (a protobuf message) parsed from `data`, or from the file `source` where data is None;
    a file that cannot be read or parsed is one TraceDataError that names it and `what` it should be."""
    from google.protobuf.message import DecodeError

    try:
        message.ParseFromString(Path(source).read_bytes() if data is None else data)
    except DecodeError as exc:
        raise TraceDataError(f"{source} is not a readable {what} (truncated or corrupt: {exc}).") from None
    except OSError as exc:
        raise TraceDataError(f"cannot read {source}: {exc.strerror or exc}.") from None
    return message


def _pairs(buf: np.ndarray) -> np.ndarray:
    """The two bytes from each position of buf as one little-endian uint16 (overlapping)."""
    return np.ndarray((max(len(buf) - 1, 0),), dtype="<u2", buffer=buf, strides=(1,))


def _words(buf: np.ndarray) -> np.ndarray:
    """The eight bytes from each position of buf as one little-endian uint64 (overlapping)."""
    return np.ndarray((max(len(buf) - 7, 0),), dtype="<u8", buffer=buf, strides=(1,))


def _varints(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(values as uint64, byte lengths) of the varints starting at each position.

    Varints of one byte are the byte; longer ones are read eight bytes at a time as a word, the
    7-bit groups packed with masks; the few longer than eight bytes byte by byte."""
    byte = buf[pos]
    if not len(pos) or (byte < 0x80).all():
        return byte.astype(np.uint64), np.ones(len(pos), dtype=np.int64)
    words = _words(buf)
    if int(pos.max()) >= len(words):  # only a damaged event reads that far into the padding
        return _varints_bytewise(buf, pos)
    word = words[pos]
    last = ~word & _HIGH_BITS  # the top bit of each byte that ends a varint
    last &= ~last + _ONE  # the first of them
    mask = (last << _ONE) - _ONE  # the varint's bytes (all eight where the last one ends it)
    value = word & mask & _LOW_BITS
    for keep, high, shift in _PACK:
        value = (value & keep) | ((value & high) >> shift)
    length = (np.bitwise_count(mask) >> 3).astype(np.int64)
    longer = np.nonzero(last == 0)[0]
    if len(longer):
        value[longer], length[longer] = _varints_bytewise(buf, pos[longer])
    return value, length


def _varints_bytewise(buf: np.ndarray, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """_varints one byte at a time, for all lengths up to ten bytes."""
    byte = buf[pos]
    value = (byte & 0x7F).astype(np.uint64)
    length = np.ones(len(pos), dtype=np.int64)
    todo = np.nonzero(byte >= 0x80)[0]
    for k in range(1, 10):
        if not len(todo):
            return value, length
        byte = buf[pos[todo] + k]
        value[todo] |= (byte & 0x7F).astype(np.uint64) << np.uint64(7 * k)
        length[todo] += 1
        todo = todo[byte >= 0x80]
    if len(todo):
        raise ValueError("a varint longer than 10 bytes")
    return value, length


def _fields(buf: np.ndarray, start: np.ndarray, end: np.ndarray):
    """Walk the fields of many messages at once. Yields, per step, for the messages that
    still have fields: (message index, field number, wire type, value position, varint value,
    length of a length-delimited value)."""
    pos = start.copy()
    alive = np.nonzero(pos < end)[0]
    while len(alive):
        p = pos[alive]
        tag, tag_len = _varints(buf, p)
        field = (tag >> np.uint64(3)).astype(np.int64)
        wire = (tag & np.uint64(7)).astype(np.int64)
        p = p + tag_len
        value = np.zeros(len(alive), dtype=np.uint64)
        size = np.zeros(len(alive), dtype=np.int64)
        step = np.zeros(len(alive), dtype=np.int64)
        is_varint = wire == _WIRE_VARINT
        if is_varint.any():
            v, n = _varints(buf, p[is_varint])
            value[is_varint], step[is_varint] = v, n
        is_len = wire == _WIRE_LEN
        if is_len.any():
            v, n = _varints(buf, p[is_len])
            size[is_len] = v.astype(np.int64)
            p[is_len] += n
            step[is_len] = size[is_len]
        step[wire == _WIRE_FIXED64] = 8
        step[wire == _WIRE_FIXED32] = 4
        unknown = ~(is_varint | is_len | (wire == _WIRE_FIXED64) | (wire == _WIRE_FIXED32))
        if unknown.any():
            raise ValueError(f"wire type {int(wire[unknown][0])}")
        yield alive, field, wire, p, value, size
        pos[alive] = p + step
        if (pos[alive] > end[alive]).any():
            raise ValueError("a field runs past the end of its event")
        alive = alive[pos[alive] < end[alive]]


def _event_fields(buf, start, end, offset_ps, p):
    """Stat byte ranges of memory events, whose offsets (offset_ps) and the position of what
    follows their leading fields (p) _leading_fields read. Events are written field by field in
    number order: metadata id, offset, then stats, each a short length-delimited message. That
    layout is read in lockstep across all events; an event laid out otherwise goes through the
    generic walk."""
    odd = buf[start] != (_EVENT_METADATA_ID << 3 | _WIRE_VARINT)
    owners, starts, sizes = [], [], []
    alive = np.nonzero((p < end) & ~odd)[0]
    q, last = p[alive], end[alive]  # the next stat's position and the end, of the events still read
    stat_tag = _EVENT_STATS << 3 | _WIRE_LEN
    # The two bytes at each position as one number (tag, then size): read together, one gather.
    pairs = _pairs(buf)
    while len(alive):
        pair = pairs[q]
        plain = (pair & 0x80FF) == stat_tag  # the stats tag, and a size of one byte
        size = (pair >> 8).astype(np.int64)
        if not plain.all():
            odd[alive[~plain]] = True
            alive, q, last, size = alive[plain], q[plain], last[plain], size[plain]
        q = q + 2
        owners.append(alive)
        starts.append(q)
        sizes.append(size)
        q = q + size
        more = q < last
        if not more.all():  # (a stat that runs past its event's end ends its reading, so is among these)
            if (q[~more] > last[~more]).any():
                raise ValueError("a stat runs past the end of its event")
            alive, q, last = alive[more], q[more], last[more]
    redo = np.nonzero(odd)[0]
    if len(redo):
        # Rare layouts: walk those events field by field from their start again.
        keep = ~np.isin(np.concatenate(owners) if owners else np.zeros(0, np.int64), redo)
        owners = [np.concatenate(owners)[keep]] if owners else []
        starts = [np.concatenate(starts)[keep]] if starts else []
        sizes = [np.concatenate(sizes)[keep]] if sizes else []
        for alive2, field, wire, pos, value2, size2 in _fields(buf, start[redo], end[redo]):
            is_offset = (field == _EVENT_OFFSET_PS) & (wire == _WIRE_VARINT)
            offset_ps[redo[alive2[is_offset]]] = value2[is_offset]
            is_stat = (field == _EVENT_STATS) & (wire == _WIRE_LEN)
            owners.append(redo[alive2[is_stat]])
            starts.append(pos[is_stat])
            sizes.append(size2[is_stat])
    owner = np.concatenate(owners) if owners else np.zeros(0, np.int64)
    s_start = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    s_end = s_start + (np.concatenate(sizes) if sizes else np.zeros(0, np.int64))
    return offset_ps, owner, s_start, s_end


# By a varint's length in bytes (1 to 8; 0 and 9 match nothing): the high bits it must show
# (set on all its bytes but the last) among those of its bytes, and the mask of its 7-bit groups.
_OWN = np.array([(1 << 8 * k) - 1 for k in range(9)] + [0], dtype=np.uint64)
_OWN_HIGH = _OWN & _HIGH_BITS
_CONTINUED = np.concatenate([[np.uint64(1)], _OWN[:-1] & _HIGH_BITS])  # (for length 0, a bit no masked word has)
_OWN_LOW = _OWN & _LOW_BITS


def _stat_fields(buf, start, end):
    """(metadata id, value field number, raw value, {stat: (text position, length)}) of each
    stat. A stat is its metadata id then one value. Where every stat's id and value tag are one
    byte each (the profiler's: stat ids are small), each value is read knowing where it ends
    (its stat's end), all at once; the stats that do not end there, and any other layout, are
    read by _stat_fields_walked."""
    n = len(start)
    if not n or not (buf[start] == (_STAT_METADATA_ID << 3 | _WIRE_VARINT)).all():
        return _stat_fields_walked(buf, start, end)
    stat_id = buf[start + 1]
    tag = buf[start + 2]
    if not ((stat_id < 0x80).all() and (tag < 0x80).all()):
        return _stat_fields_walked(buf, start, end)
    stat_field = (tag >> 3).astype(np.int8)
    wire = tag & 7
    del tag
    at = start + 3
    if int(at.max()) + 8 > len(buf):
        return _stat_fields_walked(buf, start, end)
    length = end - at
    word = _words(buf)[at]  # the value's first eight bytes (the padding past the end covers the last ones)
    fit = np.clip(length, 0, 9)
    is_int = wire == _WIRE_VARINT
    # A varint ends at its stat's end when the high bits of its bytes are set but on the last.
    ok = is_int & ((word & _OWN_HIGH[fit]) == _CONTINUED[fit])
    value = word & _OWN_LOW[fit]
    for keep, high, shift in _PACK:
        value = (value & keep) | ((value & high) >> shift)
    # Varints of 9 or 10 bytes (negative int64s, and numbers from 2**56): eight continued bytes,
    # then one or two more read apart; the bits past 64 are dropped, as _varints_bytewise does.
    long = np.nonzero(is_int & (length > 8) & (length <= 10))[0]
    if len(long):
        head = word[long]
        ninth = buf[at[long] + 8]
        tenth = np.where(length[long] == 10, buf[np.minimum(at[long] + 9, end[long] - 1)], 0)
        good = ((head & _HIGH_BITS) == _HIGH_BITS) & ((ninth >= 0x80) == (length[long] == 10)) & (tenth < 0x80)
        head &= _LOW_BITS
        for keep, high, shift in _PACK:
            head = (head & keep) | ((head & high) >> shift)
        head |= (ninth & 0x7F).astype(np.uint64) << np.uint64(56)
        head |= (tenth & 0x7F).astype(np.uint64) << np.uint64(63)
        value[long] = head
        ok[long] = good
    is_double = wire == _WIRE_FIXED64
    ok |= is_double & (length == 8)
    stat_value = np.where(is_int, value, np.where(is_double, word, np.uint64(0)))
    del value
    is_text = np.nonzero(wire == _WIRE_LEN)[0]
    size = (word[is_text] & np.uint64(0xFF)).astype(np.int64)
    fits = (size < 0x80) & (length[is_text] == size + 1)
    ok[is_text[fits]] = True
    is_text, size = is_text[fits], size[fits]
    texts = dict(zip(is_text.tolist(), zip((at[is_text] + 1).tolist(), size.tolist())))
    redo = np.nonzero(~ok)[0]
    if len(redo):
        stat_id = stat_id.astype(np.uint64)  # (one byte each, but where walked)
        stat_id[redo], stat_field[redo], stat_value[redo], more = _stat_fields_walked(buf, start[redo], end[redo])
        texts.update((int(redo[k]), place) for k, place in more.items())
    return stat_id, stat_field, stat_value, texts


def _stat_fields_walked(buf, start, end):
    """_stat_fields for any layout: a stat's id and value read as varints where they begin, and
    the stats laid out otherwise walked field by field."""
    n = len(start)
    stat_id = np.zeros(n, dtype=np.uint64)
    stat_field = np.zeros(n, dtype=np.int8)
    stat_value = np.zeros(n, dtype=np.uint64)
    texts: dict[int, tuple[int, int]] = {}
    plain = buf[start] == (_STAT_METADATA_ID << 3 | _WIRE_VARINT)
    rows = np.nonzero(plain)[0]
    ids, id_len = _varints(buf, start[rows] + 1)
    stat_id[rows] = ids
    del ids
    p = start[rows] + 1 + id_len
    del id_len
    tag = buf[p]
    wire = tag & 7
    stat_field[rows] = tag >> 3
    value_end = np.full(len(rows), -1, dtype=np.int64)
    is_int = wire == _WIRE_VARINT
    values, length = _varints(buf, p[is_int] + 1)
    stat_value[rows[is_int]] = values
    value_end[is_int] = p[is_int] + 1 + length
    del values, length, is_int
    is_double = wire == _WIRE_FIXED64
    if is_double.any():
        stat_value[rows[is_double]] = buf[p[is_double][:, None] + 1 + np.arange(8)].copy().view(np.uint64)[:, 0]
    value_end[is_double] = p[is_double] + 9
    is_text = np.nonzero(wire == _WIRE_LEN)[0]
    size, size_len = _varints(buf, p[is_text] + 1)
    text_start = p[is_text] + 1 + size_len
    value_end[is_text] = text_start + size.astype(np.int64)
    texts.update(zip(rows[is_text].tolist(), zip(text_start.tolist(), size.tolist())))
    plain[rows[(tag >= 0x80) | (value_end != end[rows])]] = False
    redo = np.nonzero(~plain)[0]
    if len(redo):
        for alive, field2, wire2, pos, value, size2 in _fields(buf, start[redo], end[redo]):
            k = redo[alive]
            is_id = field2 == _STAT_METADATA_ID
            stat_id[k[is_id]] = value[is_id]
            other = ~is_id
            stat_field[k[other]] = field2[other]
            is_int = other & (wire2 == _WIRE_VARINT)
            stat_value[k[is_int]] = value[is_int]
            is_double = other & (wire2 == _WIRE_FIXED64)
            if is_double.any():
                stat_value[k[is_double]] = buf[pos[is_double][:, None] + np.arange(8)].copy().view(np.uint64)[:, 0]
            is_text = other & (wire2 == _WIRE_LEN)
            texts.update(zip(k[is_text].tolist(), zip(pos[is_text].tolist(), size2[is_text].tolist())))
    return stat_id, stat_field, stat_value, texts


def _leading_fields(buf, starts, ends):
    """An XEvent's metadata id, offset and duration, read where protobuf writes them: its first
    fields, in that order (a field equal to 0 is left out). (meta, offset, duration, the position
    after them, the events whose bytes hold something else before their stats: to be read field
    by field)."""
    n = len(starts)
    columns = []
    pos = starts.copy()
    last = len(buf) - 1
    for number in (_EVENT_METADATA_ID, _EVENT_OFFSET_PS, _EVENT_DURATION_PS):
        here = (pos < ends) & (buf[np.minimum(pos, last)] == (number << 3 | _WIRE_VARINT))
        if here.all():
            column, length = _varints(buf, pos + 1)
            pos += 1 + length
        else:
            column = np.zeros(n, dtype=np.uint64)
            here = np.nonzero(here)[0]
            if len(here):
                value, length = _varints(buf, pos[here] + 1)
                column[here] = value
                pos[here] += 1 + length
        columns.append(column)
    rest = pos < ends
    # What may follow: the stats (field 4, length-delimited) alone; anything else is read in full.
    odd = np.nonzero(rest & (buf[np.minimum(pos, last)] != (_EVENT_STATS << 3 | _WIRE_LEN)))[0]
    return (*columns, pos, odd)


def _interned(buf, ref_ids, strings, stat_texts, info, intern):
    """The interned text of each text stat: the names of the stat metadata ids ref_ids refer to, and
    the strings at the stats `strings` (positions in stat_texts). New names are interned first, in
    the order of their ids, then the strings in order."""
    stat_names = info.stat_names
    known = info.ref_texts  # the interned name of each stat metadata id met so far, -1 for none yet
    if (ref_ids < len(known)).all():
        ref_ids = ref_ids.astype(np.int64)
        missing = known[ref_ids] < 0
        if missing.any():
            for i in np.unique(ref_ids[missing]).tolist():  # interned in the order of their ids
                known[i] = intern(stat_names.get(i, ""))
        ref_text = known[ref_ids]
    else:
        ref_ids, ref_inverse = np.unique(ref_ids, return_inverse=True)
        ref_text = np.array([intern(stat_names.get(int(i), "")) for i in ref_ids], dtype=np.int64)[ref_inverse]
    string_text = np.array(
        [intern(bytes(buf[stat_texts[k][0]:stat_texts[k][0] + stat_texts[k][1]]).decode(errors="replace"))
         for k in strings.tolist()],
        dtype=np.int64,
    )
    return ref_text, string_text


def _decode_group(buf, starts, ends, offset_ps, after, kind, timestamp_ns, info, intern, parts, line_number) -> None:
    """Memory events' columns into parts, by allocator. timestamp_ns and line_number: their line's, or,
    for events of several lines, each event's (arrays)."""
    offset_ps, owner, s_start, s_end = _event_fields(buf, starts, ends, offset_ps, after)
    # The stats no column takes (a memory event's id, bytes_reserved) are left undecoded: where a
    # stat's id is its first byte after the tag, as the profiler writes it, it is known here. (Such a
    # stat is not read, so not checked either; its id is its first, where a stat repeating the field
    # would take its last: the profiler writes each field once.) A stat's first two bytes are read
    # as one number: the tag of its id, then the id.
    head = _pairs(buf)[s_start]
    unused = ((head & 0xFF) == (_STAT_METADATA_ID << 3 | _WIRE_VARINT)) & info.unused_ids[head >> 8] & \
        (s_end - s_start >= 2)
    if unused.any():
        keep = ~unused
        owner, s_start, s_end = owner[keep], s_start[keep], s_end[keep]
    stat_id, stat_field, stat_value, stat_texts = _stat_fields(buf, s_start, s_end)
    del s_start, s_end

    # Stat metadata id -> slot in a row (see events.SLOTS); unknown stats are skipped.
    table = info.slot_table
    if stat_id.dtype == np.uint8:  # ids of one byte (as the profiler writes them): a table of 256
        slots = info.slot_of_byte[stat_id]
    else:
        slots = np.where(stat_id < len(table), table[np.minimum(stat_id, len(table) - 1).astype(np.int64)], -1)
    del stat_id

    n = len(starts)
    row_int = np.zeros((FIRST_TEXT_SLOT, n), dtype=np.int64)
    fragmentation = np.zeros(n, dtype=np.float64)
    row_text = np.zeros((ALLOCATOR_SLOT - FIRST_TEXT_SLOT, n), dtype=np.int64)
    allocator = np.full(n, -1, dtype=np.int64)

    as_int = stat_value.view(np.int64)
    pick = (slots >= 0) & (slots < FIRST_TEXT_SLOT)
    row_int[slots[pick], owner[pick]] = as_int[pick]
    pick = slots == FRAGMENTATION_SLOT
    is_double = pick & (stat_field == _STAT_DOUBLE)
    fragmentation[owner[is_double]] = stat_value[is_double].view(np.float64)
    is_other = pick & (stat_field != _STAT_DOUBLE)
    fragmentation[owner[is_other]] = as_int[is_other].astype(np.float64)

    text_slots = slots >= FIRST_TEXT_SLOT + 1
    ref = text_slots & (stat_field == _STAT_REF)
    refs = np.nonzero(ref)[0]
    strings = np.nonzero(text_slots & (stat_field == _STAT_STR))[0]
    ref_text, string_text = _interned(buf, stat_value[refs], strings, stat_texts, info, intern)
    for rows, values in ((refs, ref_text), (strings, string_text)):
        pick = slots[rows] < ALLOCATOR_SLOT
        row_text[slots[rows[pick]] - (FIRST_TEXT_SLOT + 1), owner[rows[pick]]] = values[pick]
        pick = slots[rows] == ALLOCATOR_SLOT
        allocator[owner[rows[pick]]] = values[pick]

    stamp = timestamp_ns if isinstance(timestamp_ns, np.ndarray) else np.uint64(timestamp_ns)
    time_ns = ((stamp * np.uint64(1000) + offset_ps) // np.uint64(1000)).astype(np.int64)
    one = len(allocator) and (allocator == allocator[0]).all()
    for name_index in [allocator[0]] if one else np.unique(allocator):
        if name_index < 0:
            continue  # a memory event without an allocator: nothing to place it in
        # All the group's events (one allocator, the usual case): the columns as they are.
        mine = slice(None) if one else allocator == name_index
        columns = {"time_ns": time_ns[mine], "kind": kind[mine],
                   "line": line_number[mine] if isinstance(line_number, np.ndarray) else
                   np.full(len(time_ns[mine]), line_number, dtype=np.int64)}
        for column, stat in STAT_OF_COLUMN.items():  # each column from its stat's slot (events.py)
            slot = SLOTS[stat]
            if slot == FRAGMENTATION_SLOT:
                values = fragmentation[mine]
            elif slot < FIRST_TEXT_SLOT:
                values = row_int[slot, mine]
            else:
                values = row_text[slot - FIRST_TEXT_SLOT - 1, mine]
            columns[column] = values.view(NUMPY_TYPES[column]) if column == "address" else \
                values.astype(NUMPY_TYPES[column], copy=False)
        parts.setdefault(int(name_index), []).append(columns)
