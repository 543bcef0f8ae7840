"""The allocator map of a trace, at any moment, in stock ipywidgets.

A slider picks the moment (after which event); the pool is drawn as inline SVG, a row per
region, each chunk a rectangle whose tooltip (the browser's own, no JavaScript) gives its op,
shape, size and address. The chunks can also be picked from a list for their details. The
peak is one click away and the OOM moment is marked.
"""

from __future__ import annotations

from html import escape

import ipywidgets as w
import traitlets

from ...tracing.allocator_map import AllocatorMap
from ...units import format_bytes
from ...views.pool import map_svg, op_label
from .text_form import FullTextForm


class MapViewer(FullTextForm, w.VBox):
    """A trace's allocator map with a time slider, the peak and the OOM one click away.

    >>> tfmem_widgets.MapViewer(trace)     # %%tfmem trace shows one
    >>> viewer.allocator = "GPU_0_bfc"       # another allocator of the same trace
    """

    allocator = traitlets.Unicode()

    @traitlets.validate("allocator")
    def _valid_allocator(self, proposal):
        trace = self.__dict__.get("trace")
        return proposal["value"] if trace is None else trace.allocator_name(proposal["value"])

    @traitlets.observe("allocator")
    def _allocator_changed(self, change):
        if self.__dict__.get("_built"):
            self._build()

    def __init__(self, trace, allocator: str | None = None, **kwargs):
        self.trace = trace
        name = trace.allocator_name(allocator)  # refused in one line before any widget exists
        super().__init__(**kwargs)
        self.add_class("tfmem-map-viewer")
        self._built = False
        self.allocator = name
        self._build()

    def _build(self) -> None:
        trace = self.trace
        events = trace.events(self.allocator)
        last = len(events) - 1
        self.moment = w.IntSlider(value=last, min=0, max=last, description="after event",
                                  continuous_update=False, layout=w.Layout(width="640px"))
        self.peak_button = w.Button(description=f"peak (event {trace.peak_index(self.allocator)})", icon="arrow-up")
        oom = trace.oom is not None and trace.oom.allocator == self.allocator
        self.end_button = w.Button(description="OOM" if oom else "end", button_style="danger" if oom else "",
                                   icon="exclamation-triangle" if oom else "step-forward")
        self.figures = w.HTML()
        self.picture = w.HTML()
        self.chunks = w.Select(options=[], rows=6, description="chunks", layout=w.Layout(width="640px"))
        self.details = w.HTML()
        self.children = [
            w.HTML(f"<b>{escape(self.allocator)}</b>: {len(events):,} events"
                   + (" &mdash; <span style='color:#b00'>ended in an OOM</span>" if oom else "")),
            w.HBox([self.moment, self.peak_button, self.end_button]),
            self.figures, self.picture, self.chunks, self.details,
        ]
        self.moment.observe(lambda _: self._show(), names="value")
        self.chunks.observe(lambda _: self._detail(), names="value")
        self.peak_button.on_click(lambda _: self.show_peak())
        self.end_button.on_click(lambda _: self.show_end())
        self._map: AllocatorMap | None = None
        self._built = True
        self._show()

    def show_peak(self) -> None:
        self.moment.value = self.trace.peak_index(self.allocator)

    def show_end(self) -> None:
        self.moment.value = self.moment.max

    @property
    def current_map(self) -> AllocatorMap:
        return self._map

    def _show(self) -> None:
        at_end = self.moment.value == self.moment.max
        # At the end the map is TensorFlow's own dump where there is one (an OOM).
        self._map = self.trace.map(None if at_end else self.moment.value, self.allocator)
        m = self._map
        frag = m.fragmentation
        self.figures.value = (
            f"<span class='tfmem-map-figures'>{escape(m.source)}: in use {format_bytes(m.in_use_bytes)}, "
            f"free {format_bytes(m.free_bytes)}, largest free {format_bytes(m.largest_free_bytes)}"
            + ("" if frag is None or frag != frag else f", fragmentation {frag:.3f}")
            + (f", <b>failed request {format_bytes(m.failed_request_bytes)}</b>" if m.failed_request_bytes else "")
            + (f"; {format_bytes(m.before_trace_bytes)} from before the trace (not drawn)" if m.before_trace_bytes else "")
            + "</span>"
        )
        self.picture.value = map_svg(m)
        in_use = sorted((c for c in m.chunks if c.in_use), key=lambda c: -c.size)
        self.chunks.options = [
            (f"{format_bytes(c.size):>10}  {op_label(c.op)} {c.shape}  @ {c.address:#x}", c.address)
            for c in in_use[:500]
        ]
        self._detail()

    def _detail(self) -> None:
        chunk = None if self.chunks.value is None or self._map is None else self._map.chunk_at(self.chunks.value)
        if chunk is None:
            self.details.value = "<i>pick a chunk for its details; hover over one in the map for the same</i>"
            return
        self.details.value = (
            f"<b>{escape(op_label(chunk.op))}</b> shape {escape(chunk.shape or '?')}: "
            f"{format_bytes(chunk.size)} chunk ({chunk.size:,} B)"
            + (f" for {chunk.requested:,} B requested" if chunk.requested else "")
            + f" at {chunk.address:#x}" + (f", allocated at event {chunk.since}" if chunk.since is not None else "")
        )

    def __repr__(self) -> str:
        return f"tfmem map viewer {self.allocator} after event {self.moment.value}\n{self._map!r}"
