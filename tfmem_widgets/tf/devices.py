"""TensorFlow's devices from its configuration, never starting its runtime: the physical GPUs with
their growth, logical devices and visibility, the logical devices each becomes, a device's name read."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import ArgumentError
from .runtime import tensorflow


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

    Raises ArgumentError naming the devices that exist when it is not one of them.
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
    raise ArgumentError(
        f"no device {device!r} in this process: TensorFlow's devices are {names}; "
        f"pass one of them (e.g. {devices[-1].name!r})."
    )


def xla_autotune_level(flags: str | None = None) -> str | None:
    """The level of XLA's GPU autotuner XLA_FLAGS sets (--xla_gpu_autotune_level=N, the last one given,
    as XLA reads its flags); None where it is not set (the default: on). flags: those of another process
    (default: this one's XLA_FLAGS)."""
    import os

    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    levels = [flag.split("=", 1)[1] for flag in flags.split() if flag.startswith("--xla_gpu_autotune_level=")]
    return levels[-1] if levels else None
