"""TensorFlow's process state, read without ever starting its runtime.

TensorFlow's device setup is possible only until its runtime starts (the first op,
``list_logical_devices``, ``get_memory_info``...). Everything here answers from the
configuration alone while the runtime has not started, so reading never takes that
chance away from the user.
"""

from __future__ import annotations

import importlib.abc
import os
import re
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import SetupError
from ..units import MiB

# Lab mode: TensorFlow's CPU allocator becomes its real BFC allocator with a limit.
LAB_USE_BFC_ENV = "TF_CPU_ALLOCATOR_USE_BFC"
LAB_LIMIT_ENV = "TF_CPU_BFC_MEM_LIMIT_IN_MB"
LAB_DEFAULT_LIMIT_MB = 64 * 1024  # TensorFlow's own default when only the switch is set
LAB_ALLOCATOR_NAME = "bfc_cpu_allocator_for_gpu"
GPU_ALLOCATOR_ENV = "TF_GPU_ALLOCATOR"
FORCE_GROWTH_ENV = "TF_FORCE_GPU_ALLOW_GROWTH"
MIN_SYS_MEMORY_ENV = "TF_DEVICE_MIN_SYS_MEMORY_IN_MB"
# Every variable setup may write: TensorFlow reads each once, when its runtime starts.
SETUP_ENV_VARS = (LAB_USE_BFC_ENV, LAB_LIMIT_ENV, GPU_ALLOCATOR_ENV, FORCE_GROWTH_ENV, MIN_SYS_MEMORY_ENV)


def tensorflow():
    """Import TensorFlow on first need (importing it does not start its runtime)."""
    import tensorflow as tf

    return tf


def runtime_started() -> bool:
    """Whether TensorFlow's runtime (its eager context) has started in this process."""
    if "tensorflow" not in sys.modules:
        return False
    from tensorflow.python.eager import context

    ctx = context.context_safe()
    # The handle exists from ensure_initialized() on; TensorFlow itself refuses device
    # changes from that moment ("... cannot be modified after being initialized").
    started = ctx is not None and getattr(ctx, "_context_handle", None) is not None
    if started and _read_at_start is None:
        _remember_setup_env(known=False)
    return started


# -- what TensorFlow read when its runtime started ---------------------------------------------
#
# TensorFlow reads the setup variables once, when its eager context is created (measured: a
# lab limit changed after tf.config.list_logical_devices() and before the first tensor has no
# effect). Figures about what is in force must come from that moment, not from the environment
# now, which the user may have changed since. The moment is caught by wrapping
# Context.ensure_initialized as soon as TensorFlow's context module exists.

_read_at_start: dict[str, str | None] | None = None
_read_at_start_known = False  # False: first seen after the start, so it may differ from what TF read
_remember_lock = threading.Lock()


def _remember_setup_env(known: bool) -> None:
    global _read_at_start, _read_at_start_known
    with _remember_lock:
        if _read_at_start is None:
            _read_at_start = {name: os.environ.get(name) for name in SETUP_ENV_VARS}
            _read_at_start_known = known


def _wrap_context(module) -> None:
    cls = getattr(module, "Context", None)
    original = getattr(cls, "ensure_initialized", None)
    if original is None or getattr(original, "_tfmem_wrapped", False):
        return

    def ensure_initialized(self):
        if self._context_handle is None:
            _remember_setup_env(known=True)
        return original(self)

    ensure_initialized._tfmem_wrapped = True
    ensure_initialized.__wrapped__ = original
    ensure_initialized.__doc__ = original.__doc__
    cls.ensure_initialized = ensure_initialized


_CONTEXT_MODULE = "tensorflow.python.eager.context"


class _ContextWatcher(importlib.abc.MetaPathFinder):
    """Wraps TensorFlow's context module the moment it is imported (and then leaves)."""

    def find_spec(self, name, path, target=None):
        if name != _CONTEXT_MODULE:
            return None
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:
            return spec

        def exec_and_wrap(module):
            _remember_import_env()
            exec_module(module)
            _wrap_context(module)

        loader.exec_module = exec_and_wrap
        return spec


ONEDNN_ENV = "TF_ENABLE_ONEDNN_OPTS"
_onednn_at_import: str | None = None
_onednn_known = False


def _remember_import_env() -> None:
    """TensorFlow reads TF_ENABLE_ONEDNN_OPTS once, while it is imported (measured: set after
    the import it changes nothing): remember the value it saw."""
    global _onednn_at_import, _onednn_known
    if not _onednn_known:
        _onednn_at_import, _onednn_known = os.environ.get(ONEDNN_ENV), True


