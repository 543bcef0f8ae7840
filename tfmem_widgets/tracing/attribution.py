"""Allocations without an op, named by the activity around them.

XLA's programs allocate through TensorFlow's allocator without an op annotation (tf_op empty);
so do tensors made from Python (tf.constant) and graph building. The profiler's activities on
the same thread say what was running: an XLA executable ("CpuExecutable::ExecuteAsyncOnStream",
"XlaLaunch", ...), a tf.function ("__inference_<name>_<n>", on the thread that called it).
"""

from __future__ import annotations

import re

import numpy as np

from .wire import _EVENT_DURATION_PS, _EVENT_METADATA_ID, _EVENT_OFFSET_PS, _PADDING, _WIRE_VARINT, _fields, _varints

# CPU: CpuExecutable::ExecuteAsyncOnStream; GPU (measured on an H200): "Build buffer allocations"
_XLA_MARKER = re.compile(r"Executable::Execute|ExecuteAsyncOnStream|Build buffer allocations|XlaLaunch|XlaRun|PjRt")
FUNCTION = re.compile(r"__inference_(.+?)_\d+$")  # a tf.function: __inference_<name>_<n>
NOT_ACTIVITIES = ("MemoryAllocation", "MemoryDeallocation", "ThreadpoolListener")


def context_label(enclosing: list[str], functions: list[str]) -> str:
    """The name of what made an allocation without an op, from the activities enclosing it on
    its thread (innermost last) and the tf.functions running then (innermost last)."""
    own = [m.group(1) for m in map(FUNCTION.search, enclosing) if m]
    running = [m.group(1) for m in map(FUNCTION.search, functions) if m]
    function = own[-1] if own else (running[-1] if running else None)
    if any(_XLA_MARKER.search(name) for name in enclosing):
        return f"(XLA program in {function})" if function else "(XLA program)"
    if function:
        return f"(in {function})"
    return f"(in {enclosing[-1]})" if enclosing else ""


def _activities(plane, line, only=None):
    """(start ps, end ps, name) of the line's activities with a duration, by start; only: a
    test on the name."""
    names = {mid: m.name for mid, m in plane.event_metadata.items()
             if not m.name.startswith(NOT_ACTIVITIES) and (only is None or only(m.name))}
    events = line.events
    if not names or not len(events):
        return []
    lengths = np.fromiter(map(len, events), dtype=np.int64, count=len(events))
    buf = np.frombuffer(b"".join([*events, _PADDING]), dtype=np.uint8)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # Only the events whose metadata id (their first field) is one of the names wanted are walked.
    has_id = buf[starts] == (_EVENT_METADATA_ID << 3 | _WIRE_VARINT)
    first_id = np.zeros(len(events), dtype=np.uint64)
    first_id[has_id] = _varints(buf, starts[has_id] + 1)[0]
    wanted = np.array(sorted(names), dtype=np.uint64)
    pick = np.nonzero(~has_id | np.isin(first_id, wanted))[0]
    starts, ends = starts[pick], ends[pick]
    n = len(pick)
    meta = np.zeros(n, dtype=np.uint64)
    offset = np.zeros(n, dtype=np.uint64)
    duration = np.zeros(n, dtype=np.uint64)
    for alive, field, wire, _pos, value, _size in _fields(buf, starts, ends):
        varint = wire == _WIRE_VARINT
        for number, column in ((_EVENT_METADATA_ID, meta), (_EVENT_OFFSET_PS, offset), (_EVENT_DURATION_PS, duration)):
            chosen = varint & (field == number)
            column[alive[chosen]] = value[chosen]
    base = int(line.timestamp_ns) * 1000
    keep = np.nonzero((duration > 0) & np.isin(meta, wanted))[0]
    found = [(base + int(offset[k]), base + int(offset[k]) + int(duration[k]), names[int(meta[k])])
             for k in keep.tolist()]
    found.sort()
    return found


def _sweep(activities, times):
    """For each time (ascending), the names of the activities covering it, outermost first:
    one pass, keeping only the activities still open (a thread's activities nest, so few are)."""
    out, open_, k = [], [], 0
    for t in times:
        while k < len(activities) and activities[k][0] <= t:
            open_.append(activities[k])
            k += 1
        open_ = [a for a in open_ if a[1] >= t]
        out.append([a[2] for a in open_])
    return out


def name_unnamed_allocations(columns, lines, intern) -> None:
    """Give each allocation without an op the name of the activity that made it (in place)."""
    todo = []
    for cols in columns.values():
        unnamed = np.nonzero((cols["kind"] > 0) & (cols["op"] == 0))[0]
        if len(unnamed):
            todo.append((cols, unnamed))
    if not todo:
        for cols in columns.values():
            cols.pop("line", None)
        return
    functions = []
    for plane, line in lines:
        functions += _activities(plane, line, only=lambda name: FUNCTION.search(name) is not None)
    functions.sort()
    activities_of: dict[int, list] = {}
    for cols, unnamed in todo:
        times = cols["time_ns"][unnamed] * 1000
        line_of = cols["line"][unnamed]
        labels = np.zeros(len(unnamed), dtype=np.int64)
        order = np.argsort(times, kind="stable")
        running = _sweep(functions, times[order].tolist())
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))  # where each allocation sits in time order
        for line_number in np.unique(line_of).tolist():
            if line_number not in activities_of:
                activities_of[line_number] = _activities(*lines[line_number])
            mine = order[line_of[order] == line_number]  # this line's allocations, in time order
            enclosing = _sweep(activities_of[line_number], times[mine].tolist())
            for k, chain in zip(mine.tolist(), enclosing):
                labels[k] = intern(context_label(chain, running[rank[k]]))
        cols["op"][unnamed] = labels.astype(cols["op"].dtype)
    for cols in columns.values():
        cols.pop("line", None)
