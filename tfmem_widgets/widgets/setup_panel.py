"""The device setup panel: the choices of %tfmem setup as controls, checked live.

Every change asks the same rules as ``%tfmem setup`` (plan.plan_setup) and shows either the
conflict, with its reason, or the exact TensorFlow code Apply will run.
"""

from __future__ import annotations

import weakref
from html import escape

import ipywidgets as w

from ..device_setup import current_state, setup
from ..errors import SetupError
from ..setup_rules import DEFAULT_LAB_MB, SetupRequest, parse_split, plan_setup
from ..runtime import lab_limit_bytes, runtime_started
from ..sampler import on_after_cell
from ..units import MiB
from .text_form import FullTextForm

_AS_IS = "as it is"
_live: "weakref.WeakSet[SetupPanel]" = weakref.WeakSet()


class SetupPanel(FullTextForm, w.VBox):
    """Choose GPUs, growth, limits, logical devices, allocator and lab mode; Apply.

    >>> tfmem_widgets.SetupPanel()      # or %tfmem panel
    """

    def __init__(self, state=None, **kwargs):
        """state: the machine to plan for (a plan.DeviceState); by default this process's."""
        super().__init__(**kwargs)
        self.add_class("tfmem-setup-panel")
        self._own_state = state is None  # this process's: read again once its runtime starts
        self.state = current_state() if state is None else state
        gpus = self.state.gpus
        totals = [m.total_bytes // MiB for m in self.state.gpu_memory.values() if m is not None]
        self._limit_max = min(totals) if totals else 1
        style = {"description_width": "130px"}
        no_gpu = not gpus
        self.gpus = w.SelectMultiple(
            options=[(f"GPU {g.index} {g.device_name}".strip(), g.index) for g in gpus],
            value=tuple(g.index for g in gpus if g.visible), description="GPUs", disabled=no_gpu, style=style)
        self.growth = w.ToggleButtons(options=[_AS_IS, "growth", "preallocate"], value=_AS_IS,
                                      description="memory growth", disabled=no_gpu, style=style)
        self.force_growth = w.Checkbox(description="force growth (TF_FORCE_GPU_ALLOW_GROWTH)", disabled=no_gpu,
                                       indent=False)
        self.use_limit = w.Checkbox(description="memory limit per GPU", disabled=no_gpu or not totals, indent=False)
        self.limit = w.IntSlider(value=min(4096, self._limit_max), min=1, max=self._limit_max,
                                 description="limit (MB)", disabled=no_gpu or not totals, style=style,
                                 layout=w.Layout(width="480px"))
        self.split = w.Text(value="", placeholder="2  or  2048,2048", description="logical devices",
                            disabled=no_gpu, style=style)
        self.allocator = w.Dropdown(options=[_AS_IS, "bfc", "cuda_malloc_async"], value=_AS_IS,
                                    description="allocator", disabled=no_gpu, style=style)
        host_mb = self.state.host_total_bytes // MiB
        lab_now = lab_limit_bytes(self.state.env)
        self.lab = w.Checkbox(description="lab mode (the CPU allocator becomes TensorFlow's BFC)",
                              value=no_gpu or lab_now is not None, indent=False)
        self.lab_mb = w.IntSlider(value=min(lab_now // MiB if lab_now else DEFAULT_LAB_MB, host_mb), min=16,
                                  max=host_mb, step=16,
                                  description="lab limit (MB)", style=style, layout=w.Layout(width="480px"))
        self.message = w.HTML()
        self.message.add_class("tfmem-setup-message")
        self.code = w.HTML()
        self.apply_button = w.Button(description="Apply", button_style="primary", icon="check")
        self.result = w.HTML()
        notes = []
        if no_gpu:
            notes.append("No GPU is visible to TensorFlow here: the GPU choices are off; lab mode runs "
                         "TensorFlow's own BFC allocator on the CPU.")
        elif not totals:
            notes.append(f"The limit cannot be bounded by the card's size: {escape(self.state.nvml_note or '')}")
        self.note = w.HTML("<br>".join(notes))
        self.children = [
            w.HTML("<b>TensorFlow device setup</b>"), self.note, self.gpus, self.growth, self.force_growth,
            w.HBox([self.use_limit, self.limit]), self.split, self.allocator, w.HBox([self.lab, self.lab_mb]),
            self.message, self.code, self.apply_button, self.result,
        ]
        for control in (self.gpus, self.growth, self.force_growth, self.use_limit, self.limit, self.split,
                        self.allocator, self.lab, self.lab_mb):
            control.observe(self._changed, names="value")
        self.apply_button.on_click(lambda _: self.apply())
        self._changed()
        if self._own_state:
            _live.add(self)

    def refresh(self) -> None:
        """Read the process's state again if its runtime started since (after each cell)."""
        if self._own_state and not self.state.runtime_started and runtime_started():
            self.state = current_state()
            self._changed()

    # -- the request the controls describe ------------------------------------------------
    def request(self) -> SetupRequest:
        """The controls as a SetupRequest (raises SetupError on a malformed field)."""
        split_text = self.split.value.strip()
        split = None
        if split_text:
            try:
                split = parse_split(split_text)  # the rule %tfmem setup --split follows
            except SetupError as exc:
                raise SetupError(f"logical devices: {exc}; a count (2) or sizes in MB (2048,2048).") from None
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
        except SetupError as exc:
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
            self.message.value = "<span class='tfmem-ok' style='color:#080'>&#10003; TensorFlow's rules allow this. Apply runs:</span>"
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
        except SetupError as exc:
            self.result.value = f"<span style='color:#b00'>{escape(str(exc))}</span>"
            return None
        self.result.value = f"<pre>{escape(repr(result))}</pre>"
        self.state = current_state()
        self._changed()
        return result

    def __repr__(self) -> str:
        return "tfmem setup panel: " + _text(self.message.value)


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
