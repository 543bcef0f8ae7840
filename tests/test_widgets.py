"""The panels' state without a browser: traits after real TensorFlow work in lab mode."""

import threading
import time

import pytest
from IPython.core.error import UsageError

import tfmem_widgets
from tfmem_widgets.errors import ArgumentError, SetupError
from tfmem_widgets.notebook.widgets import Gauge, MapViewer, SetupPanel
from tfmem_widgets.readings.sampler import sampler
from tfmem_widgets.tf.devices import PhysicalGpu
from tfmem_widgets.tf.nvml import GpuMemory
from tfmem_widgets.tf.options import SetupRequest
from tfmem_widgets.tf.setup_rules import DeviceState, plan_setup

MiB = 1 << 20


def cpu_in_use():
    import tensorflow as tf

    return tf.config.experimental.get_memory_info("CPU:0")["current"]


def sampler_threads():
    return [t for t in threading.enumerate() if t.name == "tfmem-sampler"]


def wait_for(predicate, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_the_gauge_moves_while_the_main_thread_is_busy_and_stops_cleanly(lab_session):
    import tensorflow as tf

    with tf.device("CPU:0"):
        tf.zeros((1,))  # the runtime runs (a gauge never starts it itself)
    gauge = Gauge(interval=0.05, device="CPU:0")
    row = gauge.rows["CPU:0"]
    with tf.device("CPU:0"):
        held = tf.zeros((8 << 20,))  # 32 MiB
    # The main thread is busy (sleeping, as in a long cell): only the sampler thread updates.
    before = gauge.samples
    assert wait_for(lambda: row["in_use"].value == cpu_in_use() and gauge.samples > before + 2)
    assert row["in_use"].max == 256 * MiB and row["peak"].value >= row["in_use"].value
    assert "32.00 MiB" in row["text"].value or cpu_in_use() != 32 * MiB
    assert "CPU:0: in use" in repr(gauge)
    gauge.close()
    assert not gauge.running and wait_for(lambda: not sampler_threads())
    assert sampler.errors == 0
    del held


def test_several_gauges_share_one_sampler_thread(lab_session):
    gauges = [Gauge(interval=0.05) for _ in range(3)]
    assert len(sampler_threads()) == 1
    gauges[0].stop()
    assert len(sampler_threads()) == 1, "the others still need it"
    for g in gauges[1:]:
        g.stop()
    assert wait_for(lambda: not sampler_threads())


def test_after_each_cell_running_gauges_read_again(shell):
    gauge = shell.run_line_magic("tfmem", "watch --interval 600")  # no background reading soon
    before = gauge.samples
    shell.run_cell("import tensorflow as tf\nwith tf.device('CPU:0'):\n    kept_for_gauge = tf.ones((1 << 18,))")
    assert gauge.samples == before + 1
    assert gauge.rows["CPU:0"]["in_use"].value == cpu_in_use()
    shell.run_line_magic("tfmem", "watch stop")
    assert not gauge.running
    shell.run_cell("del kept_for_gauge")


def test_watch_refuses_bad_input_in_one_line(shell):
    for line in ("watch --interval 0", "watch --interval soon", "watch -d GPU:9", "watch pause"):
        with pytest.raises(UsageError) as info:
            shell.run_line_magic("tfmem", line)
        assert "\n" not in str(info.value)
    assert not sampler_threads()


def _gpu_state(started=False):
    gpu = PhysicalGpu(0, "/physical_device:GPU:0", "NVIDIA H200", (9, 0), True, False, None)
    memory = GpuMemory(0, "NVIDIA H200", "GPU-0", 80 << 30, 1 << 30, 79 << 30, ())
    return DeviceState((gpu,), {0: memory}, None, 1, 24 << 30, {}, started)


def test_the_panel_bounds_the_limit_by_the_card_and_flags_what_the_rules_refuse():
    panel = SetupPanel(state=_gpu_state())
    assert panel.limit.max == 80 * 1024 and not panel.limit.disabled and not panel.lab.value
    panel.growth.value = "growth"
    panel.use_limit.value = True
    expected = None
    try:
        plan_setup(SetupRequest(growth=True, limit_mb=panel.limit.value), panel.state)
    except SetupError as exc:
        expected = str(exc)
    assert expected and "tfmem-conflict" in panel.message.value
    assert "silently drop" in panel.message.value and panel.apply_button.disabled
    panel.growth.value = "as it is"
    panel.force_growth.value = True
    assert "tfmem-ok" in panel.message.value and not panel.apply_button.disabled
    assert "TF_FORCE_GPU_ALLOW_GROWTH" in panel.code.value and "memory_limit=4096" in panel.code.value
    panel.split.value = "two"
    assert "expected a count" in panel.message.value and panel.apply_button.disabled


def test_after_the_runtime_started_apply_is_off_with_a_restart_snippet():
    panel = SetupPanel(state=_gpu_state(started=True))
    panel.growth.value = "growth"
    assert panel.apply_button.disabled
    assert "already started" in panel.message.value
    assert "Restart the kernel" in panel.result.value and "%tfmem setup --growth" in panel.result.value


def test_the_panel_shows_this_machines_gpus_and_the_lab_in_effect(lab_session):
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    tf.config.list_logical_devices()  # the runtime started (by this test, not by whichever ran before it)
    panel = SetupPanel()
    assert len(panel.gpus.options) == len(gpus)
    assert panel.gpus.disabled == panel.growth.disabled == (not gpus)
    assert panel.lab.value and panel.lab_mb.value == 256
    assert "Nothing to change" in panel.message.value
    panel.lab_mb.value = 512
    assert "already started" in panel.message.value and panel.apply_button.disabled


def test_the_map_viewer_moves_through_a_real_trace(lab_session):
    import tensorflow as tf

    with tfmem_widgets.trace() as t:
        with tf.device("CPU:0"):
            parts = [tf.fill((k << 16,), 1.0) for k in range(1, 9)]
            del parts[::2]
    viewer = MapViewer(t, "bfc_cpu_allocator_for_gpu")
    events = t.events("bfc_cpu_allocator_for_gpu")
    assert viewer.moment.max == len(events) - 1 and viewer.end_button.description == "end"
    viewer.show_peak()
    assert viewer.moment.value == t.peak_index("bfc_cpu_allocator_for_gpu")
    assert viewer.current_map.in_use_bytes == int(events.in_use[viewer.moment.value])
    assert '<rect class="tfmem-chunk"' in viewer.picture.value and "<title>Fill" in viewer.picture.value
    viewer.chunks.value = viewer.chunks.options[0][1]
    assert "<b>Fill</b>" in viewer.details.value
    viewer.moment.value = 0
    assert viewer.current_map.event_index == 0
    # A notebook saved without widget state keeps the whole text form, not ipywidgets' first
    # 110 characters.
    text = viewer._repr_mimebundle_()["text/plain"]
    assert len(text) > 110 and text == repr(viewer) and repr(viewer.current_map) in text
    del parts


def test_a_gauge_left_running_ends_with_the_process_without_a_trace_in_the_log():
    from conftest import start_fresh

    proc = start_fresh(
        """
        import json, time, tfmem_widgets
        tfmem_widgets.setup(lab_mb=64)
        import tensorflow as tf
        with tf.device("CPU:0"):
            x = tf.zeros((1000,))
        gauge = tfmem_widgets.Gauge(interval=0.02)
        time.sleep(0.3)
        print(json.dumps({"samples": gauge.samples}))
        """  # exits with the gauge still running: the exit handler stops the thread
    )
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-2000:]
    assert '"samples"' in stdout
    assert "Traceback" not in stderr and "Exception" not in stderr


