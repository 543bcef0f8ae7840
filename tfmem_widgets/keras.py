"""``tfmem_widgets.keras.MemoryCallback``: memory across a whole fit (see readings/callback.py).

A module of its own so that importing the package never imports Keras: only this name does.
"""

from .readings.callback import IN_USE_KEY, PEAK_KEY, MemoryCallback

__all__ = ["MemoryCallback", "PEAK_KEY", "IN_USE_KEY"]
