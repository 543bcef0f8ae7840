"""Apply a device setup: read the state, ask the rules, change everything or nothing."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from . import nvml
from .devices import logical_cpu_count, physical_gpus
from .limits import host_total_bytes
from .nvml import driver_view
from .options import OPTION_NAMES, SetupRequest
from .runtime import ONEDNN_ENV, onednn_enabled, runtime_started, setup_env, setup_env_changed, tensorflow
from .setup_rules import DeviceState, SetupPlan, Step, plan_setup


def current_state() -> DeviceState:
    """The process's devices and their configuration; never starts TensorFlow's runtime."""
    gpus = tuple(physical_gpus())
    memory: dict[int, nvml.GpuMemory | None] = {}
    note = None
    if gpus:
        driver = driver_view(gpus)
        memory, note = driver.by_gpu, driver.note
    # The setup variables as TensorFlow read them at its start, not as the environment says now.
    env = {k: v for k, v in os.environ.items()}
    for name, value in setup_env().items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return DeviceState(
        gpus=gpus,
        gpu_memory=memory,
        nvml_note=note,
        cpu_logical=logical_cpu_count(),
        host_total_bytes=host_total_bytes(),
        env=env,
        runtime_started=runtime_started(),
        env_notes=tuple(setup_env_changed()),
    )


@dataclass(frozen=True)
class SetupResult:
    """What setup did, with the plain TensorFlow code that does the same."""

    plan: SetupPlan

    @property
    def changed(self) -> bool:
        return bool(self.plan.steps)

    @property
    def code(self) -> str:
        return self.plan.code()

    @property
    def lab_mb(self) -> int | None:
        return self.plan.lab_mb

    def __repr__(self) -> str:
        lines = []
        if self.changed:
            lines.append(f"tfmem setup: {len(self.plan.steps)} change(s) made before TensorFlow's runtime started.")
        else:
            lines.append("tfmem setup: already in effect, nothing changed.")
        if self.lab_mb is not None:
            lines.append(
                f"lab mode: TensorFlow's CPU allocator is its BFC allocator with a {self.lab_mb} MB limit."
            )
        lines += [f"note: {n}" for n in self.plan.notes]
        if self.changed:
            lines.append("Equivalent TensorFlow code:")
            lines += ["    " + line for line in self.code.splitlines()]
        return "\n".join(lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


class _Undo:
    """Collects the inverse of every change so a failure half-way restores everything."""

    def __init__(self):
        self._actions = []

    def add(self, action):
        self._actions.append(action)

    def run(self):
        for action in reversed(self._actions):
            action()


def _restore_env(name: str, previous: str | None):
    if previous is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = previous


def apply_steps(steps: Sequence[Step]) -> None:
    """Apply a plan's steps in order; on any failure (or Ctrl-C) undo what was done, then raise."""
    tf = tensorflow()
    gpus = tf.config.list_physical_devices("GPU")
    undo = _Undo()
    try:
        for step in steps:
            if step.kind == "env":
                previous = os.environ.get(step.target)
                os.environ[step.target] = step.value
                undo.add(lambda n=step.target, p=previous: _restore_env(n, p))
            elif step.kind == "visible":
                previous = tf.config.get_visible_devices("GPU")
                tf.config.set_visible_devices([gpus[i] for i in step.value], "GPU")
                undo.add(lambda p=previous: tf.config.set_visible_devices(p, "GPU"))
            elif step.kind == "growth":
                gpu = gpus[step.target]
                previous = tf.config.experimental.get_memory_growth(gpu)
                tf.config.experimental.set_memory_growth(gpu, step.value)
                undo.add(lambda g=gpu, p=previous: tf.config.experimental.set_memory_growth(g, p))
            elif step.kind == "logical":
                gpu = gpus[step.target]
                previous = tf.config.get_logical_device_configuration(gpu)
                tf.config.set_logical_device_configuration(
                    gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=mb) for mb in step.value]
                )
                undo.add(lambda g=gpu, p=previous: _restore_logical(g, p))
            elif step.kind == "cpus":
                cpu = tf.config.list_physical_devices("CPU")[0]
                previous = tf.config.get_logical_device_configuration(cpu)
                tf.config.set_logical_device_configuration(
                    cpu, [tf.config.LogicalDeviceConfiguration()] * step.value
                )
                undo.add(lambda c=cpu, p=previous: _restore_logical(c, p))
            else:  # pragma: no cover - plan_setup makes only the kinds above
                raise AssertionError(step.kind)
    except BaseException:
        undo.run()
        raise