def onednn_enabled() -> bool:
    """Whether TensorFlow's oneDNN kernels are on in this process (x86 Linux default), as read
    when TensorFlow was imported (or, before that, as it will read them)."""
    value = _onednn_at_import if _onednn_known else os.environ.get(ONEDNN_ENV)
    if not _onednn_known and "tensorflow" in sys.modules:
        value = os.environ.get(ONEDNN_ENV)  # imported before this package: the best guess
    return (value or "").strip().lower() not in ("0", "false")


def watch_runtime_start() -> None:
    """Remember the setup variables TensorFlow reads when its runtime starts (called on import)."""
    module = sys.modules.get(_CONTEXT_MODULE)
    if module is not None:
        _wrap_context(module)
        runtime_started()  # already started before this package was imported: remember now
    elif not any(isinstance(f, _ContextWatcher) for f in sys.meta_path):
        sys.meta_path.insert(0, _ContextWatcher())


def setup_env() -> dict[str, str | None]:
    """The setup variables in force: as TensorFlow read them when its runtime started, or, before
    that, as it will read them (the environment now)."""
    if runtime_started() and _read_at_start is not None:
        return dict(_read_at_start)
    return {name: os.environ.get(name) for name in SETUP_ENV_VARS}


def setup_env_changed() -> list[str]:
    """One line per setup variable changed in the environment since TensorFlow read it."""
    if not runtime_started() or _read_at_start is None:
        return []
    lines = []
    for name, then in _read_at_start.items():
        now = os.environ.get(name)
        if now != then:
            was = "unset" if then is None else repr(then)
            lines.append(
                f"{name} is {'unset' if now is None else repr(now)} in the environment now, but TensorFlow "
                f"read it ({was}) when its runtime started and keeps that until the process restarts"
                + ("" if _read_at_start_known else " (as first seen here, after the start)")
            )
    return lines


# -- lab mode as TensorFlow reads it ---------------------------------------------------------

_BOOL_TRUE = ("1", "true")
_BOOL_FALSE = ("0", "false")
_INT_PREFIX = re.compile(r"\s*([+-]?)(\d*)")
_INT_CLEAN = re.compile(r"\s*[+-]?\d+\s*")


@dataclass(frozen=True)
class LabSetting:
    """What TensorFlow makes of TF_CPU_ALLOCATOR_USE_BFC and TF_CPU_BFC_MEM_LIMIT_IN_MB.

    Measured on TensorFlow 2.21 (tests/test_environment.py checks it against TensorFlow): the
    switch takes 1, 0, true or false in any case and nothing else (not ' true', 'yes', 'on');
    the limit is read as the whole number at its start ('64MB' is 64, '32.5' is 32, ' 64' and
    '+64' are 64), although TensorFlow logs that it uses its default; a limit of 0 (also '',
    'abc', '0x40') makes the process crash at its first allocation; a negative one is no limit.
    """

    enabled: bool
    limit_mb: int | None  # the limit TensorFlow enforces, in MB; None: no practical limit
    problems: tuple[str, ...] = ()  # one line each: a value TensorFlow reads otherwise than written

    @property
    def limit_bytes(self) -> int | None:
        if not self.enabled:
            return None
        return None if self.limit_mb is None else self.limit_mb * MiB

    @property
    def crashes(self) -> bool:
        """TensorFlow's process dies (segmentation fault) at its first allocation."""
        return self.enabled and self.limit_mb == 0

    def describe(self) -> str:
        if not self.enabled:
            return "TensorFlow's default CPU allocator"
        if self.limit_mb is None:
            return "lab mode with no practical limit"
        return f"lab mode with {self.limit_mb} MB"


def lab_setting(env: Mapping[str, str | None] | None = None) -> LabSetting:
    """Lab mode as TensorFlow reads `env` (default: the variables in force, see setup_env)."""
    env = setup_env() if env is None else env
    problems = []
    switch = env.get(LAB_USE_BFC_ENV)
    enabled = False
    if switch is not None:
        if switch.lower() in _BOOL_TRUE:
            enabled = True
        elif switch.lower() not in _BOOL_FALSE:
            problems.append(
                f"{LAB_USE_BFC_ENV}={switch!r} is not a value TensorFlow reads (1, 0, true or false, "
                "nothing around them): it keeps its default CPU allocator, so lab mode is off"
            )
    raw = env.get(LAB_LIMIT_ENV)
    limit: int | None = LAB_DEFAULT_LIMIT_MB
    if raw is not None:
        sign, digits = _INT_PREFIX.match(raw).groups()
        value = int(sign + digits) if digits else 0
        if value < 0 or value * MiB >= 1 << 63:
            limit = None
        else:
            limit = value
        if not enabled:
            pass
        elif limit is None:
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r}: TensorFlow takes {'a negative' if value < 0 else 'so large a'} "
                "limit as no practical limit, so no OOM will come from lab mode"
            )
        elif limit == 0:
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r} is read by TensorFlow as 0 MB: its process crashes (segmentation "
                "fault) at the first allocation; give a whole number of MB, e.g. 256"
            )
        elif not _INT_CLEAN.fullmatch(raw):
            problems.append(
                f"{LAB_LIMIT_ENV}={raw!r} is not a whole number of MB: TensorFlow enforces {limit} MB (the "
                f"number it reads at the start), although its log says it uses its default of "
                f"{LAB_DEFAULT_LIMIT_MB}"
            )
    return LabSetting(enabled, limit, tuple(problems))


