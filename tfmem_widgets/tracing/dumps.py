"""TensorFlow's own record of an allocator at an OOM, as an AllocatorMap.

Two forms: the text dump the BFC allocator logs when an allocation fails (what people paste
from their logs: ``Next region of size N``, ``InUse at ADDR of size N next K``...), and the
binary ``MemoryDump`` it writes when TF_BFC_MEMORY_DUMP is set.
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from pathlib import Path

from ..errors import TraceDataError
from ..tf.allocator import MIN_ALLOCATION, bin_of, fragmentation
from .allocator_map import AllocatorMap, Chunk, Region

_REGION = re.compile(r"Next region of size (\d+)")
_CHUNK = re.compile(r"\b(InUse|Free)\s+at\s+([0-9a-fA-Fx]+)\s+of size\s+(\d+)(?:\s+by op\s+(\S+))?")
_NAME = re.compile(r"(?:BFCAllocator dump for|Allocator \()\s*([A-Za-z0-9_]+)")
_FAILED = re.compile(r"ran out of memory trying to allocate .*?\(rounded to (\d+)\)")
_LIMIT = re.compile(r"^\s*Limit:\s+(\d+)\s*$", re.MULTILINE)
_LIMIT_FROM_POOL = re.compile(r"memory_limit_:\s*([0-9.]+)\s*([KMGT]?i?B)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# What the dump states about itself, to cross-check the chunks against (all optional in a paste).
_BIN_LINE = re.compile(r"Bin \((\d+)\):\s*Total Chunks: (\d+), Chunks in use: (\d+)\.")
_BY_SIZE = re.compile(r"(\d+) Chunks of size (\d+) totalling")
_SUM_IN_USE = re.compile(r"Sum Total of in-use chunks: ([0-9.]+)\s*([KMGT]?i?B)")
_POOL = re.compile(r"Total (?:size|bytes) in pool: ([0-9.]+)\s*([KMGT]?i?B)")


def _human(value: str, unit: str) -> tuple[float, float]:
    """TensorFlow's human-readable bytes ('22.00MiB', '512.0KiB') as (bytes, how far off it may be)."""
    decimals = len(value.split(".")[1]) if "." in value else 0
    scale = _UNITS[unit]
    return float(value) * scale, 0.5 * 10 ** -decimals * scale + 1


def _cross_check(chunks: list[Chunk], regions: list[Region], text: str) -> list[str]:
    """Every total the text dump states, against its chunks: what does not add up (empty: all do)."""
    wrong = []
    bins = {int(m.group(1)): (int(m.group(2)), int(m.group(3))) for m in _BIN_LINE.finditer(text)}
    if bins:
        counted: dict[int, list[int]] = {}
        for c in chunks:
            entry = counted.setdefault(MIN_ALLOCATION << bin_of(c.size), [0, 0])
            entry[0] += 1
            entry[1] += c.in_use
        for label in sorted(set(bins) | set(counted)):
            stated = bins.get(label, (0, 0))
            found = tuple(counted.get(label, (0, 0)))
            if stated != found:
                wrong.append(f"bin {label} states {stated[0]} chunks ({stated[1]} in use), the lines give "
                             f"{found[0]} ({found[1]})")
                break
    by_size = Counter()
    for m in _BY_SIZE.finditer(text):
        by_size[int(m.group(2))] += int(m.group(1))
    if by_size and by_size != Counter(c.size for c in chunks if c.in_use):
        wrong.append("the in-use chunks by size do not match the chunk lines")
    in_use = sum(c.size for c in chunks if c.in_use)
    stated = _SUM_IN_USE.search(text)
    if stated and stated.group(2) in _UNITS:
        figure, slack = _human(stated.group(1), stated.group(2))
        if abs(figure - in_use) > slack:
            wrong.append(f"it states {stated.group(1)}{stated.group(2)} in use, the chunks hold {in_use} bytes")
    pool = _POOL.search(text)
    if pool and pool.group(2) in _UNITS:
        figure, slack = _human(pool.group(1), pool.group(2))
        total = sum(r.size for r in regions)
        if abs(figure - total) > slack:
            wrong.append(f"it states {pool.group(1)}{pool.group(2)} in the pool, the regions listed hold {total} bytes")
    return wrong