def test_gauge_settings_are_traits_that_take_effect_and_refuse_bad_values_where_set(lab_session):
    gauge = Gauge(interval=600)
    try:
        start = gauge.samples
        gauge.interval = 0.1  # the sampler, asleep for 600 s, wakes and reads every 0.1 s
        time.sleep(1.5)
        assert gauge.samples - start >= 5
        for bad in (1e-9, 4000, "fast"):
            with pytest.raises(Exception) as info:
                gauge.interval = bad
            assert "interval" in str(info.value) and "\n" not in str(info.value)
        assert gauge.interval == 0.1
        gauge.device = "cpu"  # normalized as the magic's -d is
        assert gauge.device == "CPU:0" and repr(gauge).splitlines()[1].startswith("  CPU:0")
        with pytest.raises(ArgumentError, match="no device 'GPU:7'"):
            gauge.device = "GPU:7"
        assert gauge.device == "CPU:0"
    finally:
        gauge.close()


def test_the_map_viewers_allocator_is_a_trait(lab_session):
    import tensorflow as tf

    with tfmem_widgets.trace() as t:
        with tf.device("CPU:0"):
            x = tf.zeros((1024,))
    viewer = MapViewer(t)
    assert viewer.allocator == "bfc_cpu_allocator_for_gpu"
    with pytest.raises(ArgumentError, match="no events of allocator"):
        viewer.allocator = "GPU_7_bfc"
    assert viewer.allocator == "bfc_cpu_allocator_for_gpu" and viewer.current_map is not None
    with pytest.raises(ArgumentError, match="no events of allocator"):
        MapViewer(t, "GPU_7_bfc")
    del x


