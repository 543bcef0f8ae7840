"""TensorFlow's own record of an allocator at an OOM, as an AllocatorMap.

Two forms: the text dump the BFC allocator logs when an allocation fails (what people paste
from their logs: ``Next region of size N``, ``InUse at ADDR of size N next K``...), and the
binary ``MemoryDump`` it writes when TF_BFC_MEMORY_DUMP is set.
"""

from __future__ import annotations

import re
from pathlib import Path

from .allocator_map import AllocatorMap, Chunk, Region
from .xplane import TraceDataError

_REGION = re.compile(r"Next region of size (\d+)")
_CHUNK = re.compile(r"\b(InUse|Free)\s+at\s+([0-9a-fA-Fx]+)\s+of size\s+(\d+)(?:\s+by op\s+(\S+))?")
_NAME = re.compile(r"(?:BFCAllocator dump for|Allocator \()\s*([A-Za-z0-9_]+)")
_FAILED = re.compile(r"ran out of memory trying to allocate .*?\(rounded to (\d+)\)")
_LIMIT = re.compile(r"^\s*Limit:\s+(\d+)\s*$", re.MULTILINE)
_LIMIT_FROM_POOL = re.compile(r"memory_limit_:\s*([0-9.]+)\s*([KMGT]?i?B)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def parse_bfc_dump(text: str) -> AllocatorMap:
    """The allocator's state from its text dump (a log pasted whole, prefixes and all).

    >>> m = tfmem_widgets.parse_bfc_dump(open("train.log").read())
    >>> m.largest_free_bytes, m.fragmentation, m.failed_request_bytes
    """
    # A log may hold several dumps (one per failed allocation): the last one is the latest.
    starts = [m.start() for m in re.finditer(r"BFCAllocator dump for", text)]
    header = text
    if len(starts) > 1:
        header, text = text[: starts[-1]], text[starts[-1]:]
    regions: list[Region] = []
    chunks: list[Chunk] = []
    expected_next = None
    region_end = None
    for number, line in enumerate(text.splitlines(), 1):
        region = _REGION.search(line)
        if region:
            if regions and expected_next is None:
                raise TraceDataError(f"allocator dump is missing lines: a region before line {number} lists no chunks.")
            if region_end is not None and expected_next != region_end:
                raise TraceDataError(
                    f"allocator dump is missing lines: the region before line {number} is not filled "
                    "by its chunks; paste the whole dump."
                )
            regions.append(Region(-1, int(region.group(1))))
            expected_next = None
            region_end = None
            continue
        chunk = _CHUNK.search(line)
        if not chunk:
            continue
        if not regions:
            raise TraceDataError(f"allocator dump line {number} lists a chunk before any 'Next region of size' line.")
        address = int(chunk.group(2), 16)
        size = int(chunk.group(3))
        if expected_next is None:  # the region's first chunk gives its address
            regions[-1] = Region(address, regions[-1].size)
            region_end = address + regions[-1].size
        elif address != expected_next:
            raise TraceDataError(
                f"allocator dump is missing lines before line {number}: chunk at {address:#x} should "
                f"be at {expected_next:#x}; paste the whole dump."
            )
        chunks.append(Chunk(address, size, chunk.group(1) == "InUse", op=chunk.group(4) or ""))
        expected_next = address + size
    if not chunks:
        raise TraceDataError(
            "no allocator dump in this text: expected TensorFlow's lines 'Next region of size N' and "
            "'InUse at ADDR of size N' (they are logged at INFO level: TF_CPP_MIN_LOG_LEVEL=0)."
        )
    if expected_next is None or expected_next != region_end:
        raise TraceDataError("allocator dump is missing lines at its end: the last region is not filled by its chunks.")
    name = _NAME.search(text)
    failed = list(_FAILED.finditer(header))
    failed = failed[-1] if failed else None
    limit = _LIMIT.search(text)
    limit_bytes = int(limit.group(1)) if limit else None
    if limit_bytes is None:
        pool = _LIMIT_FROM_POOL.search(text)
        if pool and pool.group(2) in _UNITS:
            limit_bytes = round(float(pool.group(1)) * _UNITS[pool.group(2)])
    return AllocatorMap(
        allocator=name.group(1) if name else "unknown allocator",
        chunks=tuple(sorted(chunks, key=lambda c: c.address)),
        regions=tuple(sorted(regions, key=lambda r: r.address)),
        source="text dump",
        limit_bytes=limit_bytes,
        failed_request_bytes=int(failed.group(1)) if failed else None,
    )


def load_memory_dump(path: str | Path) -> AllocatorMap:
    """The allocator's state from the binary MemoryDump written when TF_BFC_MEMORY_DUMP is set.

    The binary form has no region boundaries: a gap between chunks, or two free chunks side
    by side (the allocator would have merged them within one region), starts a new region.
    """
    from google.protobuf.message import DecodeError
    from tensorflow.core.protobuf import bfc_memory_map_pb2

    dump = bfc_memory_map_pb2.MemoryDump()
    try:
        dump.ParseFromString(Path(path).read_bytes())
    except DecodeError as exc:
        raise TraceDataError(f"{path} is not a readable TensorFlow MemoryDump ({exc}).") from None
    if not dump.chunk:
        raise TraceDataError(f"{path} holds no chunks: not a TensorFlow MemoryDump.")
    chunks = sorted(
        (Chunk(c.address, c.size, c.in_use, c.requested_size if c.in_use else None, c.op_name) for c in dump.chunk),
        key=lambda c: c.address,
    )
    regions: list[Region] = []
    start = chunks[0].address
    for previous, chunk in zip(chunks, chunks[1:]):
        contiguous = chunk.address == previous.address + previous.size
        if not contiguous or (not previous.in_use and not chunk.in_use):
            regions.append(Region(start, previous.address + previous.size - start))
            start = chunk.address
    regions.append(Region(start, chunks[-1].address + chunks[-1].size - start))
    return AllocatorMap(
        allocator=dump.allocator_name,
        chunks=tuple(chunks),
        regions=tuple(regions),
        source="dump",
        reported_fragmentation=dump.stats.fragmentation_metric,
        notes=("regions inferred from gaps between chunks (the binary dump does not list them)",),
    )
