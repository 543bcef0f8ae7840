"""One reading of every memory figure that matters: TensorFlow's, the driver's, the host's.

``report()`` never starts TensorFlow's runtime: before it has started, TensorFlow's columns
say so and setup is still possible.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from html import escape

import psutil

from ..errors import StateError
from ..text import LinesText
from ..tf import nvml
from ..tf.devices import LogicalDevice, PhysicalGpu, logical_devices, physical_gpus
from ..tf.lab import lab_setting
from ..tf.limits import device_limit
from ..tf.nvml import driver_view
from ..tf.runtime import runtime_started, setup_env_changed, tensorflow
from ..tf.system_reserve import reserve_behind_limit
from ..units import format_bytes
from .allocator import process_peak, read_allocator


@dataclass(frozen=True)
class DeviceReading:
    """TensorFlow's allocator figures for one logical device (None: not known yet)."""

    name: str
    limit_bytes: int | None
    limit_source: str
    in_use_bytes: int | None
    peak_bytes: int | None
    note: str | None = None


@dataclass(frozen=True)
class GapItem:
    bytes: int
    label: str


@dataclass(frozen=True)
class GpuSection:
    """A physical GPU: the driver's figures, TensorFlow's devices on it, and the gap."""

    index: int
    device_name: str
    compute_capability: tuple[int, int] | None
    memory: nvml.GpuMemory | None
    process_bytes: int | None  # what the driver counts for this process on the card
    devices: tuple[DeviceReading, ...]
    gap: tuple[GapItem, ...]  # sums to total - TensorFlow's limits; empty if unknown

    @property
    def limit_bytes(self) -> int | None:
        limits = [d.limit_bytes for d in self.devices]
        return None if not limits or None in limits else sum(limits)


@dataclass(frozen=True, repr=False)
class MemoryReport(LinesText):
    tensorflow_version: str
    runtime_started: bool
    lab_limit_bytes: int | None
    cpus: tuple[DeviceReading, ...]
    gpus: tuple[GpuSection, ...]
    host_rss_bytes: int
    host_total_bytes: int
    nvml_note: str | None
    notes: tuple[str, ...] = ()  # the environment against what TensorFlow read from it

    def _header(self) -> str:
        state = "runtime started" if self.runtime_started else (
            "runtime not started yet: setup is still possible, figures appear after the first op"
        )
        if self.lab_limit_bytes is None:
            mode = ""
        elif self.lab_limit_bytes >= 1 << 63:
            mode = "; lab mode: the CPU allocator is TensorFlow's BFC allocator, no practical limit"
        else:
            mode = f"; lab mode: the CPU allocator is TensorFlow's BFC allocator, limit {format_bytes(self.lab_limit_bytes)}"
        return f"tfmem report (TensorFlow {self.tensorflow_version}; {state}{mode})"

    @staticmethod
    def _device_line(d: DeviceReading) -> str:
        line = (
            f"{d.name:<7} in use {format_bytes(d.in_use_bytes):>10}   peak {format_bytes(d.peak_bytes):>10}   "
            f"limit {format_bytes(d.limit_bytes):>10} ({d.limit_source})"
        )
        return line + (f"; {d.note}" if d.note else "")

    def lines(self) -> list[str]:
        out = [self._header()]
        out += [self._device_line(d) for d in self.cpus]
        for gpu in self.gpus:
            cc = f", compute capability {gpu.compute_capability[0]}.{gpu.compute_capability[1]}" if gpu.compute_capability else ""
            head = f"GPU {gpu.index} ({gpu.device_name or 'GPU'}{cc})"
            if gpu.memory is not None:
                head += (
                    f": {format_bytes(gpu.memory.total_bytes)} in all, "
                    f"{format_bytes(gpu.memory.used_bytes)} used (NVML)"
                )
                if gpu.process_bytes is not None:
                    head += f", this process {format_bytes(gpu.process_bytes)}"
            out.append(head)
            out += ["  " + self._device_line(d) for d in gpu.devices]
            if gpu.gap:
                total = sum(item.bytes for item in gpu.gap)
                out.append(f"  between the card and TensorFlow's limit: {format_bytes(total)}")
                out += [f"    {format_bytes(item.bytes):>10}  {item.label}" for item in gpu.gap]
        out.append(
            f"host: this process {format_bytes(self.host_rss_bytes)} resident, "
            f"machine {format_bytes(self.host_total_bytes)}"
        )
        if self.nvml_note:
            out.append(self.nvml_note)
        out += [f"note: {n}" for n in self.notes]
        return out

    def _repr_html_(self) -> str:
        rows = []

        def row(cells, tag="td"):
            rows.append("<tr>" + "".join(f"<{tag}>{escape(str(c))}</{tag}>" for c in cells) + "</tr>")

        row(["device", "TensorFlow in use", "TensorFlow peak", "TensorFlow limit", "physical (NVML)"], "th")
        for d in self.cpus:
            row([d.name, format_bytes(d.in_use_bytes), format_bytes(d.peak_bytes),
                 f"{format_bytes(d.limit_bytes)} ({d.limit_source})", "-"])
        for gpu in self.gpus:
            physical = (
                f"{format_bytes(gpu.memory.used_bytes)} used of {format_bytes(gpu.memory.total_bytes)}"
                if gpu.memory else "-"
            )
            for d in gpu.devices:
                row([f"{d.name} (GPU {gpu.index})", format_bytes(d.in_use_bytes), format_bytes(d.peak_bytes),
                     f"{format_bytes(d.limit_bytes)} ({d.limit_source})", physical])
        details = []
        for gpu in self.gpus:
            if gpu.gap:
                items = "".join(f"<li>{format_bytes(i.bytes)}: {escape(i.label)}</li>" for i in gpu.gap)
                details.append(f"<p>GPU {gpu.index}: between the card and TensorFlow's limit</p><ul>{items}</ul>")
        foot = [escape(self._header()),
                escape(f"host: this process {format_bytes(self.host_rss_bytes)} resident")]
        if self.nvml_note:
            foot.append(escape(self.nvml_note))
        foot += [escape(f"note: {n}") for n in self.notes]
        return (
            "<div class='tfmem-report'><table>" + "".join(rows) + "</table>" + "".join(details)
            + "".join(f"<p>{f}</p>" for f in foot) + "</div>"
        )


