"""Behaviours that exist only on a GPU, measured live there and recorded for everywhere else.

The reserve, preallocation, growth regions, logical-device limits and the driver's view (NVML)
do not exist in lab mode. Each experiment here is a cell that runs in a fresh process on a GPU
(setup is once per process) and prints what it measured. ``gpu_result(name)`` runs it live
where TensorFlow sees a GPU; elsewhere it shows the result recorded on a real GPU, labelled with
the card, the TensorFlow version and the date.

Record on a GPU machine (writes gpu_recorded.json next to this file):

    python notebooks/gpu_experiments.py record
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tfmem_widgets.fresh.run import run_fresh

RECORDED = Path(__file__).with_name("gpu_recorded.json")


def visible_gpus() -> int:
    """How many GPUs TensorFlow will see, asked of the driver (NVML) and CUDA_VISIBLE_DEVICES, not of
    TensorFlow: importing TensorFlow before the setup keeps oneDNN's kernels on in lab mode, where an
    OOM inside one of them kills the process."""
    import os

    from tfmem_widgets import NvmlUnavailable
    from tfmem_widgets.tf import nvml

    try:
        count = len(nvml.read_gpus())
    except NvmlUnavailable:
        return 0
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return count
    picked = [d for d in chosen.split(",") if d.strip()]
    return 0 if not picked or picked[0].strip() == "-1" else min(count, len(picked))

# Every experiment's cell starts with this: the card as NVML sees it, in bytes.
_PRELUDE = """
import gc
from tfmem_widgets.tf import nvml
from tfmem_widgets.units import format_bytes as fmt

def card():
    gpus = nvml.read_gpus()
    return gpus[nvml.nvml_index_for_cuda_ordinal(0, gpus)]

def first_tensor_jump(device="GPU:0"):   # NVML's used memory added by a 1 KiB tensor, devices made first
    import tensorflow as tf
    tf.config.list_logical_devices("GPU")
    before = card().used_bytes
    with tf.device(device):
        tf.zeros((256,))
    return card().used_bytes - before
"""


@dataclass(frozen=True)
class Experiment:
    title: str
    code: str
    setup: dict | None = None  # tfmem_widgets.setup() arguments in the fresh process
    env: dict = field(default_factory=dict)


# A transformer block of FACTS section 8 (embedding 512, 8 heads, 256 tokens, a 2,048-wide feed-forward layer)
# as code, JIT its jit_compile: at 4,096 rows its attention scores hold 2^31 elements. tests/test_gpu.py fits it too.
ATTENTION_MODEL = '''
import keras, numpy as np
L = keras.layers
tokens = keras.Input((256,), dtype="int32")
h = L.Embedding(1000, 512, name="embed")(tokens)
h = L.LayerNormalization(name="ln1")(h + L.MultiHeadAttention(num_heads=8, key_dim=64, name="attn")(h, h))
h = L.LayerNormalization(name="ln2")(h + L.Dense(512, name="ffn_out")(L.Dense(2048, activation="relu", name="ffn_in")(h)))
model = keras.Model(tokens, L.Dense(10, name="head")(L.GlobalAveragePooling1D()(h)))
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=JIT)
'''


# Notebook 4's float16 gradient step in a fresh lab process (format it with batch, d_in, hidden, classes and
# min_tensor): the tensors' peak (the same bytes with every kernel) and the allocator's (the kernels' scratch too).
FLOAT16_STEP = """
import numpy as np, tensorflow as tf, keras, tfmem_widgets
keras.mixed_precision.set_global_policy("float16")
x = tf.random.stateless_normal(({batch}, {d_in}), seed=(1, 2))
y = tf.random.stateless_uniform(({batch},), seed=(3, 4), maxval={classes}, dtype=tf.int32)
model = keras.Sequential([keras.Input(({d_in},)), keras.layers.Dense({hidden}, activation="relu"),
                          keras.layers.Dense({hidden}, activation="relu"), keras.layers.Dense({classes}),
                          keras.layers.Activation("linear", dtype="float32")])
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x)))
    return tape.gradient(loss, model.trainable_variables)
step()
with tfmem_widgets.measure("CPU:0") as allocator, tfmem_widgets.trace() as t:
    grads = step()
