"""Start and stop: every step undone on every exit path (faults 16 to 18, and the class).

The class test raises a KeyboardInterrupt at each step of entering and leaving a trace, a
measure, a fresh run and a gauge (tests/injection.py), one step per run, and checks that
nothing is left behind: file descriptor 2 where it was, TF_BFC_MEMORY_DUMP as it was, no
temporary folder, no open file, no child process, no thread, no subscriber, no lock held.
"""

import glob
import importlib
import os
import tempfile
import threading
import time

import psutil
import pytest
from injection import Steps

from tfmem_widgets import ArgumentError, measure, run_fresh, trace
from tfmem_widgets.readings.sampler import sampler
from tfmem_widgets.tf import dump_place

# The modules (the package's names `trace` and `measure` are the classes).
trace_module = importlib.import_module("tfmem_widgets.tracing.block")
measure_module = importlib.import_module("tfmem_widgets.readings.measure")
fresh = importlib.import_module("tfmem_widgets.fresh.run")
transport = importlib.import_module("tfmem_widgets.fresh.transport")


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def fd2() -> tuple[int, int]:
    st = os.fstat(2)
    return st.st_dev, st.st_ino


def leftovers(pattern: str) -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), pattern)))


def profiler_running() -> bool:
    from tensorflow.python.profiler import profiler_v2

    return profiler_v2._profiler is not None


class State:
    """What must be the same after any interrupted operation as before it."""

    def __init__(self):
        self.fd2 = fd2()
        self.fds = open_fds()
        self.dump_env = os.environ.get("TF_BFC_MEMORY_DUMP")
        self.traces = leftovers("tfmem-trace-*")
        self.fresh = leftovers("tfmem-fresh-*")
        self.threads = {t.ident for t in threading.enumerate()}

    def differences(self) -> list[str]:
        out = []
        if fd2() != self.fd2:
            out.append("fd 2 moved")
        if os.environ.get("TF_BFC_MEMORY_DUMP") != self.dump_env:
            out.append("TF_BFC_MEMORY_DUMP changed")
        if leftovers("tfmem-trace-*") != self.traces or leftovers("tfmem-fresh-*") != self.fresh:
            out.append("a temporary folder left")
        extra = open_fds() - self.fds
        if extra:
            out.append(f"file descriptors left open: {sorted(extra)}")
        if trace_module.tracing():
            out.append("the trace lock is held")
        if "a trace" in dump_place._owners.values():
            out.append("a dump prefix is still owned")
        if measure_module.running_measurements():
            out.append("a measurement is still active")
        if psutil.Process().children(recursive=True):
            out.append("a child process is alive")
        return out


def check_every_step(steps: Steps, operation, prepare=None, finish=None, settle=None):
    """Run `operation` once per step with an interrupt there; after each, nothing left behind."""
    if prepare:
        prepare()
    sites = steps.sites(operation)
    if finish:
        finish()
    assert len(sites) >= 5, sites
    before = State()
    for site in sites:
        if prepare:
            prepare()
        reached = steps.interrupt(operation, site)
        if finish:
            finish()
        if settle:
            settle()
        problems = before.differences()
        assert not problems, f"interrupted at {site}: {problems}"
        assert reached, f"{site} was not reached again"
    return sites


@pytest.fixture
def warm(lab_session):
    """One whole trace first, so TensorFlow's own lazy start-up is not counted as a leak."""
    import tensorflow as tf

    with trace():
        with tf.device("CPU:0"):
            tf.zeros((16,))
    yield


TRACE_STEPS = Steps([trace_module], cleanup=("_release", "_restore_env", "stop", "_profiler_stop_quietly"))


def test_an_interrupt_at_each_step_of_starting_a_trace_leaves_nothing(warm):
    held = {}

    def enter():
        held["block"] = trace()
        held["block"].__enter__()

    def finish():
        block = held.pop("block", None)
        if block is not None and block.running:
            block.__exit__(None, None, None)  # entered whole: leave it

    sites = check_every_step(TRACE_STEPS, enter, finish=finish)
    assert any(site[3] == "start" for site in sites), "the profiler's start is one of the steps"
    assert not profiler_running()


