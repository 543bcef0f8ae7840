"""The pool drawn: one model of it (its rows: each region, or stretch of addresses seen, with its
chunks) and every form it is shown in: TensorFlow's one-line picture ('*' in use, '_' free), the SVG
of an OOM report (one scale for every region, the request against the largest hole), the SVG of the
map viewer (a row per region, chunks coloured by op with their details as tooltips), and the
matplotlib snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from html import escape

from ..units import MiB, format_bytes

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]
NO_OP = "(no op recorded)"  # a chunk whose op the profiler did not name


def op_label(op: str) -> str:
    """The name shown for a chunk's op."""
    return op or NO_OP


@dataclass(frozen=True)
class Stretch:
    """Addresses seen together where a pool's region bounds are unknown (drawn as such, never as a region)."""

    address: int
    size: int


_CLUSTER_GAP = 1 << 20


def address_clusters(ranges) -> list[Stretch]:
    """The (address, size) ranges grouped into stretches, a gap of more than 1 MiB starting a new one."""
    clusters: list[list[int]] = []
    for low, high in sorted((a, a + s) for a, s in ranges):
        if clusters and low - clusters[-1][1] <= _CLUSTER_GAP:
            clusters[-1][1] = max(clusters[-1][1], high)
        else:
            clusters.append([low, high])
    return [Stretch(low, high - low) for low, high in clusters]


@dataclass(frozen=True)
class PoolRow:
    """One row of the picture: a region (or a stretch of the addresses seen) and its chunks."""

    address: int
    size: int
    chunks: tuple  # the map's chunks inside it, by address


def pool_rows(amap, regions=None) -> list[PoolRow]:
    """The rows of a map: its regions (or the given bands), each with the chunks inside it."""
    regions = list(amap.regions) if regions is None else regions
    return [PoolRow(r.address, r.size, tuple(c for c in amap.chunks if r.address <= c.address < r.address + r.size))
            for r in regions]


def occupancy(amap, width: int = 64) -> str:
    """A one-line picture of the pool, TensorFlow's style: '*' in use, '_' free, '|' between regions."""
    if not amap.regions:
        return ""
    total = amap.pool_bytes
    cells = []
    for row in pool_rows(amap):
        n = max(1, round(width * row.size / total))
        for k in range(n):
            lo = row.address + row.size * k // n
            hi = row.address + row.size * (k + 1) // n
            used = sum(max(0, min(c.address + c.size, hi) - max(c.address, lo)) for c in row.chunks if c.in_use)
            cells.append("*" if used * 2 >= hi - lo else "_")
        cells.append("|")
    return "".join(cells[:-1])


def report_svg(amap, request_bytes: int | None, largest_free_bytes: int | None, width: int = 640) -> str:
    """An OOM's pool, region by region (blue in use, white free), and the request against the
    largest hole, on one scale."""
    rows = pool_rows(amap)
    scale = width / max([r.size for r in rows] + [request_bytes or 0, 1])
    row_height = 16
    height = row_height * (len(rows) + 1) + 4
    shapes = []
    for k, row in enumerate(rows):
        y = k * row_height + 2
        shapes.append(f"<rect x='0' y='{y}' width='{row.size * scale:.1f}' height='{row_height - 4}' "
                      "fill='white' stroke='#1f77b4' stroke-width='0.6'/>")
        for c in row.chunks:
            if c.in_use:
                shapes.append(f"<rect x='{(c.address - row.address) * scale:.1f}' y='{y}' "
                              f"width='{max(c.size * scale, 0.5):.1f}' height='{row_height - 4}' fill='#1f77b4'/>")
    y = len(rows) * row_height + 2
    if request_bytes:
        shapes.append(f"<rect x='0' y='{y}' width='{request_bytes * scale:.1f}' height='{row_height - 4}' "
                      "fill='#d62728'/>")
        shapes.append(f"<rect x='0' y='{y}' width='{(largest_free_bytes or 0) * scale:.1f}' height='{row_height - 4}' "
                      "fill='none' stroke='black' stroke-width='1.2'/>")
    return (f"<svg width='{width + 2}' height='{height}' xmlns='http://www.w3.org/2000/svg'>{''.join(shapes)}</svg>"
            "<br><small>one row per region (blue in use, white free); red: the request, black: the largest hole</small>")


_ROW = 22