tensors = int(np.concatenate([[0], t.events().held_bytes({min_tensor}, scratch=False)]).max())
allocator_peak = allocator.peak_bytes
"""
# The kernels it runs under (environment variables of each fresh process).
KERNELS = {"oneDNN, all threads": {"TF_ENABLE_ONEDNN_OPTS": "1"},
           "oneDNN, one thread": {"TF_ENABLE_ONEDNN_OPTS": "1", "TF_NUM_INTRAOP_THREADS": "1"},
           "Eigen": {"TF_ENABLE_ONEDNN_OPTS": "0"}}
# Notebook 4's sizes for it.
FLOAT16_SIZES = {"batch": 2048, "d_in": 128, "hidden": 512, "classes": 10, "min_tensor": 1024}

# Notebook 7's model and batches: three Dense layers, Adam, a graph step.
WHAT_FITS_FUNCTIONS = """
def build_model():
    import keras

    model = keras.Sequential([keras.Input((512,)),
                              keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile("adam", "mse", jit_compile=False)
    return model


def make_batch(n):
    import numpy as np

    return np.ones((n, 512), "float32"), np.ones((n, 1), "float32")
"""


EXPERIMENTS: dict[str, Experiment] = {
    "default_limit": Experiment(
        "TensorFlow's default limit: the free memory it reads, minus a reserve",
        """
before = card()
import tensorflow as tf
from tensorflow.python.client import device_lib
from tfmem_widgets.tf.system_reserve import system_reserve
limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU")
after = card()
major, minor = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])["compute_capability"]
reserve, why = system_reserve(after.free_bytes, major)
print(f"card: {after.name}, compute capability {major}.{minor}, {fmt(after.total_bytes)} in all")
print(f"NVML used before TensorFlow made its device: {fmt(before.used_bytes)} (the driver, other processes)")
print(f"making the device (the CUDA context) added {fmt(after.used_bytes - before.used_bytes)}, before any tensor")
print(f"NVML free then: {fmt(after.free_bytes)}; TensorFlow's limit: {fmt(limit)}")
print(f"free - limit = {fmt(after.free_bytes - limit)}; TensorFlow's table: {why}")
result = {"total": after.total_bytes, "used_before": before.used_bytes, "context": after.used_bytes - before.used_bytes,
          "free": after.free_bytes, "limit": limit, "reserve_table": reserve, "cc": [major, minor]}
""",
    ),
    "reserve_500": Experiment(
        "TF_DEVICE_MIN_SYS_MEMORY_IN_MB=500: a smaller reserve, a larger limit",
        """
import tensorflow as tf
from tensorflow.python.client import device_lib
limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU")
after = card()
print(f"NVML free after the CUDA context: {fmt(after.free_bytes)}; TensorFlow's limit: {fmt(limit)}")
print(f"free - limit = {fmt(after.free_bytes - limit)} (asked: 500 MiB)")
result = {"free": after.free_bytes, "limit": limit}
""",
        env={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "500"},
    ),
    "outside_tensorflow": Experiment(
        "Memory outside TensorFlow's allocator: the driver sees it, TensorFlow does not",
        """
import tensorflow as tf
x = tf.zeros((16 << 20,))                       # 64 MiB through TensorFlow's allocator
tf_before, nvml_before = tf.config.experimental.get_memory_info("GPU:0")["current"], card().used_bytes
try:                                            # another library in the same process
    import torch
    other = torch.empty(256 << 20, dtype=torch.float32, device="cuda")   # 1 GiB
    library = f"PyTorch {torch.__version__}"
except Exception:                               # no PyTorch: the CUDA runtime itself
    import ctypes
    pointer = ctypes.c_void_p()
    ctypes.CDLL("libcudart.so.12").cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(1 << 30))
    library = "cudaMalloc (CUDA runtime)"
tf_after, nvml_after = tf.config.experimental.get_memory_info("GPU:0")["current"], card().used_bytes
print(f"1 GiB allocated with {library}")
print(f"NVML used: {fmt(nvml_before)} -> {fmt(nvml_after)} (+{fmt(nvml_after - nvml_before)})")
print(f"TensorFlow's in use: {fmt(tf_before)} -> {fmt(tf_after)} (+{fmt(tf_after - tf_before)})")
result = {"library": library, "nvml_delta": nvml_after - nvml_before, "tf_delta": tf_after - tf_before}
""",
        setup={"growth": True},
    ),
    "no_growth": Experiment(
        "Without growth, the first tensor takes the whole limit",
        """
