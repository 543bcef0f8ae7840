"""A trace saved and loaded: JSON with every event, dump and OOM, a checksum of its contents,
and the checks that refuse a file cut, damaged or edited; and the events as CSV."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from ..errors import TraceDataError
from ..tf.messages import OomInfo
from .allocator_map import AllocatorMap
from .events import ALLOC, COLUMNS, FREE, NUMPY_TYPES, AllocatorEvents

_FORMAT = "tfmem-trace/2"


class _Damaged(Exception):
    """A saved trace that does not hold together (the message says how)."""


def checksum(data: dict) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _check_events(e: AllocatorEvents) -> None:
    """An allocator's events hold together: kinds, sizes, text references, and every in-use
    figure is the one before it plus or minus that event's bytes (an event missing shows)."""
    name = e.allocator
    n = len(e)
    if n == 0:
        return
    if not np.isin(e.kind, (ALLOC, FREE)).all():
        raise _Damaged(f"{name} has events that are neither allocations nor frees")
    if (e.size <= 0).any() or (e.requested < 0).any() or (e.in_use < 0).any() or (e.peak < e.in_use).any():
        raise _Damaged(f"{name} has negative or impossible sizes")
    for column in (e.op, e.shape, e.region):
        if len(column) and (column.min() < 0 or column.max() >= len(e.texts)):
            raise _Damaged(f"{name} refers to texts it does not have")
    delta = e.kind.astype(np.int64) * e.size
    # Events at the same nanosecond may be listed in either order: their sum must still hold.
    tied = np.zeros(n, dtype=bool)
    same = np.diff(e.time_ns) == 0
    tied[1:] |= same
    tied[:-1] |= same
    untied = np.nonzero(~tied)[0]
    if not len(untied):
        return
    first = int(untied[0])
    before = int(e.in_use[first]) - int(delta[: first + 1].sum())
    expected = before + np.cumsum(delta)
    wrong = np.nonzero(expected != e.in_use)[0]
    if before < 0 or len(wrong) and (~tied[wrong]).any():
        at = int(wrong[~tied[wrong]][0]) if len(wrong) and (~tied[wrong]).any() else 0
        raise _Damaged(f"{name}'s in-use figure jumps at event {at}: an event is missing or changed")
    # For each run of tied events, the state after the run is one of the figures in it.
    for k in np.unique(wrong):
        start = k
        while start > 0 and e.time_ns[start - 1] == e.time_ns[k]:
            start -= 1
        end = k
        while end + 1 < n and e.time_ns[end + 1] == e.time_ns[k]:
            end += 1
        if expected[end] not in e.in_use[start:end + 1]:
            raise _Damaged(f"{name}'s in-use figure jumps at event {k}: an event is missing or changed")


def _check_dump(dump: AllocatorMap) -> None:
    """A saved dump: positive sizes, no overlaps, and each region exactly filled by its chunks."""
    chunks = sorted(dump.chunks, key=lambda c: c.address)
    if not chunks or any(c.size <= 0 for c in chunks):
        raise _Damaged(f"the dump of {dump.allocator} has no chunks or impossible sizes")
    for previous, chunk in zip(chunks, chunks[1:]):
        if chunk.address < previous.address + previous.size:
            raise _Damaged(f"the dump of {dump.allocator} has overlapping chunks")
    for region in dump.regions:
        inside = [c for c in chunks if region.address <= c.address < region.address + region.size]
        filled = sum(c.size for c in inside)
        if filled != region.size or (inside and inside[0].address != region.address):
            raise _Damaged(f"the dump of {dump.allocator} does not fill its region at {region.address:#x}: "
                           "chunks are missing")
    if dump.regions and sum(r.size for r in dump.regions) != sum(c.size for c in chunks):
        raise _Damaged(f"the dump of {dump.allocator} has chunks outside its regions")


