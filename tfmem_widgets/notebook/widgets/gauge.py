"""A live memory gauge made of stock ipywidgets: bars, figures and a sparkline.

It only assigns traits; the readings come from the process's one sampler thread (while a
cell runs) and from a refresh after each cell (for frontends that do not show background
updates). Its text repr is the same figures as a line per device, for saved notebooks.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from html import escape

import ipywidgets as w
import traitlets

from ...readings.sampler import DEFAULT_INTERVAL, Sample, check_interval, read_sample, sampler
from ...units import format_bytes
from ..hooks import on_after_cell, on_unload
from .text_form import FullTextForm

_HISTORY = 120  # samples kept for the sparkline
_SPARK_EVERY = 0.5  # seconds between redraws of the sparkline
_SHOW_EVERY = 0.5  # seconds between updates of the page from the sampler thread
_live: weakref.WeakSet[Gauge] = weakref.WeakSet()


def _bar(description: str, style: str = "") -> w.FloatProgress:
    return w.FloatProgress(value=0.0, min=0.0, max=1.0, description=description, bar_style=style,
                           style={"description_width": "110px"}, layout=w.Layout(width="360px"))


def _sparkline(values: list[int], width: int = 240, height: int = 36,
               marks: list[tuple[int, str]] = ()) -> str:
    """In-use history as an inline SVG polyline (plain HTML: no custom JavaScript); marks
    (position in `values`, label) are dashed vertical lines with the label as their tooltip."""
    if len(values) < 2:
        return f'<svg width="{width}" height="{height}"></svg>'
    top = max(values) or 1
    step = width / (len(values) - 1)
    points = " ".join(f"{k * step:.1f},{height - 2 - (v / top) * (height - 4):.1f}" for k, v in enumerate(values))
    lines = "".join(
        f'<line class="tfmem-mark" data-label="{escape(label)}" x1="{k * step:.1f}" x2="{k * step:.1f}" y1="0" '
        f'y2="{height}" stroke="#888" stroke-dasharray="2,2"><title>{escape(label)}</title></line>'
        for k, label in marks if 0 <= k < len(values))
    return (f'<svg width="{width}" height="{height}" class="tfmem-sparkline">{lines}'
            f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/></svg>')


class Gauge(FullTextForm, w.VBox):
    """Per device: TensorFlow's in use and peak against its limit, the card (NVML), the host.

    >>> tfmem_widgets.Gauge(interval=0.5)      # or %tfmem watch
    """

    # Settings are traits: `gauge.interval = 2` takes effect at once, a bad value is refused where
    # it is set (the sampler's rule, 0.01 to 3600 s); `gauge.device = "CPU:0"` switches the device.
    interval = traitlets.Float(DEFAULT_INTERVAL)
    device = traitlets.Unicode(None, allow_none=True)

    @traitlets.validate("interval")
    def _valid_interval(self, proposal):
        return check_interval(proposal["value"])

    @traitlets.validate("device")
    def _valid_device(self, proposal):
        value = proposal["value"]
        if value is None:
            return None
        from ...tf.devices import resolve_device

        return resolve_device(value).name  # one line naming the devices that exist, if not one

    @traitlets.observe("interval")
    def _interval_changed(self, change):
        if self.__dict__.get("_token") is not None:
            sampler.set_interval(self._token, change["new"])

    @traitlets.observe("device")
    def _device_changed(self, change):
        if self.__dict__.get("_token") is not None:
            with self._lock:
                self._history.clear()
                self._marks.clear()
            self.refresh()

    def __init__(self, interval: float = DEFAULT_INTERVAL, device: str | None = None, **kwargs):
        interval = check_interval(interval)  # refused before any widget or thread exists
        if device is not None and not isinstance(device, str):
            from ...errors import ArgumentError

            raise ArgumentError(f"device must be a device's name such as 'GPU:0', got {device!r}.")
        self._token = None
        self._lock = threading.Lock()
        super().__init__(**kwargs)
        self.interval = interval
        self.device = device
        self.samples = 0
        self._rows: dict[str, dict[str, w.Widget]] = {}
        self._history: deque[int] = deque(maxlen=_HISTORY)
        self._appended = 0  # readings ever added to the history: marks are placed by this count
        self._marks: deque[tuple[int, str]] = deque(maxlen=_HISTORY)
        self._title = w.HTML("<b>TensorFlow memory</b>")
        self._status = w.HTML("")
        self._host = _bar("host (process)", "info")
        self._host_text = w.HTML("")
        self._spark = w.HTML(_sparkline([]))
        self._spark_label = w.Label("")
        self._spark_line = w.HBox([self._spark_label, self._spark])
        self._host_line = w.HBox([self._host, self._host_text])
        self._last: Sample | None = None
        self._spark_drawn = 0.0
        self._shown_at = 0.0
        self.add_class("tfmem-gauge")
        self._token = sampler.subscribe(self._on_sample, interval)
        try:
            _live.add(self)
            self.refresh()
        except BaseException:
            self.close()  # no subscription or widget left behind
            raise

    # -- updates ------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read now, on the calling thread (used after each cell), and show it."""
        self._on_sample(read_sample(), show=True)

    def _on_sample(self, sample: Sample, show: bool = False) -> None:
        with self._lock:
            if self._token is None:
                return
            self._last = sample
            self.samples += 1
            main = self._main_device(sample)
            if main is not None and main.in_use_bytes is not None:
                self._history.append(main.in_use_bytes)
                self._appended += 1
            # Every reading is kept; the page is updated at most twice a second, since each
            # update is a message the kernel sends while the user's cell runs.
            if show or sample.time - self._shown_at >= _SHOW_EVERY:
                self._shown_at = sample.time
                self._apply(sample)

    def _main_device(self, sample: Sample):
        """The device the sparkline and `readings` follow: the one asked for, else the first GPU
        with figures, else the first device with figures (lab mode's CPU)."""
        if self.device is not None:
            return next((d for d in sample.devices if d.name == self.device), None)
        with_figures = [d for d in sample.devices if d.in_use_bytes is not None]
        return next((d for d in with_figures if d.name.startswith("GPU")), with_figures[0] if with_figures else None)

    def _device_row(self, name: str) -> dict[str, w.Widget]:
        """The widgets of one row, made once: later samples only assign their traits."""
        row = self._rows.get(name)
        if row is None:
            row = {
                "in_use": _bar(f"{name} in use"),
                "peak": _bar(f"{name} peak", "warning"),
                "text": w.HTML(""),
            }
            row["line"] = w.HBox([row["in_use"], row["text"]])
            self._rows[name] = row
        return row

    def _apply(self, sample: Sample) -> None:
        children: list[w.Widget] = [self._title]
        devices = [d for d in sample.devices if self.device is None or d.name == self.device]
        if not sample.runtime_started or not devices:
            self._status.value = (
                "TensorFlow's runtime has not started: setup is still possible; figures appear after the first op."
                if not sample.runtime_started else "no TensorFlow device matches"
            )
            children.append(self._status)
        main = self._main_device(sample)
        for d in devices:
            row = self._device_row(d.name)
            limit = d.limit_bytes or max(d.peak_bytes or 0, 1)
            row["in_use"].max = row["peak"].max = float(limit)
            row["in_use"].value = float(min(d.in_use_bytes or 0, limit))
            row["peak"].value = float(min(d.peak_bytes or 0, limit))
            row["text"].value = (
                f"<span class='tfmem-in-use' data-bytes='{d.in_use_bytes}'>{format_bytes(d.in_use_bytes)}</span> in use, "
                f"peak {format_bytes(d.peak_bytes)}, limit {format_bytes(d.limit_bytes)}"
            )
            children += [row["line"], row["peak"]]
        for gpu in sample.gpus:
            row = self._device_row(f"card {gpu.index}")
            row["in_use"].description = f"GPU {gpu.index} (NVML)"
            row["in_use"].max = float(gpu.total_bytes)
            row["in_use"].value = float(gpu.used_bytes)
            row["text"].value = f"{format_bytes(gpu.used_bytes)} used of {format_bytes(gpu.total_bytes)}"
            children.append(row["line"])
        # Whole MiB for the host: its last bytes move at every reading, and every change is
        # a message to the frontend.
        rss = sample.host_rss_bytes >> 20 << 20
        self._host.max = float(sample.host_total_bytes)
        self._host.value = float(rss)
        self._host_text.value = f"{format_bytes(rss)} resident"
        children.append(self._host_line)
        if main is not None and len(self._history):
            if sample.time - self._spark_drawn >= _SPARK_EVERY or not self._spark_label.value:
                self._spark_drawn = sample.time  # the sparkline, the largest message, at most 2 Hz
                self._spark.value = _sparkline(list(self._history), marks=self._marks_in_view())
                self._spark_label.value = f"{main.name} in use, recent readings"
            children.append(self._spark_line)
        if tuple(self.children) != tuple(children):
            self.children = children

    def mark(self, label: str) -> None:
        """A dashed line on the sparkline at the latest reading (MemoryCallback marks each epoch's
        end), shown at once."""
        self.refresh()  # a reading at the moment marked
        with self._lock:
            if self._token is None or not self._appended:
                return
            self._marks.append((self._appended - 1, str(label)))
            self._spark_drawn = 0.0
            if self._last is not None:
                self._apply(self._last)

    def _marks_in_view(self) -> list[tuple[int, str]]:
        first = self._appended - len(self._history)  # the count of the oldest reading still shown
        return [(at - first, label) for at, label in self._marks if at >= first]

    @property
    def marks(self) -> list[tuple[int, str]]:
        """The marks still on the sparkline: (position among `readings`, label)."""
        with self._lock:
            return self._marks_in_view()

    @property
    def last_sample(self) -> Sample | None:
        """The reading shown last."""
        return self._last

    @property
    def rows(self) -> dict[str, dict[str, w.Widget]]:
        """Per device (and 'card N' per GPU): its widgets ('in_use', 'peak' bars, 'text')."""
        return dict(self._rows)

    @property
    def readings(self) -> list[int]:
        """The recent in-use readings (bytes, oldest first) of the device the sparkline follows."""
        with self._lock:
            return list(self._history)

    # -- lifetime -------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._token is not None

    def stop(self) -> None:
        """Stop updating (the widget stays, showing the last figures)."""
        if "_lock" not in self.__dict__:
            return  # refused before it was made: nothing runs
        with self._lock:
            token, self._token = self._token, None
        if token is not None:
            sampler.unsubscribe(token)
        _live.discard(self)

    def close(self) -> None:
        self.stop()
        super().close()

    def __repr__(self) -> str:
        sample = self._last
        if sample is None:
            return "<tfmem gauge>"
        head = f"tfmem gauge ({'running' if self.running else 'stopped'}, every {self.interval:g} s)"
        lines = [head] + ["  " + line for line in sample.lines(self.device)]
        marks = self.marks
        if marks:
            lines.append("  marked: " + ", ".join(label for _, label in marks))
        return "\n".join(lines)


def refresh_all() -> None:
    """After each cell: every running gauge reads once on the main thread."""
    for gauge in list(_live):
        if gauge.running:
            gauge.refresh()


def mark_all(label: str) -> int:
    """Mark every running gauge (an epoch's end); returns how many."""
    gauges = running_gauges()
    for gauge in gauges:
        gauge.mark(label)
    return len(gauges)


def running_gauges() -> list[Gauge]:
    """The gauges of this process still updating."""
    return [g for g in list(_live) if g.running]


def stop_all() -> int:
    """Stop every gauge; returns how many were running."""
    gauges = [g for g in list(_live) if g.running]
    for gauge in gauges:
        gauge.stop()
    return len(gauges)


on_after_cell(refresh_all)
on_unload(stop_all)
sampler.on_mark(mark_all)
