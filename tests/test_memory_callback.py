"""Memory across a whole fit: MemoryCallback's figures in History, TensorBoard and its warnings
(issue: what will fit, item 3). Each scenario is a lab-mode process of its own."""

import pytest

from conftest import finish_fresh, start_fresh

FIT = """
import json, io, contextlib, glob, os
import tfmem_widgets
tfmem_widgets.setup(lab_mb=LAB)
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.keras import MemoryCallback

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=False)
x = np.ones((2048, 256), "float32"); y = np.ones((2048, 1), "float32")
kept = []

class Leak(keras.callbacks.Callback):      # keeps 4 MiB more after every epoch, as a list of outputs would
    def on_epoch_end(self, epoch, logs=None):
        if LEAK:
            kept.append(tf.ones((1 << 20,)))

said = io.StringIO()
callback = MemoryCallback(per_batch=True)
with contextlib.redirect_stderr(said):
    writer = tf.summary.create_file_writer(os.path.join(os.environ["WORK"], "logs"))
    with writer.as_default():
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[Leak(), callback])
    writer.flush()
    with tfmem_widgets.measure() as whole:
        again = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[Leak(), callback])
variables = sum(int(np.prod(v.shape)) * 4 for v in model.variables)
events = glob.glob(os.path.join(os.environ["WORK"], "logs", "events.*"))
tags = set()
for path in events:
    for record in tf.data.TFRecordDataset(path):
        event = tf.compat.v1.Event.FromString(record.numpy())
        tags.update(v.tag for v in event.summary.value)
print(json.dumps({"history": {k: v for k, v in history.history.items() if k.startswith("tfmem")},
                  "again": again.history.get("tfmem_peak_bytes"), "whole_peak": whole.highest_bytes,
                  "variables": variables, "warnings": callback.warnings, "said": said.getvalue(),
                  "tags": sorted(tags), "limit": callback.limit()[0]}))
"""


def _fit(tmp_path, lab=256, batch=256, epochs=3, leak=False):
    code = (FIT.replace("LAB", str(lab)).replace("BATCH", str(batch)).replace("EPOCHS", str(epochs))
            .replace("LEAK", str(leak)))
    return start_fresh(code, {"WORK": str(tmp_path)})


@pytest.fixture(scope="module")
def fits(tmp_path_factory):
    procs = {"plain": _fit(tmp_path_factory.mktemp("plain")),
             "leak": _fit(tmp_path_factory.mktemp("leak"), epochs=4, leak=True)}
    return {name: finish_fresh(p, timeout=300) for name, p in procs.items()}


def test_history_holds_each_epochs_peak_and_in_use_bytes(fits):
    out = fits["plain"]
    peaks, in_use = out["history"]["tfmem_peak_bytes"], out["history"]["tfmem_in_use_bytes"]
    assert len(peaks) == len(in_use) == 3
    # the variables (and Adam's slots) are in use after every epoch; a step's activations only at its peak
    assert all(used >= out["variables"] for used in in_use)
    assert all(peak > used for peak, used in zip(peaks, in_use))
    assert out["again"] and out["whole_peak"] >= out["again"][0]  # an enclosing measure() still sees the peak
    assert {"tfmem_peak_bytes", "tfmem_in_use_bytes"} <= set(out["tags"])  # the default writer got them
    # four epochs across two fits: what Keras leaves between epochs (a few hundred bytes) is no leak
    assert out["warnings"] == [] and out["said"] == ""


def test_bytes_that_keep_rising_after_each_epoch_are_said_once(fits):
    out = fits["leak"]
    in_use = out["history"]["tfmem_in_use_bytes"]
    # 4 MiB kept each epoch; what else an epoch leaves (its iterator's buffers) moves the figure by less
    assert all(b - a >= 3 << 20 for a, b in zip(in_use, in_use[1:])), in_use
    rising = [w for w in out["warnings"] if "after each of the last 4 epochs rose" in w]
    assert len(rising) == 1 and out["said"].count("after each of the last 4 epochs rose") == 1


def test_a_peak_within_5_percent_of_the_limit_is_said_once(lab_session, capsys):
    from tfmem_widgets.keras import MemoryCallback

    limit, source = MemoryCallback().limit()  # this process: lab mode, 256 MB
    assert (limit, source) == (256 << 20, "lab mode")
    far, near = MemoryCallback(), MemoryCallback()
    far._check(limit // 2)
    near._check(int(limit * 0.96))
    near._check(int(limit * 0.97))
    assert far.warnings == [] and len(near.warnings) == 1
    assert "within 5% of CPU:0's limit (256.00 MiB, lab mode)" in near.warnings[0]
    assert capsys.readouterr().err.count("tfmem warning:") == 1


def test_a_bad_device_fails_before_the_fit(lab_session):
    from tfmem_widgets.errors import SetupError
    from tfmem_widgets.keras import MemoryCallback

    with pytest.raises(SetupError) as caught:
        MemoryCallback(device="GPU:7")
    assert "\n" not in str(caught.value)
