"""A batch search's probe processes, started before their batch is known (search/warm.py).

Real processes in lab mode: a waiting process has TensorFlow imported and nothing of its runtime
started (its lab setup still applies after the wait), a warm probe measures what a cold one does,
and no process outlives the search: closed, timed out, interrupted, or its parent gone.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import psutil
import pytest

from tfmem_widgets.errors import FreshRunError
from tfmem_widgets.search.probe import LOAD_AUTOTUNE, probe_in_fresh_process
from tfmem_widgets.search.warm import SharedAutotune, WarmProbes

SETUP = {"lab_mb": 64}


def _functions(hang: bool = False, seen: str | None = None, meet: str | None = None, gate: str | None = None,
               flags: str | None = None):
    """meet: a folder; build_model waits (up to 60 s) there until two probes' processes have begun, so
    two probes one after the other cannot both build their models: a pair that trains ran side by side.
    gate: a file; build_model waits (up to 60 s) until it exists. flags: a file; build_model adds a line of
    the XLA_FLAGS its process had."""
    def build_model():
        import os
        from pathlib import Path

        import keras

        if seen:  # what the probe's process had when the model was built: lab mode's oneDNN switch
            with open(seen, "a") as out:
                out.write(f"{os.environ.get('TF_ENABLE_ONEDNN_OPTS')}\n")
        if flags:
            with open(flags, "a") as out:
                out.write(os.environ.get("XLA_FLAGS", "") + "\n")
        if meet:
            import time as clock

            Path(meet, str(os.getpid())).write_text("")
            deadline = clock.monotonic() + 60
            while len(list(Path(meet).iterdir())) < 2:
                if clock.monotonic() > deadline:
                    raise RuntimeError("the other probe never began")
                clock.sleep(0.05)
        if gate:
            import time as clock

            deadline = clock.monotonic() + 60
            while not Path(gate).exists():
                if clock.monotonic() > deadline:
                    raise RuntimeError("the gate never opened")
                clock.sleep(0.05)
        if hang:
            import time as clock

            clock.sleep(600)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"), keras.layers.Dense(1)])
        model.compile("adam", "mse", jit_compile=True)
        return model

    def make_batch(n):
        import numpy as np

        return np.ones((n, 64), "float32"), np.ones((n, 1), "float32")

    return cloudpickle.dumps((build_model, make_batch))


def _children():
    return [p for p in psutil.Process().children(recursive=True) if p.is_running() and p.status() != "zombie"]


def _has_imported_tensorflow(process: psutil.Process) -> bool:
    try:
        return any("libtensorflow_framework" in m.path for m in process.memory_maps())
    except psutil.Error:
        return False


def test_a_warm_probe_imports_first_then_sets_up_and_measures_as_a_cold_probe_does(tmp_path):
    seen = tmp_path / "seen"
    warm = WarmProbes(_functions(seen=str(seen)), 2, SETUP, {}, 120)
    try:
        deadline = time.monotonic() + 60
        while not any(_has_imported_tensorflow(p) for p in _children()) and time.monotonic() < deadline:
            time.sleep(0.2)
        waiting = _children()
        assert waiting and any(_has_imported_tensorflow(p) for p in waiting), "TensorFlow imported while it waits"
        # The lab setup is applied after the wait: it is refused once TensorFlow's runtime has started, so
        # a probe under the 64 MB lab limit shows the waiting process started nothing of it.
        hot = warm.probe(512)
        cold = probe_in_fresh_process(warm.path, 512, 2, SETUP, {}, 120)
    finally:
        warm.close()
    assert hot.fits and cold.fits
    assert hot.limit_bytes == cold.limit_bytes == 64 << 20
    assert hot.limit_source == cold.limit_source and "lab" in hot.limit_source
    # The same step in the same allocator: its peak, up to the input pipeline's 128 KiB buffer, which
    # meets the step's peak in some runs and not in others, warm or cold, and a few 256-byte chunks of the
    # fit's scalars (measured here: 935,168 B or 1,066,240 B in four of each; a fresh-clone run saw
    # 1,066,752 B, two chunks more, beside 935,168 B).
    assert abs(hot.peak_bytes - cold.peak_bytes) <= (128 << 10) + 4 * 256, (hot.peak_bytes, cold.peak_bytes)
    assert seen.read_text().split() == ["0", "0"]  # oneDNN off in both, as the lab setup makes it
    assert not _children() and not warm.path.exists()


def test_a_probe_begun_after_the_plans_tells_xla_to_read_what_their_compiles_timed(tmp_path, monkeypatch):
    # XLA's dump and load of autotune results run on a GPU (tests/test_gpu.py); here the search's side in real
    # processes: a probe begun before the plans' results are published times its own kernels, and a process
    # started ahead of that, begun after, tells XLA to read them as its work begins (XLA reads its flags then).
    monkeypatch.setattr(SharedAutotune, "of", staticmethod(lambda env, setup, work: SharedAutotune(work)))
    seen = tmp_path / "seen"
    warm = WarmProbes(_functions(flags=str(seen)), 2, SETUP, {}, 120)
    try:
        before = warm.probe(64)
        warm.autotune.written.write_text('results {\n  hlo: "a"\n}\n')  # as the plans' process writes them
        warm.autotune.publish()
        assert warm.autotune.kernels == 1
        after = warm.probe(64, ahead=False)
    finally:
        warm.close()
    assert before.fits and after.fits
    first, second = seen.read_text().splitlines()
    assert LOAD_AUTOTUNE not in first and second.endswith(f"{LOAD_AUTOTUNE}={warm.autotune.shared}"), (first, second)


def test_a_pair_of_probes_runs_side_by_side_each_in_a_process_of_its_own(tmp_path):
    met = tmp_path / "met"
    met.mkdir()
    warm = WarmProbes(_functions(meet=str(met)), 2, SETUP, {}, 240, ready=2)
    try:
        small, large = warm.probe_pair(64, 512, ahead=False)
        time.sleep(1)  # a process started ahead would be running by now (a thread starts it)
        assert not _children()  # ahead=False: the pair's processes ended, none waits for a probe after them
        assert len(list(met.iterdir())) == 2  # two processes, each met the other before building its model
        third = warm.probe(32)  # a probe after all: its process starts now (its build meets the pair's marks)
    finally:
        warm.close()
    assert third.fits and third.limit_bytes == 64 << 20
    assert (small.batch, large.batch) == (64, 512) and small.fits and large.fits
    assert small.limit_bytes == large.limit_bytes == 64 << 20 and small.peak_bytes < large.peak_bytes
    assert not _children() and not warm.path.exists()


def test_a_searchs_pair_starts_no_process_for_a_probe_after_it_and_joins_its_probes(monkeypatch):
    # Through the search's own probing(): the pair that confirms a plan search's answer is expected to be its
    # last, so once it has run no process waits (on a small machine one would import on the pair's cores).
    from tfmem_widgets.search import warm
    from tfmem_widgets.search.batch_search import BatchSearch

    monkeypatch.setattr(warm, "room_for_two", lambda setup, env, now=True: "here")
    search = BatchSearch([], 1, 1024, 2, 0.0, 0.02, where="lab mode 64 MB", lab=True,
                         _run=(_functions(), SETUP, {}, 240))
    with warm.probing(search, pairs=True) as probe_one:
        both = probe_one.pair(64, 512)
        time.sleep(1)  # a process started for a later probe would be running by now (a thread starts it)
        assert not _children()
        assert probe_one(32, ahead=False).fits  # a probe after all: its process starts now, none after it
        time.sleep(1)
        assert not _children()
    assert [p.batch for p in search.probes] == [64, 512, 32] and all(p.fits for p in both)
    assert "batches 64 and 512 were probed side by side: two processes, here" in search.notes
    assert not _children()


def test_a_search_says_its_probes_read_the_plans_timings_only_where_a_probe_began_after_them(monkeypatch):
    # The note is the search's: where the plans' results were published (here: said to hold 7 timings) and no
    # probe began after, nothing read them, and nothing is said.
    from tfmem_widgets.search import warm
    from tfmem_widgets.search.batch_search import BatchSearch

    monkeypatch.setattr(SharedAutotune, "of", staticmethod(lambda env, setup, work: SharedAutotune(work)))
    monkeypatch.setattr(SharedAutotune, "publish", lambda self, batches=(): setattr(self, "kernels", 7))
    said = "the probes begun after the plans read the 7 kernel timings XLA's autotuner made while the plans compiled"
    search = BatchSearch([], 1, 1024, 2, 0.0, 0.02, where="lab mode 64 MB", lab=True,
                         _run=(_functions(), SETUP, {}, 240))
    with warm.probing(search) as probe_one:
        assert probe_one.plans_env["XLA_FLAGS"].endswith("autotune-plans.txt")  # the planning process writes them
        probe_one(32, ahead=False)
        probe_one.plans_done(None)
    assert not any(note.startswith(said) for note in search.notes)
    with warm.probing(search) as probe_one:
        probe_one.plans_done(None)
        probe_one(32, ahead=False)
    assert sum(note.startswith(said) for note in search.notes) == 1, search.notes


def test_a_pair_begun_runs_while_the_search_does_something_else_and_is_read_after(monkeypatch, tmp_path):
    # begin_pair: a closing plan's two probes begin while the planning process compiles it
    # (search/plan_first.plan_first); the search's thread is free meanwhile and reads them after.
    from tfmem_widgets.search import warm
    from tfmem_widgets.search.batch_search import BatchSearch

    met, gate = tmp_path / "met", tmp_path / "gate"
    met.mkdir()
    monkeypatch.setattr(warm, "room_for_two", lambda setup, env, now=True: "here")
    search = BatchSearch([], 1, 1024, 2, 0.0, 0.02, where="lab mode 64 MB", lab=True,
                         _run=(_functions(meet=str(met), gate=str(gate)), SETUP, {}, 240))
    with warm.probing(search, pairs=True) as probe_one:
        read = probe_one.begin_pair(64, 512)
        gate.write_text("")  # the builds wait for this: a begin that waited for its probes would never get here
        deadline = time.monotonic() + 120
        while len(list(met.iterdir())) < 2 and time.monotonic() < deadline:  # both building, none read
            time.sleep(0.1)
        assert len(list(met.iterdir())) == 2 and search.probes == []
        both = read()
        time.sleep(1)  # a process started for a later probe would be running by now
        assert not _children()
    assert search.probes == both and [p.batch for p in both] == [64, 512] and all(p.fits for p in both)
    assert 0 < search.overlap_seconds == min(p.seconds for p in both)  # their shared seconds counted once
    assert not _children()


def test_two_probes_side_by_side_only_where_each_has_its_limit_and_there_is_room_for_both(monkeypatch):
    # The driver's reading is the seam (no GPU here): read_gpus as NVML would answer on a 80 GiB card.
    import tfmem_widgets.tf.nvml as nvml
    from tfmem_widgets.errors import NvmlUnavailable
    from tfmem_widgets.search import warm
    from tfmem_widgets.tf.nvml import GpuMemory

    GiB = 1 << 30

    def card(free):
        return [GpuMemory(0, "H100", "GPU-0", 80 * GiB, 80 * GiB - free, free, ())]

    def no_driver():
        raise NvmlUnavailable("NVML not available: no NVIDIA driver answered")

    def cores(count):
        monkeypatch.setattr(warm.os, "sched_getaffinity", lambda pid: set(range(count)), raising=False)
        monkeypatch.setattr(warm.os, "cpu_count", lambda: count)

    def host(available):
        monkeypatch.setattr(psutil, "virtual_memory", lambda: type("Memory", (), {"available": available})())

    cores(16)
    host(60 * GiB)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(nvml, "read_gpus", no_driver)
    assert "each under its 128 MB lab limit, with" in warm.room_for_two({"lab_mb": 128}, {})
    assert warm.room_for_two({}, {}) is None  # no limit and no GPU: nothing to probe side by side
    monkeypatch.setattr(nvml, "read_gpus", lambda: card(70 * GiB))
    assert warm.room_for_two({"lab_mb": 128}, {}) is None  # a GPU the lab probes may use, no limit on it
    assert warm.room_for_two({"lab_mb": 128, "gpus": []}, {}) is not None  # the GPU hidden from them
    assert warm.room_for_two({"growth": True}, {}) is None  # each fresh process would take what it finds
    assert warm.room_for_two({"limit_mb": 2000}, {}) == "each under its 2000 MB limit, where GPU 0 had 70.00 GiB free"
    assert warm.room_for_two({"limit_mb": {0: 2000}}, {}) is not None
    assert warm.room_for_two({"limit_mb": {1: 2000}}, {}) is None  # GPU 0 has no limit of its own
    assert warm.room_for_two({"split": [1000, 2000]}, {}) == "each under its 3000 MB limit, where GPU 0 had 70.00 GiB free"
    assert warm.room_for_two({"split": 2}, {}) is None  # a count without a limit divides what each process finds
    assert "its 2000 MB limit" in warm.room_for_two({"limit_mb": 2000, "split": 2}, {})
    assert warm.room_for_two({"limit_mb": 2000}, {"CUDA_VISIBLE_DEVICES": "1"}) is None  # GPUs this process can't tell
    monkeypatch.setattr(nvml, "read_gpus", lambda: card(40 * GiB))
    assert warm.room_for_two({"limit_mb": 19000}, {}) is None  # 2 x (19000 MB + 2 GiB) is more than 40 GiB free
    assert warm.room_for_two({"limit_mb": 19000}, {}, now=False) is not None  # allowed, once the card is freer
    assert warm.room_for_two({"limit_mb": 16000}, {}) is not None
    host(3 * GiB)
    assert warm.room_for_two({"limit_mb": 2000}, {}) is None  # not the host's memory for two processes
    assert warm.room_for_two({"limit_mb": 2000}, {}, now=False) is not None
    host(60 * GiB)
    cores(2)
    assert warm.room_for_two({"limit_mb": 2000}, {}) is not None  # two cores: a pair still gains
    cores(1)
    assert warm.room_for_two({"limit_mb": 2000}, {}) is None  # one core: two processes only take turns


def test_closing_a_search_ends_its_waiting_process_and_a_probe_past_its_timeout_ends_with_it():
    warm = WarmProbes(_functions(), 2, SETUP, {}, 60)
    try:
        deadline = time.monotonic() + 30  # its process is started by a thread: soon, not at once
        while not _children() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _children()
    finally:
        warm.close()
    assert not _children() and not warm.path.exists()

    warm = WarmProbes(_functions(hang=True), 2, SETUP, {}, 15)
    started = time.monotonic()
    try:
        with pytest.raises(FreshRunError) as caught:
            warm.probe(8)
    finally:
        warm.close()
    assert "the probe at batch 8 ran past 15 s and was stopped" in str(caught.value)
    assert "\n" not in str(caught.value) and time.monotonic() - started < 60
    assert not _children()


def test_ctrl_c_during_a_probe_ends_the_probe_and_the_next_waiting_process():
    # Ctrl-C as Python takes it: SIGINT to the main thread, its default handler raising KeyboardInterrupt
    # (whatever an earlier test of this session left: in the whole suite a SIGINT sent to the process twice
    # never reached the waiting thread, where the test alone passes).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    warm = WarmProbes(_functions(hang=True), 2, SETUP, {}, 300)
    timer = threading.Timer(8, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            warm.probe(8)
        left = _children()
        assert len(left) <= 1, [(c.pid, c.status()) for c in left]  # the probe in flight is gone; the next one waits
    finally:
        timer.cancel()
        warm.close()
        signal.signal(signal.SIGINT, previous)
    assert not _children()


@pytest.mark.parametrize("parent_lives_s", [0.3, 5])
def test_a_waiting_process_ends_by_itself_when_the_process_that_started_it_is_gone(tmp_path, parent_lives_s):
    # A parent that starts a waiting probe process and dies without closing it (a killed kernel): while the
    # child still imports TensorFlow (0.3 s), or once it waits (5 s, on a quiet machine).
    pid_file = tmp_path / "pid"
    parent = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from tfmem_widgets.search.warm import _Waiting
        path = Path({str(tmp_path)!r}) / "functions.pickle"
        path.write_bytes(b"")
        waiting = _Waiting(path, 2, {SETUP!r}, {{}})
        while waiting.process is None:
            time.sleep(0.05)
        Path({str(pid_file)!r}).write_text(str(waiting.process.pid))
        time.sleep({parent_lives_s})
        os._exit(0)
    """)
    subprocess.run([sys.executable, "-c", parent], check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 60
    while psutil.pid_exists(child) and psutil.Process(child).status() != "zombie" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
