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

After %load_ext, an OOM in any cell is explained under its traceback (last_oom()).
"""

from .tracing.allocator_map import AllocatorMap, Chunk, Region
from .fit.search import BatchSearch, Probe, max_batch_size
from .tracing.dumps import load_memory_dump, parse_bfc_dump
from .tf.device_setup import SetupResult, setup
from .errors import FreshRunError, NvmlUnavailable, SetupError, TraceDataError
from .fit.fresh import FreshRun, run_fresh
from .readings.measure import Measurement, measure
from .oom.report import OomReport
from .oom.watch import explain_oom, last_oom, unwatch_oom, watch_oom
from .tracing.recorder import Recorder, record
from .readings.report import MemoryReport, report
from .tracing.block import Trace, trace
from .tf.runtime import watch_runtime_start

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
    "BatchSearch",
    "Probe",
    "max_batch_size",
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
    "OomReport",
    "explain_oom",
    "last_oom",
    "watch_oom",
    "Recorder",
    "record",
    "unwatch_oom",
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
        from .notebook import widgets

        return getattr(widgets, name)
    if name == "keras":  # MemoryCallback: imports Keras, so only when asked for
        import importlib

        return importlib.import_module(".keras", __name__)
    raise AttributeError(f"module 'tfmem_widgets' has no attribute {name!r}")


def _after_cell(result=None):
    """post_run_cell: the readings' after-cell hook (gauges and panels register on it)."""
    from .readings.sampler import after_cell

    after_cell()


def _before_cell(info=None):
    """pre_run_cell: the OOM watcher notes the dumps that exist; lab-mode hazards are said
    before the cell runs."""
    from .oom.watch import cell_started
    from .notebook.hazards import warn_before_cell

    cell_started()
    warn_before_cell(getattr(info, "raw_cell", "") or "")


def _explain_oom(result=None):
    """post_run_cell: an OOM the cell raised is explained in its output."""
    from .oom.watch import cell_finished

    cell_finished(result)


def load_ipython_extension(ipython):
    """%load_ext tfmem_widgets: registers %tfmem / %%tfmem and the OOM watcher (TensorFlow's
    dump at every OOM, into a folder of the extension's own); starts nothing."""
    from .notebook.magics import TfmemMagics

    ipython.register_magics(TfmemMagics)
    watch_oom()
    for event, hook in (("post_run_cell", _after_cell), ("pre_run_cell", _before_cell),
                        ("post_run_cell", _explain_oom)):
        if hook not in ipython.events.callbacks[event]:
            ipython.events.register(event, hook)


def unload_ipython_extension(ipython):
    """%unload_ext tfmem_widgets: removes what load_ipython_extension added; gauges stop."""
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("tfmem", None)
    for event, hook in (("post_run_cell", _after_cell), ("pre_run_cell", _before_cell),
                        ("post_run_cell", _explain_oom)):
        if hook in ipython.events.callbacks[event]:
            ipython.events.unregister(event, hook)
    unwatch_oom()
    from .tracing.recorder import stop

    stop()
    from .readings.sampler import unload

    unload()  # gauges stop, and with them the sampler's thread