def _small_chunks(pending: list, y: int) -> str:
    """One rectangle for neighbouring chunks too narrow to draw one by one."""
    x, wide, count = pending
    return (f'<rect x="{x:.2f}" y="{y}" width="{max(wide, 1):.2f}" height="{_ROW - 6}" fill="#555">'
            f"<title>{count} small chunks</title></rect>")


def map_svg(snapshot, width: int = 760) -> str:
    """The pool as SVG: one row per region, in-use chunks coloured by op, holes left blank.
    Without known regions (a trace after earlier work), rows are stretches of the addresses
    seen, labelled so."""
    regions, exact = snapshot.bands()
    ops = list(snapshot.by_op())
    colors = {op: PALETTE[k % len(PALETTE)] for k, op in enumerate(ops)}
    label = 140
    height = _ROW * max(1, len(regions)) + 8
    parts = [f'<svg width="{width + label}" height="{height}" class="tfmem-map" xmlns="http://www.w3.org/2000/svg">']
    for number, row in enumerate(pool_rows(snapshot, regions)):
        y = 4 + number * _ROW
        name = "region" if exact else "seen"
        parts.append(f'<text x="0" y="{y + 14}" font-size="11">{name} {escape(format_bytes(row.size))}</text>')
        parts.append(f'<rect x="{label}" y="{y}" width="{width}" height="{_ROW - 6}" fill="white" stroke="black" '
                     'stroke-width="0.6"/>')
        scale = width / row.size
        pending = None  # neighbouring chunks narrower than a pixel are drawn together
        for chunk in row.chunks:
            if not chunk.in_use:
                continue
            x = label + (chunk.address - row.address) * scale
            wide = chunk.size * scale
            if wide < 1:
                if pending and x > pending[0] + pending[1] + 1:
                    parts.append(_small_chunks(pending, y))
                    pending = None
                pending = pending or [x, 0, 0]
                pending[1] = x + wide - pending[0]
                pending[2] += 1
                continue
            title = (f"{op_label(chunk.op)} {chunk.shape} {format_bytes(chunk.size)} "
                     f"at {chunk.address:#x}" + (f", event {chunk.since}" if chunk.since is not None else ""))
            parts.append(f'<rect class="tfmem-chunk" x="{x:.2f}" y="{y}" width="{wide:.2f}" height="{_ROW - 6}" '
                         f'fill="{colors.get(op_label(chunk.op), "#999")}"><title>{escape(title)}</title></rect>')
        if pending:
            parts.append(_small_chunks(pending, y))
    parts.append("</svg>")
    return "".join(parts)


def plot_pool(snapshot, ax=None):
    """The pool at one moment with matplotlib, region by region; after an OOM, the failed request
    drawn next to the largest hole it did not fit in."""
    import matplotlib.pyplot as plt

    rows = pool_rows(snapshot)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1.2 + 0.45 * (len(rows) + 1)))
    mib = float(MiB)
    for number, row in enumerate(rows):
        ax.broken_barh([((c.address - row.address) / mib, c.size / mib) for c in row.chunks if c.in_use],
                       (number - 0.35, 0.7), facecolors="C0", edgecolors="white", linewidth=0.3)
        ax.broken_barh([((c.address - row.address) / mib, c.size / mib) for c in row.chunks if not c.in_use],
                       (number - 0.35, 0.7), facecolors="none", edgecolors="C0", linewidth=0.6, hatch="//")
    labels = [f"region {format_bytes(r.size)}" for r in rows]
    largest = max((c for c in snapshot.chunks if not c.in_use), key=lambda c: c.size, default=None)
    if snapshot.failed_request_bytes is not None:
        number = len(rows)
        ax.broken_barh([(0, snapshot.failed_request_bytes / mib)], (number - 0.35, 0.7), facecolors="C3")
        labels.append(f"failed request {format_bytes(snapshot.failed_request_bytes)}")
        if largest is not None:
            ax.broken_barh([(0, largest.size / mib)], (number - 0.35, 0.7), facecolors="none",
                           edgecolors="black", linewidth=1.2)
            ax.annotate(f"largest hole {format_bytes(largest.size)}", (largest.size / mib, number),
                        xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xlabel("MiB from the region's start")
    frag = snapshot.fragmentation
    ax.set_title(
        f"{snapshot.allocator} ({snapshot.source}): in use {format_bytes(snapshot.in_use_bytes)}, "
        f"free {format_bytes(snapshot.free_bytes)}, largest free {format_bytes(snapshot.largest_free_bytes)}"
        + ("" if frag is None or frag != frag else f", fragmentation {frag:.3f}")
    )
    ax.invert_yaxis()
    return ax