import tensorflow as tf
from tensorflow.python.client import device_lib
limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU")
jump = first_tensor_jump()
print(f"TensorFlow's limit: {fmt(limit)}")
in_use = tf.config.experimental.get_memory_info('GPU:0')['current']
print(f"a 1 KiB tensor: NVML used +{fmt(jump)}; TensorFlow's in use {fmt(in_use)}")
result = {"limit": limit, "nvml_delta": jump}
""",
    ),
    "growth_regions": Experiment(
        "With growth, the pool grows in regions and never shrinks",
        """
import tensorflow as tf
tf.config.list_logical_devices("GPU")          # make the device (and the CUDA context) first
kept, rows = [], []
for label, floats in (("1 KB", 256), ("1 MB", 1 << 18), ("10 MB", 10 << 18), ("100 MB", 100 << 18), ("1000 MB", 1000 << 18)):
    before = card().used_bytes
    kept.append(tf.zeros((floats,)))
    after = card().used_bytes
    current = tf.config.experimental.get_memory_info("GPU:0")["current"]
    rows.append((label, after - before, current))
    print(f"keep a {label:>7} tensor: NVML used +{fmt(after - before):>11}; TensorFlow's in use {fmt(current)}")
used_full = card().used_bytes
del kept
gc.collect()
current = tf.config.experimental.get_memory_info("GPU:0")["current"]
used_after = card().used_bytes
print(f"after del and gc.collect(): TensorFlow's in use {fmt(current)}; NVML used changed by {fmt(used_after - used_full)}")
result = {"rows": rows, "current_after_del": current, "nvml_change_after_del": used_after - used_full}
""",
        setup={"growth": True},
    ),
    "growth_then_logical": Experiment(
        "The popular snippet: growth, then a 1024 MB logical device",
        """
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.experimental.set_memory_growth(gpu, True)
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
print("both calls accepted, no error")
jump = first_tensor_jump()
print(f"a 1 KiB tensor: NVML used +{fmt(jump)}: growth was dropped, the logical device took its whole limit")
result = {"nvml_delta": jump}
""",
    ),
    "logical_then_growth": Experiment(
        "The other order: a logical device, then growth",
        """
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
try:
    tf.config.experimental.set_memory_growth(gpu, True)
    message = None
    print("accepted")
except ValueError as error:
    message = str(error)
    print(f"ValueError: {message}")
result = {"error": message}
""",
    ),
    "force_growth_logical": Experiment(
        "TF_FORCE_GPU_ALLOW_GROWTH=true with the same 1024 MB logical device",
        """
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=1024)])
jump = first_tensor_jump()
print(f"a 1 KiB tensor: NVML used +{fmt(jump)}: growth holds, the limit still applies")
result = {"nvml_delta": jump}
""",
        env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
    ),
    "fresh_process": Experiment(
        "Memory comes back when the process ends, not before",
        """
import tfmem_widgets
start = card().used_bytes
held = tfmem_widgets.run_fresh('''
import gc, tensorflow as tf
from tfmem_widgets.tf import nvml
x = tf.zeros((256 << 20,))                      # 1 GiB
del x
gc.collect()
used = nvml.read_gpus()[0].used_bytes
''', setup={"growth": True}, returns=["used"], echo=False).values["used"]
end = card().used_bytes
print(f"a process made and deleted 1 GiB: NVML used +{fmt(held - start)} while it lived")
print(f"after it ended: NVML used {fmt(end - start)} above the start")
result = {"held": held - start, "after_exit": end - start}
""",
    ),
    "logical_limits": Experiment(
        "Two logical devices of one GPU, each within its own limit",
        """
import tensorflow as tf
import tfmem_widgets
from tfmem_widgets.tf.device_setup import current_state
logical = [d.name for d in tf.config.list_logical_devices("GPU")]
print(f"logical GPUs: {', '.join(name.split('device:')[-1] for name in logical)}")
jumps = []
for index in range(2):
    jumps.append(first_tensor_jump(f"GPU:{index}"))
    print(f"first tensor on GPU:{index}: NVML used +{fmt(jumps[-1])}")
