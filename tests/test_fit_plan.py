"""The plan of a whole fit (plans/fit.py) in lab mode: its peak against the peak TensorFlow's allocator measured
while the fit ran, in a fresh process each (plan, then fit on the same arrays), for FACTS section 8's three models
and our own; its shares said and labelled; the placement leaves the pool and the process's peak as they were."""

import pytest

from conftest import plan_then_fit


@pytest.mark.parametrize("kind,form,scale", [
    ("dense", "arrays", 0.25), ("dense", "tensors", 0.25), ("multi", "arrays", 0.25),
    ("conv", "arrays", 0.125), ("attention", "arrays", 0.125), ("mlp", "arrays", 0.25), ("long", "arrays", 0.03125)])
def test_the_fits_planned_peak_is_within_one_percent_of_its_measured_peak(kind, form, scale):
    out = plan_then_fit(kind, form, scale, "2048")
    print(out["text"])
    assert abs(out["planned"] / out["peak"] - 1) < 0.01, out
    # what the step alone plans is well below: the fit's data and pipeline are a real share of its peak
    assert "the fit's peak in this process" in out["text"]


def test_the_fits_shares_are_said_each_labelled(lab_session):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmem_widgets
    from tfmem_widgets.readings.allocator import process_peak

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    x, y = np.ones((1000, 64), "float32"), np.ones((1000, 1), "float32")
    spike = tf.zeros((8 << 20,))  # a peak before the plan: the plan's placement must not lose it
    del spike
    before = tf.config.experimental.get_memory_info("CPU:0")
    planned = tfmem_widgets.plan(model, (x, y), 512)
    after = tf.config.experimental.get_memory_info("CPU:0")
    fit = planned.fit
    assert fit.rows == 1000 and fit.form == "arrays"
    assert fit.data == (1000 * 64 * 4, 1000 * 4)  # each array as one tensor, converted
    # lab mode: the pipeline's permutation twice and every batch of the epoch (one full, one of 488 rows)
    assert fit.pipeline == (8000, 8000, *planned.batch_sizes, 488 * 64 * 4, 488 * 4) and fit.batches == 2
    assert fit.batch_copy == ()  # (the step reads a pipeline's batch where it is: the same device)
    assert fit.in_use_bytes == after["current"]  # placed, then every buffer given back
    assert process_peak("CPU:0", after["peak"]) >= before["peak"] >= 32 << 20
    sizes = sum((*fit.data, *fit.pipeline, *planned.step_allocations))
    assert fit.in_use_bytes + sizes <= planned.fit_peak_bytes == fit.peak_bytes
    text = repr(planned)
    for said in ("the fit's peak in this process", "(measured: its allocations placed", "the data 253.91 KiB (1,000 rows; "
                 "planned", "the input pipeline up to", "(assumed: the row permutation twice and the batches it holds at "
                 "once, 2 (this machine):", "the step "):
        assert said in text, text


def test_a_sample_of_specs_or_tensors_says_what_it_knows_of_the_data(lab_session):
    import keras
    import tensorflow as tf

    import tfmem_widgets

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    specs = (tf.TensorSpec([None, 64], tf.float32), tf.TensorSpec([None, 1], tf.float32))
    planned = tfmem_widgets.plan(model, specs, 128)
    assert planned.fit.rows is None and planned.fit.peak_bytes is None
    assert planned.fit_peak_bytes == planned.fit.fresh_peak_bytes >= planned.peak_bytes
    assert "the data: not known (the sample is TensorSpecs" in repr(planned)
    x, y = tf.ones((500, 64)), tf.ones((500, 1))
    held = tfmem_widgets.plan(model, (x, y), 128).fit
    assert held.form == "tensors" and held.data == () and held.data_held == (500 * 64 * 4, 500 * 4)


def test_near_the_limit_nothing_is_placed_and_a_fresh_pool_is_modelled(lab_session):
    import keras
    import numpy as np

    import tfmem_widgets

    model = keras.Sequential([keras.Input((512,)), keras.layers.Dense(2048), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    x, y = np.ones((100000, 512), "float32"), np.ones((100000, 1), "float32")  # 196 MiB of data, a 256 MiB limit
    planned = tfmem_widgets.plan(model, (x, y), 4096)
    assert planned.fit.peak_bytes is None and planned.fit.in_use_bytes is not None
    assert planned.fit_peak_bytes == planned.fit.fresh_peak_bytes > planned.limit_bytes
    assert "the fit's peak in a fresh process" in repr(planned)


def test_the_plot_draws_the_whole_fit_beside_the_program(lab_session):
    import keras
    import matplotlib
    import numpy as np

    import tfmem_widgets

    matplotlib.use("Agg")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    planned = tfmem_widgets.plan(model, (np.ones((3000, 64), "float32"), np.ones((3000, 1), "float32")), 1024)
    ax = planned.plot()
    side = ax.figure.axes[1]
    legend = [t.get_text() for t in side.get_legend().get_texts()]
    assert legend[0].startswith("the fit's peak, placed: ") and any(t.startswith("the data: ") for t in legend)
    stacked = sum(patch.get_height() for patch in side.patches)  # the shares and what was handed out beyond them
    assert abs(stacked * (1 << 20) - planned.fit_peak_bytes) < 1024
    assert any("dense" in t.get_text() for t in ax.get_legend().get_texts())  # the program's buffers by Keras layer


def test_a_measured_block_around_a_plan_keeps_the_peaks_before_and_inside_it(lab_session):
    import keras
    import numpy as np
    import tensorflow as tf

    import tfmem_widgets

    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(128), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=True)
    x, y = np.ones((20000, 64), "float32"), np.ones((20000, 1), "float32")  # the data: 4.96 MiB placed
    with tfmem_widgets.measure("CPU:0") as m:
        spike = tf.zeros((4 << 20,))  # 16 MiB, before the plan resets TensorFlow's counter
        del spike
        planned = tfmem_widgets.plan(model, (x, y), 512)
    assert m.peak_bytes >= 16 << 20
    with tfmem_widgets.measure("CPU:0") as inside:
        planned = tfmem_widgets.plan(model, (x, y), 512)
    # the placement's instant is the fit's peak in this process: the block saw it, beyond what was in use
    assert inside.peak_bytes >= planned.fit_peak_bytes - planned.fit.in_use_bytes > 20000 * 65 * 4