def lab_limit_bytes(env: Mapping[str, str | None] | None = None) -> int | None:
    """The CPU BFC allocator's limit if lab mode is configured, else None (see lab_setting).

    With no practical limit (a negative one), this is the limit as TensorFlow holds it.
    """
    setting = lab_setting(env)
    if not setting.enabled:
        return None
    return setting.limit_bytes if setting.limit_mb is not None else (1 << 64) - 1


@dataclass(frozen=True)
class PhysicalGpu:
    """One GPU as TensorFlow lists it, with its current (not yet applied) configuration."""

    index: int
    name: str  # TensorFlow's physical device name, e.g. /physical_device:GPU:0
    device_name: str  # the product name, e.g. NVIDIA H200 ('' where TensorFlow gives none)
    compute_capability: tuple[int, int] | None
    visible: bool
    growth: bool
    logical_limits_mb: tuple[int, ...] | None  # None: no logical devices configured


def physical_gpus() -> list[PhysicalGpu]:
    """The GPUs TensorFlow sees, with growth / logical devices / visibility as configured."""
    tf = tensorflow()
    gpus = tf.config.list_physical_devices("GPU")
    visible = set(d.name for d in tf.config.get_visible_devices("GPU"))
    found = []
    for index, gpu in enumerate(gpus):
        details = tf.config.experimental.get_device_details(gpu)
        logical = tf.config.get_logical_device_configuration(gpu)
        found.append(
            PhysicalGpu(
                index=index,
                name=gpu.name,
                device_name=details.get("device_name", ""),
                compute_capability=details.get("compute_capability"),
                visible=gpu.name in visible,
                growth=bool(tf.config.experimental.get_memory_growth(gpu)),
                logical_limits_mb=(
                    None if logical is None else tuple(int(c.memory_limit) for c in logical)
                ),
            )
        )
    return found


def logical_cpu_count() -> int:
    tf = tensorflow()
    cpu = tf.config.list_physical_devices("CPU")[0]
    logical = tf.config.get_logical_device_configuration(cpu)
    return len(logical) if logical else 1


@dataclass(frozen=True)
class LogicalDevice:
    """A device TensorFlow places tensors on, e.g. ``GPU:1``, and the GPU it lives on."""

    name: str  # short form: 'CPU:0', 'GPU:1'
    device_type: str  # 'CPU' or 'GPU'
    physical_index: int | None  # the physical GPU's index (None for CPUs)
    limit_mb: int | None  # a configured logical-device limit, if any


def logical_devices(gpus: list[PhysicalGpu] | None = None) -> list[LogicalDevice]:
    """The devices the runtime has, or will have once it starts, in TensorFlow's order.

    Computed from the configuration, so it never starts the runtime: each visible GPU
    becomes one logical device, or as many as its logical configuration lists.
    """
    devices = [LogicalDevice(f"CPU:{i}", "CPU", None, None) for i in range(logical_cpu_count())]
    gpus = physical_gpus() if gpus is None else gpus
    ordinal = 0
    for gpu in gpus:
        if not gpu.visible:
            continue
        limits = gpu.logical_limits_mb or (None,)
        for limit in limits:
            devices.append(LogicalDevice(f"GPU:{ordinal}", "GPU", gpu.index, limit))
            ordinal += 1
    return devices


_DEVICE_RE = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu)(?::(\d+))?$", re.IGNORECASE)


def resolve_device(device: str | None) -> LogicalDevice:
    """Turn 'gpu', '/GPU:1', '/device:CPU:0' or None (first GPU, else CPU) into a device.

    Raises SetupError naming the devices that exist when it is not one of them.
    """
    devices = logical_devices()
    if device is None:
        gpus = [d for d in devices if d.device_type == "GPU"]
        return gpus[0] if gpus else devices[0]
    match = _DEVICE_RE.match(str(device).strip())
    wanted = None
    if match:
        wanted = f"{match.group(1).upper()}:{match.group(2) or 0}"
        for candidate in devices:
            if candidate.name == wanted:
                return candidate
    names = ", ".join(d.name for d in devices)
    raise SetupError(
        f"no device {device!r} in this process: TensorFlow's devices are {names}; "
        f"pass one of them (e.g. {devices[-1].name!r})."
    )
