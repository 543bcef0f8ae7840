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

from .errors import ArgumentError, FitStopped, FreshRunError, NvmlUnavailable, SetupError, StateError, TfmemError, TraceDataError
from .fresh.run import FreshRun, run_fresh
from .oom.explain import explain_oom, last_oom
from .oom.report import OomReport
from .oom.traced import trace
from .oom.watch import unwatch_oom, watch_oom
from .plans.plan import StepPlan, plan
from .plans.replicas import ReplicaPlan
from .readings.measure import Measurement, measure
from .readings.report import MemoryReport, report
from .search.batch_search import BatchSearch, Probe, max_batch_size
from .tf.device_setup import SetupResult, setup
from .tf.runtime import watch_runtime_start
from .tracing.allocator_map import AllocatorMap, Chunk, Region
from .tracing.dumps import load_memory_dump, parse_bfc_dump
from .tracing.recorder import Recorder, record
from .tracing.result import Trace

watch_runtime_start()  # remember what TensorFlow reads when its runtime starts (never starts it)

__version__ = "0.1.0"
__all__ = [
    "TfmemError",
    "ArgumentError",
    "SetupError",
    "StateError",
    "TraceDataError",
    "NvmlUnavailable",
    "FreshRunError",
    "FitStopped",
    "AllocatorMap",
    "Chunk",
    "Region",
    "Trace",
    "load_memory_dump",
    "parse_bfc_dump",
    "trace",
    "BatchSearch",
    "Probe",
    "max_batch_size",
    "StepPlan",
    "ReplicaPlan",
    "plan",
    "FreshRun",
    "run_fresh",
    "Measurement",
    "MemoryReport",
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


def load_ipython_extension(ipython):
    """%load_ext tfmem_widgets: registers %tfmem / %%tfmem and the OOM watcher (TensorFlow's dump at
    every OOM, into a folder of the extension's own), and tells of a kernel that died before this one in
    the same folder; starts nothing of TensorFlow's."""
    from .notebook.extension import load

    load(ipython)


def unload_ipython_extension(ipython):
    """%unload_ext tfmem_widgets: removes what load_ipython_extension added; gauges stop."""
    from .notebook.extension import unload

    unload(ipython)