def parse_bfc_dump(text: str) -> AllocatorMap:
    """The allocator's state from its text dump (a log pasted whole, prefixes and all).

    >>> m = tfmem_widgets.parse_bfc_dump(open("train.log").read())
    >>> m.largest_free_bytes, m.fragmentation, m.failed_request_bytes
    """
    if not isinstance(text, str):
        raise TraceDataError(f"parse_bfc_dump takes the log's text, got {type(text).__name__}.")
    # A log may hold several dumps (one per failed allocation): the last one is the latest.
    starts = [m.start() for m in re.finditer(r"BFCAllocator dump for", text)]
    header = text
    if len(starts) > 1:
        header, text = text[: starts[-1]], text[starts[-1]:]
    regions, chunks = _regions_and_chunks(text)
    wrong = _cross_check(chunks, regions, text)
    if wrong:
        raise TraceDataError(f"allocator dump does not add up ({wrong[0]}): lines are missing or changed; "
                             "paste the whole dump.")
    stated = bool(_BIN_LINE.search(text) or _SUM_IN_USE.search(text) or _POOL.search(text))
    name = _NAME.search(text)
    failed = list(_FAILED.finditer(header))
    failed = failed[-1] if failed else None
    return AllocatorMap(
        allocator=name.group(1) if name else "unknown allocator",
        chunks=tuple(sorted(chunks, key=lambda c: c.address)),
        regions=tuple(sorted(regions, key=lambda r: r.address)),
        source="text dump",
        limit_bytes=_stated_limit(text),
        failed_request_bytes=int(failed.group(1)) if failed else None,
        notes=() if stated else ("the text states no totals (bins, sums, pool): the chunks were not cross-checked",),
    )


def _regions_and_chunks(text: str) -> tuple[list[Region], list[Chunk]]:
    """The dump's regions and their chunks, line by line; raises where a line is missing (a region
    not filled by its chunks, a chunk not where the one before it ends)."""
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
        try:
            address = int(chunk.group(2), 16)
        except ValueError:
            raise TraceDataError(f"allocator dump line {number}: {chunk.group(2)!r} is not an address.") from None
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
    return regions, chunks


def _stated_limit(text: str) -> int | None:
    """The allocator's limit as the dump states it: its 'Limit:' line, else the pool's memory_limit_."""
    limit = _LIMIT.search(text)
    if limit:
        return int(limit.group(1))
    pool = _LIMIT_FROM_POOL.search(text)
    if pool and pool.group(2) in _UNITS:
        return round(float(pool.group(1)) * _UNITS[pool.group(2)])
    return None


def load_memory_dump(path: str | Path) -> AllocatorMap:
    """The allocator's state from the binary MemoryDump written when TF_BFC_MEMORY_DUMP is set.

    The binary form has no region boundaries: a gap between chunks, or two free chunks side
    by side (the allocator would have merged them within one region), starts a new region.
    """
    from tensorflow.core.protobuf import bfc_memory_map_pb2

    from .wire import parse_message

    if not isinstance(path, (str, os.PathLike)):
        raise TraceDataError(f"load_memory_dump takes a file's path, got {type(path).__name__}.")
    dump = parse_message(bfc_memory_map_pb2.MemoryDump(), path, "TensorFlow MemoryDump")
    if not dump.chunk:
        raise TraceDataError(f"{path} holds no chunks: not a TensorFlow MemoryDump.")
    chunks = sorted(
        (Chunk(c.address, c.size, c.in_use, c.requested_size if c.in_use else None, c.op_name) for c in dump.chunk),
        key=lambda c: c.address,
    )
    wrong = _check_memory_dump(dump, chunks)
    if wrong:
        raise TraceDataError(f"{path} is damaged or cut short: {wrong}.")
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


def _check_memory_dump(dump, chunks: list[Chunk]) -> str | None:
    """The dump's chunks against its own statistics and bin summary (written after the chunks,
    so a file cut short loses them): what does not add up, or None."""
    if any(c.size <= 0 for c in chunks):
        return "a chunk has no size"
    for previous, chunk in zip(chunks, chunks[1:]):
        if chunk.address < previous.address + previous.size:
            return f"chunks at {previous.address:#x} and {chunk.address:#x} overlap"
    stats = dump.stats
    in_use = [c.size for c in chunks if c.in_use]
    if stats.bytes_in_use != sum(in_use):
        return f"its statistics say {stats.bytes_in_use} bytes in use, its chunks hold {sum(in_use)}"
    if stats.peak_bytes_in_use < stats.bytes_in_use:
        return "its peak is below what is in use"
    if in_use and (stats.largest_alloc_size < max(in_use) or stats.num_allocs < len(in_use)):
        return "its statistics are incomplete"
    free = [c.size for c in chunks if not c.in_use]
    expected = fragmentation(sum(free), max(free, default=0))
    stated = stats.fragmentation_metric
    same = (math.isnan(expected) and (math.isnan(stated) or stated == 0)) or math.isclose(
        stated, expected, rel_tol=1e-5, abs_tol=1e-6)
    if not same:
        return f"its fragmentation is {stated:.6f}, its chunks give {expected:.6f}"
    if dump.bin_summary:
        counted = Counter()
        counted_in_use = Counter()
        for c in chunks:
            counted[bin_of(c.size)] += 1
            counted_in_use[bin_of(c.size)] += c.in_use
        for summary in dump.bin_summary:
            if (summary.total_chunks_in_bin, summary.total_chunks_in_use) != (
                    counted[summary.bin], counted_in_use[summary.bin]):
                return (f"bin {summary.bin} lists {summary.total_chunks_in_bin} chunks, "
                        f"the dump holds {counted[summary.bin]}")
    return None