def test_an_interrupt_at_each_step_of_stopping_a_trace_leaves_nothing(warm):
    import tensorflow as tf

    held = {}

    def prepare():
        held["block"] = trace()
        held["block"].__enter__()
        with tf.device("CPU:0"):
            held["x"] = tf.zeros((64,))

    def leave():
        held["block"].__exit__(None, None, None)

    sites = check_every_step(TRACE_STEPS, leave, prepare=prepare)
    assert any(site[3] == "read_xplane_file" for site in sites)
    assert not profiler_running()
    with trace() as t:  # and the next trace works
        with tf.device("CPU:0"):
            tf.zeros((8,))
    assert t.allocators


MEASURE_STEPS = Steps([measure_module])


def test_an_interrupt_at_each_step_of_a_measure_leaves_nothing(lab_session):
    import tensorflow as tf

    def whole():
        with measure("CPU:0"):
            with tf.device("CPU:0"):
                tf.zeros((64,))

    check_every_step(MEASURE_STEPS, whole)
    with measure("CPU:0") as m:
        with tf.device("CPU:0"):
            x = tf.zeros((1024,))
    assert m.delta_bytes >= 4096
    del x


FRESH_STEPS = Steps([fresh, transport], cleanup=("_kill_group",))


def test_an_interrupt_at_each_step_of_a_fresh_run_leaves_nothing(lab_session):
    def whole():
        run_fresh("x = 1", returns=["x"], echo=False, timeout=120)

    def settle():
        deadline = time.monotonic() + 10
        while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
            time.sleep(0.05)

    sites = check_every_step(FRESH_STEPS, whole, settle=settle)
    # The child is started (Popen.__init__) and followed (select) among the steps interrupted.
    assert any(site[1] == "run_checked" and site[3] == "__init__" for site in sites)
    assert any(site[0] == "transport.py" for site in sites)  # the job written for the child
    assert any(site[3] == "select" for site in sites)


def test_an_interrupt_at_each_step_of_making_a_gauge_leaves_no_subscriber(lab_session):
    from tfmem_widgets.notebook.widgets import gauge as gauge_module

    steps = Steps([gauge_module], cleanup=("close", "stop"))
    made = []

    def whole():
        made.append(gauge_module.Gauge(interval=0.5))

    def finish():
        while made:
            made.pop().close()

    def settle():
        deadline = time.monotonic() + 5
        while sampler.running and time.monotonic() < deadline:
            time.sleep(0.05)

    check_every_step(steps, whole, finish=finish, settle=settle)
    assert sampler.subscriber_count == 0 and not sampler.running
    assert not gauge_module.running_gauges()


# -- fault 16: Ctrl-C while the profiler starts -----------------------------------------------

