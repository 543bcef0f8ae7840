"""Allocations without an op, named by the activity around them.

XLA's programs allocate through TensorFlow's allocator without an op annotation (tf_op empty);
so do tensors made from Python (tf.constant) and graph building. The profiler's activities on
the same thread say what was running: an XLA executable ("CpuExecutable::ExecuteAsyncOnStream",
"XlaLaunch", ...), a tf.function ("__inference_<name>_<n>", on the thread that called it).
"""

from __future__ import annotations

import re

import numpy as np

from ..tf.messages import FUNCTION
from .lines import NOT_ACTIVITIES as NOT_ACTIVITIES  # the names of what is no activity, read here too

# The activities an XLA program runs in: CpuExecutable::ExecuteAsyncOnStream on a CPU, "Build buffer allocations" on a GPU
_XLA_MARKER = re.compile(r"Executable::Execute|ExecuteAsyncOnStream|Build buffer allocations|XlaLaunch|XlaRun|PjRt")


def context_label(enclosing: list[str], functions: list[str]) -> str:
    """The name of what made an allocation without an op, from the activities enclosing it on
    its thread (innermost last) and the tf.functions running then (innermost last)."""
    own = [m.group(1) for m in map(FUNCTION.search, enclosing) if m]
    running = [m.group(1) for m in map(FUNCTION.search, functions) if m]
    function = own[-1] if own else (running[-1] if running else None)
    xla = any(_XLA_MARKER.search(name) for name in enclosing)
    return label(xla, function, enclosing[-1] if enclosing else None)


def label(xla: bool, function: str | None, innermost: str | None) -> str:
    """context_label's words: an XLA program (in its tf.function), a tf.function, the innermost activity."""
    if xla:
        return f"(XLA program in {function})" if function else "(XLA program)"
    if function:
        return f"(in {function})"
    return f"(in {innermost})" if innermost else ""


def _parents(begin, end) -> np.ndarray | None:
    """Each activity's parent (the innermost other one enclosing it; -1 for none), for activities in
    _activities' order that nest, as one thread's do; None where two overlap without nesting."""
    n = len(begin)
    depth = np.arange(1, n + 1) - np.searchsorted(np.sort(end, kind="stable"), begin, side="left")  # enclosing its begin
    parent = np.full(n, -1, dtype=np.int64)
    positions = np.arange(n)
    for d in range(2, int(depth.max(initial=0)) + 1):
        outer = positions[depth == d - 1]
        inner = positions[depth == d]
        parent[inner] = outer[np.searchsorted(outer, inner) - 1]
    has = parent >= 0
    if np.any(depth[~has] != 1) or np.any(end[parent[has]] < end[has]):
        return None
    return parent


def _ids(meta) -> list[int]:
    """The distinct metadata ids in meta, ascending (np.unique's answer, counted instead of sorted)."""
    if len(meta) and 0 <= int(meta.min()) and int(meta.max()) < 1 << 22:
        return np.flatnonzero(np.bincount(meta)).tolist()
    return np.unique(meta).tolist()


def _around(begin, end, meta, times):
    """The activities (in _activities' order) that cover at least one of times: with every one that
    encloses them, so their nesting, and the innermost one around each time, are the line's own."""
    if not len(begin) or not len(times):
        return begin[:0], end[:0], meta[:0]
    times = np.sort(times)
    # Each activity's first time at or after its begin (past the last time: none).
    counts = np.diff(np.searchsorted(begin, times, side="right"), prepend=0)
    first = np.full(len(begin), np.iinfo(np.int64).max, dtype=np.int64)
    first[:int(counts.sum())] = np.repeat(times, counts)
    keep = np.nonzero(end >= first)[0]
    return begin[keep], end[keep], meta[keep]


def _covering(begin, end, parent, times) -> np.ndarray:
    """For each time, the innermost activity covering it (-1 for none)."""
    if not len(begin):
        return np.full(len(times), -1, dtype=np.int64)
    k = np.searchsorted(begin, times, side="right") - 1
    while True:
        out = (k >= 0) & (end[np.maximum(k, 0)] < times)
        if not out.any():
            return k
        k[out] = parent[k[out]]


def _last_running(begin, end, times) -> np.ndarray:
    """For each time, the last-begun of the activities covering it (they need not nest: tf.functions
    on every thread); -1 for none."""
    if not len(begin):
        return np.full(len(times), -1, dtype=np.int64)
    k = np.searchsorted(begin, times, side="right") - 1
    reach = np.maximum.accumulate(end)  # the latest end among those begun so far
    for _ in range(64):
        out = (k >= 0) & (end[np.maximum(k, 0)] < times)
        out &= reach[np.maximum(k, 0)] >= times  # none begun at or before k covers it: no answer
        if not out.any():
            break
        k[out] -= 1
    else:  # many finished ones in between: the rest one by one
        for q in np.nonzero((k >= 0) & (end[np.maximum(k, 0)] < times))[0].tolist():
            j = int(k[q])
            while j >= 0 and end[j] < times[q] and reach[j] >= times[q]:
                j -= 1
            k[q] = j
    return np.where((k >= 0) & (end[np.maximum(k, 0)] >= times), k, -1)


