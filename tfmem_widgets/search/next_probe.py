"""Where a probe search goes next: the batch the next probe takes, and, with a margin, the probes that
settle the batch it recommends.

Before a failure the search grows the batch toward the edge the line through the peaks predicts; after
one it halves the interval, then probes once past the edge (search/batch_search.py says why). With a margin, a
probe is aimed at the margin's batch where none was measured near it, and the batch recommended is
probed a second time in another process.
"""

from __future__ import annotations

import math

from ..errors import TfmemError
from ..text import RunNote
from ..units import format_bytes

GROWTH = 16  # the most a probe grows the batch before a failure is seen


MARGIN_PROBES = 5  # the most probes a margin adds: aimed at it, the batch recommended again; the last one confirms
MARGIN_AIMS = 2  # the second halfway down, where the first's peak took the margin or it did not hold


def settle_recommended(search, probe_one, bar, max_probes: int) -> None:
    """With a margin, once the edge is known: a probe aimed at the margin's batch (margin_aim) where
    nothing measured lies within a step below it (a plan search measures only the edge), and a second
    where the first did not become the recommended batch (its peak took the margin, or it did not
    train); then the recommended batch probed again in another fresh process, so that its peaks left
    the margin free in two, and no aim after that: a step's peak at one batch differs between processes,
    and a batch that trained in one can run out of memory in the next. Where the second probe's peak takes
    the margin, or it does not train, the rule recommends a lower batch, aimed at or probed again in turn.
    An aim is made only where a probe is left after it for its second process. At most MARGIN_PROBES probes
    and max_probes in all; the search's `margin_probes` counts them. A probe
    that fails otherwise (its process died, ran past the timeout) ends this with a note: the edge found
    stands."""
    aimed = 0
    for left in range(MARGIN_PROBES, 0, -1):
        batch = search.recommended
        room = left > 1 and len(search.probes) + 1 < max_probes  # a probe after the aim, for its second process
        aim, why = (None, "") if aimed >= MARGIN_AIMS or not room else \
            (margin_aim(search, bisect=aimed > 0) or (None, ""))
        if aim is not None and aim not in {p.batch for p in search.probes} and (
                batch is None or aim > batch + math.ceil(batch * search.resolution)):
            aimed, what = aimed + 1, f"a probe aimed at the {search.margin:.0%} margin"
        elif batch is not None and search.trained_at(batch) == 1:
            aim, what = batch, "the recommended batch again"
        else:
            break
        if len(search.probes) >= max_probes:
            search.notes.append(RunNote(f"{what} was not probed: max_probes={max_probes} reached"))
            break
        # a process waits for the next probe only where one may follow (after the batch again, where it failed)
        ahead = aim != batch and left > 1 and len(search.probes) + 1 < max_probes
        bar.probing(len(search.probes) + 1, aim)
        try:
            done = probe_one(aim, ahead=ahead)
        except TfmemError as exc:  # (a probe's own failure: the search's edge stands)
            search.notes.append(RunNote(f"the margin's probes stopped: {exc}"))
            break
        search.margin_probes += 1
        bar.probed(len(search.probes), done)
        if aim != batch:
            search.notes.append(RunNote(f"batch {aim:,} was probed for the {search.margin:.0%} margin: {why}"))
            if search.recommended == aim:
                aimed = MARGIN_AIMS  # it stands: probed again next, no aim after it
            continue
        if search.recommended == batch:
            break  # its peaks left the margin free in two processes
        aimed = min(aimed, MARGIN_AIMS - 1)  # it did not hold: an aim below it, where one is left
        search.notes.append(RunNote(f"batch {batch:,}, recommended by its first probe, "
                                    + (f"peaked at {format_bytes(done.peak_bytes)} in a second fresh process, over "
                                       f"{1 - search.margin:.0%} of the limit" if done.fits else
                                       "ran out of memory in a second fresh process")
                                    + ": a step's peak differs between processes"))
    rec = search.recommended
    if rec is not None and search.trained_at(rec) < 2:
        search.notes.append(RunNote(f"the recommended batch {rec:,} was measured by one probe only"))
    alike = chunk_bound_peaks(search)
    if alike is not None:
        a, b, peak = alike
        search.notes.append(RunNote(f"batches {a:,} and {b:,} peaked alike, at {format_bytes(peak)}: a step's buffer "
                                    "took a free chunk whole in both (the allocator splits a chunk only where it is "
                                    "twice the request or 128 MiB larger), so near the edge a peak counts the chunk, "
                                    "not the step; the line through such peaks aimed nothing, and the recommended "
                                    "batch is one whose own peaks left the margin free"))


