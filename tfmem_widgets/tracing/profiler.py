"""TensorFlow's profiler, shared by the trace and the recorder: one per process.

Allocator events are host events (TraceMe at level 2 on the /host:CPU plane, a GPU's
allocator included), so both run the profiler with the host tracer alone: no device tracer
(CUPTI on a GPU) and no Python tracer.
"""

from __future__ import annotations

import threading

HOST_ONLY = dict(host_tracer_level=2, python_tracer_level=0, device_tracer_level=0)

TRACE_LOCK = threading.Lock()  # held while a trace runs (traces cannot nest)
_recorder = None  # the running recorder, paused while a trace runs


def profiler_options():
    """The profiler's options for allocator events: the host tracer alone."""
    import tensorflow as tf

    return tf.profiler.experimental.ProfilerOptions(**HOST_ONLY)


def running_recorder():
    return _recorder


def set_recorder(recorder) -> None:
    global _recorder
    _recorder = recorder
