"""A batch search's progress, counted here and shown by whoever asked: a line per probe (a terminal,
a script), nothing, or an object of the caller's with probing(), probed() and done(); the notebook
layer's bar is such an object, the default while the extension is loaded (its frontend's)."""

from __future__ import annotations

from ..errors import ArgumentError
from ..frontend import frontend
from ..units import format_bytes
from .probe import Probe


class LineProgress:
    """A search's progress as a line per probe (a terminal, a script); the notebook layer gives a bar
    with the same three methods (`progress=` takes any such object)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet

    def probing(self, count: int, batch: int) -> None:
        pass

    def probed(self, count: int, probe: Probe) -> None:
        if not self.quiet:
            print(f"tfmem batch: {probe_line(count, probe)}", flush=True)

    def done(self, search) -> None:
        pass


def probe_line(count: int, probe: Probe) -> str:
    what = f"trained, peak {format_bytes(probe.peak_bytes)}" if probe.fits else "out of memory"
    return f"probe {count}: batch {probe.batch:,} {what} ({probe.seconds:.1f} s)"


def progress_for(progress, most: int):
    """The progress object a search reports to, from its `progress` argument."""
    if progress is False:
        return LineProgress(quiet=True)
    if progress == "lines":
        return LineProgress()
    if progress in (None, "bar"):
        shown_by = frontend().progress  # a notebook's bar, while the extension is loaded
        shown = shown_by(most, progress == "bar") if shown_by is not None else None
        if shown is None and progress == "bar":
            raise ArgumentError("max_batch_size: progress='bar' is a notebook widget: load the extension first "
                                "(%load_ext tfmem_widgets), or pass progress='lines'.")
        return shown or LineProgress()
    return progress
