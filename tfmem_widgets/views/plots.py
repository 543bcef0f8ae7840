"""Pictures of a trace with matplotlib: the memory map, the timeline, a snapshot of the pool.

The memory map is the TensorFlow counterpart of PyTorch memory_viz's views: time (event
number) across, address up, each chunk a rectangle coloured by the op that made it, free
holes left blank, regions outlined. Regions far apart in the address space are stacked
next to each other. Past a few thousand chunks the map is drawn as an image, each pixel
showing the op that holds most of it: one image, however many chunks.
"""

from __future__ import annotations

import numpy as np

from ..units import format_bytes
from .pool import address_clusters, op_label, plot_pool

_MAX_RECTANGLES = 4000
_OTHER = "other ops"


def _pyplot():
    import matplotlib.pyplot as plt

    return plt


def _lifetimes(trace, name: str):
    """(address, size, start, end, op index) of every chunk the trace saw allocated."""
    e = trace.events(name)
    open_chunks: dict[int, tuple[int, int, int]] = {}
    spans = []
    kinds, addresses, sizes, ops = e.kind.tolist(), e.address.tolist(), e.size.tolist(), e.op.tolist()
    for i, kind in enumerate(kinds):
        if kind > 0:
            open_chunks[addresses[i]] = (sizes[i], i, ops[i])
        else:
            started = open_chunks.pop(addresses[i], None)
            if started is not None:
                spans.append((addresses[i], started[0], started[1], i, started[2]))
    end = len(kinds)
    spans += [(a, s, start, end, op) for a, (s, start, op) in open_chunks.items()]
    return spans


def _bands(trace, name: str, spans) -> tuple[list[tuple[int, int]], bool]:
    """(address, size, first event) ranges to stack: the trace's regions where it knows them,
    else clusters of addresses (a gap over 1 MiB starts a new one)."""
    e = trace.events(name)
    if trace.is_fresh(name):
        replay = trace.replay(name, len(e) - 1)
        if replay.regions:
            return [(r.address, r.size, replay.region_created[r.address]) for r in replay.regions], True
    return [(r.address, r.size, 0) for r in address_clusters((a, s) for a, s, *_ in spans)], False


def _band_offsets(bands):
    offsets, total = [], 0
    for _, size, _ in bands:
        offsets.append(total)
        total += size
    return offsets, total


def _op_colors(trace, name, spans, top: int = 10):
    plt = _pyplot()
    e = trace.events(name)
    totals: dict[int, int] = {}
    for _, size, start, end, op in spans:
        totals[op] = totals.get(op, 0) + size * (end - start)
    ranked = sorted(totals, key=lambda op: -totals[op])[:top]
    palette = plt.get_cmap("tab10")
    colors = {op: palette(k % 10) for k, op in enumerate(ranked)}
    labels = {op: op_label(e.texts[op]) for op in ranked}
    return colors, labels


