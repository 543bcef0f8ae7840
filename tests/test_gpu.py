"""The GPU paths on a real GPU: TensorFlow's GPU runtime, its BFC allocator, NVML.

Each test runs in a fresh process, since device setup is fixed once TensorFlow's runtime
starts. The allocator's tests use only allocation and elementwise ops (tf.zeros / tf.fill / +),
which run on every CUDA build; the Keras fits need cuBLAS. Written for any number of cards and
any card size (read from NVML). Skipped where TensorFlow sees no GPU.
"""

import signal
import subprocess
import sys
import textwrap

import gpu_experiments  # notebooks/, put on the path by tests/conftest.py
import pytest

from conftest import (
    FRESH_SHELL,
    MIRRORED_MODEL,
    PROBE_DATA_MODEL,
    plan_then_fit,
    run_fresh,
    search_functions,
    trains_like_a_probe,
)
from tfmem_widgets.fresh.run import child_environment
from tfmem_widgets.search.probe import REFUSED

pytestmark = pytest.mark.gpu
MiB = 1 << 20

PRELUDE = """
import json, os
import tfmem_widgets
from tfmem_widgets.tf import nvml
def used():
    return nvml.read_gpu(nvml.nvml_index_for_cuda_ordinal(0, nvml.read_gpus())).used_bytes
"""


def fresh(code, env=None, first=""):
    return run_fresh(PRELUDE + first + "\n" + textwrap.dedent(code), env=env)


def test_default_limit_is_free_memory_minus_the_reserve_and_the_gap_adds_up():
    out = fresh(
        """
        import tensorflow as tf
        tf.config.list_logical_devices("GPU")            # creates the CUDA context and the devices
        free_after_context = nvml.read_gpus()[0].free_bytes
        r = tfmem_widgets.report()
        gpu = r.gpus[0]
        print(json.dumps({"limit": gpu.limit_bytes, "free": free_after_context,
                          "total": gpu.memory.total_bytes, "gap": [[i.bytes, i.label] for i in gpu.gap],
                          "cc": list(gpu.compute_capability), "text": repr(r)}))
        """
    )
    print(out["text"])
    from tfmem_widgets.tf.system_reserve import system_reserve

    reserve, _ = system_reserve(out["free"], out["cc"][0], env={})
    # TensorFlow reads free memory itself, a few MiB apart from NVML's reading after it.
    assert abs(out["limit"] - (out["free"] - reserve)) <= 16 * MiB
    assert sum(b for b, _ in out["gap"]) == out["total"] - out["limit"]
    assert out["gap"][0][0] == reserve and "system reserve" in out["gap"][0][1]


def test_without_growth_the_first_tensor_takes_the_whole_limit():
    out = fresh(
        """
        import tensorflow as tf
        tf.config.list_logical_devices("GPU")
        before = used()
        x = tf.zeros((256,))
        jump = used() - before
        limit = tfmem_widgets.report().gpus[0].limit_bytes
        print(json.dumps({"jump": jump, "limit": limit}))
        """
    )
    assert abs(out["jump"] - out["limit"]) <= 64 * MiB


def test_growth_grows_in_regions_and_never_gives_back():
    out = fresh(
        """
        r = tfmem_widgets.setup(growth=True)
        import tensorflow as tf, gc
        tf.config.list_logical_devices("GPU")
        start = used()
        small = tf.zeros((256,))
        after_small = used() - start
        with tfmem_widgets.measure() as m:
            big = tf.zeros((25 << 20,))            # 100 MiB
        after_big = used() - start
        del small, big; gc.collect()
        after_del = used() - start
        print(json.dumps({"code": r.code, "small": after_small, "big": after_big, "after_del": after_del,
                          "peak": m.peak_bytes, "current": tf.config.experimental.get_memory_info("GPU:0")["current"]}))
        """
    )
    assert "set_memory_growth(gpus[0], True)" in out["code"]
    assert out["small"] <= 8 * MiB, "growth: the first region is small"
    assert 100 * MiB <= out["big"] <= 300 * MiB
    assert out["after_del"] == out["big"], "nothing goes back to the driver"
    assert out["current"] < 1 * MiB


def test_logical_devices_each_preallocate_their_limit_and_force_growth_stops_it():
    code = """
        import tensorflow as tf
        names = [d.name for d in tf.config.list_logical_devices("GPU")]
        jumps = []
        for name in names:
            before = used()
            with tf.device(name):
                x = tf.zeros((256,))
            jumps.append(used() - before)
        r = tfmem_widgets.report()
        print(json.dumps({"names": [n.split("device:")[-1] for n in names], "jumps": jumps,
                          "cards": len(tf.config.list_physical_devices("GPU")),
                          "limits": [[d.limit_bytes for d in g.devices] for g in r.gpus], "text": repr(r)}))
        """
    pre = fresh(code, first="tfmem_widgets.setup(split=[1024, 512])")
    print(pre["text"])
    cards = pre["cards"]   # the split applies to each card TensorFlow sees: two logical devices a card
    assert cards >= 1 and pre["names"] == [f"GPU:{i}" for i in range(2 * cards)]
    assert pre["limits"] == [[1024 * MiB, 512 * MiB]] * cards
    # the first card's devices (each preallocates its limit); NVML's figure is of the first card alone
    assert abs(pre["jumps"][0] - 1024 * MiB) <= 8 * MiB and abs(pre["jumps"][1] - 512 * MiB) <= 8 * MiB
    grow = fresh(code, first="tfmem_widgets.setup(split=[1024, 512], force_growth=True)")
    assert all(j <= 16 * MiB for j in grow["jumps"])