def save(trace, path: str | Path) -> None:
    """Everything, losslessly: events, dumps, OOM; Trace.load gives the same maps back.

    The file carries a checksum of its contents, so a damaged or edited file is refused."""
    data = {
        "format": _FORMAT,
        "fresh": trace.fresh,
        "growth": trace.growth,
        "oom": None if trace.oom is None else vars(trace.oom),
        "dumps": {k: v.to_dict() for k, v in trace.dumps.items()},
        "text_dump": None if trace.text_dump is None else trace.text_dump.to_dict(),
        "notes": list(trace.notes),
        "allocators": {
            name: {"texts": e.texts, **{c: getattr(e, c).tolist() for c in COLUMNS}}
            for name, e in trace.event_items()
        },
    }
    data["sha256"] = checksum(data)
    Path(path).write_text(json.dumps(data))

def load(path: str | Path, make):
    """A trace saved with save, built by `make` (the Trace class); a damaged, cut or edited file is
    refused in one line."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError, TypeError) as exc:
        raise TraceDataError(f"cannot read {path} ({exc}).") from None
    try:
        data = json.loads(text)
        return _from_data(data, make)
    except _Damaged as exc:
        raise TraceDataError(f"{path} is not a sound saved tfmem trace: {exc}.") from None
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError) as exc:
        raise TraceDataError(f"{path} is not a saved tfmem trace ({type(exc).__name__}: {exc}).") from None

def _from_data(data, make):
    if not isinstance(data, dict) or data.get("format") not in (_FORMAT, "tfmem-trace/1"):
        raise _Damaged("it does not say it is one (format tfmem-trace/2)")
    if data["format"] == _FORMAT:
        stated = data.get("sha256")
        if stated != checksum({k: v for k, v in data.items() if k != "sha256"}):
            raise _Damaged("its checksum does not match its contents (cut, damaged or edited)")
    dtypes = NUMPY_TYPES
    events = {}
    for name, cols in data["allocators"].items():
        lengths = {len(cols[c]) for c in COLUMNS}
        if len(lengths) != 1:
            raise _Damaged(f"the event columns of {name} differ in length")
        events[name] = AllocatorEvents(allocator=name, texts=list(cols["texts"]),
                                       **{c: np.array(cols[c], dtype=dtypes[c]) for c in COLUMNS})
        _check_events(events[name])
    dumps = {k: AllocatorMap.from_dict(v) for k, v in data["dumps"].items()}
    text_dump = None if data["text_dump"] is None else AllocatorMap.from_dict(data["text_dump"])
    for dump in [*dumps.values(), *([text_dump] if text_dump else [])]:
        _check_dump(dump)
    oom = None if data["oom"] is None else OomInfo(**data["oom"])
    if oom is not None and events and oom.allocator not in events and oom.allocator not in dumps:
        raise _Damaged(f"its OOM names allocator {oom.allocator!r}, which it has no record of")
    growth = data["growth"]
    if not isinstance(growth, dict) or not all(isinstance(v, bool) for v in growth.values()):
        raise _Damaged("its growth settings are not true/false per allocator")
    if not isinstance(data["fresh"], bool):
        raise _Damaged("'fresh' is not true or false")
    return make(events, data["fresh"], growth, oom=oom, dumps=dumps, text_dump=text_dump,
               notes=tuple(data.get("notes", ())))


def save_csv(trace, path: str | Path) -> None:
    """One row per event: allocator, time, alloc/free, address, bytes, op, TensorFlow's figures."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["allocator", "time_ns", "event", "address", "bytes", "requested_bytes", "op",
                         "shape", "region_type", "in_use_after", "peak_after", "fragmentation_after"])
        for name in trace.allocators:
            e = trace.events(name)
            for i in range(len(e)):
                writer.writerow([
                    name, int(e.time_ns[i]), "alloc" if e.kind[i] > 0 else "free", hex(int(e.address[i])),
                    int(e.size[i]), int(e.requested[i]), e.text(e.op, i), e.text(e.shape, i),
                    e.text(e.region, i), int(e.in_use[i]), int(e.peak[i]), float(e.fragmentation[i]),
                ])