def plot_map(trace, allocator: str | None = None, ax=None):
    """Address against time, each chunk a rectangle coloured by its op; regions outlined."""
    plt = _pyplot()
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch, Rectangle

    name = trace.allocator_name(allocator)
    e = trace.events(name)
    spans = _lifetimes(trace, name)
    bands, exact = _bands(trace, name, spans)
    offsets, total = _band_offsets(bands)
    starts = [b[0] for b in bands]
    colors, labels = _op_colors(trace, name, spans)
    other = (0.6, 0.6, 0.6, 1.0)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 5))

    def y_of(address: int) -> float | None:
        k = int(np.searchsorted(starts, address, side="right")) - 1
        if k < 0 or address >= bands[k][0] + bands[k][1]:
            return None
        return offsets[k] + address - bands[k][0]

    n_events = max(1, len(e))
    if len(spans) <= _MAX_RECTANGLES:
        polys, facecolors = [], []
        for address, size, start, end, op in spans:
            y = y_of(address)
            if y is None:
                continue
            polys.append([(start, y), (end, y), (end, y + size), (start, y + size)])
            facecolors.append(colors.get(op, other))
        ax.add_collection(PolyCollection(polys, facecolors=facecolors, edgecolors="none"))
    else:
        # Too many to see one by one: an image, each pixel the op holding most of it.
        height, width = 600, 1200
        image = np.zeros((height, width), dtype=np.int16)  # 0: free
        codes = {op: k + 1 for k, op in enumerate(colors)}
        other_code = len(codes) + 1
        scale_y, scale_x = height / max(total, 1), width / n_events
        for address, size, start, end, op in spans:
            y = y_of(address)
            if y is None:
                continue
            y0, y1 = int(y * scale_y), max(int(y * scale_y) + 1, int((y + size) * scale_y))
            x0, x1 = int(start * scale_x), max(int(start * scale_x) + 1, int(end * scale_x))
            image[y0:y1, x0:x1] = codes.get(op, other_code)
        from matplotlib.colors import ListedColormap

        cmap = ListedColormap([(1, 1, 1, 0)] + [colors[op] for op in codes] + [other])
        ax.imshow(image, cmap=cmap, vmin=0, vmax=other_code, origin="lower", aspect="auto",
                  extent=(0, n_events, 0, total), interpolation="nearest")
    for (_, size, created), offset in zip(bands, offsets):
        ax.add_patch(Rectangle((created, offset), n_events - created, size, fill=False, lw=0.8,
                               ls="-" if exact else ":", edgecolor="black"))
    ax.set_xlim(0, n_events)
    ax.set_ylim(0, max(total, 1))
    ticks = [o + s / 2 for (_, s, _), o in zip(bands, offsets)]
    ax.set_yticks(ticks)
    ax.set_yticklabels([f"{format_bytes(s)} @ {a:#x}" for a, s, _ in bands], fontsize=7)
    ax.set_xlabel("allocator event")
    ax.set_ylabel("regions (stacked by address)" if exact else "addresses seen (region bounds unknown)")
    ax.set_title(f"{name}: chunks by op ({len(spans):,} chunks, {len(e):,} events)")
    if trace.oom and trace.oom.allocator == name:
        ax.axvline(n_events, color="red", lw=2)
        ax.annotate("OOM", (n_events, total), color="red", ha="right", va="bottom")
    handles = [Patch(color=colors[op], label=labels[op]) for op in colors]
    if len(colors) < len({s[4] for s in spans}):
        handles.append(Patch(color=other, label=_OTHER))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_timeline(trace, allocator: str | None = None, ax=None):
    """In use after every event, the peak, the pool (rebuilt) and the limit."""
    plt = _pyplot()
    name = trace.allocator_name(allocator)
    e = trace.events(name)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    x = np.arange(len(e))
    mib = float(1 << 20)
    ax.step(x, e.in_use / mib, where="post", label="in use", lw=1)
    peak = trace.peak_index(name)
    ax.plot([peak], [e.in_use[peak] / mib], "o", color="C3", label=f"peak {format_bytes(int(e.in_use[peak]))}")
    pool = trace.pool_bytes_after_each_event(name)
    if pool is not None:
        ax.step(x, pool / mib, where="post", label="pool (regions)", lw=1, color="C2")
    if e.limit_bytes:
        ax.axhline(e.limit_bytes / mib, color="gray", ls="--", lw=1, label=f"limit {format_bytes(e.limit_bytes)}")
    if trace.oom and trace.oom.allocator == name:
        ax.axvline(len(e), color="red", lw=2, label="OOM")
    ax.set_xlabel("allocator event")
    ax.set_ylabel("MiB")
    ax.set_title(f"{name}: in use and peak")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax


def plot_snapshot(target, at=None, allocator: str | None = None, ax=None):
    """The pool at one moment, region by region; after an OOM, the failed request drawn
    next to the largest hole it did not fit in. `target` is a Trace or an AllocatorMap."""
    snapshot = target.map(at, allocator) if callable(getattr(target, "map", None)) else target
    return plot_pool(snapshot, ax)