class _FunctionTable:
    """One plane's activities that are tf.functions, for every metadata id its lines hold (each name
    read once): function(meta) is the interned name of each activity's function, -1 for none. Ids are
    looked up among the plane's own, sorted: no table as long as the largest id."""

    def __init__(self, names: dict, metas: list):
        self.ids = np.asarray(_ids(np.concatenate(metas).astype(np.int64)), dtype=np.int64)
        self.functions = {}  # metadata id -> the function's name
        for mid in self.ids.tolist():
            name = names[mid]
            if "__inference_" in name and (match := FUNCTION.search(name)):
                self.functions[mid] = match.group(1)
        self.texts = np.full(len(self.ids), -1, dtype=np.int64)
        self.is_one = np.zeros(len(self.ids), dtype=bool)  # by number among the ids: a tf.function's
        self.is_one[np.searchsorted(self.ids, np.fromiter(self.functions, dtype=np.int64, count=len(self.functions)))] = True

    def intern_all(self, intern) -> None:
        for mid, function in self.functions.items():
            self.texts[np.searchsorted(self.ids, mid)] = intern(function)

    def function(self, meta) -> np.ndarray:
        return self.texts[np.searchsorted(self.ids, meta)] if len(self.ids) else np.full(len(meta), -1, np.int64)

    def is_function(self, meta) -> np.ndarray:
        if not self.functions:
            return np.zeros(len(meta), dtype=bool)
        return self.is_one[np.searchsorted(self.ids, meta)]


def _function_tables(lines) -> dict[int, _FunctionTable]:
    """A _FunctionTable for each plane's names (the dict its lines share, by id)."""
    planes: dict[int, tuple[dict, list]] = {}
    for (_, _, meta), names in lines:
        planes.setdefault(id(names), (names, []))[1].append(meta)
    return {key: _FunctionTable(names, metas) for key, (names, metas) in planes.items()}


def _windows(lines):
    """lines: ((begin, end, meta), times) of several lines. Their activities and times each moved
    into a window of its own, one after the other (what is in one line is in its window, in the same
    order): (begin, end, meta, times), concatenated; None where a damaged file's times would not
    stay in their windows (an activity ending before it begins) or the windows not fit in int64."""
    shift, out = 0, []
    for (begin, end, meta), times in lines:
        if (end < begin).any():
            return None
        low, high = int(begin.min(initial=times.min())), int(end.max(initial=times.max()))  # (times are in)
        moved = shift - low
        if abs(moved) > 1 << 62 or shift + high - low + 1 > 1 << 62:
            return None
        out.append((begin + moved, end + moved, meta, times + moved))
        shift += high - low + 1
    return tuple(np.concatenate(column) for column in zip(*out))


def _label_line(begin, end, meta, times, running_name, context) -> np.ndarray | None:
    """The label of each allocation at `times` on a line whose activities (in _activities' order)
    are begin, end, meta: the XLA program, tf.function and innermost activity around it, else the
    tf.function running then (running_name: its interned name, -1 for none). None where the
    activities overlap without nesting. context: (names, function table, XLA marks, intern)."""
    names, table, known, intern = context
    near = _around(begin, end, meta, times)
    if not np.any((np.diff(near[0]) == 0) & (np.diff(near[1]) == 0)):
        begin, end, meta = near  # (twins keep the whole line: which is innermost is the line's say)
    parent = _parents(begin, end)
    if parent is None:
        return None
    # Per metadata id, looked up for all activities at once.
    # Ids are numbered among the lines' own, in their order (no table as long as the largest id).
    ids = np.asarray(_ids(meta), dtype=np.int64)
    for mid in ids.tolist():
        if mid not in known:
            known[mid] = bool(_XLA_MARKER.search(names[mid]))
    place = np.searchsorted(ids, meta)
    xla_of = np.fromiter((known[mid] for mid in ids.tolist()), dtype=bool, count=len(ids))
    xla_flag, fn_id = xla_of[place], table.function(meta)
    at = _covering(begin, end, parent, times)
    innermost = np.full(len(times), -1, dtype=np.int64)  # the innermost activity's id, by its number
    innermost[at >= 0] = place[at[at >= 0]]
    xla = np.zeros(len(times), dtype=bool)
    own = np.full(len(times), -1, dtype=np.int64)
    k = at.copy()
    while (k >= 0).any():  # up the chain of enclosing activities, one level for all at once
        alive = k >= 0
        here = k[alive]
        xla[alive] |= xla_flag[here]
        unset = alive & (own < 0)
        own[unset] = fn_id[k[unset]]
        k[alive] = parent[here]
    function = np.where(own >= 0, own, running_name)
    # One number per (XLA, function, innermost), in the order of those triples.
    f_span = int(function.max(initial=-1)) + 2
    i_span = int(innermost.max(initial=-1)) + 2
    keys = (xla.astype(np.int64) * f_span + (function + 1)) * i_span + (innermost + 1)
    unique, inverse = np.unique(keys, return_inverse=True)
    x, rest = np.divmod(unique, f_span * i_span)
    f, i = np.divmod(rest, i_span)
    words = [label(bool(x), intern.texts[f - 1] if f > 0 else None, names[int(ids[i - 1])] if i > 0 else None)
             for x, f, i in zip(x.tolist(), f.tolist(), i.tolist())]
    return np.fromiter(map(intern, words), dtype=np.int64, count=len(words))[inverse.reshape(-1)]


