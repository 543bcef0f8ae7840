"""tfmem_widgets: TensorFlow's memory, visible and controllable from a notebook.

Importing this package imports neither TensorFlow nor IPython: TensorFlow's device setup is
only possible before its runtime starts, so nothing here may start it early.

    %load_ext tfmem_widgets
    %tfmem setup --lab 256        # or --growth, --limit 4096, --split 2 ... on a GPU
    %tfmem                        # TensorFlow's figures next to the driver's and the host's
    %%tfmem                       # exact peak and net change of a cell
    %%tfmem trace                 # every allocation of a cell, its memory map, the OOM dump
    %%tfmem fresh --lab 64        # the cell in a new process, set up its own way
    %tfmem watch / %tfmem panel   # a live gauge; the setup panel
"""

from .allocator_map import AllocatorMap, Chunk, Region
from .bfc_dump import load_memory_dump, parse_bfc_dump
from .device_setup import SetupResult, setup
from .errors import FreshRunError, NvmlUnavailable, SetupError, TraceDataError
from .fresh import FreshRun, run_fresh
from .measure import Measurement, measure
from .report import MemoryReport, report
from .trace import Trace, trace
from .runtime import watch_runtime_start

watch_runtime_start()  # remember what TensorFlow reads when its runtime starts (never starts it)

__version__ = "0.1.0"
__all__ = [
    "AllocatorMap",
    "Chunk",
    "Region",
    "Trace",
    "TraceDataError",
    "load_memory_dump",
    "parse_bfc_dump",
    "trace",
    "FreshRun",
    "FreshRunError",
    "NvmlUnavailable",
    "run_fresh",
    "Measurement",
    "MemoryReport",
    "SetupError",
    "SetupResult",
    "measure",
    "report",
    "setup",
    "load_ipython_extension",
    "unload_ipython_extension",
    "Gauge",
    "MapViewer",
    "SetupPanel",
]
_WIDGETS = ("Gauge", "MapViewer", "SetupPanel")


def __getattr__(name):
    # The panels need ipywidgets (and so IPython): loaded on first use only.
    if name in _WIDGETS:
        from . import widgets

        return getattr(widgets, name)
    raise AttributeError(f"module 'tfmem_widgets' has no attribute {name!r}")


def _after_cell(result=None):
    """post_run_cell: the readings' after-cell hook (gauges and panels register on it)."""
    from .sampler import after_cell

    after_cell()


def load_ipython_extension(ipython):
    """%load_ext tfmem_widgets: registers %tfmem / %%tfmem; starts nothing."""
    from .magics import TfmemMagics

    ipython.register_magics(TfmemMagics)
    if _after_cell not in ipython.events.callbacks["post_run_cell"]:
        ipython.events.register("post_run_cell", _after_cell)


def unload_ipython_extension(ipython):
    """%unload_ext tfmem_widgets: removes what load_ipython_extension added; gauges stop."""
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("tfmem", None)
    if _after_cell in ipython.events.callbacks["post_run_cell"]:
        ipython.events.unregister("post_run_cell", _after_cell)
    from .sampler import unload

    unload()  # gauges stop, and with them the sampler's thread