def _reading(device: LogicalDevice, started: bool, lab_limit: int | None) -> DeviceReading:
    known = device_limit(device, started, lab_limit)
    limit, source = known.bytes, known.source
    if not started:
        return DeviceReading(device.name, limit, source, None, None)
    note = None
    try:
        in_use, peak = read_allocator(device.name)
        peak = process_peak(device.name, peak)
        if device.device_type == "CPU" and lab_limit is None:
            note = "not lab mode: small tensors may be left out"
    except StateError:
        in_use = peak = None
        note = "no allocator figures outside lab mode"
    return DeviceReading(device.name, limit, source, in_use, peak, note)


def _gap(gpu: PhysicalGpu, memory: nvml.GpuMemory | None, limit: int | None, pid: int) -> tuple[GapItem, ...]:
    """Why TensorFlow may use less than the card has, in bytes that add up exactly."""
    if memory is None or limit is None:
        return ()
    gap = memory.total_bytes - limit
    if gpu.logical_limits_mb is not None:
        return (GapItem(gap, f"left out by the limits set ({sum(gpu.logical_limits_mb)} MB in logical devices)"),)
    cc_major = gpu.compute_capability[0] if gpu.compute_capability else None
    reserve, why = reserve_behind_limit(limit, cc_major)  # TensorFlow's default: free when it made the device - reserve
    if reserve is None or reserve > gap:
        return (GapItem(gap, "not given to TensorFlow (reserve unknown)"),)
    items = [GapItem(reserve, why)]
    in_use_then = gap - reserve
    others = sum(p.used_bytes or 0 for p in memory.processes if p.pid != pid)
    if 0 < others <= in_use_then:
        items.append(GapItem(others, "other processes (their use now, per NVML)"))
        in_use_then -= others
    items.append(GapItem(in_use_then, "in use when TensorFlow created the device: driver, CUDA context, other libraries"))
    return tuple(items)


def _unused_gpus_note(readings: list[nvml.GpuMemory], gpus: list[PhysicalGpu]) -> str:
    """One line for a machine whose driver sees GPUs that TensorFlow does not use, and why."""
    names = ", ".join(sorted({g.name for g in readings}))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpus:
        why = "setup hid them (--gpus none / tf.config.set_visible_devices)"
    elif visible is not None and visible.strip() in ("", "-1"):
        why = f"CUDA_VISIBLE_DEVICES={visible!r} hides them from TensorFlow"
    elif not tensorflow().test.is_built_with_cuda():
        why = "this TensorFlow has no GPU support (install tensorflow[and-cuda] for it)"
    else:
        why = "TensorFlow found no usable GPU: its CUDA libraries did not load (see its start-up log)"
    return f"NVML sees {len(readings)} GPU(s) ({names}), none in use by TensorFlow here: {why}"


def report() -> MemoryReport:
    """Read every figure now. Never starts TensorFlow's runtime.

    >>> tfmem_widgets.report()      # or %tfmem in a notebook
    """
    tf = tensorflow()
    started = runtime_started()
    lab = lab_setting()  # as TensorFlow read it when its runtime started, not the environment now
    lab_limit = lab.limit_bytes
    gpus = physical_gpus()
    devices = logical_devices(gpus)
    pid = os.getpid()
    driver = driver_view(gpus, visible_only=True)
    readings = list(driver.readings)
    nvml_note = driver.note
    cpus = tuple(_reading(d, started, lab_limit) for d in devices if d.device_type == "CPU")
    sections = []
    for gpu in gpus:
        if not gpu.visible:
            continue
        memory = driver.by_gpu.get(gpu.index)
        on_gpu = tuple(
            _reading(d, started, lab_limit) for d in devices if d.physical_index == gpu.index
        )
        limits = [d.limit_bytes for d in on_gpu]
        limit = None if None in limits else sum(limits)
        sections.append(
            GpuSection(
                index=gpu.index,
                device_name=gpu.device_name,
                compute_capability=gpu.compute_capability,
                memory=memory,
                process_bytes=memory.process_bytes(pid) if memory else None,
                devices=on_gpu,
                gap=_gap(gpu, memory, limit, pid),
            )
        )
    if readings and not sections:
        nvml_note = _unused_gpus_note(readings, gpus)
    return MemoryReport(
        tensorflow_version=tf.__version__,
        runtime_started=started,
        lab_limit_bytes=lab_limit,
        cpus=cpus,
        gpus=tuple(sections),
        host_rss_bytes=psutil.Process(pid).memory_info().rss,
        host_total_bytes=psutil.virtual_memory().total,
        nvml_note=nvml_note,
        notes=tuple(lab.problems) + tuple(setup_env_changed()),
    )