def name_unnamed_allocations(columns, lines, intern) -> None:
    """Give each allocation without an op the name of the activity that made it (in place): the
    activities covering it on its own thread (innermost last), an XLA program among them, and the
    tf.functions running then on any thread. Array operations throughout; a thread whose activities
    do not nest is read one allocation at a time (context_label)."""
    todo = []
    for cols in columns.values():
        unnamed = np.nonzero((cols["kind"] > 0) & (cols["op"] == 0))[0]
        if len(unnamed):
            todo.append((cols, unnamed))
    if not todo:
        for cols in columns.values():
            cols.pop("line", None)
        return
    parsed = lines  # each line's activities, as lines.read_memory_columns read them
    tables = _function_tables(lines)
    marks_xla: dict[int, dict[int, bool]] = {}  # per plane's names: metadata id -> an XLA program's, once read
    # The tf.functions of every thread.
    f_begin, f_end, f_name = [], [], []
    for (begin, end, meta), names in lines:
        table = tables[id(names)]
        if not table.functions:
            continue
        hit = table.is_function(meta)
        if not hit.any():
            continue
        for mid in _ids(meta[hit]):
            pick = meta == mid
            f_begin.append(begin[pick])
            f_end.append(end[pick])
            f_name.append(np.full(int(pick.sum()), intern(table.functions[mid]), dtype=np.int64))
    for table in tables.values():  # (each already interned above, in the lines' order)
        table.intern_all(intern)
    if f_begin:
        fb, fe, fn = np.concatenate(f_begin), np.concatenate(f_end), np.concatenate(f_name)
        order = np.lexsort((-fe, fb))
        fb, fe, fn = fb[order], fe[order], fn[order]
    else:
        fb = fe = fn = np.zeros(0, np.int64)
    for cols, unnamed in todo:
        times = cols["time_ns"][unnamed].astype(np.int64) * 1000
        line_of = cols["line"][unnamed]
        running = _last_running(fb, fe, times)
        running_name = np.full(len(times), -1, dtype=np.int64)
        running_name[running >= 0] = fn[running[running >= 0]]
        labels = np.zeros(len(unnamed), dtype=np.int64)
        # The lines of one plane (one names dict) are labelled together: each line's activities and
        # allocations moved into a time window of its own, so that no two lines' activities overlap
        # and one array pass serves them all. Where activities do not nest, line by line.
        by_plane: dict[int, list[tuple[int, np.ndarray]]] = {}
        for line_number in np.unique(line_of).tolist():
            by_plane.setdefault(id(parsed[line_number][1]), []).append(
                (line_number, np.nonzero(line_of == line_number)[0]))
        for held in by_plane.values():
            names = parsed[held[0][0]][1]
            context = names, tables[id(names)], marks_xla.setdefault(id(names), {}), intern
            if len(held) > 1:
                windows = _windows([(parsed[number][0], times[mine]) for number, mine in held])
                mine = np.concatenate([m for _, m in held])
                found = None if windows is None else _label_line(*windows, running_name[mine], context)
                if found is not None:
                    labels[mine] = found
                    continue
            for line_number, mine in held:
                (begin, end, meta), _ = parsed[line_number]
                found = _label_line(begin, end, meta, times[mine], running_name[mine], context)
                if found is None:  # activities that overlap without nesting: one at a time
                    spans = sorted(zip(begin.tolist(), (-end).tolist(), meta.tolist()))
                    found = np.zeros(len(mine), dtype=np.int64)
                    for q, k in enumerate(mine.tolist()):
                        t = int(times[k])
                        chain = [names[m] for b, ne, m in spans if b <= t <= -ne]
                        live = [intern.texts[int(running_name[k])]] if running_name[k] >= 0 else []
                        found[q] = intern(context_label(chain, [f"__inference_{f}_0" for f in live]))
                labels[mine] = found
        cols["op"][unnamed] = labels.astype(cols["op"].dtype)
    for cols in columns.values():
        cols.pop("line", None)