try:
    with tf.device("GPU:1"):
        too_big = tf.zeros((150 << 20,))        # 600 MiB on the 512 MB device
    oom = None
except tf.errors.ResourceExhaustedError as error:
    import re
    oom = re.search(r"OOM when allocating tensor with shape\\[\\d+\\].*? by allocator \\S+", str(error)).group(0)
print(f"600 MiB on GPU:1 with {fmt(card().free_bytes)} free on the card: {'OOM: ' + oom if oom else 'fitted'}")
with tf.device("GPU:0"):
    fits = tf.zeros((150 << 20,))
print("the same 600 MiB on GPU:0 (1024 MB): fitted")
result = {"logical": logical, "nvml_jumps": jumps, "oom": oom}
""",
        setup={"split": [1024, 512]},
    ),
    "second_process": Experiment(
        "A second process on a GPU that the first one preallocated",
        """
import tensorflow as tf
import tfmem_widgets
from tensorflow.python.client import device_lib
first_limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU")
jump = first_tensor_jump()                      # no growth: the first tensor takes the whole limit
print(f"first process: limit {fmt(first_limit)}; its first tensor took {fmt(jump)}; the card has {fmt(card().free_bytes)} free")
second = tfmem_widgets.run_fresh('''
import tensorflow as tf
from tensorflow.python.client import device_lib
from tfmem_widgets.tf import nvml
from tfmem_widgets.tf.system_reserve import system_reserve
def card():
    gpus = nvml.read_gpus()
    return gpus[nvml.nvml_index_for_cuda_ordinal(0, gpus)]
limit = next(d.memory_limit for d in device_lib.list_local_devices() if d.device_type == "GPU")
free = card().free_bytes                        # after this process's CUDA context
major = tf.config.experimental.get_device_details(tf.config.list_physical_devices("GPU")[0])["compute_capability"][0]
reserve, why = system_reserve(free, major)
outcomes = {}
for label, floats in (("a 1 KiB tensor", 256), ("half its limit", limit // 8), ("twice its limit", limit // 2)):
    try:
        kept = tf.zeros((floats,))
        outcomes[label] = "fitted"
        del kept
    except tf.errors.ResourceExhaustedError:
        outcomes[label] = "OOM"
''', returns=["limit", "free", "reserve", "why", "outcomes"], echo=False).values
print(f"second process: it read {fmt(second['free'])} free and took a limit of {fmt(second['limit'])}: "
      f"free - limit = {fmt(second['free'] - second['limit'])} ({second['why']})")
for label, outcome in second["outcomes"].items():
    print(f"second process, {label}: {outcome}")
result = {"first_limit": first_limit, "first_jump": jump, **second}
""",
    ),
    "logical_cap": Experiment(
        "Two logical GPUs whose limits add up past the card, growth forced: a limit caps, it reserves nothing",
        """
