"""Memory across a whole fit: MemoryCallback's figures in History, TensorBoard and its warnings
(issue: what will fit, item 3). Each scenario is a lab-mode process of its own."""

import pytest

from conftest import finish_fresh, start_fresh

FIT = """
import json, io, contextlib, glob, os
import tfmem_widgets
tfmem_widgets.setup(lab_mb=LAB)
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.readings.callback import MemoryCallback

keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=False)
x = np.ones((2048, 256), "float32"); y = np.ones((2048, 1), "float32")
kept = []

class Leak(keras.callbacks.Callback):      # keeps 4 MiB more after every epoch, as a list of outputs would
    def on_epoch_end(self, epoch, logs=None):
        if LEAK:
            kept.append(tf.ones((1 << 20,)))

class Batches(keras.callbacks.Callback):   # what a later callback sees in each batch's logs
    def on_train_batch_end(self, batch, logs=None):
        batches.append(logs.get("tfmem_batch_peak_bytes"))

batches = []
said = io.StringIO()
callback = MemoryCallback(per_batch=True)
with contextlib.redirect_stderr(said):
    writer = tf.summary.create_file_writer(os.path.join(os.environ["WORK"], "logs"))
    with writer.as_default():
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, callbacks=[Leak(), callback, Batches()])
    writer.flush()
    first_fit_batches = list(batches)
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
                  "tags": sorted(tags), "limit": callback.limit()[0], "batches": first_fit_batches,
                  "steps": len(x) // BATCH}))
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
    # per batch: the peak since the previous batch, folded into the epoch's (a batch's reset loses nothing)
    steps, batches = out["steps"], out["batches"]
    assert len(batches) == 3 * steps and all(isinstance(b, int) for b in batches)
    for epoch, (peak, used) in enumerate(zip(peaks, in_use)):
        assert used < max(batches[epoch * steps:(epoch + 1) * steps]) <= peak
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
    from tfmem_widgets.readings.callback import MemoryCallback

    limit, source = MemoryCallback().limit()  # this process: lab mode, 256 MB
    assert (limit, source) == (256 << 20, "lab mode")
    far, near = MemoryCallback(), MemoryCallback()
    far._check(limit // 2, limit, source)
    near._check(int(limit * 0.96), limit, source)
    near._check(int(limit * 0.97), limit, source)
    assert far.warnings == [] and len(near.warnings) == 1
    assert "within 5% of CPU:0's limit (256.00 MiB, lab mode)" in near.warnings[0]
    assert capsys.readouterr().err.count("tfmem warning:") == 1


def test_a_bad_device_fails_before_the_fit(lab_session):
    from tfmem_widgets.errors import ArgumentError
    from tfmem_widgets.readings.callback import MemoryCallback

    with pytest.raises(ArgumentError) as caught:
        MemoryCallback(device="GPU:7")
    assert "\n" not in str(caught.value)


MIRRORED = """
import json
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256, cpus=2)
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.readings.callback import MemoryCallback
from tfmem_widgets.notebook.widgets import Gauge

gauge = Gauge(interval=600)   # no background reading: the marks come from the callback
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=False)
x = np.ones((2048, 256), "float32"); y = np.ones((2048, 1), "float32")
callback = MemoryCallback()
history = model.fit(x, y, batch_size=256, epochs=3, verbose=0, callbacks=[callback])
print(json.dumps({"history": {k: v for k, v in history.history.items() if k.startswith("tfmem")},
                  "warnings": callback.warnings, "notes": callback.notes, "text": repr(callback),
                  "marks": gauge.marks, "svg": gauge._spark.value, "gauge": repr(gauge)}))