def test_ctrl_c_while_the_profiler_starts_leaves_fd2_the_environment_and_files_as_they_were(warm, monkeypatch):
    import tensorflow as tf

    before = State()

    def interrupted(logdir, options=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(tf.profiler.experimental, "start", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with trace():
            pass
    monkeypatch.undo()
    assert before.differences() == []  # fd 2 is the same file as before, not the trace's capture


# -- fault 18: a short gauge after a long one -------------------------------------------------

def test_a_short_interval_made_after_a_long_one_is_read_on_time(lab_session):
    from tfmem_widgets.notebook.widgets.gauge import Gauge

    slow = Gauge(interval=600)
    try:
        time.sleep(0.3)  # the sampler is now asleep for 600 s
        fast = Gauge(interval=0.1)
        try:
            start = fast.samples  # its first reading was on this thread; the next come from the sampler
            time.sleep(1.5)
            assert fast.samples - start >= 5, f"{fast.samples - start} background readings in 1.5 s"
        finally:
            fast.close()
    finally:
        slow.close()


@pytest.mark.parametrize("interval", [1e-9, 0, -1, 4000, "0.5", None, True])
def test_a_gauge_interval_is_checked_where_it_is_given(lab_session, interval):
    from tfmem_widgets.notebook.widgets.gauge import Gauge

    subscribers = sampler.subscriber_count
    with pytest.raises(ArgumentError) as info:
        Gauge(interval=interval)
    assert "\n" not in str(info.value) and "interval" in str(info.value)
    assert sampler.subscriber_count == subscribers


# -- the recorder: Ctrl-C while a window ends on the main thread, or while it stops ------------

recorder_module = importlib.import_module("tfmem_widgets.tracing.recorder")
RECORDER_STEPS = Steps([recorder_module])


def _records_now(recorder) -> bool:
    """An allocation made now is in the recorder's next window."""
    import tensorflow as tf

    before = recorder.events
    with tf.device("CPU:0"):
        made = tf.fill((1 << 12,), 1.0)
    del made
    recorder.roll()
    return recorder.events > before


def test_ctrl_c_at_each_step_of_a_window_ending_on_the_main_thread_leaves_it_recording(warm, monkeypatch, tmp_path):
    # An OOM report rolls the recorder's window on the main thread: a Ctrl-C there used to leave the
    # profiler stopped while the recorder said "recording" and recorded nothing.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the recorder's folders, and only them
    recorder = recorder_module.record(window=3600)
    try:
        assert _records_now(recorder)
        sites = RECORDER_STEPS.sites(recorder.roll)
        assert any(site[3] == "read_xplane_file" for site in sites) and any(site[3] == "profiler_stop" for site in sites)
        for site in sites:
            assert RECORDER_STEPS.interrupt(recorder.roll, site), site
            assert recorder.running and recorder._profiling and profiler_running(), site
            assert len(leftovers("tfmem-record-*")) == 1, site      # the window running now, no other
            assert "recording" in repr(recorder) and _records_now(recorder), site
    finally:
        recorder_module.stop()
    assert not profiler_running() and not leftovers("tfmem-record-*")


def test_ctrl_c_at_each_step_of_stopping_the_recorder_leaves_the_profiler_stopped_or_owned(warm, monkeypatch, tmp_path):
    # A Ctrl-C during %tfmem record stop used to leave TensorFlow's profiler running with no recorder
    # to stop it: record and traces refused until a restart, the window's folder left behind.
    import tensorflow as tf

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the recorder's folders, and only them

    recorder_module.record(window=3600)
    stop_sites = RECORDER_STEPS.sites(recorder_module.stop)
    assert any(site[3] == "join" for site in stop_sites) and any(site[3] == "stop" for site in stop_sites)
    for site in stop_sites:
        recorder = recorder_module.record(window=3600)
        assert RECORDER_STEPS.interrupt(recorder_module.stop, site), site
        owned = recorder_module.current() is recorder and recorder._profiling
        assert profiler_running() == owned, site                  # running only while its recorder says so
        assert len(leftovers("tfmem-record-*")) == int(owned), site
        recorder_module.stop()
        assert not profiler_running() and not leftovers("tfmem-record-*"), site
        with trace() as t:  # the profiler is free: a trace runs
            with tf.device("CPU:0"):
                tf.zeros((8,))
        assert t.allocators, site


def test_a_recorder_still_running_when_its_process_ends_leaves_no_folder(lab_session, tmp_path):
    # A recorder never stopped, its windows rolling every second while the process exits: a Python
    # process that ends (a kernel shut down), and a fresh process of the package (it ends with os._exit).
    import subprocess
    import sys

    code = ("import time\nimport tfmem_widgets\ntfmem_widgets.setup(lab_mb=64)\nimport tensorflow as tf\n"
            "recorder = tfmem_widgets.record(window=1)\nx = tf.fill((1 << 16,), 1.0)\ntime.sleep(2.5)\n"
            "windows = recorder.windows\nprint('windows', windows)\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TMPDIR": str(plain)})
    assert done.returncode == 0 and "windows" in done.stdout, done.stderr[-2000:]
    assert not list(plain.glob("tfmem-record-*"))
    child = tmp_path / "fresh"
    child.mkdir()
    run = run_fresh(code.replace("tfmem_widgets.setup(lab_mb=64)\n", ""), setup={"lab_mb": 64},
                    env={"TMPDIR": str(child)}, returns=["windows"], echo=False)
    assert run.values["windows"] >= 1
    assert not list(child.glob("tfmem-record-*"))