def _search(lab: bool):
    """A search's probes as max_batch_size records them (the search itself: test_batch_search.py):
    peaks on a line of 10 MiB + 20 KiB per example, 4,096 trained, 4,608 ran out of memory under 96 MB."""
    from tfmem_widgets.search.batch_search import BatchSearch, Probe

    probes = [Probe(b, 10 * MiB + b * 20 * 1024, 5.0) for b in (256, 1024, 4096)]
    probes.append(Probe(4608, None, 15.0, verdict="limit", request_bytes=8 * MiB))
    return BatchSearch(probes, low=1, high=16384, steps=2, margin=0.05, resolution=0.02, limit_bytes=96 * MiB,
                       limit_source="lab mode" if lab else "logical device limit", lab=lab,
                       where="lab mode 96 MB" if lab else "as if on a card of 96 MB")


def test_the_panel_reads_what_fits_at_the_chosen_limit_and_the_limit_a_batch_needs(lab_session):
    search = _search(lab=True)
    panel = SetupPanel(search=search)  # this process: lab mode, so the lab slider is the one read
    assert panel.fit_box in panel.children
    assert panel.batch.value == search.recommended
    def shown():
        return int(panel.fits.value.split("data-batch='")[1].split("'")[0])

    panel.lab_mb.value = 96  # the search's own limit: the measured edge, not the line (4,403 there)
    assert shown() == search.batch_for(96 * MiB) == 4096 and "measured: the largest below every failure" in panel.fits.value
    # a lab search's figures vary with the CPU: each is marked; the words around them do not
    assert "with a peak of 90.00 MiB (this CPU); at this limit that leaves +6.00 MiB (this CPU)" in panel.fits.value
    # one margin rule, the measured one: the batch a probe measured leaving the margin free (recommended)
    assert search.recommended == 4096
    assert "; 4,096 (this CPU) with a margin of 5% (measured: its peaks left the margin free, the margin below " \
        "every failure)" in panel.fits.value
    assert "or a larger one trained: 0 (this CPU): near the edge keep a margin." in panel.fits.value  # every run
    panel.lab_mb.value = 48  # under it: the line, never above what failed at 96 MB
    assert shown() == search.batch_for(48 * MiB) == (48 - 10) * 1024 // 20
    assert "; 1,024 (this CPU) with a margin of 5% (measured" in panel.fits.value   # 30 MiB measured, within 95% of 48
    panel.lab_mb.value = 192  # above it: the line, extrapolated and said so
    assert shown() == search.batch_for(192 * MiB)
    assert search.needs_bytes(shown()) <= 192 * MiB < search.needs_bytes(shown() + 1)
    assert "extrapolated" in panel.fits.value
    assert f"; {search.batch_for(int(192 * MiB * 0.95)):,} (this CPU) with a margin of 5% (by the line)" \
        in panel.fits.value
    assert panel.picture.value[:4] == b"\x89PNG"
    panel.batch.value = 4096   # a batch a probe trained at: the limit it needs from its measured peak
    assert panel.needed_limit_mb() == -(-int(90 * MiB / 0.95) // MiB) and "(measured)" in panel.needs.value
    panel.batch.value = 8000
    needed = panel.needed_limit_mb()
    assert needed == -(-int(search.needs_bytes(8000) / 0.95) // MiB)
    assert f"data-mb='{needed}'" in panel.needs.value
    panel.use_needed.click()  # the lab slider moves to the limit, rounded up to its 16 MB steps
    assert panel.lab_mb.value == -(-needed // 16) * 16
    assert "batch of 8,000 needs" in repr(panel)  # a batch typed in is the reader's, not marked
    panel.batch.value = search.recommended  # the search's own: marked, as the limit it needs
    assert f"A batch of {search.recommended:,} (this CPU) needs 90.00 MiB (this CPU) (measured)" in repr(panel)


def test_a_search_whose_peaks_fall_is_told_so_not_called_fewer_than_two(lab_session):
    from tfmem_widgets.search.batch_search import BatchSearch, Probe

    # small batches, measured in lab mode: the larger one peaked lower (the pool's regions)
    probes = [Probe(2, 6 * MiB, 4.0), Probe(32, 5 * MiB, 4.0), Probe(64, None, 14.0, verdict="limit")]
    search = BatchSearch(probes, low=1, high=64, steps=2, margin=0.05, resolution=0.02, limit_bytes=8 * MiB,
                         limit_source="lab mode", lab=True, where="lab mode 8 MB")
    panel = SetupPanel(search=search)
    assert "do not rise with the batch (2 at 6.00 MiB, 32 at 5.00 MiB)" in panel.fits.value
    assert "fewer than two" not in panel.fits.value
    one = BatchSearch(probes[:1], low=1, high=2, steps=2, margin=0.05, resolution=0.02, limit_bytes=8 * MiB,
                      limit_source="lab mode", lab=True, where="lab mode 8 MB")
    assert one.no_line_reason().startswith("The search has fewer than two batches that trained")


def test_a_gpu_panel_reads_its_limit_slider_and_says_when_a_search_ran_in_lab_mode():
    panel = SetupPanel(state=_gpu_state(), search=_search(lab=False))
    panel.limit.value = 96
    assert "At a GPU limit of 96 MB" in panel.fits.value and "lab mode" not in panel.fits.value
    panel.batch.value = 2000
    panel.use_needed.click()
    assert panel.use_limit.value and panel.limit.value == panel.needed_limit_mb()
    assert "memory_limit=" in panel.code.value  # the chosen limit is what Apply would run
    panel.search = _search(lab=True)
    assert "ran in lab mode (CPU kernels)" in panel.fits.value
    with pytest.raises(ArgumentError):
        panel.search = "not a search"


def test_panel_search_refuses_a_missing_or_wrong_variable_in_one_line(shell):
    shell.user_ns["not_a_search"] = 3
    for line, says in (("panel --search nowhere", "no variable 'nowhere'"),
                       ("panel --search not_a_search", "got int")):
        with pytest.raises(UsageError) as info:
            shell.run_line_magic("tfmem", line)
        assert says in str(info.value) and "\n" not in str(info.value)