import re
import tensorflow as tf
gpu = tf.config.list_physical_devices("GPU")[0]
free = card().free_bytes
share_mb = int(free * 0.6) >> 20                # each limit 60% of the free memory: together past the card
tf.config.set_logical_device_configuration(gpu, [tf.config.LogicalDeviceConfiguration(memory_limit=share_mb)] * 2)
tf.config.list_logical_devices("GPU")
print(f"two logical GPUs with limits of {share_mb:,} MB each on a card with {fmt(free)} free: accepted, no error")
first_bytes = (free // 2 + (4 << 30)) // 256 * 256   # past half the card, within GPU:0's limit
with tf.device("GPU:0"):
    first = tf.zeros((first_bytes // 4,))
print(f"GPU:0 keeps {fmt(first_bytes)}, within its limit; the card has {fmt(card().free_bytes)} free")
second_bytes = free // 2 // 256 * 256           # half the card, within GPU:1's limit
try:
    with tf.device("GPU:1"):
        second = tf.zeros((second_bytes // 4,))
    oom = None
except tf.errors.ResourceExhaustedError as error:
    oom = re.search(r"OOM when allocating tensor with shape\\[\\d+\\].*? by allocator \\S+", str(error)).group(0)
print(f"GPU:1 asks for {fmt(second_bytes)}, under its limit of {share_mb:,} MB: {'OOM: ' + oom if oom else 'fitted'}")
result = {"free": free, "limit_mb": share_mb, "first_bytes": first_bytes, "second_bytes": second_bytes, "oom": oom}
""",
        env={"TF_FORCE_GPU_ALLOW_GROWTH": "true"},
    ),
    "garbage_collection": Experiment(
        "Empty regions given back, only when an allocation would otherwise fail",
        """
import tensorflow as tf
import tfmem_widgets
tf.config.list_logical_devices("GPU")
start = card().used_bytes
def used():
    return card().used_bytes - start
x = tf.zeros((1000 << 18,))                     # 1000 MiB: a region of its own
with_x = used()
del x
gc.collect()
after_del = used()
y = tf.zeros((3500 << 18,))                     # 3500 MiB: no room under the 4096 MB limit beside that region
with_y = used()
print(f"keep 1000 MiB: NVML used +{fmt(with_x)}; after del and gc.collect(): +{fmt(after_del)} (nothing given back)")
print(f"then 3500 MiB under the 4096 MB limit: fitted; NVML used +{fmt(with_y)}")
without = tfmem_widgets.run_fresh('''
import gc, tensorflow as tf
x = tf.zeros((1000 << 18,))
del x
gc.collect()
try:
    y = tf.zeros((3500 << 18,))
    outcome = "fitted"
except tf.errors.ResourceExhaustedError:
    outcome = "OOM"
''', setup={"limit_mb": 4096, "force_growth": True}, env={"TF_ENABLE_GPU_GARBAGE_COLLECTION": "false"},
   returns=["outcome"], echo=False).values["outcome"]
print(f"the same with TF_ENABLE_GPU_GARBAGE_COLLECTION=false: {without}")
result = {"with_first": with_x, "after_del": after_del, "with_second": with_y, "without_gc": without}
""",
        setup={"limit_mb": 4096, "force_growth": True},
    ),
    "clear_session": Experiment(
        "What keras.backend.clear_session() gives back",
        """
import keras
import tensorflow as tf
tf.config.list_logical_devices("GPU")
rows = []
def row(label):
    rows.append((label, tf.config.experimental.get_memory_info("GPU:0")["current"], card().used_bytes))
    print(f"{label:<44} TensorFlow's in use {fmt(rows[-1][1]):>11}   NVML used {fmt(rows[-1][2]):>11}")
row("start")
model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096), keras.layers.Dense(4096)])
model.compile(optimizer="adam", loss="mse")
data = tf.ones((1024, 4096))
model.fit(data, data, epochs=1, verbose=0)
row("after one fit (weights, Adam's slots, data)")
keras.backend.clear_session()
gc.collect()
row("clear_session() with `model` still named")
del model
gc.collect()
row("del model, gc.collect()")
keras.backend.clear_session()
gc.collect()
row("clear_session() again")
del data
gc.collect()
row("del data, gc.collect()")
result = {"rows": rows}
""",
        setup={"growth": True},
    ),
    "mirrored": Experiment(
        "MirroredStrategy over two logical GPUs: one copy of every variable per replica",
        """
import tensorflow as tf
devices = ["/gpu:0", "/gpu:1"]
strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
def in_use():
    return [tf.config.experimental.get_memory_info(f"GPU:{i}")["current"] for i in range(2)]
before = in_use()
with strategy.scope():
    weights = tf.Variable(tf.ones((16 << 20,)), aggregation=tf.VariableAggregation.MEAN)  # 64 MiB
after = in_use()
print(f"replicas: {strategy.num_replicas_in_sync}")
for i in range(2):
    print(f"GPU:{i}: a 64 MiB variable under the strategy added {fmt(after[i] - before[i])}")

@tf.function
def step():
    def replica_step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.tanh(weights * 0.5))
        grad = tape.gradient(loss, weights)
        weights.assign_sub(0.01 * grad)
        return loss
    return strategy.run(replica_step)
peaks = []
for i in range(2):
    tf.config.experimental.reset_memory_stats(f"GPU:{i}")
step()
for i in range(2):
    peak = tf.config.experimental.get_memory_info(f"GPU:{i}")["peak"]
    peaks.append(peak)
    print(f"GPU:{i}: peak during one step {fmt(peak)}")
result = {"added": [after[i] - before[i] for i in range(2)], "peaks": peaks}
""",
        setup={"split": [1024, 1024], "force_growth": True},
    ),
    "kernel_death": Experiment(
        "A graph step at 2^31 elements: named by its plan, ended by TensorFlow's check, told by the next session;"
        " with XLA it trains",
        "ATTENTION_MODEL = " + repr(ATTENTION_MODEL) + """
import os, subprocess, sys, tempfile
import numpy as np
import tfmem_widgets
MODEL = ATTENTION_MODEL
FIT = ('model.fit(np.ones((4096, 256), "int32"), np.ones((4096,), "int64"), batch_size=4096, epochs=1, verbose=0)\\n'
       'print("trained at 4,096")')
exec(MODEL.replace("JIT", "False"))
sample = (np.ones((2, 256), "int32"), np.ones((2,), "int64"))
plans = {}
for batch in (4095, 4096):
    plans[batch] = tfmem_widgets.plan(model, sample, batch)
    named = plans[batch].abort_risks
    print(f"the plan at {batch:,} rows (jit_compile=False): {len(named)} tensor(s) of 2^31 elements or more"
          + (f", the first {named[0].tensor.layer} {list(named[0].shape)}" if named else ""))
folder, records = tempfile.mkdtemp(), tempfile.mkdtemp()
env = {k: v for k, v in os.environ.items() if k != "TFMEM_KERNEL_RECORD"}
env["TFMEM_KERNELS_DIR"] = records
SESSION = ("from IPython.testing.globalipapp import start_ipython\\nip = start_ipython()\\n"
           "ip.run_line_magic('load_ext', 'tfmem_widgets')\\n")
def session(cells):
    script = SESSION + "".join(f"ip.run_cell({cell!r}, store_history=True)\\n" for cell in cells) + "print('ended')"
    return subprocess.run([sys.executable, "-c", script], cwd=folder, env=env, capture_output=True, text=True,
                          timeout=900)
died = session(["%tfmem setup --growth", MODEL.replace("JIT", "False"), FIT])
print(f"an IPython session fitting at 4,096 without XLA: return code {died.returncode}"
      + (" (SIGABRT)" if died.returncode == -6 else ""))
told = session([]).stdout
head = told.split("  Python's stacks at the signal")[0].rstrip()
print("the next session started in its folder, on %load_ext tfmem_widgets:")
print("\\n".join("  " + line for line in head.splitlines()))
xla = session(["%tfmem setup --growth", MODEL.replace("JIT", "True"), FIT])
print("the same model with jit_compile=True at 4,096:", "trained" if "trained at 4,096" in xla.stdout
      else f"did not train (return code {xla.returncode})")
result = {"risks": {b: len(p.abort_risks) for b, p in plans.items()}, "died": died.returncode,
          "told": told, "xla": xla.returncode}
""",
        setup={"growth": True},  # the plans' process holds little beside the sessions it starts
        env={"XLA_FLAGS": "--xla_gpu_autotune_level=0"},
    ),
    "lab_kernels": Experiment(
        "Notebook 4's float16 step under three kernels, in lab mode on the CPU of the GPU's machine",
        "FLOAT16_STEP = " + repr(FLOAT16_STEP) + "\nKERNELS = " + repr(KERNELS) + "\nSIZES = " + repr(FLOAT16_SIZES) + """
import os, platform, tfmem_widgets
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
           platform.processor())
