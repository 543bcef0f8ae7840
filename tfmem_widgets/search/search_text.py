"""A batch search in words: what its probes found, each probe, the warnings and the notes.

In lab mode every probe is a Keras step on this processor: which batches were probed, how many, their
peaks, the edge and the seconds vary with the CPU's kernels (their temporary buffers, the order their
threads ran ops in), and another run on the same CPU probes other batches. There each such figure is marked
" (this CPU)", and a line whose presence or count follows the probes says so: a probe's line marks its batch,
a warning that fitting was not monotone its batches, a note that says what the probes measured (a
``RunNote``) is a ``note (this CPU):``. The lines every lab search prints have one shape in every run
(tests/nbval_sanitize.cfg replaces the marked figures and removes the marked lines). On a GPU the text
marks nothing.
"""

from __future__ import annotations

import math

from ..text import THIS_CPU, RunNote, marked
from ..units import format_bytes

DEATHS = ("died", "abort: 2^31 elements")  # the verdicts of a probe whose process a signal ended

# A fit given NumPy arrays holds the whole arrays on the device besides the probes' one batch (docs/what-fits.md).
NUMPY_NOTE = ("the probes hold one batch; model.fit(x, y) with NumPy arrays also puts the whole arrays on the "
              "device: feed a tf.data pipeline built on the host (with tf.device('CPU:0')), or leave room for them")


def search_lines(search) -> list[str]:
    """BatchSearch.lines(): the search's text (the module says what a lab search marks)."""
    lab = search.lab

    def m(figure) -> str:
        return marked(figure if isinstance(figure, str) else f"{figure:,}", lab)

    head = f"tfmem batch search: {search.where}, {search.steps} train step{'s' if search.steps != 1 else ''} a probe"
    if search.limit_bytes is not None:
        head += f", limit {format_bytes(search.limit_bytes)} ({search.limit_source})"
    out = [head]
    largest = search.largest
    if largest is None and not search.probes:
        out.append("  nothing measured: the search was interrupted before its first probe ended" if search.interrupted
                   else "  nothing measured: no probe ran")
    elif largest is None:
        first = min(search.probes, key=lambda p: p.batch)
        out.append(f"  nothing trained: a batch of {first.batch:,} "
                   + (f"did not train ({first.verdict})" if first.verdict in DEATHS else "ran out of memory"))
    else:
        out += _found_lines(search, largest, m)
    out += _plans_and_probes_lines(search, m)
    for failed, trained in search.not_monotone:
        what = (f"{m(trained)} trained in one fresh process and ran out of memory in another" if trained == failed
                else f"{m(trained)} trained although {m(failed)} ran out of memory")
        out.append(f"  warning: not monotone: {what}: near the edge the allocator's regions and chunk rounding "
                   "decide; keep a margin")
    if search.interrupted:
        out.append("  interrupted: the search stopped with the probes above")
    if largest is not None:
        out.append(f"  note: {NUMPY_NOTE}")
    return out + [f"  note {THIS_CPU}: {n}" if lab and isinstance(n, RunNote) else f"  note: {n}"
                  for n in search.notes]


def _found_lines(search, largest: int, m) -> list[str]:
    """The largest batch that trained, the recommended one, the edge and the line through the peaks."""
    safe, failure = search.edge
    rec = search.recommended
    lab = search.lab
    times = search.trained_at(rec) if rec is not None else 0
    out = [f"  largest batch that trained: {m(largest)}"
           + (f"; below every failure: {m(safe)}" if safe is not None and (safe != largest or lab) else "")
           + (f"; recommended, its measured peaks leaving {search.margin:.0%} of the limit free"
              + (f", {search.margin:.0%} below every failure" if failure is not None else "") + f": {m(rec)}"
              + (f" (the fresh processes it trained in: {m(times)})" if lab else
                 f" (in each of {times} fresh processes)" if times > 1 else "")
              if search.margin and rec is not None else "")
           + (f"; no batch whose probes' peaks left {search.margin:.0%} of the limit free"
              + (f", {search.margin:.0%} below every failure" if failure is not None else "")
              if search.margin and rec is None else "")]
    largest = safe if safe is not None else largest
    if failure is not None and failure > largest:
        step = max(search.replicas, math.ceil(largest * search.resolution))
        at = [p for p in search.failed if p.batch == failure]
        how = ("ran out of memory" if any(p.verdict not in DEATHS for p in at) else
               f"did not train ({at[0].verdict})") if at else "cannot train by its plan (not probed)"
        each = f"; batches of {search.replicas} replicas' multiples" if search.replicas > 1 else ""
        out.append(f"  edge: {m(largest)} trained, {m(failure)} {how} "
                   f"({m(failure - largest)} apart; resolution {search.resolution:.0%} = {m(step)} examples{each})")
    elif largest >= search.high:
        out.append(f"  the highest batch asked for ({search.high:,}) trained: the edge is above it")
    model = search.peak_model()
    if model is not None:
        out.append(f"  peak = {m(format_bytes(max(0, int(model[0]))))} + {m(format_bytes(int(model[1])))} per "
                   "example (a line through the batches that trained)")
    return out


def _plans_and_probes_lines(search, m) -> list[str]:
    """The plans (or the process that found none), the probes' count and seconds, and each probe."""
    out = []
    if search.plans and search.plans_after_seconds:
        out.append(f"  planned after the probes, for what fits away from their limit: {m(len(search.plans))} plans "
                   f"of the step (XLA's buffer assignment) in {m(f'{search.plans_after_seconds:.0f} s')}, one fresh "
                   "process")
    elif search.plans:
        planned = search.plan_answer
        out.append(f"  planned first: {m(len(search.plans))} plans of the step (XLA's buffer assignment) in "
                   f"{m(f'{search.plan_seconds:.0f} s')}, one fresh process; "
                   + (f"the largest batch they fit: {m(planned)}" if planned else "none fits"))
    elif search.plan_seconds:
        out.append(f"  a fresh process to plan first: {m(f'{search.plan_seconds:.0f} s')}, no plans (the notes say "
                   "why)")
    count = len(search.probes)
    seconds = sum(p.seconds for p in search.probes) - search.overlap_seconds
    out.append(f"  {m(count)} probe{'s' if count != 1 else ''} in {m(f'{seconds:.0f} s')}, each in a fresh process"
               + (f" ({m(search.margin_probes)} of them for the margin, after the edge was known)"
                  if search.margin_probes or (search.lab and search.margin) else "")
               + (" (two side by side" if search.overlap_seconds else "")
               + (f", {m(f'{search.beside_plans_seconds:.0f} s')} of it while the plans were made"
                  if search.beside_plans_seconds else "")
               + (")" if search.overlap_seconds else "") + ":")
    for p in search.probes:
        if p.fits:
            what = f"trained, peak {m(format_bytes(p.peak_bytes))}"
        elif p.verdict in DEATHS:
            what = f"did not train ({p.verdict}): the process {p.died}"
        else:
            what = "out of memory" + (f" ({p.verdict}" + (f", request {m(format_bytes(p.request_bytes))}"
                                                           if p.request_bytes else "") + ")" if p.verdict else "")
            if p.died:
                what += f"; the process {p.died}"
        if search.lab:  # the batch marked, not padded to a column: which batches were probed varies
            out.append(f"    batch {m(p.batch)}: {what}, in {m(f'{p.seconds:.1f} s')}")
        else:
            out.append(f"    batch {p.batch:>8,}: {what} ({p.seconds:.1f} s)")
    return out