def _restore_logical(device, previous):
    tf = tensorflow()
    if previous is not None:
        tf.config.set_logical_device_configuration(device, previous)
        return
    # tf.config has no call to remove a logical configuration; before the runtime starts
    # the context's map is the whole of it.
    from tensorflow.python.eager import context

    context.context()._virtual_device_map.pop(device, None)


def setup(
    *,
    lab_mb: int | None = None,
    gpus: Sequence[int] | None = None,
    growth: bool | None = None,
    force_growth: bool | None = None,
    limit_mb: int | Mapping[int, int] | None = None,
    split: int | Sequence[int] | None = None,
    allocator: str | None = None,
    reserve_mb: int | None = None,
    cpus: int | None = None,
) -> SetupResult:
    """Set TensorFlow's devices up, checked against its rules first; all or nothing.

    Call it before any TensorFlow work. Without a GPU and with no arguments it turns on
    lab mode (TensorFlow's real BFC allocator on the CPU, 1024 MB). Changes nothing and
    raises (one line: what is wrong and what to do) ArgumentError for a malformed option,
    SetupError when a rule is broken, StateError when the runtime has already started.

    >>> tfmem_widgets.setup(lab_mb=256)            # any machine: the real allocator, 256 MB
    >>> tfmem_widgets.setup(growth=True)           # every GPU grows its pool on demand
    >>> tfmem_widgets.setup(limit_mb=4096, split=2, force_growth=True)

    The keywords are the setup options (tf/options.py SETUP_OPTIONS), one each.
    """
    given = locals()
    request = SetupRequest(**{name: given[name] for name in OPTION_NAMES})
    onednn_off = _onednn_off_for_lab(request)
    try:
        plan = plan_setup(request, current_state())
        apply_steps(plan.steps)
    except BaseException:
        if onednn_off:
            os.environ.pop(ONEDNN_ENV, None)
            _forget_onednn_switch()
        raise
    if onednn_off:  # a change too, and the first line of its code (before TensorFlow is imported)
        switch = Step("env", ONEDNN_ENV, "0", f'os.environ["{ONEDNN_ENV}"] = "0"  # lab mode: oneDNN\'s kernels '
                      "off; before TensorFlow is imported")
        plan = replace(plan, steps=(switch, *plan.steps), notes=(*plan.notes, ONEDNN_OFF_NOTE))
    elif request.lab_mb is not None and "tensorflow" in sys.modules and onednn_enabled():
        plan = replace(plan, notes=(*plan.notes, ONEDNN_ON_NOTE))
    return SetupResult(plan)


ONEDNN_ON_NOTE = ("oneDNN's kernels stay on: TensorFlow was imported before this setup and read "
                  "TF_ENABLE_ONEDNN_OPTS then; in lab mode an OOM inside a oneDNN fused kernel (a Dense layer in a "
                  "tf.function or a Keras fit) kills the process with nothing said; restart and run the setup "
                  "before importing TensorFlow (or %tfmem record), or run such cells with %%tfmem fresh")


ONEDNN_OFF_NOTE = ("oneDNN's kernels off (TF_ENABLE_ONEDNN_OPTS=0, set before TensorFlow's import): in lab mode an "
                   "OOM inside a oneDNN fused kernel crashes the process, Eigen's kernels raise it, tf.data's do not")


def before_import(options: dict) -> None:
    """What setup(**options) does before TensorFlow's import, for a process that imports it before
    its setup (a warm probe, search/warm.py): lab mode's oneDNN switch."""
    _onednn_off_for_lab(SetupRequest(**options))


def _onednn_off_for_lab(request: SetupRequest) -> bool:
    """Lab mode asked before TensorFlow is imported, oneDNN not chosen by the user: turn its
    kernels off while it still can be (TensorFlow reads the switch at import)."""
    global onednn_switched_off
    if request.lab_mb is None or "tensorflow" in sys.modules or ONEDNN_ENV in os.environ:
        return False
    os.environ[ONEDNN_ENV] = "0"
    onednn_switched_off = True
    return True


def _forget_onednn_switch() -> None:
    global onednn_switched_off
    onednn_switched_off = False


onednn_switched_off = False  # this process's setup turned oneDNN off (a fresh process decides its own)
