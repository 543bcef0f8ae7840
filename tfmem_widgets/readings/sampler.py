"""Memory readings on a timer, for live gauges: one background thread for the whole process.

The thread never starts TensorFlow's runtime (before it has started there is nothing to
read, and starting it would end the user's chance to set devices up) and reads TensorFlow
only through ``get_memory_info``, serialized by one lock with every other read of ours.
Subscribers get each reading; the thread stops when the last one leaves, and at exit.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import ArgumentError, StateError
from ..tf import nvml
from ..tf.devices import logical_devices, physical_gpus
from ..tf.lab import lab_limit_bytes
from ..tf.limits import device_limit
from ..tf.nvml import driver_view
from ..tf.runtime import runtime_started
from .allocator import process_peak, read_allocator

DEFAULT_INTERVAL = 0.5
MIN_INTERVAL = 0.01  # a reading takes about a millisecond: faster would be a busy loop
MAX_INTERVAL = 3600.0


def check_interval(interval) -> float:
    """Seconds between readings, MIN_INTERVAL to MAX_INTERVAL; anything else is refused in one line."""
    import numbers

    if isinstance(interval, bool) or not isinstance(interval, numbers.Real):
        raise ArgumentError(f"the interval must be a number of seconds, got {interval!r}.")
    value = float(interval)
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:
        raise ArgumentError(
            f"the interval must be between {MIN_INTERVAL:g} and {MAX_INTERVAL:g} seconds, got {interval!r}."
        )
    return value


@dataclass(frozen=True)
class DeviceSample:
    name: str  # 'CPU:0', 'GPU:1'
    in_use_bytes: int | None
    peak_bytes: int | None
    limit_bytes: int | None


@dataclass(frozen=True)
class GpuSample:
    index: int  # TensorFlow's physical GPU index
    used_bytes: int
    total_bytes: int


@dataclass(frozen=True)
class Sample:
    """Everything a gauge shows, read at one moment."""

    time: float
    runtime_started: bool
    devices: tuple[DeviceSample, ...]
    gpus: tuple[GpuSample, ...]
    host_rss_bytes: int
    host_total_bytes: int

    def lines(self, device: str | None = None) -> list[str]:
        """The reading as text, a line per device (only `device` if given), then the cards."""
        from ..units import format_bytes

        out = []
        for d in self.devices:
            if device is None or d.name == device:
                out.append(f"{d.name}: in use {format_bytes(d.in_use_bytes)}, peak {format_bytes(d.peak_bytes)}, "
                           f"limit {format_bytes(d.limit_bytes)}")
        for gpu in self.gpus:
            out.append(f"GPU {gpu.index} (NVML): {format_bytes(gpu.used_bytes)} used of {format_bytes(gpu.total_bytes)}")
        if not self.runtime_started:
            out.append("TensorFlow's runtime has not started")
        return out


_read_lock = threading.Lock()
_static: dict | None = None  # devices and limits, fixed once the runtime has started


def _static_parts(background: bool) -> dict:
    """Devices, limits and the NVML mapping, cached once the runtime has started.

    TensorFlow's default GPU limit comes from device_lib, which creates device objects: that
    is left to the main thread (a gauge refreshes there after each cell); from the sampler
    thread the other figures are read and that limit waits.
    """
    global _static
    if _static is not None:
        return _static
    gpus = physical_gpus()
    devices = logical_devices(gpus)
    lab = lab_limit_bytes()  # what TensorFlow read when its runtime started
    started = runtime_started()
    limits = {d.name: device_limit(d, started, lab, main_thread=not background).bytes for d in devices}
    driver = driver_view(gpus, visible_only=True)
    mapping = {index: driver.nvml_index(index) for index in driver.by_gpu}
    parts = {"devices": [d.name for d in devices], "limits": limits,
             "nvml": {k: v for k, v in mapping.items() if v is not None}}
    complete = not background or all(v is not None for k, v in limits.items() if k.startswith("GPU"))
    if started and complete:
        _static = parts
    return parts


_PROCESS = None
_HOST_TOTAL = None


def _process(psutil):
    global _PROCESS
    if _PROCESS is None or _PROCESS.pid != os.getpid():
        _PROCESS = psutil.Process(os.getpid())
    return _PROCESS


def _host_total(psutil) -> int:
    global _HOST_TOTAL
    if _HOST_TOTAL is None:
        _HOST_TOTAL = psutil.virtual_memory().total
    return _HOST_TOTAL


def read_sample(background: bool = False) -> Sample:
    """One reading of every figure; never starts TensorFlow's runtime.

    background=True (the sampler's thread) reads only what is cheap and safe from a second
    thread: TensorFlow's device list and limits are first read on the main thread.
    """
    import psutil

    with _read_lock:
        started = runtime_started()
        devices: list[DeviceSample] = []
        gpus: list[GpuSample] = []
        if started:
            parts = _static_parts(background)
            for name in parts["devices"]:
                try:
                    in_use, peak = read_allocator(name)
                    peak = process_peak(name, peak)
                except StateError:
                    in_use = peak = None
                devices.append(DeviceSample(name, in_use, peak, parts["limits"].get(name)))
            nvml_indices = parts["nvml"]
        else:
            nvml_indices = {}
        for tf_index, nvml_index in nvml_indices.items():
            try:
                gpu = nvml.read_gpu(nvml_index)
            except Exception:  # the driver went away: show the rest
                continue
            gpus.append(GpuSample(tf_index, gpu.used_bytes, gpu.total_bytes))
        return Sample(time.time(), started, tuple(devices), tuple(gpus),
                      _process(psutil).memory_info().rss, _host_total(psutil))


class Sampler:
    """The process's one sampling thread, shared by every subscriber."""

    def __init__(self):
        self._lock = threading.Lock()
        self._subscribers: dict[int, tuple[Callable[[Sample], None], float]] = {}
        self._next_token = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._changed = threading.Event()  # a subscriber came or went: the shortest interval may differ
        self.errors = 0  # callbacks that raised (kept out of the user's log)
        self._mark_listeners: list[Callable[[str], object]] = []

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- marks: a moment worth seeing on what shows the readings (an epoch's end) ----------------
    def on_mark(self, listener: Callable[[str], object]) -> None:
        """Call `listener(label)` at each mark (a gauge draws it on its sparkline)."""
        with self._lock:
            if listener not in self._mark_listeners:
                self._mark_listeners.append(listener)

    def mark(self, label: str) -> int:
        """Mark this moment for every listener; returns how many marked it (each kept from the
        others' faults)."""
        with self._lock:
            listeners = list(self._mark_listeners)
        marked = 0
        for listener in listeners:
            try:
                marked += int(listener(label) or 0)
            except Exception:
                self.errors += 1
        return marked

    @property
    def subscriber_count(self) -> int:
        with self._lock:
            return len(self._subscribers)

    def subscribe(self, callback: Callable[[Sample], None], interval: float = DEFAULT_INTERVAL) -> int:
        interval = check_interval(interval)
        with self._lock:
            token = self._next_token
            self._next_token += 1
            self._subscribers[token] = (callback, interval)
            self._changed.set()
            if not self.running:
                # Each thread its own stop event: an old thread still winding down is never revived.
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="tfmem-sampler",
                                                daemon=True)
                self._thread.start()
        return token

    def set_interval(self, token: int, interval: float) -> None:
        """A subscriber's new interval, in effect from the next wait (the thread wakes now)."""
        interval = check_interval(interval)
        with self._lock:
            if token in self._subscribers:
                callback, _ = self._subscribers[token]
                self._subscribers[token] = (callback, interval)
                self._changed.set()

    def unsubscribe(self, token: int) -> None:
        with self._lock:
            self._subscribers.pop(token, None)
            self._changed.set()
            if self._subscribers:
                return
            # The last one: decided and stopped under the lock, so a subscriber that comes in
            # between starts a thread of its own.
            thread, self._thread = self._thread, None
            self._stop.set()
        self._join(thread)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (every subscriber is dropped)."""
        with self._lock:
            self._subscribers.clear()
            thread, self._thread = self._thread, None
            self._stop.set()
            self._changed.set()
        self._join(thread, timeout)

    @staticmethod
    def _join(thread: threading.Thread | None, timeout: float = 5.0) -> None:
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _interval(self) -> float:
        with self._lock:
            return min((i for _, i in self._subscribers.values()), default=DEFAULT_INTERVAL)

    def _run(self, stop: threading.Event) -> None:
        while True:
            # Wait the shortest interval, but wake when subscribers change (a 0.1 s gauge made
            # after a 600 s one must not wait 600 s for its first background reading).
            self._changed.clear()
            deadline = time.monotonic() + self._interval()
            while not stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                if self._changed.wait(left):
                    self._changed.clear()
                    deadline = min(deadline, time.monotonic() + self._interval())
            if stop.is_set():
                return
            try:
                sample = read_sample(background=True)
            except Exception:
                self.errors += 1
                continue
            with self._lock:
                callbacks = [cb for cb, _ in self._subscribers.values()]
            for callback in callbacks:
                if stop.is_set():
                    return
                try:
                    callback(sample)
                except Exception:
                    self.errors += 1


sampler = Sampler()
atexit.register(sampler.stop)
