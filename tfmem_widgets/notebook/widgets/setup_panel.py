"""The device setup panel: the choices of %tfmem setup as controls, checked live.

Every change asks the same rules as ``%tfmem setup`` (plan.plan_setup) and shows either the
conflict, with its reason, or the exact TensorFlow code Apply will run.
"""

from __future__ import annotations

import weakref
from html import escape

import ipywidgets as w

from ...errors import ArgumentError, TfmemError
from ...tf.device_setup import current_state, setup
from ...tf.lab import lab_limit_bytes
from ...tf.options import DEFAULT_LAB_MB, SetupRequest, parse_split
from ...tf.runtime import runtime_started
from ...tf.setup_rules import plan_setup
from ...units import MiB
from ..hooks import on_after_cell
from .text_form import FullTextForm

_AS_IS = "as it is"
_live: weakref.WeakSet[SetupPanel] = weakref.WeakSet()


class SetupPanel(FullTextForm, w.VBox):
    """Choose GPUs, growth, limits, logical devices, allocator and lab mode; Apply.

    >>> tfmem_widgets.SetupPanel()      # or %tfmem panel
    """

    def __init__(self, state=None, search=None, **kwargs):
        """state: the machine to plan for (a plan.DeviceState); by default this process's.
        search: a BatchSearch (max_batch_size's result): the panel then shows what fits at the
        chosen limit, and the limit a batch needs."""
        super().__init__(**kwargs)
        self.add_class("tfmem-setup-panel")
        self._own_state = state is None  # this process's: read again once its runtime starts
        self.state = current_state() if state is None else state
        style = {"description_width": "130px"}
        self._device_controls(style)
        self._lab_controls(style)
        self.message = w.HTML()
        self.message.add_class("tfmem-setup-message")
        self.code = w.HTML()
        self.apply_button = w.Button(description="Apply", button_style="primary", icon="check")
        self.result = w.HTML()
        self.note = w.HTML(self._machine_note())
        self._fit_controls(style)
        self._limit_row = w.HBox([self.use_limit, self.limit])
        self._lab_row = w.HBox([self.lab, self.lab_mb])
        self._search = None
        self._search_batch = None
        self._layout()
        self._connect()
        self._changed()
        if search is not None:
            self.search = search
        if self._own_state:
            _live.add(self)

    def _device_controls(self, style: dict) -> None:
        """The GPU choices: which GPUs, growth, a limit, logical devices, the allocator (off without a GPU)."""
        gpus = self.state.gpus
        totals = self._card_sizes_mb()
        self._limit_max = min(totals) if totals else 1
        no_gpu = not gpus
        self.gpus = w.SelectMultiple(
            options=[(f"GPU {g.index} {g.device_name}".strip(), g.index) for g in gpus],
            value=tuple(g.index for g in gpus if g.visible), description="GPUs", disabled=no_gpu, style=style)
        self.growth = w.ToggleButtons(options=[_AS_IS, "growth", "preallocate"], value=_AS_IS,
                                      description="memory growth", disabled=no_gpu, style=style)
        # Short labels, whole (a label cut by the frontend's width says nothing); the detail in a tooltip.
        whole = w.Layout(width="auto")
        self.force_growth = w.Checkbox(description="force growth", disabled=no_gpu, indent=False, layout=whole,
                                       tooltip="TF_FORCE_GPU_ALLOW_GROWTH=true: every GPU grows its pool on "
                                               "demand, whatever the code asks")
        self.use_limit = w.Checkbox(description="limit per GPU", disabled=no_gpu or not totals, indent=False,
                                    layout=whole, tooltip="a memory limit on each visible GPU (a logical device)")
        no_limit = no_gpu or not totals  # no card to size it by: no number shown, not a made-up one
        self.limit = w.IntSlider(value=min(4096, self._limit_max), min=1, max=self._limit_max,
                                 description="limit (MB)" if not no_limit else "limit (MB): no GPU",
                                 disabled=no_limit, readout=not no_limit, style=style,
                                 layout=w.Layout(width="480px"), continuous_update=False)
        self.split = w.Text(value="", placeholder="2  or  2048,2048", description="logical devices",
                            disabled=no_gpu, style=style)
        self.allocator = w.Dropdown(options=[_AS_IS, "bfc", "cuda_malloc_async"], value=_AS_IS,
                                    description="allocator", disabled=no_gpu, style=style)

    def _card_sizes_mb(self) -> list[int]:
        """Each GPU's size (MB) where the driver gave one: what a limit is bounded by."""
        return [m.total_bytes // MiB for m in self.state.gpu_memory.values() if m is not None]

    def _lab_controls(self, style: dict) -> None:
        """Lab mode and its limit, as the environment has them (on where no GPU is visible)."""
        host_mb = self.state.host_total_bytes // MiB
        lab_now = lab_limit_bytes(self.state.env)
        self.lab = w.Checkbox(description="lab mode", value=not self.state.gpus or lab_now is not None, indent=False,
                              layout=w.Layout(width="auto"),
                              tooltip="the CPU's allocator becomes TensorFlow's BFC allocator, with "
                                      "the limit beside: real OOMs and fragmentation without a GPU")
        self.lab_mb = w.IntSlider(value=min(lab_now // MiB if lab_now else DEFAULT_LAB_MB, host_mb), min=16,
                                  max=host_mb, step=16,
                                  description="lab limit (MB)", style=style, layout=w.Layout(width="480px"),
                                  continuous_update=False)  # checked and redrawn where the drag ends

    def _machine_note(self) -> str:
        """Why choices are off on this machine (no GPU, no card size to bound the limit); '' where none is."""
        if not self.state.gpus:
            return ("No GPU is visible to TensorFlow here: the GPU choices are off; lab mode runs "
                    "TensorFlow's own BFC allocator on the CPU.")
        if not self._card_sizes_mb():
            return f"The limit cannot be bounded by the card's size: {escape(self.state.nvml_note or '')}"
        return ""

    def _fit_controls(self, style: dict) -> None:
        """What fits, from a batch search: beside the limit it reads."""
        self.fits = w.HTML()
        self.fits.add_class("tfmem-fits")
        self.batch = w.BoundedIntText(value=1, min=1, max=1 << 40, description="batch", style=style,
                                      layout=w.Layout(width="260px"))
        self.needs = w.HTML()
        self.needs.add_class("tfmem-needs")
        self.use_needed = w.Button(description="set this limit", icon="arrow-up")
        self.picture = w.Image(format="png", layout=w.Layout(width="560px"))
        self.fit_box = w.VBox([self.fits, w.HBox([self.batch, self.use_needed]), self.needs, self.picture])
        self.fit_box.add_class("tfmem-fit-box")

    def _connect(self) -> None:
        """Every choice re-checked as it changes; the limit read and the batch typed redraw what fits."""
        for control in (self.gpus, self.growth, self.force_growth, self.use_limit, self.limit, self.split,
                        self.allocator, self.lab, self.lab_mb):
            control.observe(self._changed, names="value")
        for control in (self.limit, self.lab_mb, self.batch):
            control.observe(self._fits_changed, names="value")
        self.apply_button.on_click(lambda _: self.apply())
        self.use_needed.on_click(lambda _: self.set_needed_limit())

    def _layout(self) -> None:
        rows = [w.HTML("<b>TensorFlow device setup</b>"), self.note, self.gpus, self.growth, self.force_growth,
                self._limit_row]
        if self._search is not None and not self._reads_lab():
            rows.append(self.fit_box)
        rows += [self.split, self.allocator, self._lab_row]
        if self._search is not None and self._reads_lab():
            rows.append(self.fit_box)
        self.children = rows + [self.message, self.code, self.apply_button, self.result]

    # -- what fits, from a batch search ----------------------------------------------------
    @property
    def search(self):
        """The BatchSearch the panel reads (None: none)."""
        return self._search

    @search.setter
    def search(self, search) -> None:
        from ...search.batch_search import BatchSearch

        if search is not None and not isinstance(search, BatchSearch):
            raise ArgumentError(f"search must be what max_batch_size returns (a BatchSearch), got "
                                f"{type(search).__name__}.")
        self._search = search
        if search is not None:
            start = search.recommended or search.largest or search.low
            self._search_batch = max(1, int(start))  # the search's batch, until another is typed in
            self.batch.value = self._search_batch
        self._layout()
        self._fits_changed()

    def _reads_lab(self) -> bool:
        """Which limit the search's figures go with: lab mode's (a lab search, or no GPU here)."""
        return not self.state.gpus or bool(self._search is not None and self._search.lab)

    def chosen_limit_bytes(self) -> int:
        """The limit the panel's slider shows for the search: lab mode's, else the GPU limit's."""
        return (self.lab_mb.value if self._reads_lab() else self.limit.value) * MiB

    def needed_limit_mb(self) -> int | None:
        """The limit (MB) the batch in the `batch` box needs with its margin: by its measured peak where
        a probe trained at it, else by the search's plans or its line."""
        need = None if self._search is None else self._search.limit_needed_bytes(self.batch.value)
        return None if need is None else -(-need // MiB)  # whole MB

    def set_needed_limit(self) -> None:
        """Move the slider to the limit the chosen batch needs (lab mode's in steps of 16 MB)."""
        needed = self.needed_limit_mb()
        if needed is None:
            return
        if self._reads_lab():
            self.lab.value = True
            self.lab_mb.value = min(self.lab_mb.max, max(self.lab_mb.min, -(-needed // 16) * 16))
        else:
            self.use_limit.value = True
            self.limit.value = min(self.limit.max, max(self.limit.min, needed))

    def _fits_changed(self, change=None) -> None:
        """What fits at the chosen limit and what the batch in the box needs. A lab search's figures vary with
        the CPU (its probes' Keras steps): each is marked " (this CPU)", and the line on fitting that was not
        monotone is said in every run, with its count (search/search_text.py says why)."""
        search = self._search
        if search is None:
            return
        from ...text import marked

        def m(figure) -> str:
            return marked(figure if isinstance(figure, str) else f"{figure:,}", search.lab)

        limit = self.chosen_limit_bytes()
        kind = "lab limit" if self._reads_lab() else "GPU limit"
        if search.will_plan(limit):  # a probe search plans once, in a fresh process: said while it does
            self.fits.value = ("Planning the model's step in one fresh process, to read what fits away from the "
                               "search's limit ...")
        lines = self._fits_lines(search, limit, kind, m)
        if search.lab and self.state.gpus:
            lines.append("The search ran in lab mode (CPU kernels): a GPU's workspaces differ.")
        elif not search.lab and not self.state.gpus:
            lines.append("The search ran on a GPU; lab mode's CPU kernels need other figures.")
        self.fits.value = "<br>".join(lines)
        peak = search.measured_peak(self.batch.value)  # measured, else by the plans (made once) or the line
        need = peak if peak is not None else search.needs_bytes(self.batch.value)
        needed = self.needed_limit_mb()
        if needed is None:
            self.needs.value = ""
            self.use_needed.disabled = True
        else:
            from ...units import format_bytes

            batch = m(self.batch.value) if self.batch.value == self._search_batch else f"{self.batch.value:,}"
            self.needs.value = (f"A batch of {batch} needs {'' if peak else 'about '}{m(format_bytes(need))}"
                                f"{' (measured)' if peak else ''}: a {kind} of at "
                                f"least <b class='tfmem-needed-mb' data-mb='{needed}'>{needed:,} MB</b>"
                                + (" (this CPU)" if search.lab else "")
                                + (f" (with the margin of {search.margin:.0%})" if search.margin else "") + ".")
            self.use_needed.disabled = False
        self.picture.value = self._plot_png(limit)

    @staticmethod
    def _fits_lines(search, limit: int, kind: str, m) -> list[str]:
        """The panel's lines on what fits at `limit` (m: a figure, marked where the search's vary)."""
        from ...units import format_bytes

        batch = search.batch_for(limit)  # a probe search asked away from its edge plans first
        model = search.peak_model()
        if batch is None or (model is None and not search.plans and limit != search.limit_bytes):
            return [search.no_line_reason() or "The search measured no batch to read this limit from."]
        how = ("measured: the largest below every failure" if limit == search.limit_bytes and search.edge[1] else
               "by the search's plans, each placed in a fresh pool under this limit, bounded by the batches "
               "measured" + (" (plans of the step under XLA, which the model's step runs without: an estimate)"
                             if search.plans_estimate else "") if search.plans else
               f"the line through the search's peaks, {m(format_bytes(max(0, int(model[0]))))} + "
               f"{m(format_bytes(int(model[1])))} per example, bounded by the batches measured: an estimate, as the "
               "pool's regions under another limit are not the probes'")
        text = (f"At a {kind} of {limit // MiB:,} MB the largest batch is about <b class='tfmem-fits-batch' "
                f"data-batch='{batch}'>{batch:,}</b>{' (this CPU)' if search.lab else ''} ({how})")
        if search.margin:
            kept, measured_kept = search.within_margin(limit)
            if kept is None:
                text += (f"; no batch measured left a margin of {search.margin:.0%} free, the margin below every "
                         "failure")
            else:
                text += (f"; {m(kept)} with a margin of {search.margin:.0%} ("
                         + ("measured: its peaks left the margin free, the margin below every failure" if measured_kept
                            else "by the plans" if search.plans else "by the line") + ")")
        lines = [text + "."]
        largest = search.edge[0]
        measured = None if largest is None else search.measured_peak(largest)  # (the highest of its probes)
        if search.limit_bytes and measured is not None:
            spare = limit - measured
            lines.append(f"Measured: {m(largest)} trained under {format_bytes(search.limit_bytes)} with a peak of "
                         f"{m(format_bytes(measured))}; at this limit that leaves "
                         f"{m(format_bytes(spare, signed=True))} ({m(f'{spare / limit:+.0%}')} of the limit).")
        if search.limit_bytes and limit > search.limit_bytes:
            lines.append(f"Above the limit the probes ran under ({format_bytes(search.limit_bytes)}): the "
                         + ("plans are" if search.plans else "line is") + " extrapolated; search again at this "
                         "limit to measure.")
        if search.lab:  # whether a lab search's fitting was monotone varies by run: said in every run
            lines.append(f"Batches that ran out of memory although the same batch (in another process) or a larger "
                         f"one trained: {m(len(search.not_monotone))}: near the edge keep a margin.")
        elif search.not_monotone:
            lines.append("Near the edge fitting was not monotone: keep a margin.")
        return lines

    def _plot_png(self, limit: int) -> bytes:
        """The search's plot, the chosen batch and the chosen limit, as PNG bytes (no pyplot state)."""
        import io

        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 3.4), dpi=80)
        ax = fig.subplots()
        self._search.plot(ax=ax, pick=self.batch.value)
        ax.axhline(limit / MiB, color="#ff7f0e", linestyle="--", linewidth=1, label=f"chosen limit {limit // MiB:,} MB")
        ax.set_ylim(0, max(ax.get_ylim()[1], limit / MiB * 1.08))  # the chosen limit in view
        ax.legend(loc="upper left", fontsize=7)
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png")
        return buffer.getvalue()

    def refresh(self) -> None:
        """Read the process's state again if its runtime started since (after each cell)."""
        if self._own_state and not self.state.runtime_started and runtime_started():
            self.state = current_state()
            self._changed()

    # -- the request the controls describe ------------------------------------------------
    def request(self) -> SetupRequest:
        """The controls as a SetupRequest (raises ArgumentError on a malformed field)."""
        split_text = self.split.value.strip()
        split = None
        if split_text:
            try:
                split = parse_split(split_text)  # the rule %tfmem setup --split follows
            except ArgumentError as exc:
                raise ArgumentError(f"logical devices: {exc}; a count (2) or sizes in MB (2048,2048).") from None
        has_gpu = bool(self.state.gpus)
        current_visible = tuple(g.index for g in self.state.gpus if g.visible)
        return SetupRequest(
            growth={_AS_IS: None, "growth": True, "preallocate": False}[self.growth.value] if has_gpu else None,
            force_growth=True if (has_gpu and self.force_growth.value) else None,
            limit_mb=self.limit.value if (has_gpu and self.use_limit.value) else None,
            split=split if has_gpu else None,
            gpus=list(self.gpus.value) if has_gpu and tuple(self.gpus.value) != current_visible else None,
            allocator=None if (not has_gpu or self.allocator.value == _AS_IS) else self.allocator.value,
            lab_mb=self.lab_mb.value if self.lab.value else None,
        )

    def _changed(self, change=None) -> None:
        if self._own_state and not self.state.runtime_started and runtime_started():
            self.state = current_state()  # the runtime started since the panel was made
        self.lab_mb.disabled = not self.lab.value
        started = self.state.runtime_started
        try:
            request = self.request()
            plan = plan_setup(request, self.state)
        except TfmemError as exc:  # a malformed field, a rule broken, a runtime started: said in the panel
            self.message.value = f"<span class='tfmem-conflict' style='color:#b00'>&#9888; {escape(str(exc))}</span>"
            self.code.value = ""
            self.apply_button.disabled = True
            if started:
                self._explain_started(request if "request" in locals() else None)
            return
        self.apply_button.disabled = started or not plan.steps
        if not plan.steps:
            self.message.value = "<span class='tfmem-ok'>Nothing to change: this is the current setup.</span>"
            self.code.value = ""
        else:
            self.message.value = ("<span class='tfmem-ok' style='color:#080'>&#10003; TensorFlow's rules allow this. "
                                  "Apply runs:</span>")
            self.code.value = f"<pre class='tfmem-code'>{escape(plan.code())}</pre>"
        if started:
            self._explain_started(request)

    def _explain_started(self, request: SetupRequest | None) -> None:
        """After the runtime started: why Apply is off, and a ready snippet for a fresh kernel."""
        self.apply_button.disabled = True
        magic = request.as_magic() if request is not None and not request.is_empty() else "%tfmem setup ..."
        self.result.value = (
            "<span class='tfmem-started'>Apply is off: TensorFlow's runtime has already started in this kernel, "
            "and devices can only be set up before it starts. Restart the kernel, then run this first:</span>"
            f"<pre class='tfmem-restart'>%load_ext tfmem_widgets\n{escape(magic)}</pre>"
        )

    def apply(self):
        """Run the setup the controls describe; the result (or refusal) is shown below."""
        try:
            result = setup(**vars(self.request()))
        except TfmemError as exc:
            self.result.value = f"<span style='color:#b00'>{escape(str(exc))}</span>"
            return None
        self.result.value = f"<pre>{escape(repr(result))}</pre>"
        self.state = current_state()
        self._changed()
        return result

    def __repr__(self) -> str:
        text = "tfmem setup panel: " + _text(self.message.value)
        if self._search is not None:
            text += "\n" + "\n".join(_text(line) for line in self.fits.value.split("<br>"))
            if self.needs.value:
                text += "\n" + _text(self.needs.value)
        return text


def refresh_all() -> None:
    """After each cell: panels of this process follow its runtime's start."""
    for panel in list(_live):
        panel.refresh()


on_after_cell(refresh_all)


def _text(html: str) -> str:
    """The words of a bit of HTML, for the text repr."""
    import re
    from html import unescape

    return unescape(re.sub(r"<[^>]+>", "", html)).strip()
