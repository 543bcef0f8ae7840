"""TensorFlow's process state, read without ever starting its runtime.

TensorFlow's device setup is possible only until its runtime starts (the first op,
``list_logical_devices``, ``get_memory_info``...). Everything here answers from the
configuration alone while the runtime has not started, so reading never takes that
chance away from the user.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass

from .errors import SetupError
from .units import MiB

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
    return ctx is not None and getattr(ctx, "_context_handle", None) is not None


def lab_limit_bytes(env=None) -> int | None:
    """The CPU BFC allocator's limit if lab mode is configured, else None."""
    env = os.environ if env is None else env
    if env.get(LAB_USE_BFC_ENV, "").strip().lower() not in ("1", "true"):
        return None
    raw = env.get(LAB_LIMIT_ENV, "").strip()
    try:
        return int(raw) * MiB if raw else LAB_DEFAULT_LIMIT_MB * MiB
    except ValueError:
        return LAB_DEFAULT_LIMIT_MB * MiB


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