gauge.close()
"""


def test_mirrored_replicas_each_get_keys_and_lab_mode_says_their_allocator_is_shared():
    from conftest import run_fresh

    out = run_fresh(MIRRORED, timeout=300)
    h = out["history"]
    for replica in ("CPU:0", "CPU:1"):
        assert len(h[f"tfmem_peak_bytes/{replica}"]) == len(h[f"tfmem_in_use_bytes/{replica}"]) == 3
    # one allocator behind both logical CPUs: the same figures, the plain keys the highest of them
    assert h["tfmem_peak_bytes/CPU:0"] == h["tfmem_peak_bytes/CPU:1"] == h["tfmem_peak_bytes"]
    assert all(p > u for p, u in zip(h["tfmem_peak_bytes"], h["tfmem_in_use_bytes"]))
    assert out["warnings"] == []  # no imbalance is told between replicas of one allocator
    assert any("CPU:0 and CPU:1 share one allocator" in n for n in out["notes"])
    assert "CPU:0 " in out["text"] and "CPU:1 " in out["text"]
    # a running gauge got a mark at each epoch's end, on its sparkline and in its text
    assert [label for _, label in out["marks"]] == ["epoch 1", "epoch 2", "epoch 3"]
    assert out["svg"].count('class="tfmem-mark"') == 3 and 'data-label="epoch 3"' in out["svg"]
    assert "marked: epoch 1, epoch 2, epoch 3" in out["gauge"]


WORKER = """
import contextlib, io, json, os
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256)
import keras, tensorflow as tf
from tfmem_widgets.readings.callback import MemoryCallback

strategy = tf.distribute.MultiWorkerMirroredStrategy()   # two workers, from TF_CONFIG
index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
with strategy.scope():
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(512, activation="relu"), keras.layers.Dense(1)])
    optimizer = keras.optimizers.Adam()
kept = []


class Hold(keras.callbacks.Callback):   # worker 1 holds 16 MiB more during each epoch
    def on_epoch_begin(self, epoch, logs=None):
        if index == 1:
            kept.append(tf.ones((4 << 20,)))

    def on_epoch_end(self, epoch, logs=None):
        kept.clear()


@tf.function
def train_step(x, y):
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    strategy.run(step, args=(x, y))


# Keras 3's fit does not run under this strategy (keras#20585): a custom loop calls the hooks.
data = strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensors((tf.ones((256, 256)), tf.ones((256, 1)))).repeat(4))
gathered, own, history = MemoryCallback(), MemoryCallback(device="CPU:0"), keras.callbacks.History()
callbacks = keras.callbacks.CallbackList([Hold(), gathered, own, history], model=model)
said = io.StringIO()
with contextlib.redirect_stderr(said):
    callbacks.on_train_begin()
    for epoch in range(2):
        callbacks.on_epoch_begin(epoch)
        for x, y in data:
            train_step(x, y)
        callbacks.on_epoch_end(epoch, {})
    callbacks.on_train_end()
print(json.dumps({"index": index, "history": {k: v for k, v in history.history.items() if k.startswith("tfmem")},
                  "own": [e["tfmem_peak_bytes"] for e in own.epochs], "chief": gathered.chief,
                  "highest": [e["tfmem_peak_bytes"] for e in gathered.epochs],
                  "warnings": gathered.warnings, "said": said.getvalue()}))