def test_split_by_count_divides_what_tensorflow_may_use():
    out = fresh(
        """
        r = tfmem_widgets.setup(split=2)
        import tensorflow as tf
        print(json.dumps({"sizes": [len(tf.config.list_logical_devices("GPU"))], "code": r.code,
                          "cards": len(tf.config.list_physical_devices("GPU"))}))
        """
    )
    cards = out["cards"]   # two logical devices on each card, one line of code a card
    assert cards >= 1 and out["sizes"] == [2 * cards] and out["code"].count("memory_limit=") == 2 * cards


def test_tensorflows_own_rules_and_ours_agree():
    out = fresh(
        """
        import tensorflow as tf
        gpu = tf.config.list_physical_devices("GPU")[0]
        errors = {}
        # TensorFlow: growth after logical devices raises.
        tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except ValueError as exc:
            errors["tf"] = str(exc)
        try:
            tfmem_widgets.setup(growth=True)
        except tfmem_widgets.SetupError as exc:
            errors["ours"] = str(exc)
        try:
            tfmem_widgets.setup(limit_mb=10**7)
        except tfmem_widgets.SetupError as exc:
            errors["too_big"] = str(exc)
        try:
            tfmem_widgets.setup(gpus=[7])
        except tfmem_widgets.SetupError as exc:
            errors["no_gpu"] = str(exc)
        tf.zeros((4,))
        try:
            tfmem_widgets.setup(force_growth=True)
        except tfmem_widgets.StateError as exc:
            errors["late"] = str(exc)
        print(json.dumps(errors))
        """
    )
    assert "Cannot set memory growth on device when virtual devices configured" in out["tf"]
    assert "already has logical devices" in out["ours"]
    assert "in all (NVML)" in out["too_big"]
    assert "no GPU 7" in out["no_gpu"]
    assert "already started" in out["late"]


def test_growth_set_earlier_then_a_limit_is_refused_before_tensorflow_drops_it():
    out = fresh(
        """
        tfmem_widgets.setup(growth=True)
        try:
            tfmem_widgets.setup(limit_mb=1024)
            refusal = None
        except tfmem_widgets.SetupError as exc:
            refusal = str(exc)
        # What the popular snippet does instead: accepted by TensorFlow, growth silently gone.
        import tensorflow as tf
        gpu = tf.config.list_physical_devices("GPU")[0]
        tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
        tf.config.list_logical_devices("GPU")
        before = used()
        x = tf.zeros((256,))
        print(json.dumps({"refusal": refusal, "jump": used() - before}))
        """
    )
    assert "silently drop" in out["refusal"]
    assert abs(out["jump"] - 1024 * MiB) <= 8 * MiB, "growth was dropped: the whole limit is taken"


def test_measure_and_magics_on_the_gpu():
    out = fresh(
        """
        ip.run_line_magic("tfmem", "setup --growth")
        m = ip.run_cell_magic("tfmem", "-o -q", KEEP_8_DROP_16)
        r = ip.run_line_magic("tfmem", "-o -q")
        print(json.dumps({"device": m.device, "peak": m.peak_bytes, "delta": m.delta_bytes, "text": repr(r)}))
        """,
        first=FRESH_SHELL,
    )
    print(out["text"])
    assert out["device"] == "GPU:0"
    assert abs(out["peak"] - 24 * MiB) <= 4096 and abs(out["delta"] - 8 * MiB) <= 4096
    assert "NVML" in out["text"] and "this process" in out["text"]


def test_cuda_malloc_async_counts_unrounded_bytes():
    out = fresh(
        """
        r = tfmem_widgets.setup(allocator="cuda_malloc_async")
        import tensorflow as tf
        with tfmem_widgets.measure() as m:
            x = tf.zeros((25 << 20,))             # 100 MiB
        print(json.dumps({"code": r.code, "peak": m.peak_bytes, "text": repr(tfmem_widgets.report())}))
        """
    )
    print(out["text"])
    assert 'TF_GPU_ALLOCATOR"] = "cuda_malloc_async"' in out["code"]
    assert 100 * MiB <= out["peak"] < 100 * MiB + 64 * 1024


