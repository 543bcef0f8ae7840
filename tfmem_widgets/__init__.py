"""tfmem_widgets: TensorFlow's memory, visible and controllable from a notebook.

Importing this package imports neither TensorFlow nor IPython: TensorFlow's device setup is
only possible before its runtime starts, so nothing here may start it early.

    %load_ext tfmem_widgets
    %tfmem setup --lab 256        # or --growth, --limit 4096, --split 2 ... on a GPU
    %tfmem                        # TensorFlow's figures next to the driver's and the host's
    %%tfmem                       # exact peak and net change of a cell
    %%tfmem trace                 # every allocation of a cell, its memory map, the OOM dump
"""

from .allocator_map import AllocatorMap, Chunk, Region
from .bfc_dump import load_memory_dump, parse_bfc_dump
from .device_setup import SetupResult, setup
from .errors import SetupError
from .measure import Measurement, measure
from .report import MemoryReport, report
from .trace import Trace, trace
from .xplane import TraceDataError

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
    "Measurement",
    "MemoryReport",
    "SetupError",
    "SetupResult",
    "measure",
    "report",
    "setup",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython):
    """%load_ext tfmem_widgets: registers %tfmem / %%tfmem; starts nothing."""
    from .magics import TfmemMagics

    ipython.register_magics(TfmemMagics)


def unload_ipython_extension(ipython):
    """%unload_ext tfmem_widgets: removes what load_ipython_extension added."""
    for kind in ("line", "cell"):
        ipython.magics_manager.magics[kind].pop("tfmem", None)