print(f"this machine's CPU: {cpu}, {os.cpu_count()} logical cores; lab mode, each kernel in a fresh process")
peaks = {}
for name, env in KERNELS.items():
    run = tfmem_widgets.run_fresh(FLOAT16_STEP.format(**SIZES), setup={"lab_mb": 256, "gpus": []}, env=env,
                                  returns=["tensors", "allocator_peak"], echo=False)
    peaks[name] = run.values
    print(f"float16 step, {name:<20} tensors {run.values['tensors']:>12,} B   the allocator's peak "
          f"{fmt(run.values['allocator_peak'])}")
low, high = sorted(v["allocator_peak"] for v in peaks.values())[::2]
print("the tensors' peak is the same with every kernel:", len({v["tensors"] for v in peaks.values()}) == 1)
print(f"the allocator's peaks range from {fmt(low)} to {fmt(high)}: they differ by kernel: {high > low}")
result = {"cpu": cpu, "cores": os.cpu_count(), "peaks": peaks}
""",
    ),
    "edge_above": Experiment(
        "Notebook 7's search under 128 MB, on a logical GPU and in lab mode on the machine's CPU, and five batches"
        " just above each first failure",
        WHAT_FITS_FUNCTIONS + """
import tfmem_widgets
result = {}
for where, setup in (("a 128 MB logical GPU", {"limit_mb": 128}),
                     ("lab mode, 128 MB on this machine's CPU", {"lab_mb": 128, "gpus": []})):
    search = tfmem_widgets.max_batch_size(build_model, make_batch, setup=setup, high=16384, margin=0.1, progress=False)
    safe, failed = search.edge
    print(f"{where}: {safe:,} trained below every failure; {failed:,}, the first failure, ran out of memory")
    more = search.probe(*[int(failed * (1 + k / 50)) for k in range(1, 6)])
    trained = [p.batch for p in more if p.fits]
    print(f"  of {len(more)} batches 2% to 10% above the first failure, {len(trained)} of {len(more)} trained"
          + (": " + ", ".join(f"{b:,}" for b in trained) if trained else ""))
    print(f"  batches that ran out of memory although the same batch or a larger one trained: {len(search.not_monotone)}")
    print(f"  the recommended batch, {search.recommended:,}, lies below every failure:",
          all(search.recommended < p.batch for p in search.failed))
    result[where] = {"edge": [safe, failed], "above": [[p.batch, p.fits] for p in more],
                     "recommended": search.recommended}