def test_trace_on_two_logical_gpus_rebuilds_the_oom_dump_and_draws(tmp_path):
    # Two 64 MB logical GPUs with growth forced: the fragmentation pattern on GPU:0 ends in a
    # real OOM of GPU_0_bfc; GPU:1 only allocates. GPU garbage collection is switched off so
    # that no wholly free region is handed back between the last event and the dump.
    out = fresh(
        f"""
        import numpy as np, matplotlib
        matplotlib.use("Agg")
        tfmem_widgets.setup(split=[64, 64], force_growth=True)
        import tensorflow as tf
        try:
            with tfmem_widgets.trace() as t:
                with tf.device("GPU:1"):
                    other = [tf.zeros((1 << 18,)) for _ in range(3)]
                with tf.device("GPU:0"):
                    ts = [tf.zeros((1 << 19,)) for _ in range(24)]
                    ts = ts[1::2]
                    tf.zeros((4 << 20,))
            raised = False
        except tf.errors.ResourceExhaustedError:
            raised = True
        e = t.events("GPU_0_bfc")
        rebuilt = t.replay("GPU_0_bfc", len(e) - 1).snapshot()
        dump = t.dumps["GPU_0_bfc"]
        series = t.fragmentation_series("GPU_0_bfc")
        t.plot_map("GPU_0_bfc").figure.savefig({str(tmp_path / 'map.png')!r})
        t.plot_snapshot(allocator="GPU_0_bfc").figure.savefig({str(tmp_path / 'snapshot.png')!r})
        chunks = lambda m: [(c.address, c.size, c.in_use) for c in m.chunks]
        print(json.dumps({{
            "raised": raised, "allocators": t.allocators, "oom": t.oom.allocator if t.oom else None,
            "equal": chunks(rebuilt) == chunks(dump), "chunks": len(dump.chunks),
            "frag_diff": float(np.nanmax(np.abs(series - e.fragmentation))),
            "gpu1_events": len(t.events("GPU_1_bfc")), "gpu1_complete": t.map(allocator="GPU_1_bfc").complete,
            "text": repr(t)}}))
        """,
        env={"TF_ENABLE_GPU_GARBAGE_COLLECTION": "false"},
    )
    print(out["text"])
    assert out["raised"] and out["oom"] == "GPU_0_bfc"
    assert {"GPU_0_bfc", "GPU_1_bfc"} <= set(out["allocators"])
    assert out["equal"] and out["chunks"] > 10 and out["frag_diff"] <= 1e-6
    assert out["gpu1_events"] >= 3 and out["gpu1_complete"]
    assert (tmp_path / "map.png").stat().st_size > 0 and (tmp_path / "snapshot.png").stat().st_size > 0


