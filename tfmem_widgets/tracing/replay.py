"""Rebuild a BFC allocator's chunks from its events, the way the allocator moves them.

What the BFC allocator does (tsl/framework/bfc_allocator.cc), and what the replay relies on:

- An allocation takes the *front* of a free chunk: the rest becomes a free chunk after it
  (or, when the rest is small, the whole chunk is handed out; the event's size says which).
  So every allocation's address is the start of a free chunk, or of a new region.
- A free chunk merges with free neighbours in the same region; regions never merge.
- A new region is taken when no free chunk fits: with growth its size doubles from 2 MiB
  until the request fits (``curr_region_allocation_bytes_``), capped by what is left of the
  limit; without growth the first region is the whole limit. The profiler does not record
  regions, so the rule gives their sizes and the first allocation in each gives its address.

Traced from the allocator's first allocation, this gives the whole pool exactly. Traced after
earlier work, the chunks from before are not in the events: their total is known (the first
event's in-use figure), their layout is not, and no layout is invented for them.
"""

from __future__ import annotations

import bisect
import heapq

import numpy as np

from ..tf.allocator import FIRST_GROWTH_REGION, MIN_ALLOCATION, fragmentation, grown_region, rounded
from .allocator_map import AllocatorMap, Chunk, Region
from .events import ALLOC, AllocatorEvents