""",
    ),
}


@dataclass
class GpuResult:
    """One experiment's output, live or recorded, with where it came from."""

    name: str
    title: str
    source: str
    output: str
    values: dict[str, Any]
    live: bool

    def __repr__(self) -> str:
        return f"{self.title}\n[{self.source}]\n{self.output.rstrip()}"

    def _repr_pretty_(self, printer, cycle):
        printer.text(repr(self))


def _gpu_here() -> bool:
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("GPU"))


def run_experiment(name: str, echo: bool = False) -> tuple[str, dict]:
    """Run one experiment in a fresh process (needs a GPU): (its printed output, its values)."""
    experiment = EXPERIMENTS[name]
    run = run_fresh(_PRELUDE + experiment.code, setup=experiment.setup, env=experiment.env,
                    returns=["result"], echo=echo)
    return run.output, run.values["result"]


# Which GPU math libraries TensorFlow loaded, and whether each is the real one: a stand-in (an
# empty library of the same name) loads but lacks the library's functions. Read in a process that
# made the GPU device and ran a matmul, from the files mapped into it.
_LIBRARIES_CODE = """
import ctypes, tensorflow as tf
tf.config.list_logical_devices("GPU")
a = tf.ones((64, 64))
_ = (a @ a).numpy()
symbols = {"cuBLAS": ("libcublas.so", "cublasCreate_v2"), "cuFFT": ("libcufft.so", "cufftPlan1d"),
           "cuSOLVER": ("libcusolver.so", "cusolverDnCreate"), "cuSPARSE": ("libcusparse.so", "cusparseCreate"),
           "cuDNN": ("libcudnn.so", "cudnnCreate")}
mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
libraries = {}
for name, (stem, symbol) in symbols.items():
    paths = sorted(p for p in mapped if p.rsplit("/", 1)[-1].startswith(stem))
    if not paths:
        libraries[name] = "not loaded"
    else:
        libraries[name] = "real" if hasattr(ctypes.CDLL(paths[0]), symbol) else "stand-in"
"""


def libraries_label(libraries: dict[str, str]) -> str:
    """E.g. 'cuBLAS real; cuFFT, cuSOLVER, cuSPARSE empty stand-ins; cuDNN not loaded'."""
    parts = []
    for state, one, several in (("real", "real", "real"), ("stand-in", "an empty stand-in", "empty stand-ins"),
                                ("not loaded", "not loaded", "not loaded")):
        names = [name for name, found in libraries.items() if found == state]
        if names:
            parts.append(f"{', '.join(names)} {one if len(names) == 1 else several}")
    return "; ".join(parts)


