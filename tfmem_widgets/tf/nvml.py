"""The driver's view of GPU memory, through NVML (package nvidia-ml-py, module pynvml).

NVML sees everything on a card: TensorFlow's pool, the CUDA context, other processes and
other libraries. Where there is no NVIDIA driver, ``read_gpus`` raises NvmlUnavailable with
one line saying so; callers show that line and go on with the rest.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import NvmlUnavailable

if TYPE_CHECKING:
    from .devices import PhysicalGpu


@dataclass(frozen=True)
class ProcessGpuMemory:
    pid: int
    used_bytes: int | None  # None where the driver does not report it (e.g. some containers)


@dataclass(frozen=True)
class GpuMemory:
    """One physical GPU as the driver sees it, in bytes."""

    index: int  # NVML's index (PCI order)
    name: str
    uuid: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: tuple[ProcessGpuMemory, ...]

    def process_bytes(self, pid: int) -> int | None:
        """What the driver counts for one process on this GPU (None: not listed)."""
        for proc in self.processes:
            if proc.pid == pid:
                return proc.used_bytes
        return None


_lock = threading.Lock()
_initialized = False
_failure: str | None = None


def _nvml():
    """pynvml, initialized once per process, or NvmlUnavailable."""
    global _initialized, _failure
    with _lock:
        if _failure is not None:
            raise NvmlUnavailable(_failure)
        try:
            import pynvml
        except ImportError:
            _failure = "NVML not available: the nvidia-ml-py package is not installed"
            raise NvmlUnavailable(_failure) from None
        if not _initialized:
            try:
                pynvml.nvmlInit()
            except pynvml.NVMLError as exc:
                _failure = f"NVML not available: no NVIDIA driver answered ({exc})"
                raise NvmlUnavailable(_failure) from None
            _initialized = True
        return pynvml


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_gpu(nvml_index: int) -> GpuMemory:
    """One GPU's memory and its processes, from the driver."""
    pynvml = _nvml()
    handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    try:
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        procs = []
    processes = tuple(
        ProcessGpuMemory(
            pid=int(p.pid),
            # pynvml turns the driver's "not available" marker into None.
            used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
        )
        for p in procs
    )
    return GpuMemory(
        index=nvml_index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        total_bytes=int(info.total),
        used_bytes=int(info.used),
        free_bytes=int(info.free),
        processes=processes,
    )


def read_gpus() -> list[GpuMemory]:
    """Every GPU the driver has, in NVML's order."""
    pynvml = _nvml()
    return [read_gpu(i) for i in range(pynvml.nvmlDeviceGetCount())]


def nvml_index_for_cuda_ordinal(ordinal: int, gpus: list[GpuMemory]) -> int | None:
    """Which NVML GPU a CUDA ordinal (= TensorFlow's physical GPU index) is.

    CUDA numbers the GPUs listed in CUDA_VISIBLE_DEVICES (indices or UUIDs) from 0; NVML
    ignores that variable. Returns None when the mapping cannot be known (e.g. MIG).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ordinal if ordinal < len(gpus) else None
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if ordinal >= len(entries):
        return None
    entry = entries[ordinal]
    if entry.isdigit():
        index = int(entry)
        return index if index < len(gpus) else None
    for gpu in gpus:
        if gpu.uuid == entry or (entry.startswith("GPU-") and gpu.uuid.startswith(entry)):
            return gpu.index
    return None


# -- the driver's reading for each of TensorFlow's GPUs ----------------------------------------

@dataclass(frozen=True)
class DriverView:
    """NVML's reading for each of TensorFlow's GPUs (by TensorFlow's index), and why not."""

    readings: tuple[GpuMemory, ...]  # every GPU the driver sees, in NVML's order
    by_gpu: dict[int, GpuMemory | None]
    note: str | None  # why NVML could not be read, if it could not

    def nvml_index(self, tf_index: int) -> int | None:
        memory = self.by_gpu.get(tf_index)
        return None if memory is None else memory.index


def driver_view(gpus: list[PhysicalGpu] | tuple[PhysicalGpu, ...], visible_only: bool = False) -> DriverView:
    """Map TensorFlow's GPUs (CUDA ordinals) to NVML's readings; a note when NVML is missing."""
    note = None
    try:
        readings = read_gpus()
    except NvmlUnavailable as exc:
        readings, note = [], str(exc)
    by_gpu: dict[int, GpuMemory | None] = {}
    for gpu in gpus:
        if visible_only and not gpu.visible:
            continue
        index = nvml_index_for_cuda_ordinal(gpu.index, readings)
        by_gpu[gpu.index] = readings[index] if index is not None else None
    return DriverView(tuple(readings), by_gpu, note)