def margin_aim(search, bisect: bool = False) -> tuple[int, str] | None:
    """The batch a search's margin aims at, and why: a resolution step under the margin below the smallest
    failure, or under where the line through the peaks meets the limit less the margin, the lower (its
    peak is not to sit on the margin's edge). Where a batch at or under that took the margin, or (bisect)
    after an aim took it: halfway from the recommended batch to the smallest batch above it whose peak took
    the margin, where lower (without a recommended batch, the margin below that batch). The line counts
    only above the recommended batch, and not where two batches peaked alike (chunk_bound_peaks): near the
    edge a step's buffer takes a free chunk whole (the allocator splits a chunk only where it is twice the
    request or 128 MiB larger), so the peaks there count chunks, and a line through two of them can meet
    the margin at no batch at all. At most `high`; None without a margin, a limit, or a failure or a line."""
    budget = _margin_budget(search)
    if budget is None:
        return None
    lowest = min(search._failures(), default=None)
    below = search.recommended
    aims = [] if lowest is None else [(lowest * (1 - search.margin), f"{search.margin:.0%} below the smallest failure")]
    line = None if chunk_bound_peaks(search) else search._line_batch(budget)
    if line is not None and line > (below or 0):
        aims.append((line, f"where the line through the peaks meets {1 - search.margin:.0%} of the limit"))
    if not aims:
        return None
    batch, how = min(aims)
    aim, why = int(batch * (1 - search.resolution)), f"a {search.resolution:.0%} step under {how}"
    over = min((p.batch for p in search.fitted if p.peak_bytes > budget and (below is None or p.batch > below)),
               default=None)
    if over is not None and (over <= aim or bisect):  # a batch at or under the aim took the margin already
        half, how = ((below + over) // 2, f"halfway from {below:,} to {over:,}") if below is not None else \
            (int(over * (1 - search.margin)), f"{search.margin:.0%} below {over:,}")
        if half < aim:
            aim, why = half, f"{how}, whose peak took the margin"
    aim = on_replicas(search, max(search.low, min(search.high, aim)))
    return (aim, why) if aim >= search.low else None


def chunk_bound_peaks(search) -> tuple[int, int, int] | None:
    """Two batches that trained with the same peak (within 0.01%) over the margin's part of the limit, and
    that peak: a step's buffer took a free chunk whole in both (the peak counts the chunk, not the step)."""
    budget = _margin_budget(search)
    if budget is None:
        return None
    over = sorted((p.peak_bytes, p.batch) for p in search.fitted if p.peak_bytes > budget)
    for (peak_a, a), (peak_b, b) in zip(over, over[1:]):
        if a != b and peak_b - peak_a <= peak_b * 1e-4:
            return min(a, b), max(a, b), peak_b
    return None


def _margin_budget(search) -> int | None:
    """The bytes a peak may take under the search's margin (None: no margin or no limit)."""
    if not search.margin or search.limit_bytes is None:
        return None
    return search.within_margin_bytes(search.limit_bytes)


def next_batch(search, past: list[int], probe_past: bool = True) -> int | None:
    """The next batch to probe, or None when the edge is known to the resolution.

    Before a failure: the edge the line through the peaks predicts, at least 1.25 and at most
    GROWTH times the largest batch that trained. After one: the middle of the interval (near the
    limit the peaks flatten, so the line misaims there), then one probe past the edge (`past`
    holds it once made): if that trains, fitting is not monotone here and the search stops. Without
    `probe_past` (a failure above the edge is already known) the search stops at the edge."""
    if past:
        return None
    largest, failure, m = search.largest, search.first_failure, search.replicas
    if largest is None:
        return None
    if failure is None:
        if largest >= search.high:
            return None
        grow = largest * GROWTH
        edge = search._line_batch(search.limit_bytes) if search.limit_bytes else None
        if edge is not None:
            grow = min(grow, max(edge, math.ceil(largest * 1.25)))
        grow = on_replicas(search, min(search.high, max(grow, largest + m)))
        return grow if grow > largest else None
    step = max(m, math.ceil(largest * search.resolution))
    if failure - largest <= step:
        if not probe_past:
            return None
        beyond = on_replicas(search, min(search.high, failure + 4 * step))
        if beyond > failure and beyond not in {p.batch for p in search.probes}:
            past.append(beyond)
            return beyond
        return None
    middle = on_replicas(search, math.isqrt(largest * failure) if failure > 4 * largest else (largest + failure) // 2)
    return middle if largest < middle < failure else None


def on_replicas(search, batch: int) -> int:
    """`batch` down to a multiple of the model's strategy's replicas (Keras' fit under a strategy takes no other
    global batch: plans/replicas.py, ReplicaPlan.uneven); as it is on one device."""
    return batch - batch % search.replicas
