"""Live panels made of stock ipywidgets: they observe core objects and only assign traits."""

from .gauge import Gauge
from .map_viewer import MapViewer
from .setup_panel import SetupPanel

__all__ = ["Gauge", "MapViewer", "SetupPanel"]
