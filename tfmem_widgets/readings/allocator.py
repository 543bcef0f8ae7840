"""TensorFlow's allocator figures for a device, and the highest in-use figure of the process.

measure, report, the sampler and the Keras callback read TensorFlow's counters through here.
"""

from __future__ import annotations

import threading

from ..errors import StateError
from ..tf.runtime import tensorflow

_lock = threading.RLock()
_process_peak_seen: dict[str, int] = {}


def read_allocator(device: str) -> tuple[int, int]:
    """(in use, peak) bytes of the allocator behind `device`; starts the runtime if needed."""
    tf = tensorflow()
    try:
        info = tf.config.experimental.get_memory_info(device)
    except ValueError as exc:
        raise StateError(
            f"TensorFlow keeps no allocator figures for {device} ({exc}); for the CPU, restart "
            "and run `%tfmem setup --lab 1024` first, so its allocator is the BFC allocator."
        ) from None
    return int(info["current"]), int(info["peak"])


def process_peak(device: str, allocator_peak: int) -> int:
    """The highest in-use figure of `device` in this process, across resets of TensorFlow's
    peak counter (measure() resets it; note_peak keeps what it had reached)."""
    with _lock:
        return max(allocator_peak, _process_peak_seen.get(device, 0))


def note_peak(device: str, peak: int) -> None:
    """Keep a peak TensorFlow's counter is about to forget (before reset_memory_stats)."""
    with _lock:
        _process_peak_seen[device] = max(peak, _process_peak_seen.get(device, 0))
