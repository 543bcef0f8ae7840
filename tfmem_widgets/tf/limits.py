"""The limit of an allocator or a device, where it comes from, and what the hardware has above it.

One home for "how much may this allocator hold": lab mode's limit for the CPU, a logical device's
own limit, or TensorFlow's default for a GPU (read once its runtime has started); the card's size
(NVML) or the host's memory as the capacity a limit is set below; and the limits a fresh process's
setup gives (a dump read after that process has gone, two probes side by side).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..units import MiB
from .allocator import LAB_ALLOCATOR_NAME, allocator_of_device, gpu_ordinal
from .devices import LogicalDevice, logical_devices, physical_gpus, resolve_device
from .lab import lab_limit_bytes
from .options import FORCE_GROWTH_ENV
from .runtime import runtime_started, setup_env

# Where a limit below the hardware was set by the user (an OOM under it is the verdict 'limit').
CAPPED_SOURCES = ("lab mode", "logical device limit", "memory fraction")

_default_limits: dict[str, int] | None = None


def tensorflow_default_limits() -> dict[str, int]:
    """TensorFlow's memory limit per GPU device, as it created them (runtime started only).

    device_lib lists each device with the limit TensorFlow computed; the figures cannot
    change once the runtime has started, so they are read once. It creates device objects:
    call it on the main thread.
    """
    global _default_limits
    if _default_limits is None:
        from tensorflow.python.client import device_lib

        _default_limits = {
            d.name.split("device:")[-1]: int(d.memory_limit)
            for d in device_lib.list_local_devices()
            if d.device_type == "GPU"
        }
    return _default_limits


@dataclass(frozen=True)
class DeviceLimit:
    bytes: int | None  # None: not known (yet)
    source: str  # where it comes from, in words


def device_limit(device: LogicalDevice, started: bool, lab_limit: int | None,
                 main_thread: bool = True) -> DeviceLimit:
    """The memory limit of one logical device: lab mode's for the CPU, a logical device's own,
    or TensorFlow's default (read once the runtime has started, and only on the main thread)."""
    if device.device_type == "CPU":
        return DeviceLimit(lab_limit, "lab mode") if lab_limit is not None else DeviceLimit(None, "none enforced")
    if device.limit_mb is not None:
        return DeviceLimit(device.limit_mb * MiB, "logical device limit")
    if not started:
        return DeviceLimit(None, "set when the runtime starts")
    if not main_thread:
        return DeviceLimit(None, "TensorFlow's default")
    return DeviceLimit(tensorflow_default_limits().get(device.name), "TensorFlow's default")


def limit_of(device: str | None = None) -> DeviceLimit:
    """The limit of a device of this process by name ('GPU:0', 'CPU:0'; None: the first GPU, else the CPU)."""
    return device_limit(resolve_device(device), runtime_started(), lab_limit_bytes())


def allocator_growth() -> dict[str, bool]:
    """Whether each allocator grows its pool on demand (lab mode's always does; a GPU's with growth,
    or TF_FORCE_GPU_ALLOW_GROWTH=true); one that does not takes its whole limit at its first use."""
    growth = {LAB_ALLOCATOR_NAME: True}
    forced = setup_env().get(FORCE_GROWTH_ENV) == "true"
    gpus = {g.index: g for g in physical_gpus()}
    for device in logical_devices(list(gpus.values())):
        if device.device_type == "GPU":
            gpu = gpus[device.physical_index]
            growth[allocator_of_device(device.name)] = forced or (gpu.growth and gpu.logical_limits_mb is None)
    return growth


def host_total_bytes() -> int:
    """The host's memory: what lab mode's limit is set below."""
    import psutil

    return psutil.virtual_memory().total


@dataclass(frozen=True)
class AllocatorLimit:
    """An allocator's limit and its source, and the capacity above it (the card, the host)."""

    limit_bytes: int | None
    source: str
    capacity_bytes: int | None = None
    capacity_source: str = ""


def allocator_limit(allocator: str) -> AllocatorLimit:
    """The limit of an allocator of this process (by TensorFlow's name), and what has more."""
    if allocator == LAB_ALLOCATOR_NAME:
        return AllocatorLimit(lab_limit_bytes(), "lab mode", host_total_bytes(), "host's memory")
    ordinal = gpu_ordinal(allocator)
    devices = [d for d in logical_devices() if d.device_type == "GPU"]
    if ordinal is None or ordinal >= len(devices):
        return AllocatorLimit(None, "unknown")
    device = devices[ordinal]
    limit = device_limit(device, runtime_started(), None)
    capacity = None
    try:
        from .nvml import driver_view

        memory = driver_view(physical_gpus()).by_gpu.get(device.physical_index)
        capacity = None if memory is None else memory.total_bytes
    except Exception:  # the driver's figure is extra: never fail a limit for it
        pass
    return AllocatorLimit(limit.bytes, limit.source, capacity, "card" if capacity is not None else "")


def setup_gpu_mb(setup: Mapping | None, index: int) -> int | None:
    """The MB a fresh process's setup() lets GPU `index` hold, its logical devices' limits together:
    split's sizes summed, else its limit (one for every GPU, or its own); None where the setup sets none
    (a split into a count without a limit divides the memory that process finds free).

    >>> setup_gpu_mb({"split": [1024, 2048]}, 0)
    3072
    """
    setup = setup or {}
    split, limit = setup.get("split"), setup.get("limit_mb")
    if isinstance(split, (list, tuple)):
        return sum(split)
    mb = limit.get(index) if isinstance(limit, Mapping) else limit
    return mb or None


def setup_device_mb(setup: Mapping | None, ordinal: int) -> int | None:
    """The MB limit a fresh process's setup() gives its logical GPU `ordinal` (TensorFlow numbers the
    logical devices GPU after GPU, over the GPUs in use); None where the setup sets none."""
    setup = setup or {}
    split = setup.get("split")
    sizes = list(split) if isinstance(split, (list, tuple)) else None
    per_gpu = len(sizes) if sizes else (split or 1)
    position, part = divmod(ordinal, per_gpu)
    in_use = setup.get("gpus")
    if in_use is not None:
        in_use = sorted(in_use)
        if position >= len(in_use):
            return None
    index = position if in_use is None else in_use[position]
    if sizes:
        return sizes[part]
    mb = setup_gpu_mb(setup, index)
    return None if mb is None else mb // per_gpu


def setup_limit(setup: Mapping | None, allocator: str) -> tuple[int | None, str]:
    """The limit a setup() of a fresh process gave an allocator (a dump does not carry it)."""
    setup = setup or {}
    if allocator == LAB_ALLOCATOR_NAME and setup.get("lab_mb"):
        return setup["lab_mb"] * MiB, "lab mode"
    ordinal = gpu_ordinal(allocator)
    mb = None if ordinal is None else setup_device_mb(setup, ordinal)
    if mb:
        return mb * MiB, "logical device limit"
    return None, "unknown"