def versions_label(label: dict) -> str:
    """E.g. 'TensorFlow 2.21.0, Keras 3.15.1, built for CUDA 12.5.1 and cuDNN 9 (the driver's CUDA 13.0)'."""
    text = f"TensorFlow {label['tensorflow']}"
    if "keras" in label:
        text += f", Keras {label['keras']}, built for CUDA {label['cuda']} and cuDNN {label['cudnn']}"
    if "driver_cuda" in label:
        text += f" (the driver's CUDA {label['driver_cuda']})"
    return text


def _environment_label(libraries: bool = False) -> dict:
    """The card, its driver, TensorFlow's version and the date; with `libraries`, which math
    libraries were real (read in a fresh process, for recordings)."""
    import tensorflow as tf

    from tfmem_widgets.tf import nvml

    gpu = nvml.read_gpus()[0]
    driver = nvml._nvml().nvmlSystemGetDriverVersion()
    import keras

    build = tf.sysconfig.get_build_info()
    label = {"device": gpu.name, "driver": driver if isinstance(driver, str) else driver.decode(),
             "tensorflow": tf.__version__, "keras": keras.__version__, "cuda": build.get("cuda_version", "?"),
             "cudnn": build.get("cudnn_version", "?"), "date": _dt.date.today().isoformat()}
    try:
        cuda = int(nvml._nvml().nvmlSystemGetCudaDriverVersion())
        label["driver_cuda"] = f"{cuda // 1000}.{cuda % 1000 // 10}"
    except Exception:  # an older driver: its CUDA version is not said
        pass
    if libraries:
        label["libraries"] = run_fresh(_LIBRARIES_CODE, returns=["libraries"], echo=False).values["libraries"]
    return label


def gpu_result(name: str, live: bool | None = None) -> GpuResult:
    """The experiment `name`: run live where TensorFlow sees a GPU, else as recorded.

    >>> gpu_result("growth_regions")     # shows where the figures come from
    """
    if name not in EXPERIMENTS:
        raise KeyError(f"no GPU experiment {name!r}; there are: {', '.join(EXPERIMENTS)}")
    title = EXPERIMENTS[name].title
    here = _gpu_here()
    if live is None:
        live = here  # live=False: the recording, also where a GPU is (a run to set beside this one's)
    if live:
        label = _environment_label()
        output, values = run_experiment(name)
        source = f"live on {label['device']}, {versions_label(label)}"
        return GpuResult(name, title, source, output, values, True)
    recorded = json.loads(RECORDED.read_text())
    entry = recorded["experiments"][name]
    label = entry.get("environment", recorded["environment"])  # one recorded later, on another card
    why = "shown as recorded" if here else "no GPU here, so not run live"
    source = (f"recorded on {label['device']} (driver {label['driver']}), {versions_label(label)}, "
              f"{label['date']}; {libraries_label(label['libraries'])}: {why}")
    return GpuResult(name, title, source, entry["output"], entry["values"], False)


def record(path: Path = RECORDED, names: list[str] | None = None) -> dict:
    """Run every experiment (or those `names`) on this machine's GPU and write them to `path`; an experiment
    recorded alone keeps the card it ran on beside the others'."""
    if not _gpu_here():
        raise SystemExit("recording needs a GPU that TensorFlow sees; none here")
    unknown = sorted(set(names or ()) - set(EXPERIMENTS))
    if unknown:
        raise SystemExit(f"no GPU experiment {', '.join(unknown)}; there are: {', '.join(EXPERIMENTS)}")
    label = _environment_label(libraries=True)
    data = json.loads(Path(path).read_text()) if names else {"environment": label, "experiments": {}}
    for name in names or EXPERIMENTS:
        print(f"== {name}", flush=True)
        output, values = run_experiment(name, echo=True)
        data["experiments"][name] = {"output": output, "values": values}
        if names:
            data["experiments"][name]["environment"] = label
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] != ["record"]:
        raise SystemExit("usage: python notebooks/gpu_experiments.py record [PATH] [--only NAME ...]")
    only = args[args.index("--only") + 1:] if "--only" in args else None
    paths = args[1:args.index("--only")] if "--only" in args else args[1:]
    record(Path(paths[0]) if paths else RECORDED, only)
