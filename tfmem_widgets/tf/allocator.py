"""TensorFlow's BFC allocator: the facts the rest of the package reads, from
``tsl/framework/bfc_allocator.cc`` and TensorFlow's own words.

- names: each logical GPU has an allocator ``GPU_<n>_bfc``; lab mode's CPU allocator is
  ``bfc_cpu_allocator_for_gpu``;
- sizes: chunks are whole 256-byte steps, binned by powers of two;
- the no-split rule: a free chunk is split only when it is at least twice the rounded request or
  more than 128 MiB larger, else the whole chunk is handed out;
- growth regions: with growth the first region is 2 MiB and the next doubles until a request fits;
- fragmentation: TensorFlow's formula (``GetFragmentation``);
- the markers of its text: the OOM line, XLA's OOM line, the text dump's lines.
"""

from __future__ import annotations

import re

LAB_ALLOCATOR_NAME = "bfc_cpu_allocator_for_gpu"  # the CPU allocator in lab mode
_GPU_ALLOCATOR = re.compile(r"GPU_(\d+)_bfc")

MIN_ALLOCATION = 256  # the smallest chunk and the rounding step
NUM_BINS = 21  # kNumBins: 256 B << 0 ... 256 B << 20 (and larger)
MAX_WHOLE_CHUNK_EXCESS = 128 << 20  # a free chunk this much larger than a request is always split
FIRST_GROWTH_REGION = 2 << 20  # with growth: the first region; each next one doubles until a request fits


# -- names ------------------------------------------------------------------------------------

def gpu_allocator_name(ordinal: int) -> str:
    """The allocator of logical GPU `ordinal` ('GPU_0_bfc')."""
    return f"GPU_{ordinal}_bfc"


def allocator_of_device(device: str) -> str:
    """The BFC allocator behind a device name ('CPU:0' in lab mode, 'GPU:1')."""
    kind, _, index = device.rpartition("/")[2].upper().replace("DEVICE:", "").partition(":")
    return LAB_ALLOCATOR_NAME if kind == "CPU" else gpu_allocator_name(int(index or 0))


def device_of_allocator(allocator: str) -> str | None:
    """The device an allocator serves ('CPU:0', 'GPU:1'); None for an allocator of another kind."""
    if allocator == LAB_ALLOCATOR_NAME:
        return "CPU:0"
    found = _GPU_ALLOCATOR.fullmatch(allocator)
    return f"GPU:{found.group(1)}" if found else None


def gpu_ordinal(allocator: str) -> int | None:
    """The logical GPU's ordinal of a GPU allocator ('GPU_1_bfc' -> 1), else None."""
    found = _GPU_ALLOCATOR.fullmatch(allocator)
    return int(found.group(1)) if found else None


# -- sizes ------------------------------------------------------------------------------------