"""


def test_workers_figures_are_gathered_with_the_strategys_collective_and_imbalance_is_said_once():
    import json
    import socket

    from conftest import finish_fresh, start_fresh

    def free_port():
        with socket.socket() as probe:
            probe.bind(("localhost", 0))
            return probe.getsockname()[1]

    cluster = {"worker": [f"localhost:{free_port()}", f"localhost:{free_port()}"]}
    procs = [start_fresh(WORKER, {"TF_CONFIG": json.dumps({"cluster": cluster,
                                                             "task": {"type": "worker", "index": i}})})
             for i in range(2)]
    try:
        chief, other = (finish_fresh(p, timeout=300) for p in procs)
    finally:
        for p in procs:
            p.kill()  # a worker left waiting for its peer does not outlive the test
    assert chief["chief"] and not other["chief"]
    for out in (chief, other):
        h = out["history"]
        # each worker's own reading of its device, as the other worker received it through the collective
        assert h["tfmem_peak_bytes/worker0/CPU:0"] == chief["own"]
        assert h["tfmem_peak_bytes/worker1/CPU:0"] == other["own"]
        assert out["highest"] == [max(a, b) for a, b in zip(chief["own"], other["own"])]
    # worker 1 held 16 MiB more (the two workers' steps differ by a few KiB)
    assert all(b - a >= 15 << 20 for a, b in zip(chief["own"], other["own"]))
    warning = [w for w in chief["warnings"] if "replicas' peaks differ" in w]
    assert len(warning) == 1 and warning[0].index("worker1/CPU:0") < warning[0].index("worker0/CPU:0")
    assert chief["said"].count("tfmem warning: the replicas' peaks differ") == 1
    assert other["said"] == ""  # only the chief speaks


PLAIN_CPU = """
import json, io, contextlib
import keras, numpy as np
from tfmem_widgets.readings.callback import MemoryCallback
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(1)])
model.compile("adam", "mse")
x = np.ones((256, 32), "float32"); y = np.ones((256, 1), "float32")
said = io.StringIO()
callback = MemoryCallback()
with contextlib.redirect_stderr(said):
    history = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[callback])
    model.evaluate(x, y, verbose=0, callbacks=[callback])
print(json.dumps({"keys": sorted(k for k in history.history if k.startswith("tfmem")), "epochs": callback.epochs,
                  "runs": callback.runs, "said": said.getvalue(), "text": repr(callback)}))
"""


def test_on_a_plain_cpu_it_records_nothing_and_says_why_once():
    out = finish_fresh(start_fresh(PLAIN_CPU))           # no lab mode: TensorFlow's default CPU allocator
    assert out["keys"] == [] and out["epochs"] == [] and out["runs"] == []   # no 0 B figures
    assert out["said"].count("keeps no statistics") == 1 and "--lab" in out["said"]
    assert out["text"].startswith("tfmem memory callback: nothing recorded: TensorFlow's default CPU allocator")


EVALUATE_AND_RAISE = """
import json
import tfmem_widgets
tfmem_widgets.setup(lab_mb=256, cpus=2)
import keras, numpy as np, tensorflow as tf
from tfmem_widgets.readings.callback import MemoryCallback, close_open_epochs
from tfmem_widgets.readings.measure import running_measurements
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256), keras.layers.Dense(1)])
model.compile("adam", "mse", jit_compile=False)
x = np.ones((512, 64), "float32"); y = np.ones((512, 1), "float32")
callback = MemoryCallback()
model.fit(x, y, batch_size=64, epochs=1, verbose=0, validation_data=(x, y), callbacks=[callback])
model.evaluate(x, y, batch_size=64, verbose=0, callbacks=[callback])
model.predict(x, batch_size=64, verbose=0, callbacks=[callback])

class Fails(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        raise RuntimeError("the user's own callback failed")

try:
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[callback, Fails()])
except RuntimeError:
    pass
left_open = len(running_measurements())
closed = close_open_epochs()
named = MemoryCallback(device="CPU:1")
with tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"]).scope():
    other = keras.Sequential([keras.Input((64,)), keras.layers.Dense(8)])
    other.compile("sgd", "mse")
other.fit(x, x[:, :8], batch_size=64, epochs=1, verbose=0, callbacks=[named])
print(json.dumps({"runs": [r["kind"] for r in callback.runs], "peaks": [r["tfmem_peak_bytes"] for r in callback.runs],
                  "epochs": len(callback.epochs), "left_open": left_open, "closed": closed,
                  "after": len(running_measurements()), "named_notes": named.notes}))
"""


def test_evaluate_and_predict_are_recorded_and_a_fit_that_raises_leaves_nothing_open():
    out = finish_fresh(start_fresh(EVALUATE_AND_RAISE))
    assert out["runs"] == ["evaluate", "predict"]        # the fit's validation stays inside its epoch
    assert all(p > 0 for p in out["peaks"]) and out["epochs"] == 1
    assert out["left_open"] == 1 and out["closed"] == 1 and out["after"] == 0
    assert any("CPU:1 shares one allocator with every logical CPU" in n for n in out["named_notes"])
