"""TensorFlow's profiler, shared by the trace and the recorder: one per process.

Allocator events are host events (TraceMe at level 2 on the /host:CPU plane, a GPU's
allocator included), so both run the profiler with the host tracer alone, at level 2: no device
tracer (CUPTI on a GPU) and no Python tracer. Level 1 records no allocator event; level 3 records the
same ones as level 2 with more other events.

TensorFlow 2.21 ignores the options as tf.profiler.experimental.ProfilerOptions passes them: its
wrapper reads each value of the options' dict as a bool first, and pybind11 turns any number into one,
so each option is refused ("host_tracer_level expects an i value" on fd 2) and the profiler runs with
its defaults (the device tracer on). A level is passed here as an int that refuses to be a bool, so
that the wrapper reads it as the int it is (``_Level``): the options then hold (a test checks both).
"""

from __future__ import annotations

import threading

HOST_ONLY = dict(host_tracer_level=2, python_tracer_level=0, device_tracer_level=0)


class _Level(int):
    """A profiler level TensorFlow's wrapper reads as an int (it tries bool first: see above)."""

    def __bool__(self):
        raise TypeError("a profiler level is a number, not a truth value")


class _Options:
    """The profiler's options, as tf.profiler.experimental.start takes them (it calls _asdict())."""

    def __init__(self, levels: dict[str, int]):
        self.levels = levels

    def _asdict(self) -> dict[str, int]:
        return {name: _Level(level) for name, level in self.levels.items()}

    def __repr__(self) -> str:
        return f"profiler options {self.levels}"

TRACE_LOCK = threading.Lock()  # held while a trace runs (traces cannot nest)
_recorder = None  # the running recorder, paused while a trace runs


def profiler_options(**levels: int) -> _Options:
    """The profiler's options for allocator events: the host tracer alone at level 2 (each level can
    be given instead: host_tracer_level, python_tracer_level, device_tracer_level)."""
    return _Options({**HOST_ONLY, **levels})


def running_recorder():
    return _recorder


def set_recorder(recorder) -> None:
    """The recorder that holds the profiler now (None: none); while one does, a profiler session the
    user starts or stops is refused in one line instead of cutting the recorder's short."""
    global _recorder
    _recorder = recorder
    _guard(recorder is not None)


# -- the package's own sessions, and the user's while the recorder holds the profiler -----------

RECORDER_HOLDS = ("the tfmem recorder (%tfmem record) holds TensorFlow's profiler, one session per process: "
                  "%tfmem record stop (or tfmem_widgets.record().stop()) first, then start yours")
NOT_YOURS = ("no profiler session of yours is running: the one running is the tfmem recorder's (%tfmem record); "
             "%tfmem record stop ends it")
_local = threading.local()
_originals: dict | None = None  # what the guard replaced: {(module, name): function}


def profiler_start(logdir: str, options=None) -> None:
    """Start TensorFlow's profiler for the package (a trace, the recorder's window)."""
    import tensorflow as tf

    _local.ours = True
    try:
        tf.profiler.experimental.start(logdir, options=options)
    finally:
        _local.ours = False


def profiler_stop() -> None:
    import tensorflow as tf

    _local.ours = True
    try:
        tf.profiler.experimental.stop()
    finally:
        _local.ours = False


def _holding() -> bool:
    """The recorder holds the profiler and the call is not the package's own."""
    return (_recorder is not None and getattr(_recorder, "running", False) and not getattr(_recorder, "_paused", False)
            and not getattr(_local, "ours", False))


def _guard(on: bool) -> None:
    """Wrap tf.profiler.experimental.start/stop (and profiler_v2's, which Profile and Keras'
    TensorBoard callback reach) while the recorder runs; put them back when it stops."""
    global _originals
    import sys

    if not on:
        for (module, name), function in (_originals or {}).items():
            setattr(module, name, function)
        _originals = None
        return
    if _originals is not None or "tensorflow" not in sys.modules:
        return
    import tensorflow as tf
    from tensorflow.python.profiler import profiler_v2

    start, stop = profiler_v2.start, profiler_v2.stop

    def guarded_start(*args, **kwargs):
        if _holding():
            raise tf.errors.AlreadyExistsError(None, None, RECORDER_HOLDS)
        return start(*args, **kwargs)

    def guarded_stop(*args, **kwargs):
        if _holding():
            raise tf.errors.UnavailableError(None, None, NOT_YOURS)
        return stop(*args, **kwargs)

    api = tf.profiler.experimental
    _originals = {(api, "start"): api.start, (api, "stop"): api.stop,
                  (profiler_v2, "start"): start, (profiler_v2, "stop"): stop}
    for module in (api, profiler_v2):
        module.start, module.stop = guarded_start, guarded_stop