def rounded(n: int) -> int:
    """Bytes as the BFC allocator hands them out: whole 256-byte steps, at least one."""
    return max(MIN_ALLOCATION, -(-n // MIN_ALLOCATION) * MIN_ALLOCATION)


def bin_of(size: int) -> int:
    """The bin of a chunk of `size` bytes (BinNumForSize)."""
    value = max(size, MIN_ALLOCATION) >> 8
    return min(value.bit_length() - 1, NUM_BINS - 1)


def takes_whole(chunk_bytes: int, request_bytes: int) -> bool:
    """Whether a free chunk is handed out whole for a request (FindChunkPtr): it is split only when
    it is at least twice the rounded request or at least 128 MiB larger than it."""
    request = rounded(request_bytes)
    return chunk_bytes < 2 * request and chunk_bytes - request < MAX_WHOLE_CHUNK_EXCESS


def worst_take(request_bytes: int) -> int:
    """The most the allocator can hand out for one request, whatever the pool holds: best fit takes
    the smallest free chunk at least the rounded request R and hands it out whole unless it is at
    least 2R or more than 128 MiB larger; chunks are 256-byte steps, so at most
    min(2R - 256, R + 128 MiB - 256). A region made for the request (growth) is such a chunk too."""
    request = rounded(request_bytes)
    return min(2 * request - MIN_ALLOCATION, request + MAX_WHOLE_CHUNK_EXCESS - MIN_ALLOCATION)


def grown_region(request: int, available: int, next_size: int) -> tuple[int, int]:
    """Extend's rule for a (rounded) request no free chunk holds: the new region's size (the next
    size, doubled until the request fits, cut to the `available` bytes left under the limit) and the
    next size after it (doubled again, unless it was raised to fit this request)."""
    raised = False
    while next_size < request:
        next_size, raised = next_size * 2, True
    return min(next_size, available), (next_size if raised else next_size * 2)


def _new_region(pool, request: int) -> int | None:
    """The region a growing pool (GrowingPool, BfcPool) makes for a request none of its chunks holds,
    its next size moved on; None where the request exceeds what is left under the limit (an OOM)."""
    available = (pool.limit - pool.pool_bytes) // MIN_ALLOCATION * MIN_ALLOCATION
    if request > available:
        return None
    size, pool._next = grown_region(request, available, pool._next)
    return size


class GrowingPool:
    """A pool that grows (allow_growth: lab mode's CPU allocator, a GPU with memory growth) taking
    requests it keeps, in order, from a fresh start: what regions it makes and what each request
    takes. Extend's rule: the next region is the current region size, doubled until the request
    fits (a size raised to fit a request does not double again after), cut to what is left under
    the limit; a request takes the smallest free tail of a region that holds it, or a new region
    whole unless it may split. A model of a fresh process's pool, for requests that are not freed.
    """

    def __init__(self, limit_bytes: int, first_region: int = FIRST_GROWTH_REGION):
        self.limit = limit_bytes
        self.regions: list[int] = []  # sizes
        self.free: list[int] = []  # the free tail of each region
        self._next = rounded(min(limit_bytes, first_region))

    @classmethod
    def resumed(cls, limit_bytes: int, region_sizes: list[int]) -> GrowingPool:
        """A pool that already holds these regions (their free chunks kept apart by the caller): its
        next region twice its largest, as the allocator doubles them."""
        pool = cls(limit_bytes)
        pool.regions = list(region_sizes)
        pool.free = [0] * len(pool.regions)
        if pool.regions:
            pool._next = 2 * max(pool.regions)
        return pool

    @property
    def pool_bytes(self) -> int:
        return sum(self.regions)

    def take(self, request_bytes: int) -> int | None:
        """Bytes handed out for a request kept from now on; None when it no longer fits (an OOM)."""
        request = rounded(request_bytes)
        fitting = [k for k, free in enumerate(self.free) if free >= request]
        if fitting:
            k = min(fitting, key=lambda k: self.free[k])
            taken = request if not takes_whole(self.free[k], request) else self.free[k]
            self.free[k] -= taken
            return taken
        size = _new_region(self, request)
        if size is None:
            return None
        self.regions.append(size)
        taken = size if takes_whole(size, request) else request
        self.free.append(size - taken)
        return taken


class BfcPool:
    """A pool chunk by chunk, from the pool as it stands (``of_map``: a trace's map) or empty: the
    regions in order, each its chunks in address order. A request takes the smallest free chunk that
    holds it, whole where the no-split rule says so (else its head, the rest left free after it), or
    a new region by Extend's rule (``grown_region``); a chunk given back
    merges with the free chunks beside it in its region. For requests that are freed as well as kept
    (a fit's data taken for a while, then its slots and its step)."""

    def __init__(self, limit_bytes: int, first_region: int = FIRST_GROWTH_REGION):
        self.limit = limit_bytes
        self.regions: list[list[list]] = []  # each region: its chunks as [size, in_use], in address order
        self._next = rounded(min(limit_bytes, first_region))

    @classmethod
    def of_map(cls, pool_map, limit_bytes: int, next_region: int | None = None) -> BfcPool:
        """The pool of an AllocatorMap (complete: its regions and every chunk in them); next_region: the
        size its next region starts from, where known (a trace's replay: a region raised to fit a request
        or cut to the limit is not doubled after), else twice its largest."""
        pool = cls(limit_bytes)
        for region in sorted(pool_map.regions, key=lambda r: r.address):
            inside = sorted((c for c in pool_map.chunks if region.address <= c.address < region.address + region.size),
                            key=lambda c: c.address)
            pool.regions.append([[c.size, c.in_use] for c in inside])
        if next_region is not None:
            pool._next = next_region
        elif pool.regions:
            pool._next = 2 * max(sum(c[0] for c in chunks) for chunks in pool.regions)
        return pool

    @property
    def pool_bytes(self) -> int:
        return sum(c[0] for chunks in self.regions for c in chunks)

    def take(self, request_bytes: int) -> list | None:
        """The chunk handed out for a request (give it back with ``give``); None: no room (an OOM). A
        request of no bytes takes nothing (the allocator returns no memory for it): an empty chunk."""
        if request_bytes <= 0:
            return [0, False]
        request = rounded(request_bytes)
        best = None
        for chunks in self.regions:
            for k, chunk in enumerate(chunks):
                if not chunk[1] and chunk[0] >= request and (best is None or chunk[0] < best[2][0]):
                    best = (chunks, k, chunk)
        if best is None:
            size = _new_region(self, request)
            if size is None:
                return None
            self.regions.append([[size, False]])
            best = (self.regions[-1], 0, self.regions[-1][0])
        chunks, k, chunk = best
        if not takes_whole(chunk[0], request):
            chunks.insert(k + 1, [chunk[0] - request, False])
            chunk[0] = request
        chunk[1] = True
        return chunk

    def give(self, chunk: list) -> None:
        """A chunk taken from this pool freed: merged with a free chunk on either side."""
        if chunk[0] == 0:
            return
        for chunks in self.regions:
            for k, other in enumerate(chunks):
                if other is chunk:
                    chunk[1] = False
                    if k + 1 < len(chunks) and not chunks[k + 1][1]:
                        chunk[0] += chunks.pop(k + 1)[0]
                    if k > 0 and not chunks[k - 1][1]:
                        chunks[k - 1][0] += chunks.pop(k)[0]
                    return
        raise ValueError("give: not a chunk taken from this pool")


def fragmentation(free_bytes: int, largest_free_bytes: int) -> float:
    """TensorFlow's fragmentation metric (BFCAllocator::GetFragmentation): the free bytes outside
    the largest free chunk, over all free bytes; NaN when nothing is free."""
    if free_bytes <= 0:
        return float("nan")
    return (free_bytes - largest_free_bytes) / free_bytes


# -- TensorFlow's text ------------------------------------------------------------------------

# The OOM line: "OOM when allocating tensor with shape[4194304] and type float on ... by allocator X"
OOM_LINE = re.compile(r"OOM when allocating tensor with shape\[([\d,\s]*)\] and type (\w+).*? by allocator (\S+)")
# The allocator's own line in its log: "... (rounded to 16777216)"
ROUNDED_REQUEST = re.compile(r"\(rounded to (\d+)\)")
# XLA's words: "Out of memory while trying to allocate 1.56GiB." or "... 123 bytes"
XLA_OOM_LINE = re.compile(r"Out of memory while trying to allocate ([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)\b")
UNIT_BYTES = {"bytes": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
TEXT_DUMP_REGION = "Next region of size"  # the text dump the allocator logs at an OOM, region by region


def has_text_dump(text: str) -> bool:
    """Whether a log holds the allocator's text dump."""
    return TEXT_DUMP_REGION in text


def looks_like_oom_log(text: str) -> bool:
    """Whether a text is TensorFlow's OOM log (its OOM line, XLA's, or the allocator's dump)."""
    return has_text_dump(text) or "OOM when allocating" in text or "Out of memory" in text
