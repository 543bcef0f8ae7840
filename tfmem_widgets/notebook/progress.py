"""A batch search's progress in a notebook: stock ipywidgets (a bar and a label) whose values the
search's counting sets, tqdm's split of counting and showing."""

from __future__ import annotations

from ..search.batch_search import BatchSearch
from ..search.probe import Probe
from ..search.progress import probe_line


class ProgressBar:
    """A bar and a label, shown when made; the search calls probing, probed and done."""

    def __init__(self, most: int):
        import ipywidgets as w
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=most, description="probes")
        self.label = w.Label("starting the first probe")
        display(w.HBox([self.bar, self.label]))

    def probing(self, count: int, batch: int) -> None:
        self.label.value = f"probe {count}: batch {batch:,} ..."

    def probed(self, count: int, probe: Probe) -> None:
        self.bar.value = count
        self.label.value = probe_line(count, probe)

    def done(self, search: BatchSearch) -> None:
        self.bar.max = max(self.bar.value, 1)
        self.bar.bar_style = "warning" if search.interrupted else "success"
        self.label.value = (f"{len(search.probes)} probes: largest batch that trained "
                            f"{search.largest:,}" if search.largest else "nothing trained")


def notebook_progress(most: int, bar: bool = False) -> ProgressBar | None:
    """A bar in a notebook (a kernel's shell), or where asked for; None elsewhere (a line per probe)."""
    from IPython import get_ipython

    shell = get_ipython()
    in_notebook = shell is not None and type(shell).__name__ == "ZMQInteractiveShell"
    return ProgressBar(most) if in_notebook or bar else None
