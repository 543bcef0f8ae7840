"""A batch search drawn: peak against batch, the failures at the limit, the line through the peaks."""

from __future__ import annotations

from ..units import MiB, format_bytes


def plot_search(search, ax=None, pick: int | None = None):
    """`BatchSearch.plot`: the batches that trained, the failures (at the limit, red x), the limit, the
    line through the peaks, and, with `pick`, the limit that batch needs (its measured peak where a probe
    trained at it)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4.2))
    fitted, failed = search.fitted, search.failed
    if fitted:
        ax.plot([p.batch for p in fitted], [p.peak_bytes / MiB for p in fitted], "o", color="#1f77b4",
                label="trained: the allocator's peak")
    top = search.limit_bytes / MiB if search.limit_bytes else max([p.peak_bytes / MiB for p in fitted] or [1])
    if failed:
        ax.plot([p.batch for p in failed], [top] * len(failed), "x", color="#d62728", markersize=9,
                label="out of memory")
    if search.limit_bytes:
        ax.axhline(top, color="#6a1b9a", linestyle=":", label=f"limit {format_bytes(search.limit_bytes)}")
    model = search.peak_model()
    right = max([p.batch for p in search.probes] + [1])
    if model is not None:
        ax.plot([0, right], [model[0] / MiB, (model[0] + model[1] * right) / MiB], "--", color="#888",
                linewidth=1, label="peak = fixed + per example x batch")
    measured = None if pick is None else search.measured_peak(pick)
    if pick is not None and (model is not None or measured is not None):
        need = measured if measured is not None else search.needs_bytes(pick)  # (a probe search plans for it once)
        ax.plot([pick], [need / MiB], "s", color="#ff7f0e", label=f"batch {pick:,} needs {format_bytes(need)}"
                + (" (measured)" if measured is not None else ""))
    ax.set_xlabel("batch (examples)")
    ax.set_ylabel("MiB")
    ax.set_title(f"largest batch that trained: {search.largest:,}" if search.largest else
                 "nothing trained" if search.probes else "nothing measured")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    return ax