class Replay:
    """Steps through an allocator's events, keeping its chunks and regions.

    fresh: the events start at the allocator's first allocation (no regions before).
    growth: whether the allocator grows (lab mode always does; GPUs as configured).
    """

    def __init__(self, events: AllocatorEvents, fresh: bool, growth: bool = True):
        self.events = events
        self.fresh = fresh
        self.limit = events.limit_bytes or 0
        self.growth = growth
        self.position = -1  # index of the last event applied
        self.regions: list[Region] = []
        self._region_starts: list[int] = []
        self._region_ends: list[int] = []  # each region's end, by the same index
        self._free: dict[int, int] = {}  # start -> size
        self._free_end: dict[int, int] = {}  # end -> start
        # size -> count, and a heap of -size lazily cleaned: only largest_free reads them. None while
        # run_to has moved chunks without them; largest_free rebuilds both from the free chunks then.
        self._free_sizes: dict[int, int] | None = {}
        self._heap: list[int] = []
        self.in_use: dict[int, tuple[int, int]] = {}  # address -> (size, allocating event)
        self.region_created: dict[int, int] = {}  # region address -> the event that made it
        self.before_trace_bytes = events.in_use_before() if len(events) else 0
        self.pool_bytes = 0
        self._next_region = rounded(min(self.limit, FIRST_GROWTH_REGION)) if growth else self.limit
        self.inconsistencies: list[str] = []
        self._lists = None

    # -- free-chunk bookkeeping ----------------------------------------------------------
    def _add_free(self, start: int, size: int) -> None:
        self._free[start] = size
        self._free_end[start + size] = start
        sizes = self._free_sizes
        if sizes is not None:
            sizes[size] = sizes.get(size, 0) + 1
            heapq.heappush(self._heap, -size)

    def _remove_free(self, start: int) -> int:
        size = self._free.pop(start)
        del self._free_end[start + size]
        sizes = self._free_sizes
        if sizes is not None:
            left = sizes[size] - 1
            if left:
                sizes[size] = left
            else:
                del sizes[size]
        return size

    def largest_free(self) -> int:
        if self._free_sizes is None:
            sizes: dict[int, int] = {}
            for size in self._free.values():
                sizes[size] = sizes.get(size, 0) + 1
            self._free_sizes = sizes
            self._heap = [-size for size in sizes]
            heapq.heapify(self._heap)
        heap = self._heap
        while heap and -heap[0] not in self._free_sizes:
            heapq.heappop(heap)
        return -heap[0] if heap else 0

    def _region_index(self, address: int) -> int | None:
        i = bisect.bisect_right(self._region_starts, address) - 1
        if i >= 0:
            region = self.regions[i]
            if address < region.address + region.size:
                return i
        return None

    @property
    def next_region_bytes(self) -> int:
        """The size the pool's next region would start from (before doubling to fit a request)."""
        return self._next_region

    # -- the allocator's moves -----------------------------------------------------------
    def _new_region(self, address: int, requested: int) -> int:
        """A region made for this request, sized by the allocator's growth rule."""
        available = (self.limit - self.pool_bytes) // MIN_ALLOCATION * MIN_ALLOCATION
        size, self._next_region = grown_region(rounded(requested), available, self._next_region)
        region = Region(address, size)
        self.region_created[address] = self.position + 1
        i = bisect.bisect_right(self._region_starts, address)
        self._region_starts.insert(i, address)
        self._region_ends.insert(i, address + size)
        self.regions.insert(i, region)
        self.pool_bytes += size
        return size

    def _allocate(self, index: int, address: int, size: int, requested: int) -> None:
        known = self.fresh or self._region_index(address) is not None
        if address in self._free:
            whole = self._remove_free(address)
        elif self.fresh:
            whole = self._new_region(address, requested)
        else:
            whole = None  # in a region from before the trace, or a new one: layout unknown
        if whole is not None:
            if whole < size:
                self.inconsistencies.append(f"event {index}: a {size}-byte chunk in a {whole}-byte hole")
            elif whole > size:
                self._add_free(address + size, whole - size)
        elif known:
            self.inconsistencies.append(f"event {index}: allocation at {address:#x} is not the start of a hole")
        self.in_use[address] = (size, index)

    def _deallocate(self, index: int, address: int, size: int) -> None:
        if self.in_use.pop(address, None) is None:
            if self.fresh:
                self.inconsistencies.append(f"event {index}: free of {address:#x}, never allocated")
            self.before_trace_bytes -= size
        region = self._region_index(address)
        if region is None:
            return  # a region the trace does not know: nothing to draw there
        bounds = self.regions[region]
        start, total = address, size
        right = address + size
        if right in self._free and right < bounds.address + bounds.size:
            total += self._remove_free(right)
        left = self._free_end.get(address)
        if left is not None and left >= bounds.address:
            total += self._remove_free(left)
            start = left
        self._add_free(start, total)

    def _columns(self):
        # Python lists: reading a numpy scalar per field would cost more than the step itself.
        if self._lists is None:
            e = self.events
            self._lists = (e.kind.tolist(), e.address.tolist(), e.size.tolist(), e.requested.tolist())
        return self._lists

    def step(self) -> None:
        i = self.position + 1
        kind, address, size, requested = self._columns()
        if kind[i] == ALLOC:
            self._allocate(i, address[i], size[i], requested[i])
        else:
            self._deallocate(i, address[i], size[i])
        self.position = i

    def run_to(self, index: int) -> Replay:
        """step() up to event `index`, with the common moves (a chunk taken from the front of a
        free one, a free beside free neighbours in a known region) done here in line: a call of the
        full rules per event would cost more than the move itself. The free-chunk bookkeeping
        (_add_free, _remove_free) is written out here too, for the same reason, without the count
        and heap of free sizes: only largest_free reads them, and rebuilds them after a run_to. A replay
        from mid-run (fresh False) keeps its in-use chunks alone: no region or free chunk is known there."""
        kinds, addresses, sizes, requesteds = self._columns()
        free, free_end, in_use = self._free, self._free_end, self.in_use
        region_starts, region_ends = self._region_starts, self._region_ends
        bisect_right = bisect.bisect_right
        done = self.position  # the last event applied
        if done >= index:
            return self
        if index >= len(kinds):
            raise IndexError(f"event {index} is past the trace's last, {len(kinds) - 1}")
        self._free_sizes = None
        first, last = done + 1, index + 1
        i, finished = first, False
        if not self.fresh:
            # A trace from mid-run makes no region (the pool's layout before it is unknown) and so no
            # free chunk: its chunks are the ones it allocated, and what it frees of the rest comes
            # off the bytes from before (_allocate and _deallocate, reduced to what they do then).
            try:
                for i, kind, address, size in zip(range(first, last), kinds[first:last], addresses[first:last],
                                                  sizes[first:last]):
                    if kind == ALLOC:
                        in_use[address] = (size, i)
                    elif in_use.pop(address, None) is None:
                        self.before_trace_bytes -= size
            except BaseException:  # (an interrupt: which event it came in is not known) back to the start
                self.in_use.clear()
                self.before_trace_bytes = self.events.in_use_before() if len(self.events) else 0
                self.position = -1
                raise
            self.position = index
            return self
        try:
            # One loop over the events' fields side by side: cheaper than reading each column at i.
            for i, kind, address, size in zip(range(first, last), kinds[first:last], addresses[first:last],
                                              sizes[first:last]):
                if kind == ALLOC:
                    whole = free.get(address)
                    if whole is None or whole < size:
                        self.position = i - 1
                        self._allocate(i, address, size, requesteds[i])
                        continue
                    # The chunk taken from the front of a free one (_remove_free in line).
                    del free[address], free_end[address + whole]
                    if whole > size:  # the rest stays free, after the chunk (_add_free in line)
                        free[address + size] = whole - size
                        free_end[address + whole] = address + size
                    in_use[address] = (size, i)
                    continue
                r = bisect_right(region_starts, address) - 1
                if r < 0 or address >= region_ends[r] or in_use.pop(address, None) is None:
                    self.position = i - 1
                    self._deallocate(i, address, size)  # an unknown region or chunk: the full rules
                    continue
                start, total, right = address, size, address + size
                if right < region_ends[r]:  # merged with the free chunk after (_remove_free in line)
                    after = free.pop(right, None)
                    if after is not None:
                        del free_end[right + after]
                        total += after
                left = free_end.get(address)
                if left is not None and left >= region_starts[r]:  # and with the one before
                    total += free.pop(left)
                    del free_end[address]
                    start = left
                free[start] = total  # (_add_free in line)
                free_end[start + total] = start
            finished = True
        finally:
            self.position = index if finished else i - 1  # the event that raised was not applied
        return self

    # -- results ---------------------------------------------------------------------------
    def snapshot(self, notes: tuple[str, ...] = ()) -> AllocatorMap:
        e = self.events
        chunks = [
            Chunk(a, s, True, int(e.requested[k]), e.text(e.op, k), e.text(e.shape, k), k)
            for a, (s, k) in self.in_use.items()
        ]
        chunks += [Chunk(a, s, False) for a, s in self._free.items()]
        chunks.sort(key=lambda c: c.address)
        complete = self.fresh and not self.inconsistencies
        extra = tuple(f"replay: {m}" for m in self.inconsistencies[:3])
        return AllocatorMap(
            allocator=e.allocator,
            chunks=tuple(chunks),
            regions=tuple(self.regions),
            source="trace",
            complete=complete,
            before_trace_bytes=self.before_trace_bytes,
            limit_bytes=e.limit_bytes,
            event_index=self.position,
            reported_fragmentation=float(e.fragmentation[self.position]) if self.position >= 0 else None,
            notes=notes + extra,
        )


def fragmentation_series(events: AllocatorEvents, growth: bool = True) -> np.ndarray:
    """The rebuilt fragmentation after every event of a trace from the first allocation."""
    replay = Replay(events, fresh=True, growth=growth)
    in_use = events.in_use.tolist()
    out = np.empty(len(events))
    for i in range(len(events)):
        replay.step()
        free = replay.pool_bytes - in_use[i]
        out[i] = fragmentation(free, replay.largest_free())
    return out