def test_a_plan_with_the_fits_data_on_the_gpu_meets_the_probes_measured_peak():
    # A probe fits on make_batch's arrays made into a dataset: on a GPU they become a constant on the
    # device, beside the step's own copy of the batch. The plan search counts that share, measured, and
    # what the growing pool hands out for the step: its 388 MiB buffer took a new 512 MiB region whole
    # on the H100 (the no-split rule; without it the plan stood 106 MiB under the fit's peak). The fit
    # runs first, as in a probe's fresh process; then the plan.
    out = fresh(
        "tfmem_widgets.setup(growth=True)\n" + PROBE_DATA_MODEL + textwrap.dedent("""
        model.fit(probe_dataset(make_batch(32768), 2), epochs=1, verbose=0)
        peak = tf.config.experimental.get_memory_info("GPU:0")["peak"]
        share = data_on_device(make_batch, model)
        planned = tfmem_widgets.plan(model, make_batch(8), 32768)
        held = tuple(int(size * share) for size in planned.batch_sizes)
        print(json.dumps({"share": share, "step": planned.step_bytes, "batch": planned.batch_bytes,
                          "resident": planned.resident_bytes, "held": sum(held), "peak": peak,
                          "take": planned.take_in_fresh_pool(held=held), "text": repr(planned)}))
        """),
        env={"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
    )
    print(out.pop("text"), out)
    assert abs(out["share"] - 1.0) < 0.01   # the arrays, once, on the device
    assert out["take"] is not None and out["take"] >= out["step"]
    planned = out["resident"] + out["held"] + out["batch"] + out["take"]
    # The small variables' chunks, shaped by Keras initializers' transients, take a few MiB more whole than the
    # pool model knows (10.0 MiB on the H100); the step's own buffer is placed as the model places it.
    assert planned <= out["peak"] <= planned + 16 * MiB


def test_the_package_profiles_the_host_alone_and_the_device_tracer_is_off():
    # TensorFlow's defaults turn the device tracer (CUPTI) on; the package's options are taken, so
    # its sessions hold no device plane, and asking for the device tracer shows the check can fail.
    out = fresh(
        """
        import glob, tempfile, tensorflow as tf
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
        from tfmem_widgets.tracing.profiler import profiler_options, profiler_start, profiler_stop

        def planes(**levels):
            folder = tempfile.mkdtemp()
            profiler_start(folder, options=profiler_options(**levels))
            for _ in range(10):
                x = tf.fill((1 << 20,), 1.0) + 1.0
            float(tf.reduce_sum(x))
            profiler_stop()
            space = xplane_pb2.XSpace()
            space.ParseFromString(open(glob.glob(f"{folder}/plugins/profile/*/*.xplane.pb")[0], "rb").read())
            names = {m.name for plane in space.planes for m in plane.event_metadata.values()}
            return [p.name for p in space.planes], "MemoryAllocation" in names

        with tfmem_widgets.trace() as t:
            tf.fill((1 << 20,), 1.0) + 1.0
        print(json.dumps({"package": planes(), "device_on": planes(device_tracer_level=1),
                          "log": t.log, "allocators": list(t.allocators)}))
        """
    )
    package_planes, allocations = out["package"]
    assert allocations and not [p for p in package_planes if p.startswith("/device:GPU")], package_planes
    assert [p for p in out["device_on"][0] if p.startswith("/device:GPU")], out["device_on"]
    assert "expects" not in out["log"] and "GPU_0_bfc" in out["allocators"]


def test_gauge_and_panel_show_each_logical_gpu_and_the_real_card():
    out = fresh(
        """
        tfmem_widgets.setup(split=[1024, 512])
        import tensorflow as tf
        for name in ("GPU:0", "GPU:1"):
            with tf.device(name):
                tf.zeros((256,))
        from tfmem_widgets.notebook.widgets import Gauge, SetupPanel
        gauge = Gauge(interval=0.1)
        import time; time.sleep(0.5)
        sample = gauge.last_sample
        card = nvml.read_gpus()[0]
        panel = SetupPanel()
        rows = {name: (row["in_use"].value, row["in_use"].max) for name, row in gauge.rows.items()}
        gauge.close()
        print(json.dumps({"rows": rows, "devices": [[d.name, d.in_use_bytes, d.limit_bytes] for d in sample.devices],
                          "card_total": card.total_bytes, "slider_max": panel.limit.max,
                          "gpu_rows": [[g.index, g.used_bytes, g.total_bytes] for g in sample.gpus]}))
        """
    )
    devices = {name: (in_use, limit) for name, in_use, limit in out["devices"]}
    assert devices["GPU:0"][1] == 1024 * MiB and devices["GPU:1"][1] == 512 * MiB
    assert devices["GPU:0"][0] > 0 and devices["GPU:1"][0] > 0
    assert out["rows"]["GPU:0"][1] == 1024 * MiB and out["rows"]["GPU:1"][1] == 512 * MiB
    assert out["gpu_rows"][0][2] == out["card_total"] and out["gpu_rows"][0][1] > 1536 * MiB
    assert out["slider_max"] == out["card_total"] // MiB, "the panel's limit is bounded by the real card"
    assert out["rows"]["card 0"][1] == out["card_total"]


def test_the_workbooks_gpu_experiments_run_live_and_measure_what_they_say():
    from gpu_experiments import gpu_result  # notebooks/, on the path by tests/conftest.py

    order = gpu_result("logical_then_growth")
    assert order.live and "live on" in repr(order)
    assert order.values["error"] == "Cannot set memory growth on device when virtual devices configured"
    dropped = gpu_result("growth_then_logical")
    assert dropped.values["nvml_delta"] >= 1000 << 20        # the whole 1024 MB limit
    forced = gpu_result("force_growth_logical")
    assert forced.values["nvml_delta"] < 64 << 20            # a small first region


KERAS_OOM = """
import io, contextlib, sys, time
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
STARTED = time.time()
class Said(io.StringIO):  # what the cell is told on stderr, kept and passed on as it comes, timed
    def write(self, text):
        if text.startswith("tfmem"):
            sys.__stderr__.write(f"@{time.time() - STARTED:.1f}s ")
        sys.__stderr__.write(text)
        sys.__stderr__.flush()
        return super().write(text)
shown, said = io.StringIO(), Said()
def cell(source):
    with contextlib.redirect_stdout(shown), contextlib.redirect_stderr(said):
        return ip.run_cell(source)
cell("%load_ext tfmem_widgets")
cell("%tfmem setup --limit 1024")
cell('''
import numpy as np, keras, tensorflow as tf
model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu", name="wide"),
                          keras.layers.Dense(4096, activation="relu", name="wider"), keras.layers.Dense(1, name="out")])
model.compile("adam", "mse"JIT)   # Keras' default on a GPU: the train step is an XLA program
x = np.random.rand(ROWS, 1024).astype("float32"); y = np.random.rand(ROWS, 1).astype("float32")
''')
result = cell("model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)")
r = tfmem_widgets.last_oom()
print(json.dumps({"raised": type(result.error_in_exec).__name__ if result.error_in_exec else None,
                  "jit": bool(ip.user_ns["model"].jit_compile), "said": said.getvalue(),
                  "shown": shown.getvalue(), "verdict": r and r.verdict, "allocator": r and r.allocator,
                  "limit": r and r.limit_bytes, "capacity": r and r.capacity_bytes,
                  "request": r and r.request_bytes, "largest": r and r.largest_free_bytes,
                  "keys": r and list(r.by_layer())}))
"""


def _keras_oom(jit, rows, batch, env=None):
    code = KERAS_OOM.replace("JIT", jit).replace("ROWS", str(rows)).replace("BATCH", str(batch))
    return fresh(code, env=env)


def test_a_keras_fit_without_xla_that_runs_out_of_a_logical_device_limit_is_explained():
    out = _keras_oom(", jit_compile=False", 32768, 16384)
    assert out["raised"] == "ResourceExhaustedError" and not out["jit"]
    assert out["allocator"] == "GPU_0_bfc" and out["limit"] == 1024 * MiB
    assert out["request"] > out["largest"]
    assert out["verdict"] == "limit" and out["capacity"] >= 8 * out["limit"]   # the card has far more
    # largest first: at batch 16,384 each 4096-wide activation is 256 MiB, more than `wider`'s weights and
    # Adam's slots (192 MiB); TensorFlow's dump names no op, so they are said as such, and `wider` leads the layers
    assert out["keys"][0] == "(activations and temporaries)"
    assert [k for k in out["keys"] if not k.startswith("(")][0] == "sequential/wider"
    assert "OOM in GPU_0_bfc" in out["shown"]


def test_an_xla_fit_that_runs_out_of_memory_is_explained_or_said_while_it_waits():
    # Keras' default on a GPU compiles the step with XLA. With XLA's GEMM autotuner off, a fit too big
    # for the limit raises and is explained; with it on, the autotuner is refused scratch memory again
    # and again (10 s each, measured for minutes): the cell is told while it waits. The two fits run
    # side by side, each under its own 1 GiB limit, and the waiting one is stopped once it was told.
    import json
    import re
    import threading

    from conftest import start_fresh

    code = PRELUDE + KERAS_OOM.replace("JIT", "").replace("ROWS", "32768").replace("BATCH", "32768")
    raised = start_fresh(code, env={"XLA_FLAGS": "--xla_gpu_autotune_level=0"})
    code = PRELUDE + KERAS_OOM.replace("JIT", "").replace("ROWS", "16384").replace("BATCH", "8192")
    waits = start_fresh(code)
    lines, told = [], threading.Event()

    def listen():  # the waiting cell's stderr, line by line, until it was told what fits
        for line in waits.stderr:
            lines.append(line)
            said = "".join(lines)
            if "still refused" in said and "interrupt the cell and fit with batch_size=" in said:
                told.set()
                return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    told.wait(timeout=90)
    waits.kill()
    waits.wait()
    listener.join(timeout=5)
    said = "".join(lines)

    stdout, stderr = raised.communicate(timeout=240)
    out = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
    assert out["jit"] and out["raised"] == "ResourceExhaustedError"
    assert out["allocator"] == "GPU_0_bfc" and out["request"] > out["largest"]   # XLA's "1.56GiB", read
    assert out["verdict"] == "limit"
    assert "an XLA program" in out["shown"] and "the process aborts later" in out["shown"]
    # ... as it does: TensorFlow's allocator check fails when the process frees its tensors.
    assert raised.returncode == -6 and "bfc_allocator.cc" in stderr and "Check failed" in stderr

    assert "first: GPU_0_bfc" in said   # said while the cell still waits
    assert "still refused" in said and "--xla_gpu_autotune_level=0" in said
    # ... and within 30 s of its first refusal, what the step needs and what fits, planned on the CPU
    # from a copy of the model while the autotuner waits (the figure is printed for the record)
    early = re.search(r"@([\d.]+)s tfmem: this fit's XLA step was refused memory; planned in (\d+) s", said)
    assert early, said
    print(f"told what the step needs at {early.group(1)} s of the cell, after {early.group(2)} s of plans")
    told_text = said[early.start():]
    assert "XLA's CPU program of a copy of the model" in told_text and "against the 1.00 GiB limit" in told_text
    assert "what fits: at most batch" in told_text and "interrupt the cell and fit with batch_size=" in told_text


def test_the_callback_reads_each_logical_gpu_under_mirrored_strategy_and_marks_the_gauge():
    out = fresh(
        """
        tfmem_widgets.setup(split=[1024, 1024])
        import keras, numpy as np, tensorflow as tf
        from tfmem_widgets.readings.callback import MemoryCallback
        from tfmem_widgets.notebook.widgets import Gauge

        gauge = Gauge(interval=600)
        # the cross-device reduction of notebook 5: every gradient summed on GPU:0
        strategy = tf.distribute.MirroredStrategy(["GPU:0", "GPU:1"],
                                                  cross_device_ops=tf.distribute.ReductionToOneDevice())
        with strategy.scope():
            model = keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile("adam", "mse", jit_compile=False)
        x = np.ones((2048, 1024), "float32"); y = np.ones((2048, 1), "float32")
        callback = MemoryCallback()
        history = model.fit(x, y, batch_size=256, epochs=3, verbose=0, callbacks=[callback])
        params = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)
        print(json.dumps({"history": {k: v for k, v in history.history.items() if k.startswith("tfmem")},
                          "params": params, "warnings": callback.warnings, "notes": callback.notes,
                          "text": repr(callback), "marks": [label for _, label in gauge.marks]}))
        gauge.close()
        """
    )
    h = out["history"]
    print(out["text"])
    peaks = {r: h[f"tfmem_peak_bytes/{r}"] for r in ("GPU:0", "GPU:1")}
    in_use = {r: h[f"tfmem_in_use_bytes/{r}"] for r in ("GPU:0", "GPU:1")}
    for replica in peaks:
        assert len(peaks[replica]) == 3 and all(p <= 1024 * MiB for p in peaks[replica])
        # each logical GPU's own allocator holds its own copy of the weights (and Adam's slots)
        assert all(u >= 3 * out["params"] for u in in_use[replica])
    assert h["tfmem_peak_bytes"] == [max(a, b) for a, b in zip(peaks["GPU:0"], peaks["GPU:1"])]
    assert out["notes"] == []  # no shared allocator here
    differ = any(abs(a - b) >= 0.1 * max(a, b) for a, b in zip(peaks["GPU:0"], peaks["GPU:1"]))
    assert differ == any("replicas' peaks differ" in w for w in out["warnings"])
    assert out["marks"] == ["epoch 1", "epoch 2", "epoch 3"]


def test_the_graph_walk_of_a_dense_step_is_its_peak_on_the_gpu():
    # A Keras step without XLA, as a replica runs it: the executor's walk of the traced step (plans/graphstep.py)
    # against the step's peak beyond what it was given, run four times (the order of its ops may vary).
    out = fresh(
        """
        import keras, tensorflow as tf
        from tfmem_widgets.plans.step import compile_step
        from tfmem_widgets.plans.graphstep import graph_step_peak
        L = keras.layers
        rows = []
        for batch, width in ((2048, 2048), (4096, 4096)):
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((1024,)), L.Dense(width, activation="relu"),
                                      L.Dense(width, activation="relu"), L.Dense(10)])
            model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
            model.optimizer.build(model.trainable_variables)
            specs = (tf.TensorSpec((batch, 1024), tf.float32), tf.TensorSpec((batch,), tf.int64))
            _, concrete, *_ = compile_step(model, specs, "/GPU:0", compile=False)
            walked = graph_step_peak(concrete.graph).bytes
            x, y = tf.random.normal((batch, 1024)), tf.zeros((batch,), tf.int64)
            concrete(x, y)
            measured = []
            for _ in range(4):
                tf.config.experimental.reset_memory_stats("GPU:0")
                before = tf.config.experimental.get_memory_info("GPU:0")["current"]
                concrete(x, y)
                measured.append(tf.config.experimental.get_memory_info("GPU:0")["peak"] - before)
            rows.append({"width": width, "walked": walked, "measured": measured})
        print(json.dumps({"rows": rows}))
        """
    )
    print(out)
    for row in out["rows"]:
        for measured in row["measured"]:
            assert abs(row["walked"] / measured - 1) < 0.02, row


def test_a_mirrored_fit_on_two_logical_gpus_is_planned_per_replica():
    # Two logical GPUs of one card, each its own allocator: the plan of each replica against the callback's
    # per-replica peaks (the highest epoch). A replica's step is a graph step (Keras turns XLA off under the
    # strategy), walked as the executor runs it (plans/graphstep.py); GPU:0 also holds a global batch and a third
    # batch (traces on an H100, docs/plans.md).
    out = fresh(
        """
        tfmem_widgets.setup(split=[12000, 12000])
        from tfmem_widgets.readings.callback import MemoryCallback
        """ + textwrap.indent(MIRRORED_MODEL.format(devices=["GPU:0", "GPU:1"], width=4096, rows=3 * 8192), "        ") + """
        planned = tfmem_widgets.plan(model, (x, y), 8192)
        history = model.fit(x, y, batch_size=8192, epochs=2, verbose=0, callbacks=[MemoryCallback()])
        print(json.dumps({"planned": {r.device: r.peak_bytes for r in planned.replicas}, "text": repr(planned),
                          "busiest": planned.busiest.device, "peak": planned.peak_bytes,
                          "measured": {r: max(history.history[f"tfmem_peak_bytes/{r}"]) for r in ("GPU:0", "GPU:1")}}))
        """
    )
    print(out["text"], out["measured"])
    assert out["busiest"] == "GPU:0" and out["peak"] == out["planned"]["GPU:0"]  # the fit's arrays are there
    assert out["measured"]["GPU:0"] > out["measured"]["GPU:1"]
    for replica, planned in out["planned"].items():
        assert abs(planned / out["measured"][replica] - 1) < 0.02, (replica, planned, out["measured"][replica])
    assert "all-reduced by CollectiveAllReduce" in out["text"] and "the busiest replica, GPU:0" in out["text"]
    assert "the graph executor's walk of one replica's traced step" in out["text"]


def test_the_plan_search_probes_its_answer_and_the_batch_past_it_side_by_side_under_a_limit():
    # Each probe under a 1000 MB logical device limit of its own: a card with room for both runs the plans'
    # answer and the batch just past it at once, each in a fresh process, and the edge they find is the
    # search's, within its resolution (one probe's time for two).
    import math

    import tfmem_widgets
    from tfmem_widgets.search.warm import room_for_two

    setup, env = {"limit_mb": 1000}, {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    assert room_for_two(setup, env) is not None, "a lent card holds two processes of 1000 MB and more"
    search = tfmem_widgets.max_batch_size(*search_functions(jit=True), setup=setup, env=env, high=262144, method="plan",
                                          progress=False, margin=0.2)
    print(repr(search))
    answer, past = search.probes[0].batch, search.probes[1].batch
    assert search.plans and past == answer + math.ceil(answer * 0.02)
    assert any(note.startswith(f"batches {answer:,} and {past:,} were probed side by side: two processes, each "
                               "under its 1000 MB limit, where GPU 0 had") for note in search.notes), search.notes
    largest, failure = search.edge
    assert largest is not None and failure is not None and failure - largest <= math.ceil(largest * 0.02)
    assert search.limit_bytes == 1000 * MiB  # read by a probe that trained (one ended at its first refusal reads none)
    # The plans measured only the edge: with a margin, probes are aimed below the failure, and the batch
    # recommended is probed in a second process; its peaks left the margin free in both. (A margin over 128 MiB:
    # under it, near the edge a step's buffer takes a free chunk whole, and the peaks there count the chunk: at
    # 5% of this limit, 51,628 and 54,367 rows both peaked at 992.2 MiB.)
    recommended = search.recommended
    assert recommended is not None and 0.5 * failure <= recommended <= 0.8 * failure
    assert search.trained_at(recommended) >= 2 and 2 <= search.margin_probes <= 5
    assert all(p.peak_bytes <= 0.8 * 1000 * MiB for p in search.fitted if p.batch == recommended)


def test_the_plan_searchs_probe_at_its_answer_reads_what_the_plans_compiles_timed():
    # Keras' default compile on a GPU, XLA's autotuner on: the plans' process writes what its compiles timed, and
    # the probe at the plans' answer, begun after them, has XLA read it (search/warm.SharedAutotune); it trains
    # as the plans said, and the probe past it fails, within the search's resolution.
    import math

    import tfmem_widgets

    search = tfmem_widgets.max_batch_size(*search_functions(jit=True), setup={"limit_mb": 1000}, high=262144,
                                          method="plan", progress=False)
    print(repr(search))
    read = [note for note in search.notes if "kernel timings XLA's autotuner made while the plans compiled" in note]
    assert len(read) == 1 and int(read[0].split(" read the ")[1].split()[0]) > 0, search.notes
    answer = search.probes[0]
    assert answer.batch == search.plan_answer and answer.fits
    largest, failure = search.edge
    assert largest == answer.batch and failure is not None and failure - largest <= math.ceil(largest * 0.02)
    # The batch past the answer was planned too: its probe timed no kernel, so it ended at its first refusal.
    past = search.probes[1]
    assert past.batch == failure and past.batch in {p.batch_size for p in search.plans}, search.plans
    assert past.died == REFUSED, past


def test_a_fit_in_a_fresh_process_finds_every_kernel_of_its_step_in_what_the_plan_timed(tmp_path):
    # What a plan search's probe at a planned batch reads (search/warm.SharedAutotune): a plan's compile in one
    # process writes what XLA's autotuner timed; a fit at that batch in another, told to read it and to refuse
    # any kernel not in it (XLA's --xla_gpu_require_complete_aot_autotune_results), trains: its step's kernels
    # are all there, so it times none (and a refusal in it is its program's own).
    from tfmem_widgets.fresh.run import check_request, run_checked

    timed, setup = tmp_path / "timed.txt", {"limit_mb": 1000}
    plan_code = PROBE_DATA_MODEL + ("from tfmem_widgets.plans.plan import plan\n"
                                    "plan(model, make_batch(8), 4096, build=True, place=False)")
    run_checked(plan_code, setup=check_request(setup, None), echo=False, remember_oom=False,
                env={"XLA_FLAGS": f"--xla_gpu_dump_autotune_results_to={timed}"})
    assert timed.read_text().count("results {") > 0
    env = {"XLA_FLAGS": f"--xla_gpu_load_autotune_results_from={timed} --xla_gpu_require_complete_aot_autotune_results=true"}
    assert trains_like_a_probe(4096, setup, env)
    assert not trains_like_a_probe(4093, setup, env)  # other shapes: a kernel not timed there is refused


def test_a_probe_search_asked_away_from_its_edge_plans_once_and_its_answer_trains_on_the_gpu():
    # Issue 43 fault 6 on a GPU: a probe search under a 1000 MB logical device, asked what fits under 500 MB,
    # plans the step once in one fresh process and places the plans in a fresh pool under that limit (the
    # fit's data on the device beside them, measured): that batch trains under a 500 MB limit, a fifth more not.
    import tfmem_widgets

    setup, env = {"limit_mb": 1000}, {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    search = tfmem_widgets.max_batch_size(*search_functions(jit=True), setup=setup, env=env, high=262144,
                                          method="probe", progress=False, resolution=0.1)
    assert search.edge[1] is not None and not search.plans
    half = search.batch_for(500 * MiB)
    print(repr(search), half)
    assert search.plans and search.plans_after_seconds > 0 and 0 < half < search.edge[0]
    assert [trains_like_a_probe(n, {"limit_mb": 500}, env) for n in (half, half * 6 // 5)] == [True, False], half


def test_a_gpu_plan_draws_its_program_and_its_live_buffers_add_up_to_the_anatomy():
    # StepPlan.plot on XLA's GPU heap trace (Keras' default compile, the autotuner on): at the peak the live
    # buffers are the anatomy's bytes less the step's outputs, to the byte, within the temporaries' allocation.
    out = fresh("tfmem_widgets.setup(growth=True)\n" + PROBE_DATA_MODEL + textwrap.dedent("""
        import matplotlib
        matplotlib.use("Agg")
        planned = tfmem_widgets.plan(model, make_batch(8), 32768)
        line = planned.timeline
        at = line.moments.index(line.peak_moment)
        ax = planned.plot()
        ax.figure.savefig(os.path.join(os.environ.get("OUT") or "/tmp", "gpu_plan_program.png"), dpi=90,
                          bbox_inches="tight")
        print(json.dumps({"peak": line.peak_bytes, "allocation": line.allocation_bytes, "events": line.events,
                          "at_peak": dict((k, v[at]) for k, v in line.series), "allocations": list(planned.step_allocations),
                          "layers": dict(planned.layers.items()), "device": planned.device,
                          "legend": [t.get_text() for t in ax.get_legend().get_texts()]}))
        """))
    print(out)
    assert out["device"] == "GPU:0" and out["allocation"] in out["allocations"]
    assert 0 < out["peak"] <= out["allocation"] and sum(out["at_peak"].values()) == out["peak"]
    assert sum(out["layers"].values()) == out["peak"] + sum(out["allocations"]) - out["allocation"]
    assert any(text.startswith("peak of the live buffers") for text in out["legend"])


ATTENTION_AT = "import json\n" + gpu_experiments.ATTENTION_MODEL.replace("JIT", "False")  # op by op


def test_a_graph_step_at_2_to_the_31_elements_is_foreseen_by_its_plan_and_aborts_a_real_fit():
    # The plans at 4,095 and 4,096 rows (scores of 2^31 elements at 4,096), then each batch fitted in a process
    # of its own: 4,095 trains, 4,096 dies in TensorFlow's check (SIGABRT), as the plan said, memory or not.
    planned = fresh(ATTENTION_AT + """
sample = (np.ones((2, 256), "int32"), np.ones((2,), "int64"))
plans = {b: tfmem_widgets.plan(model, sample, b) for b in (4095, 4096)}
print(json.dumps({b: dict(risks=len(p.abort_risks), fits=p.fits(), below=p.largest_batch_before_abort,
                          text=repr(p)) for b, p in plans.items()}))
""", env={"XLA_FLAGS": "--xla_gpu_autotune_level=0"})
    print(planned["4096"]["text"])
    assert planned["4095"]["risks"] == 0 and planned["4095"]["fits"] and planned["4096"]["below"] == 4095
    assert planned["4096"]["risks"] > 0 and not planned["4096"]["fits"] and "ABORTS on a GPU:" in planned["4096"]["text"]
    fitted = {}
    for batch in (4095, 4096):
        code = ATTENTION_AT + f"""
model.fit(np.ones(({batch}, 256), "int32"), np.ones(({batch},), "int64"), batch_size={batch}, epochs=1, verbose=0)
print("trained")
"""
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env=child_environment())
        fitted[batch] = (done.returncode, done.stdout.strip().splitlines()[-1:] , done.stderr[-2000:])
    print({batch: (code, [line for line in err.splitlines() if "Check failed" in line]) for batch, (code, _, err)
           in fitted.items()})
    assert fitted[4095][:2] == (0, ["trained"]), fitted[4095][2]
    assert fitted[4096][0] == -signal.SIGABRT and "Check failed" in fitted[4096][2], fitted[4096]


def test_the_guard_stops_a_fit_that_would_abort_and_a_kernel_the_abort_killed_is_explained_by_the_next(tmp_path):
    # As a user would: a Jupyter kernel, growth, the guard, the attention model without XLA. The guard stops the fit
    # at 16,384 before its first step and lets a small one run (its cost printed); with the guard off, the fit at
    # 4,096 kills the kernel in TensorFlow's check, and the next kernel started in the folder tells why.
    from conftest import run_in_kernel, start_kernel, told_by_the_next_kernel, until_kernel_dies

    folder, records = tmp_path / "notebooks", tmp_path / "records"
    folder.mkdir()
    manager, client = start_kernel(folder, records)
    try:
        run_in_kernel(client, "%load_ext tfmem_widgets\n%tfmem setup --growth")
        print(run_in_kernel(client, "%tfmem guard\n" + ATTENTION_AT + "\nimport time"))
        stopped = run_in_kernel(client, """
started = time.perf_counter()
try:
    model.fit(np.ones((16384, 256), "int32"), np.ones((16384,), "int64"), batch_size=16384, epochs=1, verbose=0)
except Exception as error:
    print(type(error).__name__, error)
print(f"stopped after {time.perf_counter() - started:.1f} s, steps run: {int(model.optimizer.iterations.numpy())}")
""", timeout=900)
        print(stopped)
        assert "FitStopped tfmem guard stopped this fit before its first step: at batch 16,384" in stopped
        assert "2^31 elements" in stopped and "steps run: 0" in stopped
        below = int(stopped.split("A batch of at most ")[1].split()[0].replace(",", ""))
        assert 0 < below <= 4095
        costs = run_in_kernel(client, """
import tfmem_widgets.notebook.fit_hook
x, y = np.ones((8192, 256), "int32"), np.ones((8192,), "int64")
model.fit(x, y, batch_size=256, epochs=1, verbose=0)  # (the step traced and run once, guard on: planned)
seconds = {}
for name, on in (("off", False), ("on, planned first", True), ("on, planned already", True)):
    if on != tfmem_widgets.notebook.fit_hook.guarding():
        tfmem_widgets.notebook.fit_hook.guard(on)
    started = time.perf_counter()
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)
    seconds[name] = time.perf_counter() - started
print("guard cost, one epoch of 32 steps at 256:", {k: round(v, 2) for k, v in seconds.items()})
""", timeout=900)
        print(costs)
        assert "guard cost" in costs
        run_in_kernel(client, "%tfmem guard off")
        until_kernel_dies(manager, client, 'model.fit(np.ones((4096, 256), "int32"), np.ones((4096,), "int64"), '
                                           'batch_size=4096, epochs=1, verbose=0)', timeout=600)
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
    (told,) = told_by_the_next_kernel(folder, records)
    print(told)
    assert "a kernel started in this folder before this one died" in told and "killed by SIGABRT (signal 6)" in told
    assert "Check failed" in told and "batch_size=4096" in told
    assert "a TensorFlow GPU kernel met a tensor at batch 4,096" in told


@pytest.mark.parametrize("kind,form", [("mlp", "arrays"), ("attention", "arrays"), ("conv", "arrays"),
                                       ("dense", "arrays"), ("dense", "tfdata"), ("multi", "arrays")])
def test_the_fits_planned_peak_is_within_one_percent_of_its_measured_peak_on_the_gpu(kind, form):
    # FACTS section 8's three models and our own, with Keras' default compile (XLA, the autotuner on) and growth:
    # the plan compiles the step first in the process (so its autotuner's trials are not in the fit's peak) and
    # places the fit's data, its batch copy and the step in the pool; the fit then runs on the same arrays.
    out = plan_then_fit(kind, form, 1.0, "gpu")
    print(out["text"], {k: v for k, v in out.items() if k != "text"})
    assert abs(out["planned"] / out["peak"] - 1) < 0.01
    assert "the input pipeline: on the host" in out["text"] and "the step's copy of the batch" in out["text"]
