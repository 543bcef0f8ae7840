"""Readings, one home each: TensorFlow's allocator figures for a device, the limit a device
has (and where it comes from), and the driver's reading for each of TensorFlow's GPUs.

measure, report, the sampler and device setup read through here; none of them decides a
limit or maps a GPU to NVML on its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..tf import nvml
from ..errors import NvmlUnavailable, SetupError
from ..tf.runtime import LogicalDevice, PhysicalGpu, tensorflow
from ..units import MiB

_lock = threading.RLock()
_process_peak_seen: dict[str, int] = {}
_default_limits: dict[str, int] | None = None


# -- TensorFlow's allocator ------------------------------------------------------------------

def read_allocator(device: str) -> tuple[int, int]:
    """(in use, peak) bytes of the allocator behind `device`; starts the runtime if needed."""
    tf = tensorflow()
    try:
        info = tf.config.experimental.get_memory_info(device)
    except ValueError as exc:
        raise SetupError(
            f"TensorFlow keeps no allocator figures for {device} ({exc}); for the CPU, restart "
            "and run `%tfmem setup --lab 1024` first, so its allocator is the BFC allocator."
        ) from None
    return int(info["current"]), int(info["peak"])


def process_peak(device: str, allocator_peak: int) -> int:
    """The highest in-use figure of `device` in this process, across resets of TensorFlow's
    peak counter (measure() resets it; note_peak keeps what it had reached)."""
    with _lock:
        return max(allocator_peak, _process_peak_seen.get(device, 0))


def note_peak(device: str, peak: int) -> None:
    """Keep a peak TensorFlow's counter is about to forget (before reset_memory_stats)."""
    with _lock:
        _process_peak_seen[device] = max(peak, _process_peak_seen.get(device, 0))


# -- a device's limit ------------------------------------------------------------------------

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


# -- the driver (NVML) for TensorFlow's GPUs -------------------------------------------------

@dataclass(frozen=True)
class DriverView:
    """NVML's reading for each of TensorFlow's GPUs (by TensorFlow's index), and why not."""

    readings: tuple[nvml.GpuMemory, ...]  # every GPU the driver sees, in NVML's order
    by_gpu: dict[int, nvml.GpuMemory | None]
    note: str | None  # why NVML could not be read, if it could not

    def nvml_index(self, tf_index: int) -> int | None:
        memory = self.by_gpu.get(tf_index)
        return None if memory is None else memory.index


def driver_view(gpus: list[PhysicalGpu] | tuple[PhysicalGpu, ...], visible_only: bool = False) -> DriverView:
    """Map TensorFlow's GPUs (CUDA ordinals) to NVML's readings; a note when NVML is missing."""
    note = None
    try:
        readings = nvml.read_gpus()
    except NvmlUnavailable as exc:
        readings, note = [], str(exc)
    by_gpu: dict[int, nvml.GpuMemory | None] = {}
    for gpu in gpus:
        if visible_only and not gpu.visible:
            continue
        index = nvml.nvml_index_for_cuda_ordinal(gpu.index, readings)
        by_gpu[gpu.index] = readings[index] if index is not None else None
    return DriverView(tuple(readings), by_gpu, note)
