"""Exact peak and net change of TensorFlow's allocator over a block of code.

The figures come from the allocator itself (``get_memory_info``), not from sampling, so a
tensor that lives for a microsecond still counts. TensorFlow keeps one peak counter per
device; ``reset_memory_stats`` sets it to the current figure. Nested blocks share that
counter, so before any reset the peak so far is folded into every enclosing block, and
the process-wide peak is kept in readings (``process_peak``) for reports.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..errors import StateError
from ..tf.devices import resolve_device
from ..tf.lab import lab_limit_bytes
from ..tf.runtime import runtime_started, tensorflow
from ..units import format_bytes, format_exact
from .allocator import note_peak, read_allocator

_lock = threading.RLock()
_active: list[Measurement] = []


def running_measurements() -> tuple[Measurement, ...]:
    """The measure() blocks running now, outermost first."""
    with _lock:
        return tuple(_active)


def _reset_peak(device: str, peak: int) -> None:
    with _lock:
        note_peak(device, peak)
        for outer in _active:
            if outer.device == device:
                outer._highest = max(outer._highest, peak)
        tensorflow().config.experimental.reset_memory_stats(device)


@dataclass
class Measurement:
    """Allocator figures for one block; bytes are exact (whole 256-byte chunks).

    peak_bytes: the highest in-use figure during the block minus the one at its start.
    delta_bytes: the in-use figure at its end minus the one at its start.
    """

    device: str
    lab_limit_bytes: int | None = None
    start_bytes: int | None = None
    end_bytes: int | None = None
    highest_bytes: int | None = None  # absolute: the allocator's in-use figure at its highest
    error: str | None = None  # the exception that ended the block, if one did
    no_runtime: bool = False  # the block did no TensorFlow work: its runtime never started
    _highest: int = field(default=0, repr=False)

    @property
    def done(self) -> bool:
        return self.end_bytes is not None

    @property
    def peak_bytes(self) -> int | None:
        return None if not self.done else self.highest_bytes - self.start_bytes

    @property
    def delta_bytes(self) -> int | None:
        return None if not self.done else self.end_bytes - self.start_bytes

    def _where(self) -> str:
        if self.lab_limit_bytes is not None and self.device.startswith("CPU"):
            return f"{self.device}, lab mode {format_bytes(self.lab_limit_bytes)}"
        return self.device

    def __repr__(self) -> str:
        if not self.done:
            return f"<tfmem measurement of {self._where()}: running>"
        if self.no_runtime:
            return (f"tfmem {self.device}: no TensorFlow work, nothing measured (TensorFlow's runtime has not "
                    "started, so %tfmem setup is still possible)")
        text = (
            f"tfmem {self._where()}: peak {format_bytes(self.peak_bytes, signed=True)} "
            f"({format_exact(self.peak_bytes, signed=True)}), net {format_bytes(self.delta_bytes, signed=True)} "
            f"({format_exact(self.delta_bytes, signed=True)}); in use {format_bytes(self.start_bytes)} -> "
            f"{format_bytes(self.end_bytes)}, highest {format_bytes(self.highest_bytes)}"
        )
        if self.error:
            text += f"; the block raised {self.error}"
        if self.device.startswith("CPU") and self.lab_limit_bytes is None:
            text += (
                "\nnote: not lab mode: the CPU allocator's figures may leave out small tensors; "
                "%tfmem setup --lab N before any TensorFlow work for exact ones"
            )
        return text

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))

    def _repr_html_(self) -> str:
        from html import escape

        return f"<pre>{escape(repr(self))}</pre>"


class measure:
    """``with measure() as m:`` gives the exact peak and net change of the block.

    device: 'GPU:0', 'CPU:0', '/device:GPU:1'...; None means the first GPU, else the CPU.

    >>> with tfmem_widgets.measure() as m:
    ...     x = tf.zeros((2 << 20,))          # 8 MiB kept
    ...     y = tf.zeros((4 << 20,)); del y   # 16 MiB made and dropped
    >>> m.peak_bytes, m.delta_bytes          # 24 MiB and 8 MiB (plus 256-byte chunks)
    """

    def __init__(self, device: str | None = None):
        # Resolved now, from the configuration: a bad name fails before anything starts.
        self.result = Measurement(device=resolve_device(device).name)

    def __enter__(self) -> Measurement:
        m = self.result
        if m in _active or m.done:
            raise StateError("this measure() block has already run; make a new one for each block.")
        with _lock:
            if not runtime_started():
                # Reading would start the runtime (and end the chance to set devices up). A
                # runtime that starts inside the block has a new allocator: from zero, and its
                # peak counter covers the whole block.
                m.start_bytes = m._highest = 0
                m.lab_limit_bytes = lab_limit_bytes()
                self._started_inside = True
            else:
                current, peak = read_allocator(m.device)
                m.lab_limit_bytes = lab_limit_bytes()
                _reset_peak(m.device, peak)
                m.start_bytes = m._highest = current
                self._started_inside = False
            _active.append(m)
        return m

    def __exit__(self, exc_type, exc, tb) -> bool:
        m = self.result
        with _lock:
            try:
                if self._started_inside and not runtime_started():
                    m.end_bytes = m.highest_bytes = 0
                    m.no_runtime = True
                else:
                    current, peak = read_allocator(m.device)
                    m.end_bytes = current
                    m.highest_bytes = max(m._highest, peak, current)
                    for outer in _active:
                        if outer is not m and outer.device == m.device:
                            outer._highest = max(outer._highest, m.highest_bytes)
                    note_peak(m.device, m.highest_bytes)
                    if self._started_inside:
                        m.lab_limit_bytes = lab_limit_bytes()  # as TensorFlow read it when it started
            finally:
                if m in _active:
                    _active.remove(m)
        if exc_type is not None:
            m.error = exc_type.__name__
        return False
